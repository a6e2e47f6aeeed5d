"""Deep, narrow models start without work that grows faster than their layer count: an unscanned stack is traced a
layer at a time (lm/model/transformer.py: one trace over all layers cost O(L^2), a 1,024-layer import took hours),
and a Hugging Face Llama of 1,024 layers imports."""

import jax
import numpy as np
import pytest
import yaml

from systolic.cli import main
from systolic.config import CheckpointConfig
from systolic.engine.checkpoint import Checkpointer
from systolic.workloads.lm.hf import config as hf_config
from systolic.workloads.lm.hf import convert as hf
from systolic.workloads.lm.model.config import ModelConfig
from systolic.workloads.lm.model.build import init_params


def test_an_unscanned_stack_is_traced_a_layer_at_a_time():
    layers = 256
    cfg = ModelConfig(d_model=8, layers=layers, heads=2, kv_heads=1, max_seq_len=8, vocab_size=64)
    jaxpr = jax.make_jaxpr(lambda key: init_params(cfg, 64, key))(jax.random.PRNGKey(0))
    # Each layer is one nested call in the outer trace (its own small trace inside), so drawing a layer's keys does
    # not walk the equations of every layer before it.
    nested = [e for e in jaxpr.eqns if e.primitive.name in ("jit", "pjit")]
    assert len(nested) >= layers and len(jaxpr.eqns) <= layers + 32


@pytest.mark.slow  # transformers builds and saves 1,024 layers (~20 s), then the import
def test_a_hugging_face_llama_of_1024_layers_imports(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=320, hidden_size=16, intermediate_size=32, num_hidden_layers=1024,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                      bos_token_id=1, eos_token_id=2)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(tmp_path / "hf")
    assert main(["convert", "from-hf", str(tmp_path / "hf"), str(tmp_path / "run")]) == 0
    imported = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert imported["model"]["layers"] == 1024
    mcfg = hf_config.model_config(hf_config.read_config(tmp_path / "hf"), tmp_path / "hf")
    reader = Checkpointer(tmp_path / "run" / "checkpoints", CheckpointConfig(async_save=False))
    try:
        params = reader.restore_params(0, hf.abstract_params(mcfg, 320))
    finally:
        reader.close()
    last = model.model.layers[1023].mlp.down_proj.weight.detach().numpy()  # (d_model, mlp): ours is its transpose
    np.testing.assert_array_equal(np.asarray(params["blocks"][1023]["mlp"]["w_down"]), last.T)
