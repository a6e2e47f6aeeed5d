"""The open model families through `systolic convert` against transformers itself: Llama with llama3, linear and
YaRN RoPE scaling, Qwen2 (q/k/v biases, tied embeddings; and with a sliding window on every layer), Qwen3 (q/k
norms, a head size other than d_model / heads), Mistral (a sliding window shorter than the test sequence) and a
SmolLM-like Llama (tied embeddings, 3 query heads sharing one key/value head), and the mixtures of experts Mixtral
(with a sliding window), Qwen3-MoE (renormalised top-k weights) and Qwen2-MoE (raw top-k probabilities, q/k/v
biases, a gated shared expert), a Qwen2 whose window covers only its second layer (`layer_types`), Gemma (GeGLU,
embeddings times sqrt(d_model), (1 + w) norms), Gemma 2 (sandwich norms, query_pre_attn_scalar, attention and final
logit soft-caps, a sliding and a full layer) and Gemma 3 (q/k norms, a sliding layer with its own RoPE base and a
full one with linear RoPE scaling), Phi-3 (fused q/k/v and gate/up tensors, LongRoPE; and Phi-4-mini's partial
RoPE with tied embeddings), OLMo 2 (norms after the sublayers, q/k norms over all heads), SmolLM3 (a NoPE layer, here
also the sliding one) and Granite (embedding, residual, attention and logit multipliers). Each tiny random model is
imported
and must give transformers' float32 logits and greedy generations, on one device and on a mesh of 8, and its
export must load in `from_pretrained` with no missing or unexpected tensors and the same logits. The MoE models' 8-device
mesh splits their 4 experts over mesh.expert=4 (all-to-all dispatch, lm/model/moe.py). The models with per-layer
windows or soft-caps also run through the inference engine's paged cache (lm/serve)."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tiny_hf import (TOKENS, VOCAB, assert_engine_matches_transformers, assert_matches_transformers,
                     export_and_reload, hf_logits, imported_on_first_use, load_sharded, ours, randomize)

from systolic.config import MeshConfig
from systolic.errors import UserError
from systolic.runtime import mesh as mesh_lib
from systolic.runtime.sharding import activate, rules_for
from systolic.workloads.lm.hf import config as hf_config
from systolic.workloads.lm.model.config import ModelConfig
from systolic.workloads.lm.model.rope import inverse_frequencies
from systolic.workloads.lm.loaded_run import load_run
from systolic.workloads.lm.model.build import model_graphdef

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

LLAMA = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
# Gemma's shapes: tied embeddings, an explicit head size, pad id 0.
GEMMA = dict(LLAMA, head_dim=16, pad_token_id=0, tie_word_embeddings=True)
# case -> (architecture, its config's arguments, the mesh for the 8-device check)
DEFAULT_MESH = MeshConfig(data=2, fsdp=2, tensor=2)
MOE_MESH = MeshConfig(data=1, fsdp=2, tensor=1, expert=4)
CASES = {
    # theta 1e4 over head size 16 puts the 8 frequencies' wavelengths (6.3 ... 2e4 positions) in all three bands of
    # an original context of 32: kept (< 8), blended (8 ... 32) and divided by factor (> 32).
    "llama3-rope": ("LlamaForCausalLM", dict(LLAMA, rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}), DEFAULT_MESH),
    "linear-rope": ("LlamaForCausalLM", dict(LLAMA, rope_parameters={
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}), DEFAULT_MESH),
    # The generations run past the original context of 16; attention_factor is YaRN's default, 0.1 ln 4 + 1.
    "yarn-rope": ("LlamaForCausalLM", dict(LLAMA, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16}),
        DEFAULT_MESH),
    "qwen2": ("Qwen2ForCausalLM", dict(LLAMA, tie_word_embeddings=True), DEFAULT_MESH),
    # Qwen's window, when on, covers the layers from max_window_layers on: from 0, all of them.
    "qwen2-window": ("Qwen2ForCausalLM", dict(LLAMA, use_sliding_window=True, sliding_window=5, max_window_layers=0),
                     DEFAULT_MESH),
    "qwen3": ("Qwen3ForCausalLM", dict(LLAMA, head_dim=24), DEFAULT_MESH),
    "mistral": ("MistralForCausalLM", dict(LLAMA, sliding_window=5), DEFAULT_MESH),
    # 3 heads do not split over a tensor axis of 2: parameters over 8 fsdp devices instead.
    "smollm": ("LlamaForCausalLM", dict(LLAMA, hidden_size=48, num_attention_heads=3, num_key_value_heads=1,
                                        tie_word_embeddings=True), MeshConfig(data=1, fsdp=8, tensor=1)),
    # Mixtures of 4 experts, 2 per token: the experts over mesh.expert=4, the rest over fsdp=2.
    "mixtral": ("MixtralForCausalLM", dict(LLAMA, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
                                           sliding_window=5), MOE_MESH),
    "qwen3-moe": ("Qwen3MoeForCausalLM", dict(LLAMA, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                              norm_topk_prob=True), MOE_MESH),
    "qwen2-moe": ("Qwen2MoeForCausalLM", dict(LLAMA, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                              shared_expert_intermediate_size=64), MOE_MESH),
    # The window from layer max_window_layers = 1 on: layer 0 full, layer 1 sliding.
    "qwen2-layer-types": ("Qwen2ForCausalLM", dict(LLAMA, use_sliding_window=True, sliding_window=5,
                                                   max_window_layers=1), DEFAULT_MESH),
    "gemma": ("GemmaForCausalLM", GEMMA, DEFAULT_MESH),
    # Layer 0 sliding, layer 1 full (Gemma 2's alternation); caps low enough to bend these models' logits.
    "gemma2": ("Gemma2ForCausalLM", dict(GEMMA, sliding_window=5, query_pre_attn_scalar=24, attn_logit_softcapping=3.0,
                                         final_logit_softcapping=8.0), DEFAULT_MESH),
    "gemma3": ("Gemma3ForCausalLM", dict(GEMMA, sliding_window=5, query_pre_attn_scalar=24, final_logit_softcapping=8.0,
                                         layer_types=["sliding_attention", "full_attention"], rope_parameters={
                                             "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                             "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                "rope_theta": 10000.0}}), DEFAULT_MESH),
    # LongRoPE with an original context of 16: the logits of 12 positions take the short factors, the generations
    # (to 28) and test_longrope_past_the_original_context the long ones.
    "phi3": ("Phi3ForCausalLM", dict(LLAMA, pad_token_id=0, original_max_position_embeddings=16, rope_scaling={
        "type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
        "long_factor": [1.5 + 0.7 * i for i in range(8)]}), DEFAULT_MESH),
    # Phi-4-mini's shape: RoPE over 3/4 of each head (6 of 8 pairs), tied embeddings.
    "phi4-mini": ("Phi3ForCausalLM", dict(LLAMA, pad_token_id=0, original_max_position_embeddings=16,
                                          tie_word_embeddings=True, partial_rotary_factor=0.75, rope_scaling={
                                              "type": "longrope", "short_factor": [1.0 + 0.2 * i for i in range(6)],
                                              "long_factor": [2.0 + 0.5 * i for i in range(6)]}), DEFAULT_MESH),
    "olmo2": ("Olmo2ForCausalLM", dict(LLAMA, pad_token_id=0), DEFAULT_MESH),
    # Every second layer without RoPE (layer 1), and that one sliding: the layers differ in both fields of their kind.
    "smollm3": ("SmolLM3ForCausalLM", dict(LLAMA, pad_token_id=0, no_rope_layer_interval=2, use_sliding_window=True,
                                           sliding_window=5), DEFAULT_MESH),
    "granite": ("GraniteForCausalLM", dict(LLAMA, embedding_multiplier=6.0, residual_multiplier=0.5,
                                           attention_multiplier=0.2, logits_scaling=4.0), DEFAULT_MESH),
}
EXPECTED = {  # what the import switches on
    "llama3-rope": dict(rope="llama3"), "linear-rope": dict(rope="linear"), "yarn-rope": dict(rope="yarn"),
    "qwen2": dict(qkv_bias=True, tie_embeddings=True), "qwen2-window": dict(qkv_bias=True, sliding_window=5),
    "qwen3": dict(qk_norm=True, head_dim=24),
    "mistral": dict(sliding_window=5), "smollm": dict(tie_embeddings=True, kv_heads=1),
    # model.moe: (experts, top_k, mlp_dim, shared_experts, shared_gate, norm_topk_prob)
    "mixtral": dict(sliding_window=5, moe=(4, 2, 32, 0, False, True)),
    "qwen3-moe": dict(qk_norm=True, moe=(4, 2, 32, 0, False, True)),
    "qwen2-moe": dict(qkv_bias=True, moe=(4, 2, 32, 2, True, False)),
    "qwen2-layer-types": dict(qkv_bias=True, sliding_window=5, switches=dict(layer_types=("full", "sliding"))),
    "gemma": dict(tie_embeddings=True, switches=dict(mlp_activation="gelu_tanh", embed_multiplier=8.0)),
    "gemma2": dict(tie_embeddings=True, sliding_window=5, switches=dict(
        mlp_activation="gelu_tanh", embed_multiplier=8.0, norm_placement="sandwich", attn_logit_scale=24**-0.5,
        attn_logit_softcap=3.0, final_logit_softcap=8.0, layer_types=("sliding", "full"))),
    "gemma3": dict(tie_embeddings=True, sliding_window=5, qk_norm=True, rope="linear", switches=dict(
        mlp_activation="gelu_tanh", embed_multiplier=8.0, norm_placement="sandwich", attn_logit_scale=24**-0.5,
        attn_logit_softcap=0.0, final_logit_softcap=8.0, layer_types=("sliding", "full"), rope_local_theta=100.0)),
    "phi3": dict(rope="longrope"),
    "phi4-mini": dict(rope="longrope", tie_embeddings=True, switches=dict(partial_rotary_factor=0.75)),
    "olmo2": dict(qk_norm=True, switches=dict(norm_placement="post", qk_norm_scope="all")),
    "smollm3": dict(tie_embeddings=True, sliding_window=5, switches=dict(no_rope_layers=(1,),
                                                                         layer_types=("full", "sliding"))),
    "granite": dict(switches=dict(embed_multiplier=6.0, residual_multiplier=0.5, attn_logit_scale=0.2,
                                  logit_divisor=4.0)),
}
PAGED = ("qwen2-layer-types", "gemma2", "gemma3", "smollm3")  # also through the inference engine


def make_hf_model(case: str):
    """A tiny transformers model of the case with random weights (tiny_hf.randomize)."""
    architecture, kwargs, _ = CASES[case]
    model_class = getattr(transformers, architecture)
    torch.manual_seed(0)
    return randomize(model_class(model_class.config_class(**kwargs, attn_implementation="eager")))


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """case -> (transformers model, its saved folder, the imported run), made on first use."""
    return imported_on_first_use(tmp_path_factory.mktemp("families"), make_hf_model)


@pytest.mark.parametrize("case", CASES)
def test_import_matches_transformers(converted, case):
    model, _, run_dir = converted(case)
    run = load_run(run_dir, "test")
    cfg = run.cfg.model
    want = EXPECTED[case]
    assert (cfg.rope_scaling.type, cfg.qkv_bias, cfg.qk_norm, cfg.sliding_window, cfg.tie_embeddings, cfg.d_head,
            cfg.n_kv_heads) == (want.get("rope", "none"), want.get("qkv_bias", False), want.get("qk_norm", False),
                                want.get("sliding_window", 0), want.get("tie_embeddings", False),
                                want.get("head_dim", 16), want.get("kv_heads", 2))
    moe = cfg.moe
    assert (moe.experts, moe.top_k, moe.mlp_dim, moe.shared_experts, moe.shared_gate, moe.norm_topk_prob) == want.get(
        "moe", (0, 2, 0, 0, False, True))
    assert {key: getattr(cfg, key) for key in want.get("switches", {})} == want.get("switches", {})
    # The rotation frequencies are transformers' to the last bit or two (torch's pow rounds a few differently);
    # Gemma 3 has a set per layer type.
    rotary = model.model.rotary_emb
    kinds = {"full_attention_": False, "sliding_attention_": True} if cfg.rope_local_theta else {"": False}
    for prefix, local in kinds.items():
        inv_freq, scale = inverse_frequencies(cfg, local=local)
        np.testing.assert_array_max_ulp(inv_freq, getattr(rotary, f"{prefix}inv_freq").numpy(), maxulp=1)
        assert scale == pytest.approx(getattr(rotary, f"{prefix}attention_scaling"), rel=1e-12)

    ref, _ = assert_matches_transformers(model, cfg, run.params, case)
    # The window is shorter than the sequence and the caps are low, so each matters.
    for switch in ("sliding_window", "attn_logit_softcap", "final_logit_softcap"):
        if getattr(cfg, switch):
            off = dict({switch: 0}, **({"layer_types": ()} if switch == "sliding_window" else {}))
            graphdef = model_graphdef(dataclasses.replace(cfg, dtype="float32", **off), VOCAB)
            without = nnx.merge(graphdef, run.params)(jnp.asarray(TOKENS, jnp.int32))
            assert np.abs(np.asarray(without) - ref).max() > 0.1, switch


@pytest.mark.parametrize("case", CASES)
def test_on_a_mesh_of_8_devices(converted, case):
    """Stacked layers placed straight into an 8-device layout, run with the plain XLA attention (one device runs
    the CPU formulation): the same logits and greedy generations."""
    model, folder, _ = converted(case)
    mesh_cfg = CASES[case][2]
    mesh = mesh_lib.make_mesh(mesh_cfg)
    rules = rules_for("default" if mesh_cfg.tensor > 1 else "fsdp", mesh)
    cfg, params = load_sharded(folder, mesh, rules, scan_layers=True, attention="xla")
    assert params["blocks"]["attn"]["wq"].addressable_shards[0].data.shape[1] < cfg.d_model  # split, not copied
    with activate(mesh, rules):
        assert_matches_transformers(model, cfg, params, f"{case} on 8 devices")


@pytest.mark.parametrize("case", CASES)
def test_export_loads_in_transformers(converted, tmp_path, case):
    model, _, run_dir = converted(case)
    _, reloaded = export_and_reload(model, run_dir, tmp_path / "out", CASES[case][0])
    rope_types = lambda config: {kind: params["rope_type"] for kind, params in config.rope_parameters.items()} \
        if "full_attention" in config.rope_parameters else config.rope_parameters["rope_type"]  # noqa: E731
    assert rope_types(reloaded.config) == rope_types(model.config)
    for key in ("sliding_window", "layer_types", "attn_logit_softcapping", "final_logit_softcapping",
                "query_pre_attn_scalar"):
        assert getattr(reloaded.config, key, None) == getattr(model.config, key, None), key
    diff = np.abs(hf_logits(reloaded, TOKENS) - hf_logits(model, TOKENS)).max()
    print(f"{case}: exported, reloaded by transformers: logits max-abs-diff {diff:.2e}")
    assert diff == 0.0  # float32 in, float32 out: the weights and the math are the same


@pytest.mark.parametrize("case", ["phi3", "phi4-mini"])
def test_longrope_past_the_original_context(converted, case):
    """24 positions, past the original context of 16: every position rotates by the long factors, as transformers
    picks them for the whole forward pass."""
    model, _, run_dir = converted(case)
    run = load_run(run_dir, "test")
    tokens = np.random.default_rng(2).integers(0, VOCAB, (2, 24))
    logits, _ = ours(run.cfg.model, run.params, tokens)
    ref = hf_logits(model, tokens)
    np.testing.assert_allclose(logits, ref, atol=1e-4, rtol=0)
    short = dataclasses.replace(run.cfg.model.rope_scaling, long_factor=run.cfg.model.rope_scaling.short_factor)
    graphdef = model_graphdef(dataclasses.replace(run.cfg.model, dtype="float32", rope_scaling=short), VOCAB)
    assert np.abs(np.asarray(nnx.merge(graphdef, run.params)(jnp.asarray(tokens, jnp.int32))) - ref).max() > 0.1


@pytest.mark.parametrize("case", PAGED)
def test_inference_engine_matches_transformers(converted, case):
    """The imported run through the inference engine's paged cache (per-layer windows, soft-caps, per-layer RoPE in
    the ragged step), requests arriving at different steps and prompts chunked over steps: transformers' greedy tokens
    among the byte tokenizer's ids (a run without tokenizer.json samples from those)."""
    model, folder, _ = converted(case)
    # Stacked layers: those of both kinds run in one scan, each with its kind beside its weights.
    assert_engine_matches_transformers(model, folder, scan_layers=True)


