"""Plan targets by the names users rent them under: Cloud TPU slices (`v5e-8`, `v5p-128`) and NVIDIA GPUs (`h100`).

A TPU name maps to the topology string that libtpu's compiler takes (`v5e:2x4`, `v5:4x4x4` for v5p) plus the
per-host layout and wrap-around links, after MaxText's `accelerator_to_spec_map.py` (read 2026-12-04); the table
here is our own. For v4 and v5p the number in the name counts TensorCores, two per chip: `v5p-128` is 64 chips.
v5e and v6e have one TensorCore per chip, so the number counts chips.

Chip figures (table dated 2026-12-04; the sources are named on each row). Bandwidths are bytes/s per chip:
HBM, inter-chip (ICI, NVLink for GPUs: the published per-chip figure, both directions) and data-center
network (DCN: the host's NICs shared by its chips). Prices are on-demand list prices per chip-hour in
us-central1; they change, so `--price-per-chip-hour` overrides them.
"""

from __future__ import annotations

import dataclasses

from systolic.errors import UserError

PRICES_DATED = "2026-12-04"


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    platform: str  # "tpu": compiled by libtpu; "gpu": compiled by XLA:CPU on fake devices (no CUDA compiler here)
    hbm_bytes: float
    peak_bf16_flops: float  # dense, per chip
    peak_int8_ops: float  # dense int8 x int8 multiply-accumulates x 2, per chip (serving plans of w8a8 weights)
    hbm_bytes_per_s: float
    ici_bytes_per_s: float
    dcn_bytes_per_s: float  # per chip
    price_per_chip_hour: float  # USD, on-demand
    source: str

    @property
    def peak_fp32_flops(self) -> float:
        # TPUs run float32 matmuls as several bf16 passes; NVIDIA's non-tensor-core float32 is far lower.
        return {"NVIDIA A100": 19.5e12, "NVIDIA H100": 67e12, "NVIDIA H200": 67e12}.get(self.name, self.peak_bf16_flops / 2)


@dataclasses.dataclass(frozen=True)
class Calibration:
    """How a real chip's step time relates to the roofline (plan/planner.py `_calibrated`): the program XLA compiles
    takes `compute` x its compute roofline (its FLOPs at the data sheet's peak; the factor covers the matrix unit's
    achieved rate, the elementwise passes, the optimizer's update) or `hbm` x its HBM roofline, whichever is longer,
    and a custom kernel (splash attention) takes its own measured rate (kernels/splash/tuned_block_sizes.py)."""

    compute: float
    hbm: float
    source: str  # the rows, command and date behind the factors


GiB = 2**30
# By chip name. Chips without a row plan at the roofline alone (and say so).
CALIBRATIONS: dict[str, Calibration] = {
    "TPU v5 lite": Calibration(compute=1.50, hbm=1.00, source=(
        "compute: llama-1b/8 layers at 4 x 2048, 243.5 ms measured by `benchmarks/harness/tpu.sh train` on the "
        "lent v5e, "
        "2026-12-06, less its splash time at the kernel's measured rate, over XLA's 122.1 ms; HBM: no row measured "
        "HBM-bound, XLA's bytes as they are (an upper estimate). Every training row within 14% of the chip: "
        "docs/planning.md, 'The planner against the chip'")),
}


@dataclasses.dataclass(frozen=True)
class ServeCalibration:
    """What one decode step of the serving engine takes on a chip (plan/serving.py `expected_decode`): its parts one
    after another, as measured (no overlap): every weight read at `weights_bytes_per_s` and a fixed `layer_s` per
    layer, each sequence's keys and values read by the Pallas paged-attention kernel
    (kernels/paged_attention/kernel.py) at its rate for the head width, and the step's matmuls at
    `matmul_flops_per_s`."""

    weights_bytes_per_s: float
    layer_s: float  # what a layer costs besides its weights at one token: launches, the layer loop, small ops
    kv_bytes_per_s: float  # the kernel, head_dim a multiple of 128: k and v are whole lane tiles
    kv_bytes_per_s_narrow: float  # the kernel, head_dim 64: 8 heads' [k | v] tiles in one matmul, twice
    matmul_flops_per_s: float
    source: str


