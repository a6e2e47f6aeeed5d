"""`systolic plan`: will it fit, how fast will it run, and what will it cost, before renting the chips?

A workload lowers its real train step from abstract inputs (`jax.ShapeDtypeStruct`, nothing allocated) on a mesh
of the target's devices and hands the planner a `StepProgram`; the planner compiles it once and reads memory per
chip from the compiler's memory analysis (a compile-time out-of-memory, or a config the workload's `precheck`
refuses before tracing, is a result, "DOES NOT FIT", carrying the fix), FLOPs and HBM bytes from its cost analysis
with each loop weighted by its trip count (plan/hlo_text.py) and custom kernels' FLOPs added from the workload's
formula, and the collectives per step (plan/hlo_collectives.py). The step time is a roofline, the max of FLOPs at
peak, HBM bytes at HBM bandwidth and collective bytes at ICI bandwidth (DCN for traffic across slices), as if they
overlapped perfectly: a lower bound.

For TPU targets the compiler is libtpu's, on compile-only devices of the named topology (no TPU needed). GPU
targets compile with XLA:CPU on fake devices: the output says so. Each reading in detail: docs/design-notes.md,
this module's section.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax

from systolic.observe.heartbeat import heartbeat
from systolic.plan import hlo_collectives
from systolic.plan import hlo_text
from systolic.plan.targets import CALIBRATIONS, PRICES_DATED, Target
from systolic.errors import UserError
from systolic.runtime import memory as memory_lib
from systolic.runtime.memory import size_text
from systolic.runtime.platform import compiling_for

FLOPS_AGREE = 0.05  # XLA's count within 5% of the formula: the MFU needs no explanation


@dataclasses.dataclass(frozen=True)
class StepProgram:
    """What a workload hands the planner (the `plan` command's result)."""

    lowered: Any  # jax.stages.Lowered: the real step, lowered on the target's mesh
    argument_bytes: int  # per device, from the inputs' shardings (an out-of-memory message counts only temporaries)
    params: int
    items_per_step: int  # tokens, env steps, samples...
    item_unit: str
    model_flops_per_step: float | None  # the workload's formula (the MFU numerator); None: it has none, XLA's count
    dtype: str  # compute dtype: "bfloat16" or "float32"
    trainable_params: int | None = None  # fewer than `params` when some are frozen (LoRA); None: all are trained
    optimizer_bytes: int | None = None  # per device: the optimizer state's share of argument_bytes; None: not given
    kernel_flops: float = 0.0  # per step, all chips: FLOPs inside custom kernels, which XLA's cost analysis sees as 0
    kernel_note: str = ""  # which kernels, counted how
    kernel_s: float | None = None  # per step: the kernels' time at their measured rate on the target chip (None: unknown)
    notes: tuple[str, ...] = ()  # anything else the reader must know (e.g. what the formula leaves out)
    memory_fix: str = "a smaller model or batch, or more chips (a larger --mesh fsdp)"  # when it does not fit


@dataclasses.dataclass(frozen=True)
class Plan:
    workload: str
    target: str
    chip: str
    chips: int
    topology: str | None
    slices: int
    compiler: str
    mesh: str
    compile_s: float
    params: int | None  # None (and the step's other figures): the arithmetic pre-check refused it before tracing
    trainable_params: int | None  # None: every parameter is trained
    items_per_step: int | None
    item_unit: str | None
    # memory, per chip
    hbm_bytes: float
    fits: bool
    argument_bytes: int | None
    optimizer_bytes: int | None  # the optimizer state's share of argument_bytes (None: the workload does not say)
    output_bytes: int | None
    alias_bytes: int | None
    temp_bytes: int | None
    code_bytes: int | None
    peak_bytes: int  # arguments + outputs not aliased to them + temporaries + code; when it does not fit: needed
    # (0 when the compiler's message gave no size; with `precheck`, the lower bound's total / chips)
    out_of_memory: str | None  # the compiler's message, or with `precheck` the lower bound's paragraph
    # FLOPs and bytes (None when the program did not compile)
    model_flops_per_step: float | None  # None: the workload has no formula
    xla_flops_raw: float | None  # cost analysis, all chips, loop bodies once
    xla_flops_per_step: float | None  # every loop x its trips, + custom kernels' FLOPs; all chips
    flops_note: str
    hbm_bytes_accessed_raw: float | None  # per chip, loop bodies once
    hbm_bytes_accessed_per_step: float | None  # per chip, every loop x its trips
    collectives: dict[str, dict[str, float]]  # kind -> count, bytes, wire_bytes (per chip per step)
    # roofline
    compute_s: float | None
    hbm_s: float | None
    ici_s: float | None
    dcn_s: float | None  # 0 for one slice
    step_time_s: float | None  # the roofline: a lower bound
    bound: str | None
    items_per_s: float | None  # at the expected step time where the chip is calibrated, else the roofline's
    mfu: float | None  # at the roofline
    mfu_note: str | None
    # calibrated on the chip (targets.CALIBRATIONS, `_calibrated`: XLA's part x the chip's factor + the custom kernels
    # at their measured rate); None for a chip never measured
    expected_step_time_s: float | None
    expected_mfu: float | None
    calibration: str | None  # how the expected step was made, and from which measurements
    # training cost
    peak_flops_per_chip: float
    price_per_chip_hour: float
    price_source: str
    train_items: float | None
    train_steps: float | None
    train_wall_s: float | None
    train_chip_hours: float | None
    train_cost_usd: float | None
    notes: tuple[str, ...]
    fix: str | None = None  # what to change, when it does not fit
    precheck: bool = False  # refused by the workload's arithmetic lower bound before tracing: nothing was compiled


def require_libtpu() -> None:
    if importlib.util.find_spec("libtpu") is None:
        raise UserError(
            "Planning for a TPU target compiles with the TPU compiler, libtpu, which is not installed here. It runs "
            "on any machine, no TPU needed. Fix: pip install 'systolic[tpu]' (or pip install 'jax[tpu]'), or plan "
            "for a GPU target (e.g. --target h100 --mesh fsdp=8), which compiles with XLA:CPU."
        )


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """libtpu warns on stderr (from C++) that this host has no TPU (TPU_ACCELERATOR_TYPE, worker hostnames): true,
    and beside the point when compiling ahead of time. Its text is shown only if something fails."""
    import sys

    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        except BaseException:
            os.dup2(saved, 2)
            sink.seek(0)
            sys.stderr.write(sink.read().decode(errors="replace"))
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)


