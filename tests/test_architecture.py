"""The package's import graph keeps its shape: no import circles, and no import that runs back up the layers.

Every `import` in src/systolic counts, at module level or inside a function (a function-level import hides a
circle from Python's import machinery, not from a reader). Modules belong to units (a package such as `runtime`, a
workload such as `workloads.rl`, a top-level module such as `config`), and units to layers, lowest first. A module
may import its own unit and the units of lower layers, never a higher layer nor a sibling unit of its own layer: so
one workload never imports another, and engine, runtime, data, observe and optim never import a workload or the CLI.
Inside the lm workload its rooms (its subpackages and top-level modules) keep layers of their own, LM_LAYERS: the
model builds itself below the config, training and serving, and never imports them. A new top-level module or
package, or a new room inside lm, fails the test until it is given a place.
"""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "systolic"

# Lowest first. A unit is a dotted prefix under systolic ("" is the package itself); a module belongs to the unit
# with its longest matching prefix.
LAYERS: list[tuple[str, ...]] = [
    ("", "errors"),
    ("safe_json", "safe_yaml", "safe_npy", "outfile", "commandline"),  # commandline: commands as declared data
    ("config",),
    ("runtime",),
    ("kernels",),  # kernel families with their references: below the models and servers that call them
    ("data", "observe"),
    ("optim",),
    ("engine",),
    ("plan",),
    ("workloads",),  # the Workload record and the registry, which finds each workload by its module's name
    ("workloads.lm", "workloads.gan", "workloads.rl", "workloads.sim"),
    ("cli",),
]
# Modules that sit in another unit than their package's: `python -m systolic` is the CLI.
UNIT_OF = {"__main__": "cli"}
# Known upward imports, each to be removed, not added to: none left.
KNOWN_UPWARD: set[tuple[str, str]] = set()

# The lm workload's rooms, lowest first: how its layers run over the mesh (parallel), the model, which builds itself
# (model/build.py), the run's config, what a training run is made of, training and opening a finished run, what
# reads a finished run (Hugging Face, eval, export, quantize), serving, `systolic generate` (on the serving engine),
# post-training (on the trainer and the engine), and the entry points the CLI calls.
LM = "workloads.lm"
LM_LAYERS: list[tuple[str, ...]] = [
    ("parallel",),
    ("model",),
    ("config",),
    ("corpus", "optimizer", "init_from", "preflight"),
    ("train", "loaded_run"),
    ("hf", "evaluate", "export", "quantize"),
    ("serve",),
    ("generate",),
    ("post",),
    ("entry", "commands", "resolve"),
]
LM_KNOWN_UPWARD: set[tuple[str, str]] = set()


def modules() -> dict[str, Path]:
    found = {}
    for path in (SRC / PACKAGE).rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The systolic modules that `module` imports anywhere in its file (a package for `from package import name`
    when `name` is not a module of its own)."""
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, up `level - 1` packages
                package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for name in names:
            while name not in known and "." in name:
                name = name.rsplit(".", 1)[0]
            if name in known and name != module:
                targets.add(name)
    return targets


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {module: imported(module, path, known) for module, path in known.items()}


def unit(module: str) -> str:
    relative = module.removeprefix(PACKAGE).removeprefix(".")
    units = [u for layer in LAYERS for u in layer] + list(UNIT_OF)
    # "" is the package's own __init__ only: a new top-level module or package matches no unit (and so fails
    # test_every_module_has_a_layer) until LAYERS names it.
    prefix = max((u for u in units if relative == u or (u and relative.startswith(u + "."))), key=len, default=None)
    return UNIT_OF.get(prefix, prefix)


def rank(unit_name: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if unit_name in layer)


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_every_module_has_a_layer():
    placed = {u for layer in LAYERS for u in layer}
    unplaced = sorted(m for m in modules() if unit(m) not in placed)
    assert not unplaced, f"modules outside every layer (give their package a place in LAYERS): {unplaced}"


def test_no_import_circles():
    found = circles(import_graph())
    assert not found, "import circles (move what both sides need into a module of its own):\n" + "\n".join(
        " <-> ".join(c) for c in found)


def upward(graph: dict[str, set[str]], unit_of, rank_of) -> list[tuple[str, str]]:
    """The imports a -> b between two units where b's layer is not below a's, sorted."""
    return sorted((a, b) for a, targets in graph.items() for b in targets
                  if unit_of(a) != unit_of(b) and rank_of(unit_of(b)) >= rank_of(unit_of(a)))


def lm_room(module: str) -> str | None:
    """The lm room of a module inside workloads.lm (its subpackage or top-level module), None outside it or for the
    package itself."""
    prefix = f"{PACKAGE}.{LM}."
    return module.removeprefix(prefix).split(".")[0] if module.startswith(prefix) else None


def lm_rank(room: str) -> int:
    return next(i for i, layer in enumerate(LM_LAYERS) if room in layer)


def lm_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The import graph between modules of the lm's rooms."""
    return {a: {b for b in targets if lm_room(b)} for a, targets in graph.items() if lm_room(a)}