# By chip name. Chips without a row plan serving at the roofline alone (and say so). v5e: measured on the lent chip
# on 2026-12-06 (jax 0.10.2, bfloat16):
# - weights and layers: the two rows of 1 sequence in flight of `benchmarks/harness/tpu.sh serve` (benchmarks/studies/
#   serve_engine.py), llama-1b (16 layers, 2.08 GB of weights) 3.08 ms a token (TPOT p50) and gemma3-1b (26 layers,
#   2.00 GB) 3.26 ms, each less its KV read and matmuls at the rates below, solved for both: 812 GB/s (the data
#   sheet's 819) and 29.5 us a layer;
# - KV: `benchmarks/kernels/paged_attention.py` (every layer's attention of a decode batch, 256 positions a sequence):
#   302 and 317 GB/s for gemma3-1b's and Gemma 2B's heads of 256; for llama-1b's heads of 64, 430 and 446 GB/s at
#   64 and 256 sequences with 8 heads a matmul (2026-12-07; 242 and 247 one head at a time);
# - matmuls: an 8192^3 bfloat16 matmul at 181 TFLOP/s (observe/peak_flops.py; the data sheet's 197).
SERVE_CALIBRATIONS: dict[str, ServeCalibration] = {
    "TPU v5 lite": ServeCalibration(weights_bytes_per_s=812e9, layer_s=29.5e-6, kv_bytes_per_s=310e9,
                                    kv_bytes_per_s_narrow=440e9, matmul_flops_per_s=181e12, source=(
        "benchmarks/harness/tpu.sh serve and benchmarks/kernels/paged_attention.py on the lent v5e, 2026-12-06 "
        "(heads of 64: "
        "2026-12-07); every decode step measured there within 25%: docs/planning.md, 'The serving plan against the "
        "chip'")),
}
CHIPS: dict[str, Chip] = {
    # https://cloud.google.com/tpu/docs/v4 (275 TFLOP/s bf16 or int8); https://cloud.google.com/tpu/pricing
    "v4": Chip("TPU v4", "tpu", 32 * GiB, 275e12, 275e12, 1200e9, 2400e9 / 8, 6.25e9, 3.22,
               "cloud.google.com/tpu/docs/v4 (ICI 2400 Gbps), tpu/pricing"),
    # https://cloud.google.com/tpu/docs/v5e: 16 GB, 819 GB/s, 394 int8 TOP/s, ICI 1600 Gbps, 2 x 100 Gbps NICs per
    # 8-chip host. Memory: the 15.75 GiB that the compiler allows a program on the chip ("exceeds available HBM
    # (15.75G)", and memory_stats' bytes_limit on the lent chip, 2026-12-06), of the data sheet's 16.
    "v5e": Chip("TPU v5 lite", "tpu", 15.75 * GiB, 197e12, 394e12, 819e9, 1600e9 / 8, 200e9 / 8 / 8, 1.20,
                "cloud.google.com/tpu/docs/v5e, tpu/pricing"),
    # https://cloud.google.com/tpu/docs/v5p: 95 GB, 2765 GB/s, 918 int8 TOP/s, ICI 4800 Gbps
    "v5p": Chip("TPU v5", "tpu", 95 * GiB, 459e12, 918e12, 2765e9, 4800e9 / 8, 6.25e9, 4.20,
                "cloud.google.com/tpu/docs/v5p, tpu/pricing"),
    # https://cloud.google.com/tpu/docs/v6e: 32 GB, 1640 GB/s, 1836 int8 TOP/s, ICI 3584 Gbps
    "v6e": Chip("TPU v6 lite", "tpu", 32 * GiB, 918e12, 1836e12, 1640e9, 3584e9 / 8, 12.5e9, 2.70,
                "cloud.google.com/tpu/docs/v6e, tpu/pricing"),
    # NVIDIA data sheets (SXM, dense bf16 and int8: A100 624, H100/H200 1979 TOP/s); NVLink both directions; GCP
    # A2/A3 on-demand per GPU
    "a100": Chip("NVIDIA A100", "gpu", 80 * GiB, 312e12, 624e12, 2039e9, 600e9, 12.5e9, 5.07,
                 "NVIDIA A100 data sheet; cloud.google.com/compute/gpus-pricing (a2-ultragpu)"),
    "h100": Chip("NVIDIA H100", "gpu", 80 * GiB, 989e12, 1979e12, 3350e9, 900e9, 50e9, 11.06,
                 "NVIDIA H100 data sheet; cloud.google.com/compute/gpus-pricing (a3-highgpu)"),
    "h200": Chip("NVIDIA H200", "gpu", 141 * GiB, 989e12, 1979e12, 4800e9, 900e9, 50e9, 10.60,
                 "NVIDIA H200 data sheet; cloud.google.com/compute/gpus-pricing (a3-ultragpu)"),
}

