"""DeepSeek-V3 through `systolic convert` against transformers itself: multi-head latent attention (a q_a/q_b
bottleneck, the compressed latent and the decoupled, interleaved RoPE key; YaRN with mscale_all_dim scaling the
logits), a dense first layer, then experts with DeepSeek's router (sigmoid scores, a random correction bias,
group-limited top-k, routed_scaling_factor) and a shared expert; and a second model with a plain q_proj, rotate-half
RoPE and no experts. Each tiny random model must give transformers' float32 logits and greedy generations (decoding
against the compressed cache, kv_b absorbed), through the inference engine's paged latent pool too, and on a mesh of
8 devices split over fsdp, tensor and expert; its export must load in `from_pretrained` with the same logits. The
decode caches and `systolic plan lm --serve`'s KV figure hold (kv_lora_rank + qk_rope_head_dim) values per token
and layer."""

import dataclasses
import shutil

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from tiny_hf import (NEW, TOKENS, VOCAB, assert_engine_matches_transformers, assert_matches_transformers,
                     export_and_reload, hf_logits, imported_on_first_use, load_sharded, randomize)

from systolic.config import MeshConfig
from systolic.errors import UserError
from systolic.runtime import mesh as mesh_lib
from systolic.runtime.sharding import activate, rules_for
from systolic.workloads.lm.hf import config as hf_config
from systolic.workloads.lm.hf import convert as hf
from systolic.workloads.lm.loaded_run import load_run
from systolic.workloads.lm.model.config import ModelConfig
from systolic.workloads.lm.model.rope import inverse_frequencies
from systolic.workloads.lm.model.transformer import make_model
from systolic.kernels.paged_attention.pool import token_bytes
from systolic.workloads.lm.serve.sizing import pool_row
from systolic.workloads.lm.serve.planned_step import serve_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
            max_position_embeddings=64, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
CASES = {
    # 8 experts in 4 groups of 2, the best 2 groups, 3 experts a token; layer 0 dense. The 12 + NEW = 28 positions
    # of the generations run past YaRN's original context of 16.
    "deepseek-v3": dict(BASE, q_lora_rank=24, n_routed_experts=8, n_shared_experts=1, moe_intermediate_size=32,
                        num_experts_per_tok=3, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                        first_k_dense_replace=1, norm_topk_prob=True, rope_parameters={
                            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                            "original_max_position_embeddings": 16, "mscale": 1.0, "mscale_all_dim": 0.8}),
    # q_proj without the bottleneck, rotate-half RoPE, every layer dense.
    "deepseek-dense": dict(BASE, q_lora_rank=None, rope_interleave=False, first_k_dense_replace=3),
}
MESH = MeshConfig(data=1, fsdp=2, tensor=2, expert=2)


def make_hf_model(case: str):
    """A tiny DeepseekV3ForCausalLM with random weights (tiny_hf.randomize; its vectors are all norm scales), and the
    router's correction bias random too (transformers initialises it to zeros, which would hide it)."""
    torch.manual_seed(0)
    model = randomize(transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**CASES[case],
                                                                                        attn_implementation="eager")))
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.2)
    return model


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """case -> (transformers model, its saved folder, the imported run), made on first use."""
    return imported_on_first_use(tmp_path_factory.mktemp("deepseek"), make_hf_model)


@pytest.mark.parametrize("case", CASES)
def test_import_matches_transformers(converted, case):
    model, _, run_dir = converted(case)
    run = load_run(run_dir, "test")
    cfg = run.cfg.model
    mla, moe = cfg.mla, cfg.moe
    assert (mla.kv_lora_rank, mla.q_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim,
            mla.rope_interleave) == (16, 24 if case == "deepseek-v3" else 0, 16, 8, 12, case == "deepseek-v3")
    if case == "deepseek-v3":
        assert (moe.experts, moe.top_k, moe.mlp_dim, moe.shared_experts, moe.first, moe.scoring, moe.groups,
                moe.topk_groups, moe.routed_scale) == (8, 3, 32, 1, 1, "sigmoid", 4, 2, 2.5)
        assert cfg.moe_layers == (1, 2) and cfg.rope_scaling.type == "yarn"
        # transformers' softmax scale: 1/sqrt(24) times YaRN's mscale(4, 0.8)^2.
        assert cfg.attn_logit_scale == pytest.approx(model.model.layers[0].self_attn.scaling, rel=1e-12)
    else:
        assert (moe.experts, cfg.rope_scaling.type, cfg.attn_logit_scale) == (0, "none", 0.0)
    rotary = model.model.rotary_emb
    inv_freq, scale = inverse_frequencies(cfg)
    np.testing.assert_array_max_ulp(inv_freq, rotary.inv_freq.numpy(), maxulp=1)
    assert scale == pytest.approx(rotary.attention_scaling, rel=1e-12)

    assert_matches_transformers(model, cfg, run.params, case)