@contextlib.contextmanager
def _no_persistent_cache(off: bool) -> Iterator[None]:
    """Compile-only TPU executables cannot be read back from jax's persistent cache (it needs a TPU client to
    deserialise them; jax warns and compiles again), so they are not written to it either."""
    before = jax.config.jax_enable_compilation_cache
    if off:
        jax.config.update("jax_enable_compilation_cache", False)
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", before)


def devices_for(target: Target) -> list[Any]:
    """The devices to build the target's mesh from: libtpu's compile-only devices of the topology, or this
    process's (fake CPU) devices for a GPU target."""
    if target.chip.platform == "tpu":
        local = jax.devices() if jax.default_backend() == "tpu" else []
        if len(local) == target.chips and all(d.device_kind == target.chip.name for d in local):
            return local  # planning on the chips it plans for: the same compiler, and no second libtpu client
        require_libtpu()
        from jax.experimental import topologies

        # libtpu takes /tmp/libtpu_lockfile to own this host's TPU chips, so a second plan at the same time would
        # fail; compile-only devices touch no chip, so several processes may load it.
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        with _quiet_stderr():
            topology = topologies.get_topology_desc(platform="tpu", topology_name=target.topology,
                                                    **dict(target.topology_kwargs))
        devices = list(topology.devices)
        assert len(devices) == target.chips, (target, len(devices))
        return devices
    devices = jax.devices()
    if len(devices) != target.chips:
        raise UserError(f"--target {target.name} on {target.chips} devices, but this process has {len(devices)}. "
                        "Fix: run it through `systolic plan`, which creates the fake devices from --mesh.")
    return devices


@contextlib.contextmanager
def for_target(target: Target) -> Iterator[None]:
    """Trace for the target's platform (model code asks `compile_platform()`), with memory checks against the
    target's chips, not this host's."""
    hbm = f"{target.chips} x {target.chip.name} ({memory_lib.gib(target.chip.hbm_bytes)} each)"
    with compiling_for(target.chip.platform), memory_lib.budget(target.chips * target.chip.hbm_bytes, hbm):
        yield


