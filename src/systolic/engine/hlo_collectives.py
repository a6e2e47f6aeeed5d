"""The collectives of a compiled program, read from its optimised HLO text (`compiled.as_text()`).

Counted per step: each collective instruction once per execution, so one inside a loop counts once per trip.
HLO after optimisation rarely states a loop's trip count, so the caller supplies the trip counts of the
program's loops by nesting depth (lm: the layer scan, inside the gradient-accumulation scan when there is one);
a loop nested deeper than the caller knows counts once per trip of the loops it does know.

Bytes are those of the whole array a collective works on, per device: an all-gather's gathered result, a
reduce-scatter's full input, an all-reduce's array. `wire_bytes` is what a ring moves per device: (n-1)/n of
that for gather, scatter and all-to-all, twice that for all-reduce, all of it for a permute.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
          "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 0.5, "u4": 0.5}
_ARRAY = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9][a-z]*)?)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \((.*)\) -> .* \{$")
_INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.+?) ([a-z][a-z0-9\-]*)\((.*)$")
_CALLS = re.compile(r"\b(calls|to_apply|body|condition)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str
    count: int  # executions per step
    bytes: float  # per device per step, the arrays as described above
    wire_bytes: float  # per device per step, moved by a ring algorithm


def _array_bytes(shape_text: str) -> list[float]:
    out = []
    for dtype, dims in _ARRAY.findall(shape_text):
        size = _BYTES.get(dtype, 1 if dtype.startswith("f8") else None)
        if size is not None:
            out.append(size * math.prod(int(d) for d in dims.split(",") if d))
    return out


def _group_size(attrs: str) -> int | None:
    """Devices in each replica group: `{{0,1,2,3},...}`, iota `[2,4]<=[8]` or `mesh[...] {'axis',...}`."""
    if m := re.search(r"replica_groups=\{\{([0-9,]*)\}", attrs):
        return len(m.group(1).split(","))
    if m := re.search(r"replica_groups=\[[0-9]+,([0-9]+)\]<=", attrs):
        return int(m.group(1))
    if m := re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", attrs):
        sizes = dict((k.strip("' "), int(v)) for k, v in (kv.split("=") for kv in m.group(1).split(",")))
        return math.prod(sizes[a.strip("' ")] for a in m.group(2).split(","))
    if m := re.search(r"source_target_pairs=\{([^}]*)\}", attrs):
        return 2
    return None


def _payload(kind: str, opcode: str, shape: str, callee_inputs: str | None, group: int | None) -> float:
    arrays = _array_bytes(shape)
    if callee_inputs is not None:  # a fused reduce-scatter: its full input is the fusion's parameters
        return sum(_array_bytes(callee_inputs))
    if opcode == "collective-permute-start":  # (operand, result, contexts...)
        return arrays[1] if len(arrays) > 1 else sum(arrays)
    if opcode == "all-gather-start":  # (operands..., results...)
        return sum(arrays[len(arrays) // 2:])
    if kind == "reduce-scatter":
        return sum(arrays) * (group or 1)
    return sum(arrays)


def _wire(kind: str, payload: float, group: int | None) -> float:
    n = group or 2
    if kind == "all-reduce":
        return 2 * payload * (n - 1) / n
    if kind == "collective-permute":
        return payload
    return payload * (n - 1) / n


def read_collectives(hlo_text: str, loop_trips: Sequence[int] = ()) -> dict[str, Collective]:
    """Every kind in KINDS, with count and bytes per step per device (zeros for kinds the program lacks)."""
    computations: dict[str, list[tuple[str, str, str, str]]] = {}
    headers: dict[str, str] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        if m := _HEADER.match(line):
            current = m.group(1)
            headers[current] = m.group(2)
            computations[current] = []
            if line.startswith("ENTRY"):
                entry = current
        elif line.startswith("}"):
            current = None
        elif current is not None and (m := _INSTR.match(line)):
            computations[current].append((m.group(1), m.group(2), m.group(3), m.group(4)))
    totals = {k: [0, 0.0, 0.0] for k in KINDS}

    def visit(comp: str, depth: int, seen: tuple[str, ...]) -> None:
        multiplier = math.prod(loop_trips[:depth])
        for _, shape, opcode, rest in computations.get(comp, ()):
            callees = [(role, name) for role, name in _CALLS.findall(rest)]
            if b := _BRANCHES.search(rest):
                callees += [("branch", n.strip().lstrip("%")) for n in b.group(1).split(",")]
            base = opcode.removesuffix("-start")
            fused_scatter = next((n for r, n in callees if r == "calls" and n.startswith("all-reduce-scatter")), None)
            kind = "reduce-scatter" if fused_scatter else base if base in KINDS and not opcode.endswith("-done") else None
            if kind:
                group = _group_size(rest) if not fused_scatter else _fused_group(computations.get(fused_scatter, ()))
                payload = _payload(kind, opcode, shape, headers.get(fused_scatter) if fused_scatter else None, group)
                totals[kind][0] += multiplier
                totals[kind][1] += multiplier * payload
                totals[kind][2] += multiplier * _wire(kind, payload, group)
                if fused_scatter:
                    continue  # its inner all-reduce is the implementation, not a second collective
            for role, callee in callees:
                if callee not in seen and callee in computations:
                    visit(callee, depth + (role in ("body", "condition")), seen + (callee,))

    if entry is not None:
        visit(entry, 0, (entry,))
    return {k: Collective(k, int(c), b, w) for k, (c, b, w) in totals.items()}


def _fused_group(instructions) -> int | None:
    for _, _, opcode, rest in instructions:
        if opcode.startswith("all-reduce"):
            return _group_size(rest)
    return None