def test_export_picks_the_architecture_that_computes_the_model():
    base = ModelConfig(vocab_size=VOCAB, d_model=64, heads=4)
    picks = {switches: hf_config.architecture(dataclasses.replace(base, **dict(switches))) for switches in [
        (), (("sliding_window", 8),), (("qkv_bias", True),), (("qkv_bias", True), ("sliding_window", 8)),
        (("qk_norm", True),), (("qk_norm", True), ("sliding_window", 8))]}
    assert list(picks.values()) == ["llama", "mistral", "qwen2", "qwen2", "qwen3", "qwen3"]
    with pytest.raises(UserError, match="both model.qk_norm and model.qkv_bias"):
        hf_config.hf_config(dataclasses.replace(base, qk_norm=True, qkv_bias=True), VOCAB, {})


# config.json as transformers 4.x wrote them for the hub (shapes of Llama 3.2 1B, Qwen2.5 0.5B, Mistral 7B v0.1):
# RoPE scaling under `rope_scaling` beside a top-level rope_theta, a Qwen window that is off.
HUB_STYLE = {
    "llama-3.2": dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=2048, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=64, rope_theta=500000.0, tie_word_embeddings=True,
                      rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                    "original_max_position_embeddings": 8192, "rope_type": "llama3"}),
    "qwen2.5": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=896, num_attention_heads=14,
                    num_key_value_heads=2, rope_theta=1000000.0, rope_scaling=None, use_sliding_window=False,
                    sliding_window=32768, max_window_layers=21, tie_word_embeddings=True),
    "mistral-v0.1": dict(model_type="mistral", architectures=["MistralForCausalLM"], hidden_size=4096,
                         num_attention_heads=32, num_key_value_heads=8, rope_theta=10000.0, sliding_window=4096),
    # Qwen1.5-MoE-A2.7B's MoE settings, with a dense first layer and MoE in every second layer after it.
    "qwen1.5-moe": dict(model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"], hidden_size=2048,
                        num_attention_heads=16, num_key_value_heads=16, rope_theta=1000000.0, num_experts=60,
                        num_experts_per_tok=4, moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
                        decoder_sparse_step=2, mlp_only_layers=[0], norm_topk_prob=False, router_aux_loss_coef=0.001),
}


