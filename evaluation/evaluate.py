"""Evaluate one checkpoint on benchmark items: sample ``n`` responses per problem, verify each with
the shared verifier, and summarise (avg@n overall and per level, pass@k, mean length).

Rows are keyed by (benchmark, problem_id, sample_idx) so the catalog can store them idempotently.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from evaluation.benchmarks import BenchmarkItem, build_prompt
from evaluation.metrics import summarize
from evaluation.verifier import Verifier
from generation.model import encode_prompt
from generation.engine import TorchEngine
from generation.records import GenRequest, PromptItem


@dataclass(frozen=True)
class EvalRow:
    benchmark: str
    problem_id: str
    sample_idx: int
    response: str
    pred: str | None
    correct: bool
    error: str | None
    length: int
    truncated: bool
    level: str | None
    subject: str | None = None


def evaluate_items(model, tokenizer, items: Sequence[BenchmarkItem], *, templates: dict[str, str | None],
                   n_samples: int, temperature: float, max_new_tokens: int, batch_size: int, seed: int,
                   device: str, verifier: Verifier, progress=None) -> list[EvalRow]:
    """One row per (item, sample). ``templates`` maps a benchmark to its prompt template
    (None = the registry default)."""
    engine = TorchEngine(model, tokenizer, device=device, batch_size=batch_size)
    prompts = [PromptItem(prompt_id=it.problem_id, text=it.problem, answer=it.answer,
                          prompt_tokens=encode_prompt(tokenizer, build_prompt(it, templates.get(it.benchmark))),
                          level=None) for it in items]
    requests = [GenRequest(prompt=p, sample_idx=s) for p in prompts for s in range(n_samples)]
    generator = torch.Generator().manual_seed(seed)
    trajectories = engine.generate(requests, max_new_tokens, temperature, generator, progress=progress)
    verdicts = verifier.verify_batch([t.text for t in trajectories], [t.prompt.answer for t in trajectories])
    rows = []
    for i, (req, traj, v) in enumerate(zip(requests, trajectories, verdicts)):
        item = items[i // n_samples]  # requests are item-major; ids may repeat across benchmarks
        rows.append(EvalRow(benchmark=item.benchmark, problem_id=item.problem_id, sample_idx=req.sample_idx,
                            response=traj.text, pred=v.pred, correct=v.correct, error=v.error,
                            length=len(traj.response_tokens), truncated=not traj.finished, level=item.level,
                            subject=item.subject))
    return rows


def summarize_rows(rows: Sequence[EvalRow], n_samples: int) -> dict[str, dict]:
    """Benchmark -> metrics (avg@n, pass@k, maj@n, mean length, truncation, by level)."""
    out: dict[str, dict] = {}
    for bench in sorted({r.benchmark for r in rows}):
        subset = [r.__dict__ for r in rows if r.benchmark == bench]
        out[bench] = summarize(subset, n_samples)
        out[bench]["verifier_errors"] = sum(1 for r in subset if r["error"])
        out[bench]["accuracy"] = out[bench][f"avg@{n_samples}"]
    return out
