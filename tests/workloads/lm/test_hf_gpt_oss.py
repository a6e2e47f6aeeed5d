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

from systolic.config import MeshConfig
from systolic.data.tokenizer import ByteTokenizer
from systolic.errors import UserError
from systolic.runtime import mesh as mesh_lib
from systolic.runtime.sharding import activate, rules_for
from systolic.workloads.lm import generate as gen
from systolic.workloads.lm.hf import config as hf_config
from systolic.workloads.lm.hf import convert as hf
from systolic.workloads.lm.hf import mxfp4
from systolic.workloads.lm.loaded_run import load_run
from systolic.workloads.lm.serve.engine import InferenceEngine, SamplingParams
from systolic.workloads.lm.train import model_graphdef, param_shardings

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 320
TOKENS = np.random.default_rng(1).integers(0, VOCAB, (8, 12))  # 8 rows: the batch splits over a mesh's 8 devices
NEW = 16
CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-6, num_local_experts=4,
              num_experts_per_tok=2, sliding_window=5, swiglu_limit=1.0, bos_token_id=1, eos_token_id=2,
              pad_token_id=0, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                               "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                               "original_max_position_embeddings": 16})


def make_hf_model():
    """Matrices with std 0.2 (logits far from uniform: argmax has no near-ties), norm scales near 1, biases near 0,
    and sinks near 1 (so they take a visible share of each softmax)."""
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**CONFIG, attn_implementation="eager"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.2) if p.ndim > 1 else p.normal_(1.0 if name.endswith(("weight", "sinks")) else 0.0, 0.1)
    return model.eval()


def hf_logits(model, tokens) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


def hf_greedy(model, tokens, vocab_limit: int = VOCAB) -> np.ndarray:
    suppress = list(range(vocab_limit, VOCAB)) or None
    with torch.no_grad():
        out = model.generate(torch.tensor(tokens), attention_mask=torch.ones(tokens.shape, dtype=torch.long),
                             max_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=None,
                             suppress_tokens=suppress)
    return out[:, tokens.shape[1]:].numpy()


def ours(cfg, params, tokens) -> tuple[np.ndarray, np.ndarray]:
    """(logits, greedy continuation through the KV cache) of our model in float32, under whatever mesh is active."""
    graphdef = model_graphdef(dataclasses.replace(cfg, dtype="float32"), VOCAB)
    tokens = jnp.asarray(tokens, jnp.int32)
    logits = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))(params, tokens)
    return np.asarray(logits), np.asarray(gen.generate(graphdef, params, tokens, max_new_tokens=NEW))


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(transformers model, its saved folder, the imported run)."""
    root = tmp_path_factory.mktemp("gpt-oss")
    model = make_hf_model()
    model.save_pretrained(root / "hf")
    hf.import_run(root / "hf", root / "run")
    return model, root / "hf", root / "run"


def test_import_matches_transformers(converted):
    model, _, run_dir = converted
    cfg = load_run(run_dir, "test").cfg.model
    moe = cfg.moe
    assert (cfg.attn_sinks, cfg.qkv_bias, cfg.attn_out_bias, cfg.sliding_window, cfg.layer_types,
            cfg.rope_scaling.type, cfg.rope_scaling.truncate) == (True, True, True, 5, ("sliding", "full"), "yarn", False)
    assert (moe.experts, moe.top_k, moe.mlp_dim, moe.norm_topk_prob, moe.router_bias, moe.expert_bias,
            moe.swiglu_limit, moe.swiglu_alpha) == (4, 2, 32, True, True, True, 1.0, 1.702)
    run = load_run(run_dir, "test")
    logits, greedy = ours(cfg, run.params, TOKENS)
    ref = hf_logits(model, TOKENS)
    print(f"gpt-oss: logits max-abs-diff {np.abs(logits - ref).max():.2e} (max |logit| {np.abs(ref).max():.2f})")
    np.testing.assert_allclose(logits, ref, atol=1e-4, rtol=0)
    np.testing.assert_array_equal(greedy, hf_greedy(model, TOKENS))
    assert len(np.unique(greedy)) > 3  # not a degenerate constant continuation
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
    hf.export_run(run_dir, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["GptOssForCausalLM"] and "quantization_config" not in config
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager", output_loading_info=True)
    assert type(reloaded) is type(model)
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensors
    for key in ("sliding_window", "layer_types", "swiglu_alpha", "swiglu_limit", "attention_bias", "rope_parameters"):
        assert getattr(reloaded.config, key) == getattr(model.config, key), key
    diff = np.abs(hf_logits(reloaded.eval(), TOKENS) - hf_logits(model, TOKENS)).max()
    print(f"gpt-oss: exported, reloaded by transformers: logits max-abs-diff {diff:.2e}")
    assert diff == 0.0  # float32 in, float32 out: the weights and the math are the same


def test_inference_engine_matches_transformers(converted):
    """The paged cache's online softmax with the sinks, both kinds of layer in one scan, requests arriving at
    different steps and prompts chunked over steps: transformers' greedy tokens among the byte tokenizer's ids."""
    model, folder, _ = converted
    cfg = dataclasses.replace(hf_config.model_config(hf_config.read_config(folder), folder, scan_layers=True),
                              dtype="float32")
    mesh = mesh_lib.make_mesh(MeshConfig(data=1, fsdp=1, tensor=1), jax.devices()[:1])
    params = hf.load_params(folder, cfg, param_shardings(cfg, VOCAB, mesh, rules_for("fsdp", mesh)))
    engine = InferenceEngine(cfg, params, ByteTokenizer(), kv_pages=64, page_size=4, max_seqs=4, max_tokens_per_step=8)
    prompts = TOKENS[:4] % 256
    greedy = SamplingParams(max_tokens=NEW, temperature=0.0, stop_token_ids=())
    events = {}
    for step in range(200):
        if step < len(prompts):
            engine.add_request(f"r{step}", prompts[step].tolist(), greedy)
        for event in engine.step():
            events.setdefault(event.request_id, []).append(event.token_id)
        if step >= len(prompts) and not engine.has_work():
            break
    want = hf_greedy(model, prompts, vocab_limit=ByteTokenizer().vocab_size)
    for i in range(len(prompts)):
        assert [t for t in events[f"r{i}"] if t is not None] == want[i].tolist(), f"r{i}"


@pytest.mark.slow
def test_on_a_mesh_of_8_devices(converted):
    """Stacked layers placed straight into an 8-device layout, the 4 experts over mesh.expert=4 (all-to-all
    dispatch) and their hidden axis with the heads over tensor=2: the same logits and greedy generations."""
    model, folder, _ = converted
    cfg = dataclasses.replace(hf_config.model_config(hf_config.read_config(folder), folder, scan_layers=True),
                              attention="xla")
    mesh = mesh_lib.make_mesh(MeshConfig(data=1, fsdp=1, tensor=2, expert=4))
    rules = rules_for("default", mesh)
    params = hf.load_params(folder, cfg, param_shardings(cfg, VOCAB, mesh, rules))
    assert params["blocks"]["mlp"]["b_gate"].addressable_shards[0].data.shape[1:] == (1, 16)  # split, not copied
    with activate(mesh, rules):
        logits, greedy = ours(cfg, params, TOKENS)
    np.testing.assert_allclose(logits, hf_logits(model, TOKENS), atol=1e-4, rtol=0)
    np.testing.assert_array_equal(greedy, hf_greedy(model, TOKENS))


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
