"""`systolic plan` with the TPU compiler (libtpu) on compile-only devices: the lm step on a small topology."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest


pytestmark = [
    pytest.mark.tpu_aot,
    pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                       reason="libtpu is not installed (pip install 'jax[tpu]'): no TPU compiler to plan with"),
]

# A 2-layer scanned Llama small enough to compile for a TPU in seconds.
TINY = ["model.d_model=128", "model.layers=2", "model.heads=4", "model.kv_heads=2", "model.max_seq_len=256",
        "data.seq_len=256", "train.batch_size=8", "model.scan_layers=true"]


def plan_lm(target: str, mesh: dict[str, int], *extra: str):
    from systolic import config as config_lib
    from systolic.plan import targets
    from systolic.plan.planner import plan_step
    from systolic.workloads.lm.config import LMConfig
    from systolic.workloads.lm.entry import plan

    overrides = [*TINY, *(f"mesh.{a}={mesh.get(a, 1)}" for a in ("data", "fsdp", "tensor")), *extra]
    cfg = config_lib.from_dict(LMConfig, config_lib.apply_overrides({}, overrides))
    return plan_step("lm", plan, cfg, targets.resolve(target, mesh_devices=0), mesh=str(mesh), train_items=1e9)


@pytest.mark.parametrize("mesh, collective", [({"data": 4}, "all-reduce"), ({"fsdp": 4}, "all-gather"),
                                              ({"fsdp": 2, "tensor": 2}, "all-gather")])
def test_lm_step_compiles_for_v5e_4_in_each_layout(mesh, collective):
    p = plan_lm("v5e-4", mesh)
    assert (p.chips, p.topology, p.fits, p.out_of_memory) == (4, "v5e:2x2", True, None)
    assert 0 < p.peak_bytes < p.hbm_bytes
    assert p.collectives[collective]["count"] > 0 and p.collectives[collective]["bytes"] > 0
    # XLA's count with every loop x its trips, + splash's FLOPs (invisible to XLA) from the formula: the formula's
    # count, plus the few percent it leaves out (norms, softmax, the optimizer).
    assert 1.0 < p.xla_flops_per_step / p.model_flops_per_step < 1.1, p.flops_note
    assert p.step_time_s == max(p.compute_s, p.hbm_s, p.ici_s) > 0


def test_fsdp_splits_the_state_and_the_gradients_are_reduce_scattered():
    data, fsdp = plan_lm("v5e-4", {"data": 4}), plan_lm("v5e-4", {"fsdp": 4})
    assert fsdp.argument_bytes < 0.4 * data.argument_bytes
    assert fsdp.collectives["reduce-scatter"]["count"] > 0


def plan_workload(workload: str, recipe: str, mesh: dict[str, int], *, slices: int = 1, extra=(), target="v5e-4"):
    from systolic import config as config_lib
    from systolic import workloads
    from systolic.plan import targets
    from systolic.plan.planner import plan_step

    w = workloads.get(workload)
    axes = ("data", "fsdp", "expert", "tensor")
    overrides = [*(f"mesh.{a}={mesh.get(a, 1)}" for a in axes), f"mesh.slices={slices}", *extra]
    cfg, _ = config_lib.load(w.config, recipe, overrides, w.default_recipe)
    target = targets.resolve(target, mesh_devices=0, slices=slices)
    return plan_step(workload, w.command("plan"), cfg, target, mesh=str(mesh))


@pytest.mark.parametrize("workload, recipe, mesh", [("rl", "rl-cartpole", {"data": 4}),
                                                    ("gan", "gan-digits", {"data": 2, "fsdp": 2}),
                                                    ("sim", "sim-gray-scott", {"data": 4})])
def test_every_workload_plans_its_real_step(workload, recipe, mesh):
    p = plan_workload(workload, recipe, mesh)
    assert (p.fits, p.topology) == (True, "v5e:2x2")
    assert sum(c["count"] for c in p.collectives.values()) > 0  # the data-parallel reductions, the halo exchange
    if workload != "gan":  # rl's rollout and update loops, sim's solver steps: weighted by their trips
        assert p.xla_flops_per_step > 10 * p.xla_flops_raw, p.flops_note
    assert p.mfu is not None
    if workload == "gan":  # it counts its model FLOPs (workloads/gan/flops.py); the TPU compiler's count adds the
        # element-wise work the formula leaves out (5.3% here, 2026-12-07, libtpu 0.0.42.1)
        assert p.model_flops_per_step < p.xla_flops_per_step < 1.08 * p.model_flops_per_step, p.mfu_note
    else:
        assert p.model_flops_per_step is None and "no FLOP formula" in p.mfu_note
    assert p.dcn_s == 0


@pytest.mark.parametrize("workload, recipe, mesh, extra", [
    ("lm", "lm-tiny", {"data": 2, "fsdp": 4}, TINY),
    ("rl", "rl-cartpole", {"data": 8}, ()),
    ("gan", "gan-digits", {"data": 8}, ()),
    ("sim", "sim-gray-scott", {"data": 8}, ()),
])
def test_every_workload_plans_two_slices_with_the_gradient_sum_over_the_data_center_network(workload, recipe, mesh,
                                                                                            extra):
    p = plan_workload(workload, recipe, mesh, slices=2, extra=extra)
    assert (p.fits, p.chips, p.slices) == (True, 8, 2)
    dcn = sum(c["dcn_wire_bytes"] for c in p.collectives.values())
    if workload in ("lm", "gan", "rl"):  # data parallel across slices: the gradients (rl: the seeds' metrics) cross
        assert dcn > 0 and p.dcn_s > 0
    if workload == "lm":  # fsdp=4 inside each slice: each chip sums its quarter of the float32 gradients across
        assert dcn == pytest.approx(p.params * 4 / 4, rel=0.1)


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    return subprocess.run([sys.executable, "-m", "systolic", "plan", "lm", *args], capture_output=True, text=True,
                          timeout=600, env=env)


def test_an_oversized_config_does_not_fit_with_the_bytes_needed_and_no_traceback():
    # The logits alone, (B, T, vocab): 64 x 4096 x 32768 x 2 bytes = 16 GiB in bfloat16, on a 16 GiB v5e chip
    # (splash attention keeps no (T, T) scores, so they are what overflows).
    proc = cli("--target", "v5e-1", *TINY, "model.layers=1", "model.max_seq_len=4096", "data.seq_len=4096",
               "train.batch_size=64", "model.vocab_size=32768", "--json")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "WARNING" not in proc.stderr, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["fits"] is False and "RESOURCE_EXHAUSTED" in plan["out_of_memory"] and plan["precheck"] is False
    assert plan["peak_bytes"] > plan["hbm_bytes"]
    assert "model.remat=full" in plan["fix"] and "--search" in plan["fix"]  # the same fix as the lower bound's


def test_plan_json_carries_every_figure():
    proc = cli("--target", "v5e-4", "--mesh", "fsdp=4", *TINY, "--tokens", "2e9", "--price-per-chip-hour", "1.5", "--json")
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    for key in ("argument_bytes", "temp_bytes", "code_bytes", "peak_bytes", "hbm_bytes", "model_flops_per_step",
                "xla_flops_raw", "xla_flops_per_step", "hbm_bytes_accessed_per_step", "compute_s", "hbm_s", "ici_s",
                "step_time_s", "items_per_s", "mfu", "train_steps", "train_wall_s", "train_chip_hours",
                "train_cost_usd", "compile_s"):
        assert isinstance(plan[key], (int, float)) and plan[key] > 0, key
    assert plan["fits"] is True and plan["topology"] == "v5e:2x2" and "TPU compiler" in plan["compiler"]
    assert set(plan["collectives"]) == {"all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute"}
    assert plan["train_cost_usd"] == pytest.approx(plan["train_chip_hours"] * 1.5)
    assert plan["price_source"] == "--price-per-chip-hour"
    # v5e is calibrated against the lent chip: the time and cost to train follow the expected step, not the bound.
    assert plan["expected_step_time_s"] > 0 and "measured factors" in plan["calibration"]
    assert plan["train_wall_s"] == pytest.approx(plan["train_steps"] * plan["expected_step_time_s"])
    assert plan["expected_mfu"] == pytest.approx(plan["mfu"] * plan["step_time_s"] / plan["expected_step_time_s"])
    text = cli("--target", "v5e-4", "--mesh", "fsdp=4", *TINY)
    assert "the TPU compiler (libtpu) for topology v5e:2x2" in text.stdout and "fits" in text.stdout
    # While it compiles, stderr says what, for which target (stdout is the report, or JSON alone).
    progress = text.stderr.splitlines()
    assert progress[0] == "plan: tracing the lm train step for v5e-4 (4 chips, mesh data=1 x fsdp=4 x tensor=1)"
    assert progress[1].startswith("plan: compiling it (") and "the TPU compiler (libtpu) for topology v5e:2x2" in progress[1]
    assert progress[2].startswith("plan: compiled in ") and "plan:" not in proc.stdout


def test_unknown_target_is_one_paragraph_and_exit_2():
    proc = cli("--target", "v5e-3")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "v5p-128" in proc.stderr and "v5e-4" in proc.stderr


@pytest.mark.slow  # the bisection itself is tested against a stand-in compiler in test_plan_search.py
def test_search_reports_the_candidates_and_the_largest_batch_that_fits():
    proc = cli("--target", "v5e-4", "--mesh", "fsdp=4", *TINY, "--search", "--json")
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)
    tried = [(c["remat"], c["per_chip"]) for c in found["candidates"]]
    assert len(tried) == len(set(tried)) and tried[0] == ("none", 8)
    # The tiny model fits 64 sequences per chip without recomputation: nothing else needs a compile.
    assert (found["best"]["remat"], found["best"]["batch"]) == ("none", 256) and found["best"]["plan"]["fits"]
    proc = subprocess.run([sys.executable, "-m", "systolic", "plan", "rl", "--target", "v5e-4", "--search"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2 and "only the lm workload" in " ".join(proc.stderr.split())


def test_packed_documents_plan_what_training_runs_with_splash_taking_the_segment_ids():
    # data.packing=documents: the batch carries segment ids and positions (two more int32 (B, T) arrays, split
    # over fsdp like the tokens), and the TPU compiler takes splash with SegmentIds per shard of batch and heads.
    mesh = {"fsdp": 2, "tensor": 2}
    concat, packed = plan_lm("v5e-4", mesh), plan_lm("v5e-4", mesh, "data.packing=documents")
    assert packed.fits and "attention runs as splash" in packed.notes[0]
    assert packed.argument_bytes - concat.argument_bytes == 2 * 8 * 256 * 4 // 2


def test_sim_3d_plans_pencil_transposes_as_all_to_all_and_gathers_nothing():
    """The 3-D solver's frame compiled by the TPU compiler on a 2x2 pencil mesh: the transposes are all-to-alls
    (bytes counted), nothing is all-gathered, and a fixed step's loop is weighted by its trips."""
    p = plan_workload("sim", "sim-taylor-green-3d", {"data": 2, "fsdp": 2},
                      extra=("grid.n=32", "sim.dt=0.01", "output.frames=200"))
    assert (p.fits, p.topology, p.model_flops_per_step) == (True, "v5e:2x2", None)
    assert p.collectives["all-to-all"]["count"] > 0 and p.collectives["all-to-all"]["bytes"] > 0
    assert p.collectives["all-gather"]["count"] == 0
    assert p.xla_flops_per_step > 5 * p.xla_flops_raw, p.flops_note  # 10 solver steps a frame