@pytest.mark.parametrize("name", HUB_STYLE)
def test_hub_style_configs_import(name, tmp_path):
    hub = dict(vocab_size=32000, intermediate_size=8192, num_hidden_layers=16, max_position_embeddings=131072,
               rms_norm_eps=1e-5, hidden_act="silu", **HUB_STYLE[name])
    cfg = hf_config.model_config(hub, tmp_path)
    got = (cfg.rope_theta, cfg.rope_scaling.type, cfg.rope_scaling.factor, cfg.rope_scaling.original_max_seq_len,
           cfg.qkv_bias, cfg.sliding_window, cfg.tie_embeddings, cfg.n_kv_heads, cfg.d_head)
    assert got == {"llama-3.2": (5e5, "llama3", 32.0, 8192, False, 0, True, 8, 64),
                   "qwen2.5": (1e6, "none", 1.0, 0, True, 0, True, 2, 64),
                   "mistral-v0.1": (1e4, "none", 1.0, 0, False, 4096, False, 8, 128),
                   "qwen1.5-moe": (1e6, "none", 1.0, 0, True, 0, False, 16, 128)}[name]
    if name == "qwen1.5-moe":  # 4 shared experts of 1408 (5632 wide); layers 1, 3, 5, ... are MoE
        assert (cfg.moe.experts, cfg.moe.top_k, cfg.moe.shared_experts, cfg.moe.first, cfg.moe.every) == (60, 4, 4, 1, 2)
        assert cfg.moe_layers == tuple(range(1, 16, 2)) and cfg.moe.aux_loss_weight == pytest.approx(0.004)


