"""GPT-OSS through `systolic convert` against transformers itself: a tiny random GptOssForCausalLM (attention sinks,
biases on q/k/v/o, a sliding layer (window 5, shorter than the test sequence) and a full one, YaRN RoPE past its
original context, 4 experts with 2 per token, a router bias, expert biases and the clamped SwiGLU with a limit low
enough to clamp) imports with transformers' float32 logits and greedy generations (KV cache, the inference
engine's paged cache, and an 8-device mesh with the experts over mesh.expert=4), exports to a folder that
`from_pretrained` loads with the same logits, and imports from the MXFP4 form the released checkpoints ship
(expert `*_blocks`/`*_scales`), whose dequantizer matches transformers' own."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from tiny_hf import (TOKENS, VOCAB, assert_engine_matches_transformers, assert_matches_transformers,
                     export_and_reload, hf_logits, load_sharded, randomize, save_and_import)

from systolic.config import MeshConfig
from systolic.errors import UserError
from systolic.runtime import mesh as mesh_lib
from systolic.runtime.sharding import activate, rules_for
from systolic.workloads.lm.hf import config as hf_config
from systolic.workloads.lm.hf import convert as hf
from systolic.workloads.lm.hf import mxfp4
from systolic.workloads.lm.loaded_run import load_run
from systolic.workloads.lm.model.build import model_graphdef

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-6, num_local_experts=4,
              num_experts_per_tok=2, sliding_window=5, swiglu_limit=1.0, bos_token_id=1, eos_token_id=2,
              pad_token_id=0, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                               "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                               "original_max_position_embeddings": 16})


def make_hf_model():
    """Random weights as tiny_hf.randomize makes them, with the sinks near 1 too (so they take a visible share of each
    softmax)."""
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**CONFIG, attn_implementation="eager"))
    return randomize(model, ones=("weight", "sinks"))


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(transformers model, its saved folder, the imported run)."""
    root = tmp_path_factory.mktemp("gpt-oss")
    return save_and_import(make_hf_model(), root / "hf", root / "run")


def test_import_matches_transformers(converted):
    model, _, run_dir = converted
    cfg = load_run(run_dir, "test").cfg.model
    moe = cfg.moe
    assert (cfg.attn_sinks, cfg.qkv_bias, cfg.attn_out_bias, cfg.sliding_window, cfg.layer_types,
            cfg.rope_scaling.type, cfg.rope_scaling.truncate) == (True, True, True, 5, ("sliding", "full"), "yarn", False)
    assert (moe.experts, moe.top_k, moe.mlp_dim, moe.norm_topk_prob, moe.router_bias, moe.expert_bias,
            moe.swiglu_limit, moe.swiglu_alpha) == (4, 2, 32, True, True, True, 1.0, 1.702)
    run = load_run(run_dir, "test")
    ref, _ = assert_matches_transformers(model, cfg, run.params, "gpt-oss")
    # The sinks, the window (shorter than the sequence) and the clamp each change the logits.
    # Sinks of -1e30 take no share of any softmax: the model without them.
    no_sinks = jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.full_like(x, -1e30) if path[-1].key == "sinks" else x, run.params)
    for off, params in ((dict(), no_sinks), (dict(sliding_window=0, layer_types=()), run.params),
                        (dict(moe=dataclasses.replace(moe, swiglu_limit=100.0)), run.params)):
        changed = dataclasses.replace(cfg, dtype="float32", **off)
        without = nnx.merge(model_graphdef(changed, VOCAB), params)(jnp.asarray(TOKENS, jnp.int32))
        assert np.abs(np.asarray(without) - ref).max() > 0.1, off


def test_export_loads_in_transformers(converted, tmp_path):
    model, _, run_dir = converted
    config, reloaded = export_and_reload(model, run_dir, tmp_path / "out", "GptOssForCausalLM")
    assert "quantization_config" not in config
    for key in ("sliding_window", "layer_types", "swiglu_alpha", "swiglu_limit", "attention_bias", "rope_parameters"):
        assert getattr(reloaded.config, key) == getattr(model.config, key), key
    diff = np.abs(hf_logits(reloaded, TOKENS) - hf_logits(model, TOKENS)).max()
    print(f"gpt-oss: exported, reloaded by transformers: logits max-abs-diff {diff:.2e}")
    assert diff == 0.0  # float32 in, float32 out: the weights and the math are the same


def test_inference_engine_matches_transformers(converted):
    """The paged cache's online softmax with the sinks, both kinds of layer in one scan, requests arriving at
    different steps and prompts chunked over steps: transformers' greedy tokens among the byte tokenizer's ids."""
    model, folder, _ = converted
    assert_engine_matches_transformers(model, folder, scan_layers=True)


