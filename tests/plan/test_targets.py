"""Plan targets by their Cloud TPU / GPU names, the out-of-memory message parser and the HLO collective counter."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from systolic.plan import hlo_collectives
from systolic.plan import hlo_text
from systolic.plan import targets
from systolic.runtime.memory import needed_bytes
from systolic.errors import UserError


@pytest.mark.parametrize("name, chips, topology", [
    ("v5e-1", 1, "v5e:1x1"), ("v5e-4", 4, "v5e:2x2"), ("v5e-8", 8, "v5e:2x4"), ("v5e-256", 256, "v5e:16x16"),
    ("v6e-32", 32, "v6e:4x8"), ("v4-8", 4, "v4:2x2x1"), ("v5p-8", 4, "v5:2x2x1"), ("v5p-128", 64, "v5:4x4x4"),
    ("v5p-1024", 512, "v5:8x8x8"),
])
def test_cloud_tpu_names_map_to_libtpu_topologies(name, chips, topology):
    target = targets.resolve(name, mesh_devices=1)
    assert (target.chips, target.topology, target.chip.platform) == (chips, topology, "tpu")
    assert "TPU compiler" in target.compiler


def test_torus_wrap_and_host_bounds_follow_the_slice_shape():
    kwargs = dict(targets.resolve("v5p-128", mesh_devices=1).topology_kwargs)
    assert kwargs == {"chip_config_name": "megacore", "chips_per_host_bounds": (2, 2, 1), "wrap": (True, True, True)}
    assert dict(targets.resolve("v5p-8", mesh_devices=1).topology_kwargs)["wrap"] == (False, False, False)
    assert dict(targets.resolve("v5e-1", mesh_devices=1).topology_kwargs)["chips_per_host_bounds"] == (1, 1, 1)


def test_gpu_targets_take_their_count_from_the_mesh_and_say_which_compiler():
    target = targets.resolve("H100", mesh_devices=8)
    assert (target.chips, target.topology, target.chip.platform) == (8, None, "gpu")
    assert "XLA:CPU" in target.compiler and "fake" in target.compiler


def test_slices_multiply_the_chips_and_reach_the_topology():
    target = targets.resolve("v5e-256", mesh_devices=1, slices=2)
    assert (target.chips, target.slices, target.topology) == (512, 2, "v5e:16x16")
    assert dict(target.topology_kwargs)["num_slices"] == 2 and "x 2 slices" in target.compiler
    with pytest.raises(UserError, match="TPU slices"):
        targets.resolve("h100", mesh_devices=8, slices=2)


@pytest.mark.parametrize("name", ["v5e-3", "v5p-7", "tpu-v5e", "v7-8", "b200"])
def test_an_unknown_name_lists_the_valid_ones(name):
    with pytest.raises(UserError, match="Unknown --target") as e:
        targets.resolve(name, mesh_devices=1)
    assert "v5p-128" in str(e.value) and "h100" in str(e.value)


def test_out_of_memory_message_gives_the_bytes_needed():
    msg = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries (40.25G) "
           "exceeds available HBM (15.75G).")
    assert needed_bytes(msg) == pytest.approx(40.25 * 2**30)  # the temporaries: what the compiler compares
    assert needed_bytes("Used 31.72G of 15.75G hbm.") == pytest.approx(31.72 * 2**30)
    assert needed_bytes("RESOURCE_EXHAUSTED: something else") is None


def test_collectives_of_a_compiled_cpu_program():
    mesh = Mesh(np.array(jax.devices()), ("x",))
    x = jax.ShapeDtypeStruct((8, 1024), jnp.float32, sharding=NamedSharding(mesh, P("x")))
    compiled = jax.jit(lambda a: a.sum(axis=0), out_shardings=NamedSharding(mesh, P())).lower(x).compile()
    found = hlo_collectives.read_collectives(compiled.as_text())
    assert set(found) == set(hlo_collectives.KINDS)
    reduce = found["all-reduce"]
    assert reduce.count == 1 and reduce.bytes == 1024 * 4
    assert reduce.wire_bytes == pytest.approx(2 * 1024 * 4 * 7 / 8)  # a ring over 8 devices


# A loop of 16 trips, written as the TPU compiler writes its collective-matmul loops: the counter starts at 0, steps
# by 2 (unrolled twice) and stops at 32; inside it, a loop whose count the compiler states (known_trip_count).
LOOP_HLO = """\
%inner (q: (s32[], f32[64])) -> (s32[], f32[64]) {
  %q = (s32[], f32[64]) parameter(0)
  %y = f32[64]{0} get-tuple-element(%q), index=1
  %s = f32[64]{0} collective-permute(%y), channel_id=3, source_target_pairs={{0,1},{1,0}}
  ROOT %u = (s32[], f32[64]) tuple(%j, %s)
}