def test_gemma_hub_configs_import(tmp_path):
    """config.json as transformers 4.x wrote them for gemma-2-2b and gemma-3-1b/4b (no layer_types: transformers'
    default alternation; Gemma 3's local base in rope_local_base_freq, its global scaling in rope_scaling)."""
    hub = dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
               num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=8192,
               rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256, sliding_window=4096)
    gemma2 = hf_config.model_config(dict(hub, model_type="gemma2", architectures=["Gemma2ForCausalLM"],
                                         attn_logit_softcapping=50.0, final_logit_softcapping=30.0), tmp_path)
    assert (gemma2.attn_logit_softcap, gemma2.final_logit_softcap, gemma2.attn_logit_scale) == (50.0, 30.0, 1 / 16)
    assert gemma2.local_layers == (True, False) * 13 and gemma2.embed_multiplier == pytest.approx(48.0)
    gemma3 = dict(hub, model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], rope_theta=1e6,
                  rope_local_base_freq=1e4, sliding_window=512, final_logit_softcapping=None,
                  attn_logit_softcapping=None)
    for scaling in (None, {"rope_type": "linear", "factor": 8.0}):
        cfg = hf_config.model_config(dict(gemma3, rope_scaling=scaling), tmp_path)
        assert cfg.local_layers == ((True,) * 5 + (False,)) * 4 + (True,) * 2
        assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_scaling.type, cfg.final_logit_softcap, cfg.qk_norm) \
            == (1e6, 1e4, "linear" if scaling else "none", 0.0, True)
    with pytest.raises(UserError, match="use_bidirectional_attention = True"):
        hf_config.model_config(dict(gemma3, use_bidirectional_attention=True), tmp_path)
    with pytest.raises(UserError, match="hidden_activation = 'gelu'"):
        hf_config.model_config(dict(gemma3, hidden_activation="gelu"), tmp_path)


