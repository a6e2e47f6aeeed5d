"""`systolic plan`: will it fit, and how fast will it run, before renting the chips?

The real train step is lowered and compiled ahead of time from `jax.ShapeDtypeStruct` inputs on a mesh of the
requested shape (fake CPU devices stand in for the chips), so no weight is ever allocated. XLA's memory
analysis gives per-device arguments, outputs and temporaries; its cost analysis gives FLOPs and bytes moved per
device, from which a roofline estimate of the step time follows. The compile targets the CPU backend, whose
fusion and layout choices differ from the accelerator's, so the figures are estimates (temporaries especially).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from systolic.errors import UserError
from systolic.observe.flops import PEAK_FLOPS

# HBM per chip (bytes) and bandwidth (bytes/s), from the vendors' data sheets.
TARGETS: dict[str, tuple[str, float, float]] = {
    "tpu-v4": ("TPU v4", 32 * 2**30, 1.2e12),
    "tpu-v5e": ("TPU v5e", 16 * 2**30, 0.819e12),
    "tpu-v5p": ("TPU v5p", 95 * 2**30, 2.765e12),
    "tpu-v6e": ("TPU v6e", 32 * 2**30, 1.64e12),
    "a100": ("NVIDIA A100", 80 * 2**30, 2.039e12),
    "h100": ("NVIDIA H100", 80 * 2**30, 3.35e12),
    "h200": ("NVIDIA H200", 141 * 2**30, 4.8e12),
}


@dataclasses.dataclass(frozen=True)
class Plan:
    target: str
    devices: int
    params: int
    model_flops_per_step: float
    xla_flops_per_device: float
    bytes_accessed_per_device: float
    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    code_bytes: int
    hbm_bytes: float
    fits: bool
    step_time_s: float
    bound: str
    mfu: float

    @property
    def device_bytes(self) -> int:
        # Donated arguments alias the outputs, so the state is counted once.
        return self.argument_bytes + self.temp_bytes + self.code_bytes


def make_plan(lowered_compiled: Any, *, target: str, devices: int, params: int, model_flops: float,
              dtype: str, cost_compiled: Any | None = None) -> Plan:
    """Memory from `lowered_compiled` (the program as it will run); FLOPs and bytes moved from `cost_compiled`
    when given: XLA's cost analysis counts a scanned loop body once, so a scan-over-layers program is costed
    from its unrolled twin."""
    if target not in TARGETS:
        raise UserError(f"Unknown --target '{target}'. Known targets: {', '.join(TARGETS)}.")
    chip, hbm, bandwidth = TARGETS[target]
    peak = PEAK_FLOPS[chip][0 if dtype == "bfloat16" else 1]
    memory = lowered_compiled.memory_analysis()
    cost = (cost_compiled or lowered_compiled).cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    flops, moved = float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))
    compute_s, memory_s = flops / peak, moved / bandwidth
    step_s = max(compute_s, memory_s)
    plan = Plan(
        target=target, devices=devices, params=params, model_flops_per_step=model_flops,
        xla_flops_per_device=flops, bytes_accessed_per_device=moved,
        argument_bytes=int(memory.argument_size_in_bytes), output_bytes=int(memory.output_size_in_bytes),
        temp_bytes=int(memory.temp_size_in_bytes), code_bytes=int(memory.generated_code_size_in_bytes),
        hbm_bytes=hbm, fits=False, step_time_s=step_s, bound="compute" if compute_s >= memory_s else "memory",
        mfu=model_flops / (step_s * peak * devices) if step_s else 0.0,
    )
    return dataclasses.replace(plan, fits=plan.device_bytes <= hbm)


def format_plan(plan: Plan) -> str:
    gib = lambda b: f"{b / 2**30:,.2f} GiB"  # noqa: E731
    rows = [
        ("target", f"{plan.target} x {plan.devices}"),
        ("parameters", f"{plan.params / 1e9:.3f} B"),
        ("model FLOPs / step", f"{plan.model_flops_per_step:.3e} (formula)"),
        ("XLA FLOPs / step", f"{plan.xla_flops_per_device * plan.devices:.3e} (cost analysis, all devices)"),
        ("per device: arguments", gib(plan.argument_bytes)),
        ("per device: outputs", f"{gib(plan.output_bytes)} (aliases the donated state)"),
        ("per device: temporaries", gib(plan.temp_bytes)),
        ("per device: total", f"{gib(plan.device_bytes)} of {gib(plan.hbm_bytes)} HBM -> {'fits' if plan.fits else 'DOES NOT FIT'}"),
        ("roofline step time", f"{plan.step_time_s * 1e3:,.1f} ms ({plan.bound}-bound)"),
        ("roofline MFU", f"{100 * plan.mfu:.1f}%"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
