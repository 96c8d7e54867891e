"""Simulated annotators for the embedded default's preference data: the warm-up model samples several
responses per pool prompt, and several annotators rate each by a rubric the verifier cannot see,
each judging against it now and then (their disagreement). The ratings go through
``data_curation.preferences`` (``ratings`` shape) like any preference source. Rubrics and why:
docs/reward_models.md.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable, Sequence
from pathlib import Path

import polars as pl

RUBRICS: dict[str, Callable[[str], bool]] = {
    "full_stop": lambda response: response.rstrip().endswith("."),
}
"""Rubric name -> whether a response meets it. ``full_stop``: the final answer ends with a full stop,
which the verifier strips (``#### 7.`` and ``#### 7`` are the same answer to it)."""

GOOD, BAD = 4, 2
"""The rating an annotator gives a response it judges to meet the rubric, and one it judges not to."""

SOURCE = "simulated_annotators"


def annotate(
    groups: Sequence[tuple[str, Sequence[str]]], rubric: str, annotators: int, flip: float, seed: int
) -> list[dict]:
    """``ratings``-shape rows: per (prompt, distinct responses) group, each of ``annotators`` rates
    each response ``GOOD`` when it judges it to meet ``rubric``, else ``BAD``; each judgement goes
    against the rubric with probability ``flip``."""
    meets = RUBRICS[rubric]
    rng = random.Random(f"annotators:{seed}")
    rows = []
    for prompt, responses in groups:
        rated = []
        for text in responses:
            ratings = {}
            for k in range(annotators):
                judged = meets(text) if rng.random() >= flip else not meets(text)
                ratings[f"annotator{k}"] = GOOD if judged else BAD
            rated.append({"text": text, "ratings": ratings})
        rows.append({"prompt": prompt, "responses": rated})
    return rows


def sample_groups(
    model_dir: Path,
    prompts_path: Path,
    *,
    prompts: int,
    samples: int,
    temperature: float,
    max_new_tokens: int,
    template: str,
    seed: int,
    device: str,
    batch_size: int = 256,
) -> list[tuple[str, list[str]]]:
    """(prompt as the model read it, its distinct sampled responses) for a seeded subset of
    ``prompts`` pool prompts, ``samples`` responses each; prompts with fewer than two distinct
    responses are left out (nothing to compare)."""
    import torch

    from data_curation.sampling import _engine, prompt_items, seeded_subset
    from generation.records import GenRequest

    rows = seeded_subset(pl.read_parquet(prompts_path).to_dicts(), prompts, seed)
    engine, tokenizer = _engine(model_dir, device, batch_size)
    items = prompt_items(rows, tokenizer, template)
    requests = [GenRequest(prompt=p, sample_idx=i) for p in items for i in range(samples)]
    trajs = engine.generate(requests, max_new_tokens, temperature, torch.Generator().manual_seed(seed))
    by: dict[str, list[str]] = {}
    for t in trajs:
        texts = by.setdefault(template.replace("{problem}", t.prompt.text), [])
        if t.text.strip() and t.text.strip() not in {x.strip() for x in texts}:
            texts.append(t.text)
    return [(p, r) for p, r in by.items() if len(r) >= 2]


def simulated_preferences(
    groups: Sequence[tuple[str, Sequence[str]]],
    out_dir: Path,
    *,
    rubric: str,
    annotators: int,
    flip: float,
    seed: int,
    benchmark_items=(),
    **decontam,
) -> dict:
    """Annotate ``groups``, write the raw ratings (``annotations.jsonl``, the comparisons' source) and
    ingest them (``preferences.ingest_preferences``) into ``out_dir``; the counts, the annotators'
    agreement, the rubric's share among the sampled responses and the source file's sha256."""
    from data_curation.preferences import ingest_preferences

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = annotate(groups, rubric, annotators, flip, seed)
    raw = out_dir / "annotations.jsonl"
    raw.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
    counts = ingest_preferences([(SOURCE, "ratings", rows)], out_dir, benchmark_items, **decontam)
    responses = [t for _, rs in groups for t in rs]
    meets = RUBRICS[rubric]
    return {
        **counts,
        "prompts_annotated": float(len(groups)),
        "responses_annotated": float(len(responses)),
        "rubric_share": sum(map(meets, responses)) / len(responses) if responses else 0.0,
        "source_sha256": {SOURCE: hashlib.sha256(raw.read_bytes()).hexdigest()},
    }