def compile_lowered(lowered: Any, target: Target,
                    progress: Callable[[str], None] = lambda _: None) -> tuple[Any, str | None]:
    """(the compiled program, None), or (None, the compiler's message) for a compile-time out-of-memory; `progress`
    hears how long the compile has run, every observe.heartbeat.EVERY_S seconds."""
    tpu = target.chip.platform == "tpu"
    try:
        with _quiet_stderr() if tpu else contextlib.nullcontext(), _no_persistent_cache(tpu), \
                heartbeat(progress, f"plan: still compiling with {target.compiler}"):
            return lowered.compile(), None
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        return None, str(e).strip().splitlines()[0]


def plan_step(workload: str, plan_fn: Callable[[Any, list[Any]], StepProgram], cfg: Any, target: Target, *,
              mesh: str, train_items: float | None = None, price_per_chip_hour: float | None = None,
              progress: Callable[[str], None] = lambda _: None) -> Plan:
    """Lowers the workload's step for `target` (model code sees `compile_platform()` = the target's platform),
    compiles it once and reads every figure. `progress` gets a line as each phase starts and when the compile ends:
    a billion-parameter step takes minutes to compile on a small host, which should not look like a hang."""
    devices = devices_for(target)
    start = time.perf_counter()
    progress(f"plan: tracing the {workload} train step for {target.name} ({target.chips} chips, mesh {mesh})")
    with for_target(target):
        try:
            program = plan_fn(cfg, devices)  # the workloads' size checks compare against the target, not this host
        except memory_lib.DoesNotFit as e:
            progress("plan: it does not fit (the arithmetic lower bound, before tracing)")
            return refused(workload, target, mesh, e, compile_s=time.perf_counter() - start)
        progress(f"plan: compiling it ({program.params / 1e6:,.1f}M parameters) with {target.compiler}; a billion "
                 "parameters take a few minutes on a small host")
        compiled, out_of_memory = compile_lowered(program.lowered, target, progress)
    compile_s = time.perf_counter() - start
    progress(f"plan: compiled in {compile_s:,.1f} s" + ("" if compiled is not None else ": it does not fit"))
    chip = target.chip
    peak = chip.peak_bf16_flops if program.dtype == "bfloat16" else chip.peak_fp32_flops
    price = price_per_chip_hour if price_per_chip_hour is not None else chip.price_per_chip_hour
    source = ("--price-per-chip-hour" if price_per_chip_hour is not None
              else f"on-demand list price as of {PRICES_DATED}: {chip.source}")
    common = dict(workload=workload, target=target.name, chip=chip.name, chips=target.chips, topology=target.topology, slices=target.slices,
                  compiler=target.compiler, mesh=mesh, compile_s=compile_s, params=program.params,
                  trainable_params=program.trainable_params, items_per_step=program.items_per_step,
                  item_unit=program.item_unit, hbm_bytes=chip.hbm_bytes, argument_bytes=program.argument_bytes,
                  optimizer_bytes=program.optimizer_bytes, model_flops_per_step=program.model_flops_per_step,
                  peak_flops_per_chip=peak, price_per_chip_hour=price, price_source=source, train_items=train_items,
                  notes=program.notes)
    if compiled is None:
        needed = memory_lib.needed_bytes(out_of_memory or "")
        return _unfit(common, peak_bytes=int(needed or 0), out_of_memory=out_of_memory, fix=program.memory_fix)

    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    # SPMD: the cost analysis is the one program every chip runs, so per chip; x chips for the step.
    raw_flops = float(cost.get("flops", 0.0)) * target.chips
    raw_bytes = float(cost.get("bytes accessed", 0.0))
    hlo = compiled.as_text()
    weighted = hlo_text.step_cost(hlo)
    flops = weighted.flops * target.chips + program.kernel_flops
    loops = (f"{weighted.loops} loop{'s' if weighted.loops > 1 else ''} weighted by {'their' if weighted.loops > 1 else 'its'} "
             "trip count from the HLO" if weighted.loops else "no loops")
    unknown = (f"; {len(weighted.unknown)} loops of unreadable trip count counted once ({', '.join(weighted.unknown)})"
               if weighted.unknown else "")
    kernels = f"; + {program.kernel_flops:.3e} {program.kernel_note}" if program.kernel_flops else ""
    flops_note = f"XLA's cost analysis, {loops}{unknown}{kernels}"
    # XLA's generic count (on this host) weights each loop's bytes; the TPU compiler's own total is scaled by it.
    step_bytes = raw_bytes * (weighted.bytes_accessed / weighted.counted_bytes if weighted.counted_bytes else 1.0)
    collectives = hlo_collectives.read_collectives(hlo, _slice_of(compiled) if target.slices > 1 else ())
    dcn = sum(c.dcn_wire_bytes for c in collectives.values())
    wire = sum(c.wire_bytes for c in collectives.values()) - dcn
    # Compute at the formula's count when XLA's falls short of it (a loop of unreadable trips, an opaque kernel).
    formula = program.model_flops_per_step
    compute_s = max(flops, formula or 0.0) / target.chips / peak
    hbm_s, ici_s, dcn_s = step_bytes / chip.hbm_bytes_per_s, wire / chip.ici_bytes_per_s, dcn / chip.dcn_bytes_per_s
    step_s = max(compute_s, hbm_s, ici_s, dcn_s)
    bound = {compute_s: "compute", hbm_s: "HBM bandwidth", ici_s: "interconnect (ICI)",
             dcn_s: "data-center network (DCN)"}[step_s]
    ratio = flops / formula if formula else 1.0
    if formula is None:
        mfu_note = "the workload has no FLOP formula: the MFU is XLA's count over the roofline time"
    elif abs(ratio - 1) <= FLOPS_AGREE:
        mfu_note = None
    elif ratio > 1:
        mfu_note = (f"XLA counts {ratio:.2f}x the formula's FLOPs (the notes say what the formula leaves out); the "
                    f"step time follows XLA's count, the MFU the formula's, so even at the compute roofline it is at "
                    f"most 1/{ratio:.2f} = {100 / ratio:.0f}%")
    else:
        mfu_note = (f"XLA counts only {ratio:.2f}x the formula's FLOPs ({flops_note}), so the compute time uses the "
                    "formula's count")
    peak_bytes = memory_lib.program_bytes(memory)
    kernel_peak_s = program.kernel_flops / target.chips / peak
    expected_s, calibration = (_calibrated(chip.name, compute_s, hbm_s, kernel_peak_s, program.kernel_s)
                               if bound in ("compute", "HBM bandwidth") else (None, None))
    steps = train_items / program.items_per_step if train_items else None
    wall = steps * (expected_s or step_s) if steps else None
    chip_hours = wall / 3600 * target.chips if wall else None
    # A TPU program that compiled fits: libtpu checks its temporaries against the chip's memory and refuses with
    # RESOURCE_EXHAUSTED (above), and the analysis' sum overshoots the chip (engine/fit.py `check` says by how much).
    fits = chip.platform == "tpu" or peak_bytes <= chip.hbm_bytes
    return Plan(**common, fits=fits, fix=None if fits else program.memory_fix, output_bytes=int(memory.output_size_in_bytes),
                alias_bytes=int(memory.alias_size_in_bytes), temp_bytes=int(memory.temp_size_in_bytes),
                code_bytes=int(memory.generated_code_size_in_bytes), peak_bytes=int(peak_bytes), out_of_memory=None,
                xla_flops_raw=raw_flops, xla_flops_per_step=flops, flops_note=flops_note,
                hbm_bytes_accessed_raw=raw_bytes, hbm_bytes_accessed_per_step=step_bytes,
                collectives={k: dataclasses.asdict(c) for k, c in collectives.items()},
                compute_s=compute_s, hbm_s=hbm_s, ici_s=ici_s, dcn_s=dcn_s, step_time_s=step_s, bound=bound,
                items_per_s=program.items_per_step / (expected_s or step_s) if step_s else None,
                mfu=(formula or flops) / (step_s * peak * target.chips) if step_s else None,
                expected_step_time_s=expected_s, calibration=calibration,
                expected_mfu=(formula or flops) / (expected_s * peak * target.chips) if expected_s else None,
                mfu_note=mfu_note, train_steps=steps, train_wall_s=wall, train_chip_hours=chip_hours,
                train_cost_usd=chip_hours * price if chip_hours else None)