def test_gemma_runs_that_no_architecture_computes_do_not_export():
    base = ModelConfig(vocab_size=VOCAB, d_model=64, heads=4, mlp_activation="gelu_tanh", embed_multiplier=8.0)
    assert hf_config.architecture(base) == "gemma"
    with pytest.raises(UserError, match=r"model\.embed_multiplier=2\.0 \(Gemma: sqrt\(d_model\) = 8\)"):
        hf_config.architecture(dataclasses.replace(base, embed_multiplier=2.0))
    with pytest.raises(UserError, match=r"model\.final_logit_softcap without model\.norm_placement=sandwich"):
        hf_config.architecture(dataclasses.replace(base, final_logit_softcap=30.0))
    gemma3 = dataclasses.replace(base, norm_placement="sandwich", qk_norm=True)
    assert hf_config.architecture(gemma3) == "gemma3_text"
    with pytest.raises(UserError, match="transformers' Gemma 3 does not soft-cap attention"):
        hf_config.architecture(dataclasses.replace(gemma3, attn_logit_softcap=50.0))
    with pytest.raises(UserError, match="only the Gemma architectures compute these"):
        hf_config.architecture(ModelConfig(vocab_size=VOCAB, d_model=64, heads=4, final_logit_softcap=30.0))
    mixed = ModelConfig(vocab_size=VOCAB, d_model=64, heads=4, layers=2, sliding_window=4,
                        layer_types=("full", "sliding"))
    with pytest.raises(UserError, match="per-layer windows come with Qwen2"):
        hf_config.architecture(mixed)
    with pytest.raises(UserError, match="not 1/sqrt"):
        hf_config.hf_config(dataclasses.replace(gemma3, attn_logit_scale=0.3), VOCAB, {})