%inner_cond (q: (s32[], f32[64])) -> pred[] {
  ROOT %c = pred[] constant(true)
}

%body (p: (s32[], f32[64])) -> (s32[], f32[64]) {
  %p = (s32[], f32[64]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[64]{0} get-tuple-element(%p), index=1
  %g = f32[256]{0} all-gather(%x), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}
  %w2 = (s32[], f32[64]) while(%p), condition=%inner_cond, body=%inner, backend_config={"known_trip_count":{"n":"3"}}
  %two = s32[] constant(2)
  %next = s32[] add(%i, %two)
  ROOT %t = (s32[], f32[64]) tuple(%next, %x)
}

%cond (p: (s32[], f32[64])) -> pred[] {
  %p = (s32[], f32[64]) parameter(0)
  %stop = s32[] constant(32)
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %c = pred[] compare(%i, %stop), direction=LT
}

ENTRY %main (a: f32[64]) -> f32[64] {
  %a = f32[64]{0} parameter(0)
  %zero = s32[] constant(0)
  %t0 = (s32[], f32[64]) tuple(%zero, %a)
  %r = f32[64]{0} all-reduce(%a), channel_id=2, replica_groups=[1,4]<=[4], to_apply=%add
  %w = (s32[], f32[64]) while(%t0), condition=%cond, body=%body
  ROOT %o = f32[64]{0} get-tuple-element(%w), index=1
}
"""


def test_a_collective_inside_a_loop_counts_once_per_trip():
    found = hlo_collectives.read_collectives(LOOP_HLO)
    assert (found["all-gather"].count, found["all-gather"].bytes) == (16, 16 * 256 * 4)
    assert (found["all-reduce"].count, found["all-reduce"].bytes) == (1, 64 * 4)
    assert found["all-gather"].wire_bytes == pytest.approx(16 * 256 * 4 * 3 / 4)
    assert found["collective-permute"].count == 16 * 3


def test_step_cost_weights_each_loop_body_by_its_trips():
    # A stand-in for XLA's cost analysis: 1 FLOP per line of each computation reachable from the entry, loop
    # bodies once (as XLA counts them).
    module = hlo_text.parse(LOOP_HLO)

    def analyse(text):
        m = hlo_text.parse(text)
        reach = {"main": ["cond", "body", "inner_cond", "inner"], "body": ["inner_cond", "inner"],
                 "inner": []}[m.entry]
        return {"flops": sum(len(m.computations[c]) for c in [m.entry, *reach]), "bytes accessed": 0.0}

    lines = {c: len(module.computations[c]) for c in module.computations}
    cost = hlo_text.step_cost(LOOP_HLO, analyse)
    inner = lines["inner"]
    body = lines["body"] + lines["inner_cond"] + 3 * inner
    want = lines["main"] + lines["cond"] + 16 * body
    assert (cost.flops, cost.loops, cost.unknown) == (want, 2, ())
    assert cost.counted_flops == lines["main"] + lines["cond"] + lines["body"] + lines["inner_cond"] + inner


def test_a_loop_body_calling_a_sparsecore_computation_stands_alone():
    # v5p's compiler offloads scatters to its SparseCores: a computation on that thread ends with
    # `}, execution_thread="sparsecore"`, and a loop body made the entry must keep it (gpt-oss-20b on v5p-64).
    offloaded = """