def _calibrated(chip: str, compute_s: float, hbm_s: float, kernel_peak_s: float,
                kernel_s: float | None) -> tuple[float | None, str | None]:
    """(expected step time, what it rests on), for a chip measured on (targets.CALIBRATIONS): the larger of the
    program XLA compiles at its compute roofline (its FLOPs less the custom kernels' at peak) times the chip's compute
    factor and at its HBM roofline times the HBM factor, plus the custom kernels' time at their measured rate
    (`kernel_s`; unknown: at peak times the compute factor). (None, None) for a chip never measured."""
    factors = CALIBRATIONS.get(chip)
    if factors is None:
        return None, None
    compute, hbm = (compute_s - kernel_peak_s) * factors.compute, hbm_s * factors.hbm
    part = (f"XLA's compute roofline {ms_text(compute_s - kernel_peak_s)} x {factors.compute:.2f}" if compute >= hbm
            else f"XLA's HBM roofline {ms_text(hbm_s)} x {factors.hbm:.2f}")
    kernel = kernel_s if kernel_s is not None else kernel_peak_s * factors.compute
    rate = "at its measured rate" if kernel_s is not None else f"at peak x {factors.compute:.2f}"
    note = (part + (f" + custom kernels {ms_text(kernel)} {rate}" if kernel else "")
            + f": the {chip}'s measured factors ({factors.source})")
    return max(compute, hbm) + kernel, note


