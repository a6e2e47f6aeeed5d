"""benchmarks/ kept honest (benchmarks/README.md is its map): every file sits in a room named for its purpose; every
import of systolic in a script resolves, wherever it is (an AST walk: imports inside functions count, and so does
Python code that a script hands a child process as a string); every call of a systolic function binds to its
signature; every global name a script reads is bound; every import of another script resolves to a file on that
script's path; and each script runs its cheap dry mode where it has one.

What nothing runs rots: before this test 37 of the 47 files under benchmarks/ were loaded by no test, and six
scripts called src/ with names or arguments it no longer took (`build_step` without its tokenizer, `load_corpus`
from a module that no longer had it)."""

from __future__ import annotations

import ast
import builtins
import importlib
import importlib.util
import inspect
import os
import re
import subprocess
import symtable
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
# The rooms, by purpose (benchmarks/README.md says what each file in them measures).
ROOMS = {
    "peers": "side by side with another project: PyTorch, PureJaxRL, SB3, jax-cfd, NumPy, TRL, HF servers, datasets",
    "harness": "the chip's and the GPU's harnesses (tpu.sh, gpu.sh) and what their rows share",
    "studies": "one side alone, behind a figure in docs/",
    "kernels": "the Pallas kernels' microbenchmarks (src/systolic/kernels/)",
}
# Imported by a peer's side but not installed by the dev extra (pyproject.toml: the bench extra, or xprof to read a
# profile); every other import must be installed here, or be a file of benchmarks/.
NOT_INSTALLED_HERE = {"stable_baselines3", "gguf", "llama_cpp", "xprof"}


# THE RESOLVER --------------------------------------------------------------------------------------------------


def benchmark_files() -> list[Path]:
    return sorted(p for p in BENCHMARKS.rglob("*") if p.is_file() and "__pycache__" not in p.parts)


def scripts() -> list[Path]:
    return [p for p in benchmark_files() if p.suffix == ".py"]


def search_path(script: Path) -> list[Path]:
    """The folders a script imports its siblings from: its own room (sys.path[0] when run as a script), and each room
    that it puts on sys.path itself (`Path(__file__).resolve().parents[1] / "harness"`)."""
    source = script.read_text(encoding="utf-8")
    benchmarks = script.parents[1]
    return [script.parent] + [benchmarks / room for room in ROOMS
                              if re.search(rf'parents\[1\]\s*/\s*"{room}"', source) and room != script.parent.name]