def test_moe_configs_that_do_not_import_or_export(tmp_path):
    """Dense layers anywhere but first, and a shared expert that is no whole number of experts, are not ours to
    compute; a MoE run that no architecture computes does not export."""
    hub = dict(model_type="qwen2_moe", vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
               num_attention_heads=4, max_position_embeddings=64, rms_norm_eps=1e-6, num_experts=4,
               num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64)
    with pytest.raises(UserError, match=r"mlp_only_layers / num_experts = \(\[1\], 4\)"):
        hf_config.model_config({**hub, "mlp_only_layers": [1]}, tmp_path)
    with pytest.raises(UserError, match=r"shared_expert_intermediate_size = 48.*a positive multiple"):
        hf_config.model_config({**hub, "shared_expert_intermediate_size": 48}, tmp_path)
    cfg = hf_config.model_config(hub, tmp_path)
    with pytest.raises(UserError, match=r"matches no Hugging Face architecture: Qwen3-MoE has q/k norms"):
        hf_config.architecture(dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, shared_gate=False)))
    plain = dataclasses.replace(cfg, qkv_bias=False, moe=dataclasses.replace(cfg.moe, shared_experts=0,
                                                                              shared_gate=False))
    assert hf_config.architecture(dataclasses.replace(plain, moe=dataclasses.replace(plain.moe, norm_topk_prob=True))) \
        == "mixtral"
    with pytest.raises(UserError, match=r"Mixtral .* renormalises the top-k weights in every layer"):
        hf_config.architecture(plain)  # Qwen2-MoE's raw probabilities, but no biases or shared expert


