"""Generation, below every stage library: model and tokenizer loading (``model``), the generation
engine (``engine.Engine``, with ``wave``, ``rows`` and ``sampler`` under it; ``engines.make_engine``
picks in-process, subprocess or vLLM), their records (``records``), the rollout worker protocol
(``protocol``) and the vLLM worker (``vllm_worker``). Curation, evaluation and RL all sample through
it; it imports only ``core``, ``conf`` and third-party libraries."""
