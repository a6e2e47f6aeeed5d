"""What `systolic convert from-hf` refuses, and the list it points the user to: an unknown architecture, a RoPE
type or a head size the model does not compute is one paragraph with exit code 2 that names the setting and the
table of families and settings that convert (docs/porting-from-pytorch.md), which is checked here against the
converter's own table; never an instruction to edit systolic's source."""

import contextlib
import io
import json
import re
from pathlib import Path

import pytest

from systolic.cli import main
from systolic.workloads.lm.hf import config as hf_config
from systolic.workloads.lm.hf import config_rules, rope_config

ROOT = Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "porting-from-pytorch.md"
LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=320, hidden_size=64,
             intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=64, rms_norm_eps=1e-6, hidden_act="silu")


def supported_table() -> list[str]:
    """The rows of the table under the heading that SUPPORTED_LIST names."""
    heading = re.search(r'"(.+)"', config_rules.SUPPORTED_LIST).group(1)
    section = DOC.read_text().split(f"### {heading}\n", 1)[1].split("\n#", 1)[0]
    return [line for line in section.splitlines() if line.startswith("| ")][1:]  # without the header


def test_the_documented_list_is_the_converters_table():
    assert DOC.name in config_rules.SUPPORTED_LIST
    rows = supported_table()
    documented = {m.groups() for row in rows if (m := re.match(r"\| `(\w+)` \(`(\w+)`", row))}
    assert documented == {(arch, model_type) for model_type, arch in hf_config.ARCHITECTURES.items()}
    rope = next(row for row in rows if "rope_type" in row).split("|")[1]
    assert set(re.findall(r"`(\w+)`", rope)) - {"rope_type", "attention_factor", "beta_fast", "beta_slow", "truncate",
                                               "mscale", "mscale_all_dim", "su", "short_factor",
                                               "long_factor"} == set(rope_config.ROPE_TYPES)


CASES = {
    "an unknown architecture": ({"model_type": "falcon", "architectures": ["FalconForCausalLM"]},
                                ["model_type 'falcon'", "LlamaForCausalLM (model_type llama)"]),
    "a rope type": ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
                    ["rope_type = 'dynamic'", "default, linear, llama3, yarn"]),
    "an odd head size": ({"head_dim": 15}, ["even head size", "head size is 15"]),
    "heads that do not divide the width": ({"num_attention_heads": 5, "num_key_value_heads": 5},
                                           ["d_model=64 is not divisible by model.heads=5", "num_attention_heads"]),
    "a partial rotary factor": ({"partial_rotary_factor": 0.5}, ["partial_rotary_factor = 0.5"]),
    "longrope factors of the wrong length": (
        {"model_type": "phi3", "architectures": ["Phi3ForCausalLM"], "original_max_position_embeddings": 16,
         "rope_scaling": {"type": "su", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}},
        ["short_factor and long_factor have 4 entries", "8 pairs"]),
    "longrope without its factors": (
        {"model_type": "phi3", "architectures": ["Phi3ForCausalLM"], "rope_scaling": {"type": "longrope"}},
        ["short_factor / long_factor"]),
    "a partial rotary factor of an odd count": (
        {"model_type": "phi3", "architectures": ["Phi3ForCausalLM"], "partial_rotary_factor": 0.1},
        ["partial_rotary_factor=0.1", "= 1 dimensions"]),
    "OLMo 2 with biases": ({"model_type": "olmo2", "architectures": ["Olmo2ForCausalLM"], "attention_bias": True},
                           ["attention_bias = True"]),
    "SmolLM3 with a flag list of the wrong length": (
        {"model_type": "smollm3", "architectures": ["SmolLM3ForCausalLM"], "no_rope_layers": [1, 0, 1]},
        ["no_rope_layers = [1, 0, 1]", "2 entries"]),
    "Granite with MLP biases": ({"model_type": "granite", "architectures": ["GraniteForCausalLM"], "mlp_bias": True},
                                ["mlp_bias = True"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_an_unsupported_config_is_one_paragraph_naming_it_and_the_list(case, tmp_path):
    change, names = CASES[case]
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**LLAMA, **change}))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["convert", "from-hf", str(tmp_path / "hf"), str(tmp_path / "run")])
    text = err.getvalue().strip()
    assert code == 2 and "Traceback" not in text and "\n\n" not in text, text
    message = " ".join(text.split())
    for name in [*names, "docs/porting-from-pytorch.md", "Fix:"]:
        assert name in message, (name, message)
    assert "mapping" not in message and "systolic.workloads" not in message  # not: "write a mapping in our source"
    assert not (tmp_path / "run").exists()
