"""The Hugging Face architectures `systolic convert` reads and writes: the registry that the converter dispatches on and
the CLI's help lists. Light (no jax, no numpy), so `systolic --help` can read it."""

from systolic.workloads.lm.hf import families

# Hugging Face model_type -> architecture. Every one but gpt2 is systolic's llama family.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM",
                 "gemma3_text": "Gemma3ForCausalLM", **families.ARCHITECTURES, "gpt_oss": "GptOssForCausalLM",
                 "deepseek_v3": "DeepseekV3ForCausalLM", "gpt2": "GPT2LMHeadModel"}


def help_text() -> str:
    """The model types that convert, for `systolic --help`."""
    return f"model_type {', '.join(ARCHITECTURES)}"
