"""Hugging Face conversion both ways: configs, tensor names, safetensors files."""