# Slice shapes in chips. v5e/v6e: 2-D, 4 chips per host board (a single chip is its own host); v4/v5p: 3-D cubes
# of 4-chip hosts, with wrap-around links (a torus) from a full 4x4x4 cube up.
_2D = {1: (1, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8), 128: (8, 16), 256: (16, 16)}
_3D = {4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4), 64: (4, 4, 4), 128: (4, 4, 8), 192: (4, 4, 12),
       256: (4, 8, 8), 384: (4, 8, 12), 512: (8, 8, 8), 768: (8, 8, 12), 1024: (8, 8, 16), 2048: (8, 16, 16),
       4096: (16, 16, 16)}
_TOPOLOGY_PREFIX = {"v4": "v4", "v5p": "v5", "v5e": "v5e", "v6e": "v6e"}
_CORES_PER_CHIP = {"v4": 2, "v5p": 2, "v5e": 1, "v6e": 1}


@dataclasses.dataclass(frozen=True)
class Target:
    name: str  # as the user wrote it: v5e-8, h100
    chip: Chip
    chips: int  # GPUs: the mesh's device count
    topology: str | None = None  # libtpu's topology string, e.g. v5e:2x4; None for GPUs
    topology_kwargs: tuple[tuple[str, object], ...] = ()  # chip_config_name, chips_per_host_bounds, wrap, num_slices
    slices: int = 1  # TPU slices joined by the data-center network; `chips` counts all of them

    @property
    def compiler(self) -> str:
        if self.chip.platform == "tpu":
            return f"the TPU compiler (libtpu) for topology {self.topology}" + (
                f" x {self.slices} slices" if self.slices > 1 else "")
        return (f"XLA:CPU on {self.chips} fake CPU devices standing in for {self.chip.name} (no CUDA compiler "
                "on this host: fusion, layout and temporaries differ from the GPU's, so memory is an estimate)")


def tpu_names() -> list[str]:
    names = []
    for family in ("v4", "v5e", "v5p", "v6e"):
        shapes = _3D if family in ("v4", "v5p") else _2D
        names += [f"{family}-{chips * _CORES_PER_CHIP[family]}" for chips in shapes]
    return names


def _tpu_target(name: str, family: str, count: int, slices: int) -> Target:
    cores = _CORES_PER_CHIP[family]
    shapes = _3D if family in ("v4", "v5p") else _2D
    if count % cores or count // cores not in shapes:
        raise _unknown(name)
    chips = count // cores
    shape = shapes[chips]
    topology = f"{_TOPOLOGY_PREFIX[family]}:{'x'.join(map(str, shape))}"
    if family in ("v4", "v5p"):
        torus = all(s >= 4 for s in shape)
        kwargs = (("chip_config_name", "megacore"), ("chips_per_host_bounds", (2, 2, 1)), ("wrap", (torus,) * 3))
    else:
        host = (1, 1, 1) if chips == 1 else (2, 2, 1)
        wrap = (shape[0] == 16, shape[1] == 16, False)  # a full 16x16 pod is a torus; 8x16 wraps its long side
        kwargs = (("chips_per_host_bounds", host), ("wrap", wrap))
    if slices > 1:
        kwargs += (("num_slices", slices),)
    return Target(name, CHIPS[family], chips * slices, topology, kwargs, slices)


def resolve(name: str, *, mesh_devices: int, slices: int = 1) -> Target:
    """The target for a user's name, `slices` of it. GPU targets take their device count from the mesh (`h100` x
    --mesh)."""
    key = name.strip().lower()
    if slices < 1:
        raise UserError(f"--slices {slices}: expected the number of slices, at least 1. Fix: e.g. --slices 2.")
    if key in CHIPS and CHIPS[key].platform == "gpu":
        if slices > 1:
            raise UserError(f"--slices {slices} with --target {name}: slices are TPU slices joined by the data-center "
                            "network; a GPU plan runs on fake devices of one process. Fix: a TPU target (e.g. --target "
                            "v5e-256 --slices 2), or leave out --slices.")
        return Target(key, CHIPS[key], mesh_devices)
    family, _, count = key.rpartition("-")
    if family in _CORES_PER_CHIP and count.isdigit():
        return _tpu_target(key, family, int(count), slices)
    raise _unknown(name)


def _unknown(name: str) -> UserError:
    gpus = [k for k, c in CHIPS.items() if c.platform == "gpu"]
    return UserError(
        f"Unknown --target '{name}'. TPU slices by their Cloud TPU names: {', '.join(tpu_names())} (for v4 and v5p "
        f"the number counts TensorCores, two per chip: v5p-128 is 64 chips). GPUs: {', '.join(gpus)} (the device "
        "count comes from --mesh, e.g. --target h100 --mesh fsdp=8). Fix: e.g. --target v5e-8."
    )
