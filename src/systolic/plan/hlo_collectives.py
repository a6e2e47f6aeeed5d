"""The collectives of a compiled program, read from its optimised HLO text (`compiled.as_text()`).

Counted per step: each collective instruction once per execution, so one inside a loop counts once per trip, a
loop's trips read from the HLO itself (plan/hlo_text.py); the fusions a collective sits in inherit its loop's count.
Bytes are those of the whole array a collective works on, per device; `wire_bytes` is what a ring moves per device:
(n-1)/n of that for gather, scatter and all-to-all, twice that for all-reduce, all of it for a permute.

With several slices (`slice_of`), traffic that crosses slices is `dcn_wire_bytes`: the TPU compiler's host-transfer
`send`s to the multi-slice runtime (Megascale), counted as the collective they stand for over a ring of the slices,
and any plain collective whose groups span slices, all of its wire bytes (an upper estimate). Which loops are
counted and how each kind is recognised in the HLO: docs/design-notes.md, this module's section.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence

import numpy as np

from systolic.plan import hlo_text as hlo_text_lib

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
          "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 0.5, "u4": 0.5}
_MEGASCALE = re.compile(r'_xla_megascale_transfer_type="([A-Z_]+)"')
_ARRAY = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9][a-z]*)?)\[([0-9,]*)\]")


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str
    count: int  # executions per step
    bytes: float  # per device per step, the arrays as described above
    wire_bytes: float  # per device per step, moved by a ring algorithm
    dcn_wire_bytes: float = 0.0  # the part of wire_bytes whose groups span slices (over the data-center network)


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


def _groups(attrs: str) -> list[list[int]] | None:
    """The partitions of each replica group (or each source -> target pair), or None when unreadable."""
    if m := re.search(r"replica_groups=\{(\{[0-9,{}]*\})\}", attrs):
        return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([0-9,]*)\}", m.group(1))]
    if m := re.search(r"replica_groups=\[([0-9]+),([0-9]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", attrs):
        dims = [int(d) for d in m.group(3).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(4):
            ids = ids.transpose([int(p) for p in m.group(4).split(",")])
        return ids.reshape(int(m.group(1)), int(m.group(2))).tolist()
    if m := re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", attrs):
        axes = [kv.split("=") for kv in m.group(1).split(",")]
        names, sizes = [k.strip("' ") for k, _ in axes], [int(v) for _, v in axes]
        grouped = [names.index(a.strip("' ")) for a in m.group(2).split(",")]
        rest = [i for i in range(len(names)) if i not in grouped]
        ids = np.arange(math.prod(sizes)).reshape(sizes).transpose(rest + grouped)
        return ids.reshape(-1, math.prod(sizes[i] for i in grouped)).tolist()
    if m := re.search(r"source_target_pairs=\{([0-9,{}]*)\}", attrs):
        return [[int(x) for x in pair.split(",")] for pair in re.findall(r"\{([0-9]+,[0-9]+)\}", m.group(1))]
    return None


def _spans_slices(attrs: str, slice_of: Sequence[int]) -> bool:
    groups = _groups(attrs)
    if groups is None:  # unreadable groups: across slices only if every partition takes part, as in all-reduce(all)
        return False
    return any(len({slice_of[p] for p in g if p < len(slice_of)}) > 1 for g in groups)


def read_collectives(hlo_text: str, slice_of: Sequence[int] = ()) -> dict[str, Collective]:
    """Every kind in KINDS, with count and bytes per step per device (zeros for kinds the program lacks).
    `slice_of[p]`: the slice of partition p (the mesh's devices in order), for the DCN share; () for one slice."""
    module = hlo_text_lib.parse(hlo_text)
    runs, _ = hlo_text_lib.executions(module)
    totals = {k: [0, 0.0, 0.0, 0.0] for k in KINDS}
    for comp, instructions in module.computations.items():
        times = runs.get(comp, 0)
        if not times:
            continue
        for instr in instructions:
            if instr.opcode == "send" and (m := _MEGASCALE.search(instr.rest)):
                kind = m.group(1).lower().replace("_", "-")
                if kind in KINDS:
                    payload = _array_bytes(instr.shape)[0]
                    n = max(len(set(slice_of)), 2)
                    wire = times * _wire(kind, payload, n)
                    for i, add in enumerate((times, times * payload, wire, wire)):
                        totals[kind][i] += add
                continue
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
            wire = times * _wire(kind, payload, group)
            totals[kind][0] += times
            totals[kind][1] += times * payload
            totals[kind][2] += wire
            attrs = instr.rest if not fused_scatter else next(
                (i.rest for i in module.computations.get(fused_scatter, ()) if i.opcode.startswith("all-reduce")), "")
            if len(set(slice_of)) > 1 and _spans_slices(attrs, slice_of):
                totals[kind][3] += wire
    return {k: Collective(k, int(c), b, w, d) for k, (c, b, w, d) in totals.items()}


def _fused_group(instructions) -> int | None:
    for instr in instructions:
        if instr.opcode.startswith("all-reduce"):
            return _group_size(instr.rest)
    return None
