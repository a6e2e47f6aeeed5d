"""The loops of a compiled program, read from its optimised HLO text (`compiled.as_text()`), and its cost per step.

XLA's cost analysis counts the body of a `while` loop once. A train step has loops of its own (a scanned layer
stack, a micro-batch scan) and, on TPU, loops the compiler makes itself (collective matmuls: a windowed einsum
over the fsdp shards, one collective-permute per trip), so its FLOPs and bytes are short by the loops' trips.
Here each loop's trip count is read from the HLO: the `known_trip_count` of its backend config when the compiler
wrote one, else its condition, `compare(counter, constant(N)), direction=LT` (or LE, GT, GE, NE) with the counter's
start read from the loop's initial tuple (0 when not a constant). A loop whose count cannot be read counts once,
and `Loops.unknown` names it.

`step_cost` weights nested bodies: with F(c) the cost analysis of computation c taken as the program (its loops
once) and T(c) its true cost, T(c) = F(c) + sum over the loops w that c runs directly of trip(w) x T(body(w)) -
F(body(w)). F(c) comes from XLA's own cost analysis (`hlo_module_cost_analysis`, run on this host's CPU client over
the HLO text with c as its entry), so the per-instruction counting is XLA's, for the TPU program as compiled.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator

_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) \((.*)\) -> .* \{$")
_INSTR = re.compile(r"^\s*(ROOT )?%([\w.\-]+) = (.+?) ([a-z][a-z0-9\-]*)\((.*)$")
_CALLS = re.compile(r"\b(calls|to_apply|body|condition)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_KNOWN_TRIPS = re.compile(r'"known_trip_count":\{"n":"([0-9]+)"')
_DIRECTIONS = {"LT": 0, "LE": 1, "GT": 0, "GE": 1, "NE": 0}


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    shape: str
    opcode: str
    rest: str  # operands and attributes
    root: bool = False

    def callees(self) -> list[tuple[str, str]]:
        """(role, computation) pairs: calls/to_apply/body/condition, and branch for a conditional's branches."""
        found = _CALLS.findall(self.rest)
        if b := _BRANCHES.search(self.rest):
            found += [("branch", n.strip().lstrip("%")) for n in b.group(1).split(",")]
        return found

    def operands(self) -> list[str]:
        return re.findall(r"%([\w.\-]+)", self.rest.split("),")[0])


@dataclasses.dataclass(frozen=True)
class Module:
    text: str
    entry: str
    headers: dict[str, str]  # computation -> its parameter list
    computations: dict[str, list[Instruction]]
    spans: dict[str, tuple[int, int]]  # computation -> its [start, end) lines in text


def parse(hlo_text: str) -> Module:
    computations: dict[str, list[Instruction]] = {}
    headers: dict[str, str] = {}
    spans: dict[str, tuple[int, int]] = {}
    entry, current, start = "", None, 0
    for i, line in enumerate(hlo_text.splitlines()):
        if m := _HEADER.match(line):
            current, start = m.group(2), i
            headers[current] = m.group(3)
            computations[current] = []
            if m.group(1):
                entry = current
        # A computation ends at "}" alone, or "}, execution_thread=..." for one that runs elsewhere (v5p's SparseCore
        # scatters); a multi-line backend config may start a line with "}" too.
        elif (line == "}" or line.startswith("}, execution_thread=")) and current is not None:
            spans[current] = (start, i + 1)
            current = None
        elif current is not None and (m := _INSTR.match(line)):
            computations[current].append(Instruction(*m.groups()[1:], root=bool(m.group(1))))
    return Module(hlo_text, entry, headers, computations, spans)