def test_decode_cache_holds_the_compressed_latent(converted):
    """generate's cache is the latent and the RoPE key per position and layer, nothing per head."""
    _, _, run_dir = converted("deepseek-v3")
    cfg = dataclasses.replace(load_run(run_dir, "test").cfg.model, dtype="float32")
    cache = nnx.eval_shape(lambda: make_model(cfg, VOCAB, 0).init_cache(2, 40))
    assert cache.k.shape == (3, 2, 40, 16 + 8) and cache.v is None
    assert token_bytes(pool_row(cfg), "auto") == 3 * (16 + 8) * 4  # float32 pool rows
    assert token_bytes(pool_row(cfg), "int8") == 3 * ((16 + 8) + 4)  # int8 values and a float32 scale per row


def test_plan_serve_reports_the_latent_kv_size(converted):
    """`systolic plan lm --serve`'s KV figure: bytes per token = layers x (kv_lora_rank + qk_rope_head_dim) x
    bytes, on a tensor-parallel mesh too (the latent is replicated: every head reads it)."""
    _, _, run_dir = converted("deepseek-v3")
    cfg = load_run(run_dir, "test").cfg
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype="bfloat16"))
    for kv, per_token in (("bf16", 3 * 24 * 2), ("int8", 3 * (24 + 4))):
        planned = serve_model(cfg, jax.devices()[:2], weights="bf16", kv=kv, page_size=4)
        assert (planned.kv_bytes_per_token, planned.kv_split) == (per_token, 1)
        assert "(16 latent + 8 RoPE key)" in planned.kv_formula and "3 layers" in planned.kv_formula
        planned.lower_step(2, 3, 8)  # the engine's step lowers against the latent pool


@pytest.mark.parametrize("case", ["deepseek-v3", pytest.param("deepseek-dense", marks=pytest.mark.slow)])
def test_on_a_mesh_of_8_devices(converted, case):
    """Stacked layers on fsdp x tensor x expert (the heads of q_b, kv_b and o over tensor, the experts over
    expert), plain XLA attention: the same logits and greedy generations."""
    model, folder, _ = converted(case)
    mesh = mesh_lib.make_mesh(MESH)
    rules = rules_for("default", mesh)
    cfg, params = load_sharded(folder, mesh, rules, scan_layers=case == "deepseek-dense", attention="xla")
    attn = params["blocks"]["attn"] if cfg.scan_layers else params["blocks"][0]["attn"]
    assert attn["wkv_b"].addressable_shards[0].data.shape[-2] == 2  # 4 heads over tensor=2
    with activate(mesh, rules):
        assert_matches_transformers(model, cfg, params, f"{case} on 8 devices")


@pytest.mark.parametrize("case", CASES)
def test_export_loads_in_transformers(converted, tmp_path, case):
    model, _, run_dir = converted(case)
    config, reloaded = export_and_reload(model, run_dir, tmp_path / "out", "DeepseekV3ForCausalLM")
    assert config["num_nextn_predict_layers"] == 0
    for key in ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "rope_interleave",
                "n_routed_experts", "n_group", "topk_group", "routed_scaling_factor", "first_k_dense_replace"):
        if case == "deepseek-v3" or key not in ("n_routed_experts", "n_group", "topk_group", "routed_scaling_factor"):
            assert getattr(reloaded.config, key) == getattr(model.config, key), key
    layer = reloaded.model.layers[-1]
    assert layer.self_attn.scaling == pytest.approx(model.model.layers[-1].self_attn.scaling, rel=1e-12)
    diff = np.abs(hf_logits(reloaded, TOKENS) - hf_logits(model, TOKENS)).max()
    print(f"{case}: exported, reloaded by transformers: logits max-abs-diff {diff:.2e}")
    # The weights are the same; the softmax scale comes back from mscale_all_dim to within float rounding.
    assert diff <= (1e-5 if case == "deepseek-v3" else 0.0)


@pytest.mark.parametrize("kv_cache", ["auto", pytest.param("int8", marks=pytest.mark.slow)])
def test_inference_engine_matches_transformers(converted, kv_cache):
    """The imported run through the inference engine's paged latent pool (requests arriving at different steps,
    prompts chunked over steps): transformers' greedy tokens among the byte tokenizer's ids. An int8 pool stores
    each latent row with one scale: the tokens may drift, so only its first tokens must agree."""
    model, folder, _ = converted("deepseek-v3")
    # Layers as a list: the dense first layer and the MoE ones differ (a scan stacks identical layers).
    engine = assert_engine_matches_transformers(model, folder, scan_layers=False, kv_cache=kv_cache,
                                                agree=NEW if kv_cache == "auto" else 4)
    assert engine.pool.shape[3:] == (16 + 8,) if kv_cache == "auto" else engine.pool.qvalue.shape[3:] == (24,)


