"""Generation, below every stage library: model and tokenizer loading (``model``), the generation
engines (``engine``, ``continuous``, ``static_slots``; ``engines.make_engine`` picks one), their
records (``records``), the rollout worker protocol (``protocol``) and the vLLM worker
(``vllm_worker``). Curation, evaluation and RL all sample through it; it imports only ``core``,
``conf`` and third-party libraries."""