def defined_names(module: Path) -> set[str]:
    """The names a sibling script defines at its top level (functions, classes, assignments, imports)."""
    names = set()
    for node in ast.parse(module.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def imports(tree: ast.AST) -> list[tuple[int, str, list[str]]]:
    """(line, module, names imported from it) of every import in `tree`, wherever it is (module level, functions),
    and of the imports in string constants that parse as Python and name systolic (code run in a child process)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            found.append((node.lineno, module, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "systolic" in node.value:
            try:
                inner = ast.parse(node.value)
            except SyntaxError:
                continue
            found += [(node.lineno, module, names) for _, module, names in imports(inner)]
    return found


def undefined_globals(source: str, filename: str) -> list[str]:
    """The global names that `source` reads, in a function or at module level, but never binds (an import, a def, an
    assignment) and that are no builtins: what a rename in src/ leaves behind when a script's import line goes
    (Python itself says so only when the line runs)."""
    top = symtable.symtable(source, filename, "exec")
    bound = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}
    known = bound | set(dir(builtins)) | {"__file__", "__name__", "__doc__", "__spec__"}
    read, tables = set(), [top]
    while tables:
        table = tables.pop()
        tables += table.get_children()
        read |= {s.get_name() for s in table.get_symbols() if s.is_referenced()
                 and (table is top or s.is_global() and not s.is_declared_global())}
    return sorted(read - known)


def _scope_nodes(scope: ast.AST):
    """The nodes of one scope (a module or a function body), not those of the functions and classes inside it."""
    todo = list(ast.iter_child_nodes(scope))
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            todo += ast.iter_child_nodes(node)


def _imported(module: str, name: str | None = None) -> object:
    """`from module import name` (or `import module`), or None where that fails (the import check reports it)."""
    try:
        found = importlib.import_module(module)
        return found if name is None else getattr(found, name, None) or importlib.import_module(f"{module}.{name}")
    except ImportError:
        return None


def bad_uses(tree: ast.AST, where: str) -> list[str]:
    """Calls of systolic's functions and classes whose arguments do not bind to the callee's signature (a parameter
    added or renamed in src/, the script not told): `f(a, b)` for `f(a, b, c)`, an unknown keyword; calls with *args
    or **kwargs are not checked. And assignments to a systolic module's attributes (`train.make_lm_optimizer = f`):
    a benchmark passes what it varies as arguments, it does not patch src/."""
    problems = []

    def visit(scope: ast.AST, names: dict[str, object]) -> None:
        names = dict(names)
        nodes = list(_scope_nodes(scope))
        if not isinstance(scope, ast.Module):  # a scope's own variables hide what an outer scope imported
            arguments = [] if isinstance(scope, ast.ClassDef) else \
                scope.args.posonlyargs + scope.args.args + scope.args.kwonlyargs
            for name in [a.arg for a in arguments] + [n.id for n in nodes
                                                     if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)]:
                names.pop(name, None)
        for node in nodes:
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "systolic":
                for alias in node.names:
                    names[alias.asname or alias.name] = _imported(node.module, alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "systolic" and alias.asname:
                        names[alias.asname] = _imported(alias.name)
        for node in nodes:
            if isinstance(node, ast.Call) and not any(isinstance(a, ast.Starred) for a in node.args) \
                    and all(k.arg for k in node.keywords):
                func = node.func
                if isinstance(func, ast.Name):
                    callee = names.get(func.id)
                elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and \
                        inspect.ismodule(names.get(func.value.id)):
                    callee = getattr(names[func.value.id], func.attr, None)
                else:
                    callee = None
                if callable(callee):
                    try:
                        signature = inspect.signature(callee)
                    except (TypeError, ValueError):
                        continue
                    try:
                        signature.bind(*node.args, **{k.arg: k.value for k in node.keywords})
                    except TypeError as e:
                        problems.append(f"{where}:{node.lineno}: {ast.unparse(node.func)}(...): {e}")
            elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                while any(isinstance(t, (ast.Tuple, ast.List)) for t in targets):  # a, b.c = ...
                    targets = [e for t in targets for e in (t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t])]
                for target in targets:
                    if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and \
                            inspect.ismodule(names.get(target.value.id)):
                        problems.append(f"{where}:{node.lineno}: assigns {ast.unparse(target)}: that swaps src/'s "
                                        "code for every caller in the process; pass what differs as an argument")
        for node in nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(node, names)

    visit(tree, {})
    return problems


def unresolved(script: Path) -> list[str]:
    """What in `script` does not resolve, one line each ("file:line: what"); [] when everything does."""
    where = script.relative_to(script.parents[1])
    source = script.read_text(encoding="utf-8")
    tree = ast.parse(source, str(script))
    first_read = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            first_read[node.id] = min(node.lineno, first_read.get(node.id, node.lineno))
    problems = [f"{where}:{first_read.get(name, 0)}: reads {name}, which it neither defines nor imports"
                for name in undefined_globals(source, str(script))]
    folders = search_path(script)
    problems += bad_uses(tree, str(where))
    for line, module, names in imports(tree):
        at = f"{where}:{line}"
        top = module.split(".")[0]
        if module in ("unittest.mock", "mock") or module == "unittest" and "mock" in names:
            problems.append(f"{at}: imports mock: a benchmark passes what it varies as arguments, it does not patch "
                            "src/ (an argument src/ lacks: add it there)")
        elif module.startswith("."):
            problems.append(f"{at}: relative import {module!r}: a script is not a package; import its room's file")
        elif top == "systolic":
            problems += [f"{at}: {p}" for p in _systolic(module, names)]
        elif sibling := next((f / f"{top}.py" for f in folders if (f / f"{top}.py").is_file()), None):
            missing = [n for n in names if n != "*" and n not in defined_names(sibling)]
            problems += [f"{at}: `from {module} import {n}`: {sibling.name} defines no {n}" for n in missing]
        elif elsewhere := sorted(script.parents[1].glob(f"*/{top}.py")):
            problems.append(f"{at}: imports {top}, which is {elsewhere[0].relative_to(script.parents[1])}: not on "
                            f"this script's path (its own room is); add `sys.path.insert(0, str(Path(__file__)"
                            f".resolve().parents[1] / \"{elsewhere[0].parent.name}\"))` before the import")
        elif top not in sys.stdlib_module_names and top not in NOT_INSTALLED_HERE and \
                importlib.util.find_spec(top) is None:
            problems.append(f"{at}: imports {top}: neither installed here nor a file of benchmarks/ on this "
                            "script's path")
    return problems


def _systolic(module: str, names: list[str]) -> list[str]:
    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError as e:  # a parent package is missing
        spec, why = None, str(e)
    else:
        why = ""
    if spec is None:
        return [f"no module {module} {why}".strip()]
    loaded = importlib.import_module(module)
    return [f"`from {module} import {n}`: {module} has no {n}" for n in names
            if n != "*" and not hasattr(loaded, n)
            and not (hasattr(loaded, "__path__") and importlib.util.find_spec(f"{module}.{n}"))]


# THE TESTS -----------------------------------------------------------------------------------------------------


def test_every_file_sits_in_a_room_and_the_map_names_it():
    rooms = {p.name for p in BENCHMARKS.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert rooms == set(ROOMS), f"benchmarks/ has the rooms {sorted(rooms)}; declared: {sorted(ROOMS)}"
    readme = (BENCHMARKS / "README.md").read_text(encoding="utf-8")
    for path in benchmark_files():
        parts = path.relative_to(BENCHMARKS).parts
        assert parts == ("README.md",) or (len(parts) == 2 and parts[0] in ROOMS), (
            f"benchmarks/{'/'.join(parts)} is not in a room: move it into one of {sorted(ROOMS)} (by its purpose) "
            "and give it a line in benchmarks/README.md")
        if parts != ("README.md",):
            assert f"{parts[0]}/{parts[1]}" in readme, f"benchmarks/README.md has no line for {parts[0]}/{parts[1]}"


@pytest.mark.parametrize("script", scripts(), ids=lambda p: str(p.relative_to(BENCHMARKS)))
def test_every_import_resolves(script: Path):
    problems = unresolved(script)
    assert not problems, "\n".join(problems)


def test_the_resolver_reports_a_broken_import(tmp_path: Path):
    """The resolver itself: a script broken every way it checks, in rooms of its own, each break on its own line."""
    (tmp_path / "harness").mkdir()
    (tmp_path / "harness" / "helpers.py").write_text("def timer():\n    pass\n")
    (tmp_path / "studies").mkdir()
    broken = tmp_path / "studies" / "broken.py"
    broken.write_text(
        "import json\n"
        "from systolic.workloads.lm import train\n"  # fine
        "def main(cfg, mesh):\n"
        "    from systolic.workloads.lm.train import load_corpus_gone\n"  # inside a function: still checked
        "    import systolic.no_such_module\n"
        "    import helpers\n"  # a file of another room, not on this script's path
        "    import no_such_sibling\n"
        "    make_schedule(cfg)\n"  # its import line gone
        "    train.make_lm_optimizer = lambda *a: None\n"  # a patch of src/, not an argument
        "    return train.build_step(cfg, mesh)\n"  # a parameter added in src/ (the tokenizer), the script not told
        "CODE = 'from systolic.optim.adamw import no_such_schedule'\n")  # code run in a child process
    problems = sorted(unresolved(broken), key=lambda p: int(p.split(":")[1]))
    assert [p.split(":")[1] for p in problems] == ["4", "5", "6", "7", "8", "9", "10", "11"], problems
    assert "has no load_corpus_gone" in problems[0] and "no module systolic.no_such_module" in problems[1]
    assert "not on this script's path" in problems[2] and "neither installed" in problems[3]
    assert "reads make_schedule" in problems[4] and "assigns train.make_lm_optimizer" in problems[5]
    assert "missing a required argument: 'tokenizer'" in problems[6] and "has no no_such_schedule" in problems[7]
    # The fix the message names makes the sibling resolve, and a name it lacks is then reported; so is a mock.
    broken.write_text("import sys\nfrom pathlib import Path\n"
                      "sys.path.insert(0, str(Path(__file__).resolve().parents[1] / \"harness\"))\n"
                      "from helpers import timer, no_timer\n"
                      "from unittest import mock\n")
    assert unresolved(broken) == ["studies/broken.py:4: `from helpers import no_timer`: helpers.py defines no no_timer",
                                  "studies/broken.py:5: imports mock: a benchmark passes what it varies as arguments, "
                                  "it does not patch src/ (an argument src/ lacks: add it there)"]


# DRY RUNS ------------------------------------------------------------------------------------------------------
# Every script, with its cheapest run (arguments, environment) or why it has none here. Quick ones run in `make test`;
# the rest are marked slow (`make test-all`).

DRY_RUNS = {
    "studies/xla_cpu_fusion_repro.py": (["--depths", "2", "--width", "32", "--rows", "64"], {}),
    "studies/rl_random_policy.py": (["CartPole-v1", "--seeds", "2", "--episodes", "2"], {}),
    "studies/fft_cost.py": (["--n2", "64", "--n3", "0"], {}),
    "peers/sim_vs_numpy.py": (["--sizes", "32", "--steps", "2", "--repeats", "1"], {}),
    "peers/sim3d_vs_numpy.py": (["--sizes", "16", "--steps", "2", "--repeats", "1"], {}),
    "kernels/paged_attention.py": (["--rows", "tiny:2:32", "--rounds", "1", "--reps", "1"], {}),
}
SLOW_DRY_RUNS = {
    "studies/mup_transfer.py": (["--steps", "2", "--widths", "32,64", "--base", "32", "--log2-lrs=-9,-7",
                                 "--eval-batches", "1", "--max-bytes", "200000", "--out", "{tmp}/mup.json",
                                 "--plot", "{tmp}/mup.png"], {}),
    "harness/gpu.sh": ([], {"SYSTOLIC_GPU_SH_DRY_RUN": "1", "SYSTOLIC_GPU_SH_SITE": "{tmp}/site"}),
    "harness/tpu_profile.py": (["--recipe", "lm-tiny", "model.d_model=64", "model.layers=1", "model.heads=4",
                                "data.max_bytes=300000", "data.val_percent=30"], {}),
    "kernels/kv_write.py": (["16:8", "1"], {"DRY": "1"}),
    "kernels/kernel_bundles.py": (["--rows", "tiny:2:32", "--pools", "bf16 p16"], {}),
    "kernels/splash_blocks.py": ([], {"SYSTOLIC_TPU_SH_DRY_RUN": "1"}),
    "peers/lm_vs_pytorch.py": (["--layers", "1", "--d-model", "64", "--heads", "2", "--seq", "32", "--batch", "2",
                                "--steps", "1", "--rounds", "1", "--warmup", "1", "--no-compile"], {}),
    "peers/cpu_gemm.py": ([], {}),
    "peers/rl_vs_sb3.py": (["--skip-sb3", "--sb3-steps-per-s", "1000", "rl.num_seeds=2", "rl.num_envs=8",
                            "rl.num_steps=8", "rl.updates_per_chunk=2", "rl.total_env_steps=512"], {}),
    "peers/rl_profile.py": (["--set", "rl.num_seeds=1", "rl.num_envs=4", "rl.num_steps=8", "rl.updates_per_chunk=1",
                             "rl.total_env_steps=512"], {"OUT": "{tmp}"}),
    "peers/data_prepare.py": (["--copies", "1"], {"BENCH_TMP": "{tmp}"}),
    "studies/compile_cache.py": (["--rounds", "1"], {}),
    "studies/moe.py": (["--rounds", "1", "--steps", "1"], {}),
    "studies/parallel_layouts.py": (["--layout", "data=8", "--layout", "data=4,context=2", "--seq-len", "64",
                                     "--batch", "8", "--steps", "1", "--rounds", "1"], {}),
    "studies/muon_vs_adamw.py": (["--recipe", "lm-tiny", "--steps", "2", "--eval-every", "1", "--adamw-lrs", "2e-3",
                                  "--muon-lrs", "0.02", "--out", "{tmp}/muon.json"], {}),
    "studies/muon_collectives.py": (["--meshes", "fsdp=8"], {}),
}
# Scripts with no run cheap enough for a test, and why; each is still import-checked above.
NO_DRY_RUN = {
    "harness/tpu.sh": "tests/test_tpu_sh.py runs its dry run (SYSTOLIC_TPU_SH_DRY_RUN=1), every part",
    "harness/tpu_bench.py": "tpu.sh runs it (tests/test_tpu_sh.py)",
    "harness/gpu_bench.py": "gpu.sh runs it (above)",
    "harness/tpu-wheels.sh": "downloads from the package registry",
    "harness/gpu-wheels.sh": "downloads from the package registry",
    "harness/bench_rows.py": "a module of helpers, not a script",
    "studies/lm_sweep.py": "a module of helpers, not a script (mup_transfer.py and muon_vs_adamw.py run it)",
    "peers/rl_vs_purejaxrl.py": "tpu.sh's rl part runs it at tiny sizes (tests/test_tpu_sh.py)",
    "peers/sim_vs_jax_cfd.py": "tpu.sh's sim part runs it at 64^2 (tests/test_tpu_sh.py)",
    "studies/serve_engine.py": "tpu.sh's serve parts run it at tiny sizes (tests/test_tpu_sh.py)",
    "studies/dns3d_fft_share.py": "tpu.sh's sim part runs it at 16^3 and 32^3 (tests/test_tpu_sh.py)",
    "peers/serve_vs_peers.py": "starts three servers, one of them from the bench extra (llama.cpp): 10-20 minutes",
    "peers/post_training_vs_trl.py": "trains with TRL and with systolic: 5-10 minutes",
    "studies/pipeline.py": "compiles 11 pipeline layouts on 8 fake devices: minutes",
    "studies/data_startup.py": "reads two prepared corpora (`systolic data prepare`), GBs",
    "studies/quantization_quality.py": "reads a trained run",
    "studies/arithmetic_accuracy.py": "reads a trained run (tests/workloads/lm/post/test_arith_task.py loads it)",
    "studies/taylor_green_3d.py": "reads finished sim-taylor-green-3d runs",
    "studies/xla_flags_per_workload.py": "runs every workload's CLI twice: minutes",
}


def test_every_script_has_a_dry_run_or_says_why_not():
    listed = set(DRY_RUNS) | set(SLOW_DRY_RUNS) | set(NO_DRY_RUN)
    files = {str(p.relative_to(BENCHMARKS)) for p in benchmark_files() if p.suffix in (".py", ".sh")}
    assert files - listed == set(), "scripts with no entry in DRY_RUNS, SLOW_DRY_RUNS or NO_DRY_RUN"
    assert listed - files == set(), "entries for scripts that are gone"


def dry_run(script: str, args: list[str], env: dict[str, str], tmp_path: Path) -> None:
    fill = lambda s: s.replace("{tmp}", str(tmp_path))  # noqa: E731
    # One device and the platform's default dtype promotion, as a user runs a script (conftest's 8 fake devices and
    # strict promotion are the tests' own); src/ first, as tpu.sh and the scripts' usage lines put it.
    xla_flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                         if not f.startswith("--xla_force_host_platform_device_count"))
    path = [str(ROOT / "src"), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    full_env = dict(os.environ, PYTHONPATH=os.pathsep.join(path), XLA_FLAGS=xla_flags,
                    JAX_NUMPY_DTYPE_PROMOTION="standard", PYTHON=sys.executable, OUT=str(tmp_path / "out"))
    full_env.update({k: fill(v) for k, v in env.items()})
    file = BENCHMARKS / script
    cmd = ["bash", str(file)] if file.suffix == ".sh" else [sys.executable, str(file)]
    proc = subprocess.run([*cmd, *map(fill, args)], cwd=ROOT, env=full_env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


@pytest.mark.parametrize("script", sorted(DRY_RUNS))
def test_dry_run(script: str, tmp_path: Path):
    dry_run(script, *DRY_RUNS[script], tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(SLOW_DRY_RUNS))
def test_slow_dry_run(script: str, tmp_path: Path):
    dry_run(script, *SLOW_DRY_RUNS[script], tmp_path)
