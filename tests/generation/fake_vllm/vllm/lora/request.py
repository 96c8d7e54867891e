"""Fake ``vllm.lora.request``: vLLM's ``LoRARequest(lora_name, lora_int_id, lora_path)``; vLLM keys its
adapter caches by ``lora_int_id`` (> 0), not by path."""

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self):
        if self.lora_int_id < 1:
            raise ValueError(f"id must be > 0, got {self.lora_int_id}")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id