def test_gemma3_1b_recipe_is_gemma_3_1b_shaped():
    """The recipe's model section: ~1.0B parameters, five sliding layers per full one, Gemma 3's switches, and
    it exports as Gemma3ForCausalLM (what `convert from-hf` makes of google/gemma-3-1b-pt's config.json)."""
    from systolic import config as config_lib
    from systolic import workloads
    from systolic.workloads.lm.hf.config import architecture
    from systolic.workloads.lm.model.sizes import param_count

    w = workloads.get("lm")
    cfg, _ = config_lib.load(w.config, "gemma3-1b", [], w.default_recipe)
    model = cfg.model
    assert model.local_layers == ((True,) * 5 + (False,)) * 4 + (True,) * 2
    assert 0.95e9 < param_count(model, model.padded_vocab(0)) < 1.05e9
    assert architecture(model) == "gemma3_text"


@pytest.mark.slow  # a 1B model through the TPU compiler: minutes on a 2-core host
def test_gemma3_1b_recipe_plans_on_a_v5e_slice():
    p = plan_workload("lm", "gemma3-1b", {"fsdp": 4})  # micro-batches of 4 rows: one per chip
    assert (p.fits, p.chips, p.topology) == (True, 4, "v5e:2x2")
    assert 0.95e9 < p.params < 1.05e9


@pytest.mark.slow  # 20.9B parameters through the TPU compiler: about 4.5 minutes on a quiet 2-core host
def test_gpt_oss_20b_recipe_plans_on_a_v5p_slice_with_its_experts_over_the_expert_axis():
    """The recipe at full size (24 layers, 32 experts of width 2880, a 201,088-token vocabulary) on a v5p-64, fsdp=8 x
    expert=4: the dropless dispatch compiles to all-to-alls and the step fits (peak 66.4 of 95 GiB a chip,
    measured 2026-12-06); the optimizer state of 20.9B parameters split 32 ways is what fsdp is for."""
    p = plan_workload("lm", "gpt-oss-20b", {"fsdp": 8, "expert": 4}, target="v5p-64")
    assert (p.fits, p.chips, p.topology) == (True, 32, "v5:2x4x4")
    assert 20.8e9 < p.params < 21.0e9
    assert p.collectives["all-to-all"]["count"] > 0
