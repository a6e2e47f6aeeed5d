"""The collectives of a compiled program, read from its optimised HLO text (`compiled.as_text()`).

Counted per step: each collective instruction once per execution, so one inside a loop counts once per trip, a
loop's trips read from the HLO itself (engine/hlo_text.py: the layer scan, a micro-batch scan, and the loops the
TPU compiler makes for collective matmuls, whose collective-permutes run once per trip). The fusions a
collective sits in are computations called from their loop body, so they inherit its count.

Bytes are those of the whole array a collective works on, per device: an all-gather's gathered result, a
reduce-scatter's full input, an all-reduce's array. `wire_bytes` is what a ring moves per device: (n-1)/n of
that for gather, scatter and all-to-all, twice that for all-reduce, all of it for a permute.
"""

from __future__ import annotations

import dataclasses
import math
import re

from systolic.engine import hlo_text as hlo_text_lib

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
          "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 0.5, "u4": 0.5}
_ARRAY = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9][a-z]*)?)\[([0-9,]*)\]")


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


def read_collectives(hlo_text: str) -> dict[str, Collective]:
    """Every kind in KINDS, with count and bytes per step per device (zeros for kinds the program lacks)."""
    module = hlo_text_lib.parse(hlo_text)
    runs, _ = hlo_text_lib.executions(module)
    totals = {k: [0, 0.0, 0.0] for k in KINDS}
    for comp, instructions in module.computations.items():
        times = runs.get(comp, 0)
        if not times:
            continue
        for instr in instructions:
            base = instr.opcode.removesuffix("-start")
            fused_scatter = next((n for r, n in instr.callees()
                                  if r == "calls" and n.startswith("all-reduce-scatter")), None)
            kind = ("reduce-scatter" if fused_scatter
                    else base if base in KINDS and not instr.opcode.endswith("-done") else None)
            if not kind:
                continue
            group = (_group_size(instr.rest) if not fused_scatter
                     else _fused_group(module.computations.get(fused_scatter, ())))
            payload = _payload(kind, instr.opcode, instr.shape,
                               module.headers.get(fused_scatter) if fused_scatter else None, group)
            totals[kind][0] += times
            totals[kind][1] += times * payload
            totals[kind][2] += times * _wire(kind, payload, group)
    return {k: Collective(k, int(c), b, w) for k, (c, b, w) in totals.items()}


def _fused_group(instructions) -> int | None:
    for instr in instructions:
        if instr.opcode.startswith("all-reduce"):
            return _group_size(instr.rest)
    return None