def test_phi_olmo_smollm_granite_runs_that_no_architecture_computes_do_not_export():
    """Each family's switches pick it on export; a switch it does not compute beside them is named, not dropped."""
    base = ModelConfig(vocab_size=VOCAB, d_model=64, heads=4, layers=2)
    picks = {name: hf_config.architecture(dataclasses.replace(base, **switches)) for name, switches in {
        "olmo2": dict(norm_placement="post", qk_norm=True, qk_norm_scope="all"),
        "phi3": dict(partial_rotary_factor=0.5), "smollm3": dict(no_rope_layers=(1,)),
        "granite": dict(residual_multiplier=0.5)}.items()}
    assert picks == {name: name for name in picks}
    refused = {
        "OLMo 2 has both norm_placement=post and q/k norms": dict(norm_placement="post"),
        r"Olmo2ForCausalLM \(model.qk_norm_scope\)": dict(qk_norm=True, qk_norm_scope="all"),
        "model.qk_norm on": dict(residual_multiplier=0.5, qk_norm=True),
        "model.qkv_bias on": dict(partial_rotary_factor=0.5, qkv_bias=True),
        r"sliding RoPE layers \[0\]": dict(no_rope_layers=(1,), sliding_window=4, layer_types=("sliding", "full")),
    }
    for match, switches in refused.items():
        with pytest.raises(UserError, match=match):
            hf_config.architecture(dataclasses.replace(base, **switches))


def test_phi_olmo_smollm_granite_hub_configs_import(tmp_path):
    """config.json as the hub has them (shapes of Phi-3-mini-128k with 4.x's "su" scaling, Phi-4-mini, OLMo-2-1B,
    SmolLM3-3B, granite-3.1-2b): each family's switches from their keys."""
    base = dict(vocab_size=32064, intermediate_size=8192, num_hidden_layers=32, max_position_embeddings=131072,
                rms_norm_eps=1e-5, hidden_act="silu", hidden_size=3072, num_attention_heads=32)
    pairs = [1.0 + i / 48 for i in range(48)]
    phi3 = hf_config.model_config(dict(base, model_type="phi3", architectures=["Phi3ForCausalLM"],
                                       original_max_position_embeddings=4096, sliding_window=262144, rope_scaling={
                                           "type": "su", "short_factor": pairs, "long_factor": pairs}), tmp_path)
    assert (phi3.rope_scaling.type, phi3.rope_scaling.factor, phi3.rope_scaling.original_max_seq_len,
            phi3.sliding_window, phi3.partial_rotary_factor) == ("longrope", 32.0, 4096, 262144, 1.0)
    phi4 = hf_config.model_config(dict(base, model_type="phi3", architectures=["Phi3ForCausalLM"], vocab_size=200064,
                                       num_attention_heads=24, num_key_value_heads=8, tie_word_embeddings=True,
                                       partial_rotary_factor=0.75, original_max_position_embeddings=4096,
                                       rope_scaling={"type": "longrope", "short_factor": pairs, "long_factor": pairs}),
                                  tmp_path)
    assert (phi4.d_head, phi4.d_rope, phi4.tie_embeddings, hf_config.architecture(phi4)) == (128, 96, True, "phi3")
    olmo2 = hf_config.model_config(dict(base, model_type="olmo2", architectures=["Olmo2ForCausalLM"],
                                        hidden_size=2048, num_attention_heads=16, rope_theta=500000.0), tmp_path)
    assert (olmo2.norm_placement, olmo2.qk_norm, olmo2.qk_norm_scope, olmo2.rope_theta) == ("post", True, "all", 5e5)
    smollm3 = hf_config.model_config(dict(base, model_type="smollm3", architectures=["SmolLM3ForCausalLM"],
                                          hidden_size=2048, num_attention_heads=16, num_key_value_heads=4,
                                          num_hidden_layers=36, rope_theta=5e6, use_sliding_window=False,
                                          no_rope_layers=[int((i + 1) % 4 != 0) for i in range(36)]), tmp_path)
    assert smollm3.no_rope_layers == tuple(range(3, 36, 4)) and smollm3.tie_embeddings and not smollm3.sliding_window
    granite = hf_config.model_config(dict(base, model_type="granite", architectures=["GraniteForCausalLM"],
                                          hidden_size=2048, num_attention_heads=32, num_key_value_heads=8,
                                          num_hidden_layers=40, embedding_multiplier=12.0, residual_multiplier=0.22,
                                          attention_multiplier=0.015625, logits_scaling=8.0, tie_word_embeddings=True),
                                     tmp_path)
    assert (granite.embed_multiplier, granite.residual_multiplier, granite.attn_logit_scale, granite.logit_divisor) \
        == (12.0, 0.22, 0.015625, 8.0)