def _unfit(common: dict[str, Any], *, peak_bytes: int, out_of_memory: str | None, fix: str,
           precheck: bool = False) -> Plan:
    """A plan that does not fit: no compiled program, so no FLOPs, collectives, roofline or cost."""
    return Plan(**common, fits=False, output_bytes=None, alias_bytes=None, temp_bytes=None, code_bytes=None,
                peak_bytes=peak_bytes, out_of_memory=out_of_memory, fix=fix, precheck=precheck,
                xla_flops_raw=None, xla_flops_per_step=None, flops_note="the program did not compile",
                hbm_bytes_accessed_raw=None, hbm_bytes_accessed_per_step=None,
                collectives={}, compute_s=None, hbm_s=None, ici_s=None, dcn_s=None, step_time_s=None, bound=None,
                items_per_s=None, mfu=None, mfu_note=None, expected_step_time_s=None, expected_mfu=None,
                calibration=None, train_steps=None, train_wall_s=None,
                train_chip_hours=None, train_cost_usd=None)


def refused(workload: str, target: Target, mesh: str, error: memory_lib.DoesNotFit, *, compile_s: float) -> Plan:
    """The plan of a config that the workload's arithmetic lower bound refused before tracing (`error`'s figures are
    totals over the target's chips); its per-chip bytes are that total spread evenly."""
    chip = target.chip
    total = (f"the arithmetic lower bound needs {size_text(error.need_bytes)} in total over {target.chips} chips, "
             f"which hold {size_text(error.have_bytes)} in total; nothing was traced or compiled")
    common = dict(workload=workload, target=target.name, chip=chip.name, chips=target.chips, topology=target.topology,
                  slices=target.slices, compiler=target.compiler, mesh=mesh, compile_s=compile_s, params=None,
                  trainable_params=None, items_per_step=None, item_unit=None, hbm_bytes=chip.hbm_bytes,
                  argument_bytes=None, optimizer_bytes=None, model_flops_per_step=None,
                  peak_flops_per_chip=chip.peak_bf16_flops, price_per_chip_hour=chip.price_per_chip_hour,
                  price_source=f"on-demand list price as of {PRICES_DATED}: {chip.source}", train_items=None,
                  notes=(total,))
    return _unfit(common, peak_bytes=-(-int(error.need_bytes) // target.chips), out_of_memory=str(error),
                  fix=error.fix, precheck=True)


def _slice_of(compiled: Any) -> list[int]:
    """The slice of each partition: partition p runs on the p-th device of the mesh the inputs are sharded over."""
    mesh = next(s.mesh for s in jax.tree.leaves(compiled.input_shardings) if hasattr(s, "mesh"))
    return [d.slice_index for d in mesh.devices.flat]


def _count_text(n: int) -> str:
    if n >= 1e8:
        return f"{n / 1e9:.3f} B"
    return f"{n / 1e6:.3f} M" if n >= 1e5 else f"{n:,}"


def ms_text(s: float) -> str:
    return f"{s * 1e3:,.1f} ms" if s >= 1e-2 else f"{s * 1e3:.3g} ms"


def _duration(s: float) -> str:
    if s >= 86400:
        return f"{s / 86400:,.1f} days"
    return f"{s / 3600:,.1f} h" if s >= 3600 else f"{s:,.0f} s"


def format_plan(plan: Plan) -> str:
    rows: list[tuple[str, str]] = [
        ("target", f"{plan.target}" + (f" x {plan.slices} slices" if plan.slices > 1 else "")
                   + f": {plan.chips} x {plan.chip}" + (f" (topology {plan.topology})" if plan.topology else "")),
        ("figures from", plan.compiler),
        ("mesh", plan.mesh),
        ("compile", f"{plan.compile_s:,.1f} s (once)"),
        ("parameters", _count_text(plan.params) + (f", {_count_text(plan.trainable_params)} of them trained (the "
                                                   "rest frozen: no gradients, no optimizer state)"
                                                   if plan.trainable_params not in (None, plan.params) else "")),
    ]
    arguments = size_text(plan.argument_bytes) + (f" (optimizer state {size_text(plan.optimizer_bytes)})"
                                                 if plan.optimizer_bytes is not None else "")
    if plan.out_of_memory:
        needs = f"needs {size_text(plan.peak_bytes)} of {size_text(plan.hbm_bytes)} HBM" if plan.peak_bytes else "size not given"
        rows += [("per chip: arguments", arguments),
                 ("per chip: memory", f"DOES NOT FIT ({needs}; a compile-time out-of-memory)"),
                 ("compiler said", plan.out_of_memory)]
    else:
        rows += [
            ("per chip: arguments", arguments),
            ("per chip: temporaries", size_text(plan.temp_bytes or 0)),
            ("per chip: generated code", size_text(plan.code_bytes or 0)),
            ("per chip: peak", f"{size_text(plan.peak_bytes)} of {size_text(plan.hbm_bytes)} HBM -> "
                               f"{'fits' if plan.fits else 'DOES NOT FIT'}"),
            ("model FLOPs / step", f"{plan.model_flops_per_step:.3e} (formula)" if plan.model_flops_per_step
                                   else "no formula for this workload"),
            ("XLA FLOPs / step", f"{plan.xla_flops_per_step:.3e}"
                                 + (f" = {plan.xla_flops_per_step / plan.model_flops_per_step:.2f}x the formula"
                                    if plan.model_flops_per_step else "")
                                 + f" ({plan.flops_note}; as reported, loop bodies once: {plan.xla_flops_raw:.3e})"),
            ("HBM bytes / step / chip", f"{plan.hbm_bytes_accessed_per_step:.3e} (XLA's bytes accessed, each loop x its "
                                        f"trips: an upper estimate, as it counts every operand read in full; as "
                                        f"reported: {plan.hbm_bytes_accessed_raw:.3e})"),
        ]
        for kind, c in plan.collectives.items():
            if c["count"]:
                dcn = f", {size_text(c['dcn_wire_bytes'])} of it across slices (DCN)" if c["dcn_wire_bytes"] else ""
                rows.append((f"  {kind}", f"{c['count']:,} per step, {size_text(c['bytes'])} per chip "
                                           f"({size_text(c['wire_bytes'])} over the links{dcn})"))
        if not any(c["count"] for c in plan.collectives.values()):
            rows.append(("collectives", "none"))
        rows += [
            ("roofline step time", f"{ms_text(plan.step_time_s)}, {plan.bound}-bound (compute {ms_text(plan.compute_s)}, "
                                   f"HBM {ms_text(plan.hbm_s)}, ICI {ms_text(plan.ici_s)}"
                                   + (f", DCN {ms_text(plan.dcn_s)}" if plan.dcn_s else "")
                                   + "; perfect overlap: a lower bound)"),
            ("expected step time", f"{ms_text(plan.expected_step_time_s)}: {plan.calibration}"
             if plan.expected_step_time_s else "no measurement of this chip: the roofline alone (a lower bound)"),
            ("throughput", f"{plan.items_per_s:,.0f} {plan.item_unit}/s"
             + (" (expected)" if plan.expected_step_time_s else " (roofline)")),
            ("roofline MFU", f"{100 * plan.mfu:.1f}%" + (f": {plan.mfu_note}" if plan.mfu_note else "")),
        ]
        if plan.expected_mfu:
            rows.append(("expected MFU", f"{100 * plan.expected_mfu:.1f}%"))
        if plan.train_items:
            rows.append((f"train {plan.train_items:.3g} {plan.item_unit}",
                         f"{plan.train_steps:,.0f} steps, {_duration(plan.train_wall_s)}, {plan.train_chip_hours:,.3g} "
                         f"chip-hours, ${plan.train_cost_usd:,.2f} at ${plan.price_per_chip_hour:.2f}/chip-hour "
                         f"({plan.price_source})"))
    rows += [("note", n) for n in plan.notes] + ([("fix", plan.fix)] if plan.fix else [])
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