def check_upward(found: list[tuple[str, str]], known: set[tuple[str, str]], describe) -> None:
    unexpected = [describe(a, b) for a, b in found if (a, b) not in known]
    assert not unexpected, "imports that run up or across the layers:\n" + "\n".join(unexpected)
    gone = known - set(found)
    assert not gone, f"known upward imports that no longer exist (drop them from the known set): {sorted(gone)}"


def test_no_import_runs_back_up_the_layers():
    check_upward(upward(import_graph(), unit, rank), KNOWN_UPWARD,
                 lambda a, b: f"{a} -> {b} ({unit(a) or PACKAGE}, layer {rank(unit(a))}, imports {unit(b) or PACKAGE}, "
                              f"layer {rank(unit(b))})")


def test_every_lm_module_has_a_room():
    placed = {room for layer in LM_LAYERS for room in layer}
    unplaced = sorted(m for m in modules() if lm_room(m) and lm_room(m) not in placed)
    assert not unplaced, f"lm modules outside every room of LM_LAYERS (give their room a place): {unplaced}"


def test_no_import_runs_back_up_the_rooms_inside_lm():
    """The model imports neither the config, training, serving nor post-training; the server neither training nor
    post-training; and so on up LM_LAYERS."""
    check_upward(upward(lm_graph(import_graph()), lm_room, lm_rank), LM_KNOWN_UPWARD,
                 lambda a, b: f"{a} -> {b} (room {lm_room(a)}, layer {lm_rank(lm_room(a))}, imports room "
                              f"{lm_room(b)}, layer {lm_rank(lm_room(b))})")


def test_the_lm_fence_fails_on_an_upward_import():
    """A model module that imported the server, or the trainer, is caught; the same import the other way is not."""
    graph = lm_graph(import_graph())
    model, server = f"{PACKAGE}.{LM}.model.transformer", f"{PACKAGE}.{LM}.serve.engine"
    assert model in graph and server in graph
    for bad in (server, f"{PACKAGE}.{LM}.train"):
        found = upward({**graph, model: graph[model] | {bad}}, lm_room, lm_rank)
        assert (model, bad) in found
        with pytest.raises(AssertionError, match="imports that run up or across the layers"):
            check_upward(found, LM_KNOWN_UPWARD, lambda a, b: f"{a} -> {b}")
    assert (server, model) not in upward(graph, lm_room, lm_rank)


def test_the_checks_see_function_level_imports_and_circles(tmp_path):
    """An import inside a function is an edge of the graph, as a relative one is, and a circle through them is found."""
    module = tmp_path / "module.py"
    module.write_text("from .. import config\n\ndef f():\n    from systolic.runtime import mesh\n    return mesh\n")
    known = {"systolic.engine.module": module, "systolic.config": module, "systolic.runtime.mesh": module}
    assert imported("systolic.engine.module", module, known) == {"systolic.config", "systolic.runtime.mesh"}
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []
