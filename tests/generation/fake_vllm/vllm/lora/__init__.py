"""Fake ``vllm.lora`` (see the package docstring)."""
