"""Run configs shared by test modules."""

TINY_CURATED = [
    "data.pool_size=200",
    "data.heldout_size=20",
    "sft.steps=10",
    "sft.batch_size=8",
    "rl.steps=2",
    "rl.prompts_per_step=4",
    "rl.group_size=2",
    "rl.max_new_tokens=32",
    "eval.n_samples=2",
    "eval.max_new_tokens=32",
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "model.num_layers=1",
    "model.num_heads=2",
    "model.num_kv_heads=1",
    "curation.difficulty.max_prompts=40",
    "curation.difficulty.samples=2",
    "curation.difficulty.max_new_tokens=32",
    "curation.dart.budget=64",
    "curation.dart.round_size=32",
    "curation.dart.max_trials=4",
    "curation.rft.steps=5",
    "curation.rft.batch_size=8",
    # the tiny model solves nothing: HIVE's learning edge would be empty, so RL takes every curated prompt
    "curation.select.strategy=uniform",
    # one torch thread: on a shared, loaded 2-core machine torch's default threads make a tiny RL step
    # 100x slower
    "threads=1",
]
"""The whole DAG on a micro model in about half a minute (the operate and lineage tests)."""