%offload (a: s32[4]) -> s32[4] {
  ROOT %a = s32[4]{0} parameter(0)
}, execution_thread="sparsecore"

%loop_body (b: s32[4]) -> s32[4] {
  %b = s32[4]{0} parameter(0)
  %start = ((s32[4]), s32[4]) call-start(%b), async_execution_thread="sparsecore", to_apply=%offload
  ROOT %done = s32[4]{0} call-done(%start)
}

ENTRY %main (x: s32[4]) -> s32[4] {
  %x = s32[4]{0} parameter(0)
  ROOT %y = s32[4]{0} call(%x), to_apply=%loop_body
}
"""
    module = hlo_text.parse("HloModule m\n" + offloaded)
    assert set(module.spans) == {"offload", "loop_body", "main"}
    alone = hlo_text.parse(hlo_text.as_entry(module, "loop_body"))
    assert (alone.entry, set(alone.spans)) == ("loop_body", {"offload", "loop_body"})


def test_cross_slice_transfers_count_as_dcn_traffic():
    # How libtpu compiles a data-parallel gradient sum over 2 slices: inside each slice an all-reduce, across slices
    # a host transfer to the multi-slice runtime.
    hlo = """\
ENTRY %main (a: f32[1024]) -> f32[1024] {
  %a = f32[1024]{0} parameter(0)
  %r = f32[1024]{0} all-reduce(%a), channel_id=1, replica_groups={{0,1,2,3}}, to_apply=%add
  %t = token[] after-all()
  %s = (f32[1024]{0}, u32[], token[]) send(%r, %t), channel_id=2, is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime",_xla_megascale_transfer_type="ALL_REDUCE"}
  ROOT %o = f32[1024]{0} copy(%r)
}
"""
    found = hlo_collectives.read_collectives(hlo, slice_of=[0, 0, 0, 0, 1, 1, 1, 1])
    reduce = found["all-reduce"]
    assert (reduce.count, reduce.bytes) == (2, 2 * 4096)
    assert reduce.dcn_wire_bytes == pytest.approx(4096)  # a ring over 2 slices moves 2 x 1/2 of the array
    assert reduce.wire_bytes == pytest.approx(2 * 4096 * 3 / 4 + 4096)
    # A plain collective whose groups span slices is DCN traffic too.
    spanning = hlo.replace("{{0,1,2,3}}", "{{0,4},{1,5},{2,6},{3,7}}")
    assert hlo_collectives.read_collectives(spanning, slice_of=[0] * 4 + [1] * 4)["all-reduce"].dcn_wire_bytes == \
        pytest.approx(2 * 4096)


def test_the_expected_step_is_xlas_roofline_times_the_chips_factor_plus_the_kernels():
    from systolic.plan.planner import _calibrated

    f = targets.CALIBRATIONS["TPU v5 lite"]
    # XLA's FLOPs less the kernel's at peak (0.10 - 0.01 s) times the compute factor, + the kernel at its rate
    expected, note = _calibrated("TPU v5 lite", compute_s=0.10, hbm_s=0.05, kernel_peak_s=0.01, kernel_s=0.03)
    assert expected == pytest.approx(0.09 * f.compute + 0.03) and "compute roofline" in note
    # the HBM side when it is the larger; a kernel of unknown rate at peak x the compute factor
    expected, note = _calibrated("TPU v5 lite", compute_s=0.03, hbm_s=0.2, kernel_peak_s=0.02, kernel_s=None)
    assert expected == pytest.approx(0.2 * f.hbm + 0.02 * f.compute) and "HBM roofline" in note
    assert _calibrated("NVIDIA H100", compute_s=0.1, hbm_s=0.05, kernel_peak_s=0.0, kernel_s=None) == (None, None)