def trip_count(module: Module, comp: str, loop: Instruction) -> int | None:
    """How many times `loop` (a while instruction in computation `comp`) runs its body; None if unreadable."""
    if m := _KNOWN_TRIPS.search(loop.rest):
        return int(m.group(1))
    condition = dict((r, n) for r, n in loop.callees()).get("condition")
    instrs = {i.name: i for i in module.computations.get(condition, ())}
    root = next((i for i in reversed(module.computations.get(condition, ())) if i.opcode == "compare"), None)
    if root is None or not (d := re.search(r"direction=(\w+)", root.rest)) or d.group(1) not in _DIRECTIONS:
        return None
    a, b = (instrs.get(n) for n in root.operands()[:2])
    if a is None or b is None:
        return None
    if a.opcode == "constant":  # constant OP counter: flip it
        a, b = b, a
        direction = {"LT": "GT", "LE": "GE", "GT": "LT", "GE": "LE", "NE": "NE"}[d.group(1)]
    else:
        direction = d.group(1)
    if b.opcode != "constant" or a.opcode != "get-tuple-element":
        return None
    bound = int(re.match(r"-?[0-9]+", b.rest).group(0))
    index = int(re.search(r"index=([0-9]+)", a.rest).group(1))
    start = _initial(module, comp, loop, index)
    step = _step(module, dict(loop.callees())["body"], index)
    if step is None or step == 0:
        return None
    span = bound - start + _DIRECTIONS[direction] if step > 0 else start - bound + _DIRECTIONS[direction]
    return max(-(-span // abs(step)), 0)


def _step(module: Module, body: str, index: int) -> int | None:
    """The counter's increment per trip: the body's result at `index` is add(counter, constant(step)) (the TPU
    compiler unrolls its collective-matmul loops by 2 and counts in steps of 2)."""
    instrs = {i.name: i for i in module.computations.get(body, ())}
    root = next((i for i in module.computations.get(body, ()) if i.root), None)
    if root is None or root.opcode != "tuple" or index >= len(root.operands()):
        return None
    update = instrs.get(root.operands()[index])
    if update is None or update.opcode not in ("add", "subtract"):
        return None
    consts = [instrs[n] for n in update.operands()[:2] if n in instrs and instrs[n].opcode == "constant"]
    if len(consts) != 1 or not (m := re.match(r"-?[0-9]+", consts[0].rest)):
        return None
    return int(m.group(0)) * (1 if update.opcode == "add" else -1)


def _initial(module: Module, comp: str, loop: Instruction, index: int) -> int:
    instrs = {i.name: i for i in module.computations[comp]}
    init = instrs.get(loop.operands()[0]) if loop.operands() else None
    if init is not None and init.opcode == "tuple" and index < len(init.operands()):
        value = instrs.get(init.operands()[index])
        if value is not None and value.opcode == "constant" and (m := re.match(r"-?[0-9]+", value.rest)):
            return int(m.group(0))
    return 0


@dataclasses.dataclass(frozen=True)
class Loop:
    computation: str  # where the while instruction is
    name: str
    body: str
    trips: int | None


def loops_in(module: Module, comp: str) -> Iterator[Loop]:
    """The loops `comp` runs directly: in itself or in what it calls, but not inside another loop's body."""
    stack, seen = [comp], {comp}
    while stack:
        c = stack.pop()
        for instr in module.computations.get(c, ()):
            callees = instr.callees()
            if instr.opcode == "while":
                roles = dict(callees)
                yield Loop(c, instr.name, roles["body"], trip_count(module, c, instr))
                continue
            for _, callee in callees:
                if callee not in seen and callee in module.computations:
                    seen.add(callee)
                    stack.append(callee)


def executions(module: Module) -> tuple[dict[str, int], list[Loop]]:
    """How many times each computation runs per execution of the entry (loop bodies x their trips, nested
    bodies x all enclosing trips), and the loops whose trip count could not be read (counted once)."""
    runs: dict[str, int] = {}
    unknown: list[Loop] = []

    def visit(comp: str, times: int) -> None:
        runs[comp] = runs.get(comp, 0) + times
        for instr in module.computations.get(comp, ()):
            for role, callee in instr.callees():
                if callee not in module.computations:
                    continue
                if role == "body":
                    trips = trip_count(module, comp, instr)
                    if trips is None:
                        unknown.append(Loop(comp, instr.name, callee, None))
                    visit(callee, times * (trips if trips is not None else 1))
                elif role == "condition":
                    trips = trip_count(module, comp, instr)
                    visit(callee, times * ((trips if trips is not None else 0) + 1))
                else:
                    visit(callee, times)

    visit(module.entry, 1)
    return runs, unknown


def as_entry(module: Module, comp: str) -> str:
    """The module's text with `comp` as its entry computation (the others kept, for what it calls)."""
    lines = module.text.splitlines()
    first = min(start for start, _ in module.spans.values())
    # The lines before the first computation: the stack frame tables that instructions' metadata refers to.
    out = ["HloModule as_entry", *lines[1:first]]
    for name, (start, end) in module.spans.items():
        header = lines[start].removeprefix("ENTRY ")
        if name == module.entry and comp != module.entry:
            continue  # nothing calls the entry; dropped so the parser does not keep two
        out += ["", ("ENTRY " if name == comp else "") + header, *lines[start + 1:end]]
    return "\n".join(out) + "\n"


@dataclasses.dataclass(frozen=True)
class StepCost:
    flops: float  # per device, every loop body times its trips
    bytes_accessed: float
    counted_flops: float  # XLA's own figure: loop bodies once
    counted_bytes: float
    loops: int  # while loops in the program
    unknown: tuple[str, ...]  # loops whose trip count could not be read (counted once)


def step_cost(hlo_text: str, analyse: Callable[[str], dict[str, float]] | None = None) -> StepCost:
    """FLOPs and bytes accessed per execution, every loop weighted by its trips (see the module docstring).
    `analyse(text) -> {"flops": ..., "bytes accessed": ...}` is XLA's cost analysis of an HLO module's text."""
    analyse = analyse or xla_cost_analysis
    module = parse(hlo_text)
    cache: dict[str, tuple[tuple[float, float], tuple[float, float]]] = {}
    unknown: list[str] = []
    count = 0

    def cost(comp: str) -> tuple[tuple[float, float], tuple[float, float]]:
        """((F flops, F bytes), (T flops, T bytes)) of comp."""
        nonlocal count
        if comp not in cache:
            got = analyse(module.text if comp == module.entry else as_entry(module, comp))
            counted = (float(got.get("flops", 0.0)), float(got.get("bytes accessed", 0.0)))
            true = list(counted)
            for loop in loops_in(module, comp):
                count += 1
                if loop.trips is None:
                    unknown.append(loop.name)
                    continue
                body_counted, body_true = cost(loop.body)
                for k in (0, 1):
                    true[k] += loop.trips * body_true[k] - body_counted[k]
            cache[comp] = (counted, (true[0], true[1]))
        return cache[comp]

    (counted_flops, counted_bytes), (flops, bytes_accessed) = cost(module.entry)
    return StepCost(flops, bytes_accessed, counted_flops, counted_bytes, count, tuple(unknown))


def xla_cost_analysis(hlo_text: str) -> dict[str, float]:
    """XLA's HloCostAnalysis of an HLO module's text, on this host's CPU client: the counting is per instruction
    and the same as the compiler's own `cost_analysis()` for the TPU program (checked in tests)."""
    import jax
    from jax._src.lib import _jax
    from jaxlib import _hlo

    client = jax.devices("cpu")[0].client
    return dict(_jax.hlo_module_cost_analysis(client, _hlo.hlo_module_from_text(hlo_text)))