def test_multi_token_prediction_layers_are_dropped_with_a_note(converted, tmp_path, capsys):
    """A real checkpoint stores its MTP module as layer num_hidden_layers: left out, and said so."""
    _, folder, _ = converted("deepseek-dense")
    shutil.copytree(folder, tmp_path / "mtp")
    tensors = load_file(str(tmp_path / "mtp" / "model.safetensors"))
    tensors["model.layers.3.eh_proj.weight"] = np.zeros((64, 128), np.float32)
    tensors["model.layers.3.self_attn.kv_b_proj.weight"] = np.zeros((112, 16), np.float32)
    save_file(tensors, str(tmp_path / "mtp" / "model.safetensors"), metadata={"format": "pt"})
    hf.import_run(tmp_path / "mtp", tmp_path / "run")
    assert "2 multi-token-prediction tensors" in capsys.readouterr().out


HUB = dict(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], vocab_size=129280, hidden_size=7168,
           intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
           num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256, routed_scaling_factor=2.5,
           kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=8,
           topk_group=4, num_experts_per_tok=8, first_k_dense_replace=3, norm_topk_prob=True, hidden_act="silu",
           max_position_embeddings=163840, rms_norm_eps=1e-6, num_nextn_predict_layers=1, scoring_func="sigmoid",
           topk_method="noaux_tc", rope_theta=10000, rope_scaling={
               "beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
               "original_max_position_embeddings": 4096, "type": "yarn"})


def test_deepseek_v3_hub_config_imports_and_unsupported_settings_are_refused(tmp_path):
    """DeepSeek-V3's own config.json (as the hub has it, 4.x style) imports; settings that transformers' model
    does not compute, or that we do not, are refused by name."""
    cfg = hf_config.model_config(HUB, tmp_path)
    assert (cfg.mla.cache_width, cfg.moe.experts, cfg.moe.first, cfg.d_rope, cfg.rope_scaling.attention_factor) == (
        576, 256, 3, 64, 1.0)
    assert cfg.attn_logit_scale == pytest.approx(192**-0.5 * (0.1 * np.log(40) + 1) ** 2)
    refused = {"attention_bias": (True, "attention_bias = True"), "scoring_func": ("softmax", "scoring_func"),
               "topk_method": ("greedy", "topk_method"), "num_key_value_heads": (16, "num_key_value_heads = 16"),
               "n_shared_experts": (0, "n_shared_experts = 0"), "hidden_act": ("gelu", "hidden_act")}
    for key, (value, message) in refused.items():
        with pytest.raises(UserError, match=message):
            hf_config.model_config({**HUB, key: value}, tmp_path)
    with pytest.raises(UserError, match="partial_rotary_factor"):
        hf_config.model_config({**HUB, "rope_scaling": {**HUB["rope_scaling"], "partial_rotary_factor": 0.5}},
                               tmp_path)


def test_mla_settings_that_do_not_combine_are_refused():
    base = dict(vocab_size=VOCAB, d_model=64, heads=4, mla=dict(kv_lora_rank=16, qk_nope_head_dim=16,
                                                                  qk_rope_head_dim=8, v_head_dim=12))
    from systolic import config as config_lib

    ok = config_lib.from_dict(ModelConfig, base, "model.")
    assert ok.d_rope == 8
    for extra, message in ((dict(kv_heads=2), "model.kv_heads=2"), (dict(sliding_window=4), "sliding_window=4"),
                           (dict(qk_norm=True), "qk_norm"), (dict(lora=dict(rank=4)), "lora.rank=4")):
        with pytest.raises(Exception, match=message):
            config_lib.from_dict(ModelConfig, {**base, **extra}, "model.")
    with pytest.raises(Exception, match="even qk_rope_head_dim"):
        config_lib.from_dict(ModelConfig, {**base, "mla": {**base["mla"], "qk_rope_head_dim": 7}}, "model.")
    with pytest.raises(UserError, match="without multi-head latent attention"):
        hf_config.architecture(ModelConfig(vocab_size=VOCAB, d_model=64, heads=4, layers=2, moe=dataclasses.replace(
            ModelConfig().moe, experts=4, scoring="sigmoid", shared_experts=1)))