@pytest.mark.slow
def test_on_a_mesh_of_8_devices(converted):
    """Stacked layers placed straight into an 8-device layout, the 4 experts over mesh.expert=4 (all-to-all
    dispatch) and their hidden axis with the heads over tensor=2: the same logits and greedy generations."""
    model, folder, _ = converted
    mesh = mesh_lib.make_mesh(MeshConfig(data=1, fsdp=1, tensor=2, expert=4))
    rules = rules_for("default", mesh)
    cfg, params = load_sharded(folder, mesh, rules, scan_layers=True, attention="xla")
    assert params["blocks"]["mlp"]["b_gate"].addressable_shards[0].data.shape[1:] == (1, 16)  # split, not copied
    with activate(mesh, rules):
        assert_matches_transformers(model, cfg, params, "gpt-oss on 8 devices")


def test_mxfp4_dequantizes_as_transformers_does():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, 8, 2, 16), dtype=np.uint8)  # (E, out, in / 32, 16)
    scales = rng.integers(110, 140, (3, 8, 2), dtype=np.uint8)
    ref = convert_moe_packed_tensors(torch.tensor(blocks), torch.tensor(scales), dtype=torch.float32).numpy()
    got = mxfp4.dequantize(blocks, scales)
    assert got.shape == (3, 64, 8) == mxfp4.dequantized_shape(blocks.shape)
    np.testing.assert_array_equal(got, ref)
    # By hand: the byte 0x2F holds code 0xF (-6) then 0x2 (1.0); the scale 128 doubles them.
    one = mxfp4.dequantize(np.full((1, 1, 1, 16), 0x2F, np.uint8), np.full((1, 1, 1), 128, np.uint8))
    assert one[0, :2, 0].tolist() == [-12.0, 2.0]


def test_mxfp4_checkpoint_imports(converted, tmp_path):
    """The released checkpoints' form: the experts' gate_up_proj and down_proj as MXFP4 blocks and scales, with
    quantization_config; the import's logits match transformers' model holding the dequantized experts."""
    model, folder, _ = converted
    model = make_hf_model()
    tensors = load_file(str(folder / "model.safetensors"))
    rng = np.random.default_rng(2)
    with torch.no_grad():
        for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
            e, d_in, d_out = tensors[name].shape
            blocks = rng.integers(0, 256, (e, d_out, d_in // 32, 16), dtype=np.uint8)
            scales = rng.integers(121, 125, (e, d_out, d_in // 32), dtype=np.uint8)
            model.get_parameter(name).copy_(torch.tensor(mxfp4.dequantize(blocks, scales)))
            del tensors[name]
            tensors.update(zip(mxfp4.quantized_names(name), (blocks, scales)))
    quantized = tmp_path / "mxfp4"
    quantized.mkdir()
    save_file(tensors, str(quantized / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (quantized / "config.json").write_text(json.dumps(config))
    hf.import_run(quantized, tmp_path / "run")
    run = load_run(tmp_path / "run", "test")
    graphdef = model_graphdef(dataclasses.replace(run.cfg.model, dtype="float32"), VOCAB)
    logits = nnx.merge(graphdef, run.params)(jnp.asarray(TOKENS, jnp.int32))
    np.testing.assert_allclose(np.asarray(logits), hf_logits(model, TOKENS), atol=1e-4, rtol=0)
    config["quantization_config"] = {"quant_method": "bitsandbytes"}
    with pytest.raises(UserError, match="quantization_config.quant_method = 'bitsandbytes'"):
        hf_config.model_config(config, quantized)


def test_gpt_oss_hub_config_imports(tmp_path):
    """config.json as openai/gpt-oss-20b ships it (transformers 4.55: rope_scaling, no swiglu_alpha, no
    layer_types in some copies)."""
    hub = dict(model_type="gpt_oss", architectures=["GptOssForCausalLM"], attention_bias=True, head_dim=64,
               hidden_act="silu", hidden_size=2880, intermediate_size=2880, max_position_embeddings=131072,
               num_attention_heads=64, num_experts_per_tok=4, num_hidden_layers=24, num_key_value_heads=8,
               num_local_experts=32, rms_norm_eps=1e-5, rope_theta=150000, router_aux_loss_coef=0.9,
               sliding_window=128, swiglu_limit=7.0, tie_word_embeddings=False, vocab_size=201088,
               quantization_config={"quant_method": "mxfp4"},
               rope_scaling={"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                             "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False})
    cfg = hf_config.model_config(hub, tmp_path)
    assert cfg.local_layers == (True, False) * 12 and (cfg.d_head, cfg.n_kv_heads, cfg.sliding_window) == (64, 8, 128)
    assert (cfg.moe.experts, cfg.moe.top_k, cfg.moe.swiglu_alpha, cfg.moe.aux_loss_weight) == (32, 4, 1.702, 3.6)
    assert (cfg.rope_theta, cfg.rope_scaling.factor, cfg.rope_scaling.original_max_seq_len) == (150000, 32.0, 4096)
    assert hf_config.architecture(cfg) == "gpt_oss"
    with pytest.raises(UserError, match=r"model\.moe\.router_bias=False \(GPT-OSS: True\)"):
        hf_config.architecture(dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, router_bias=False)))
    with pytest.raises(UserError, match="layer_types"):
        hf_config.model_config({**hub, "layer_types": ["sliding_attention", "chunked_attention"]}, tmp_path)
