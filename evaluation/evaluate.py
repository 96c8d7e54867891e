"""Evaluate one checkpoint on benchmark items: sample ``n`` responses per problem, verify each with
the shared verifier, and summarise (avg@n overall and per level, pass@k, mean length).

Rows are keyed by (benchmark, problem_id, sample_idx) so the catalog can store them idempotently.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Mapping, Sequence

import torch

from evaluation.benchmarks import BenchmarkItem, build_prompt
from evaluation.code_benchmarks import CODE_TEMPLATES, code_verdicts
from evaluation.metrics import reranked_accuracy, shaping_metrics, summarize
from conf.schema import EngineOptions, RewardComponentConfig, SandboxConfig
from rewards.components import Sample
from rewards.compose import MATH_VERIFY, REWARD_MODEL, build_component, safe_scores
from rewards.verifier import Verifier
from generation.model import encode_prompt
from generation.engine import Engine
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
    prompt_length: int = 0
    """Prompt tokens (template and chat markup included): over the model's context, the model never saw
    the whole question."""
    turns: int = 1
    tool_calls: int = 0
    tool_errors: int = 0
    """A multi-turn episode's policy turns, tool calls and failed calls (``env``)."""
    terms: tuple[tuple[str, float, bool], ...] = ()
    """The benchmark's ``score_with`` components other than the correctness verdict: per component
    (name, score, whether it got its fallback score)."""


def evaluate_items(
    model,
    tokenizer,
    items: Sequence[BenchmarkItem],
    *,
    templates: dict[str, str | None],
    n_samples: int,
    temperature: float,
    max_new_tokens: int,
    batch_size: int,
    seed: int,
    device: str,
    verifier: Verifier,
    progress=None,
    env=None,
    score_with: Mapping[str, Sequence[str]] | None = None,
    components: Sequence = (),
    judges: Mapping[str, object] | None = None,
    sandbox: SandboxConfig | None = None,
) -> list[EvalRow]:
    """One row per (item, sample). ``templates``: benchmark -> prompt template (None: the registry's).
    Prompts longer than the model's context are still sampled; ``summarize_rows`` counts them.
    ``env`` (``conf.schema.EnvConfig``): a multi-turn environment samples whole episodes. ``score_with``:
    benchmark -> the reward components that score it, each kept per row (``EvalRow.terms``).
    ``components``: built components that score every benchmark (the learned reward model).
    ``judges``: benchmark -> its verdict (``rewards.verdicts``: the run's for the pool's held-out set,
    a file benchmark's own); the others: ``verifier``, or a code benchmark's tests. ``sandbox``: the
    run's sandbox settings, for code benchmarks' tests, code components and tools."""
    engine = Engine(model, tokenizer, EngineOptions(capacity=batch_size), device=device)
    prompts = _prompt_items(tokenizer, items, templates)
    requests = [GenRequest(prompt=p, sample_idx=s) for p in prompts for s in range(n_samples)]
    generator = torch.Generator().manual_seed(seed)
    if env is not None and not env.is_default():
        trajectories = _episodes(
            model,
            tokenizer,
            requests,
            env,
            max_new_tokens,
            temperature,
            generator,
            device,
            batch_size,
            sandbox,
        )
    else:
        trajectories = engine.generate(requests, max_new_tokens, temperature, generator, progress=progress)
    verdicts = _verdicts(
        [items[i // n_samples] for i in range(len(trajectories))], trajectories, verifier, sandbox, judges
    )
    terms = _terms(
        items, n_samples, trajectories, verdicts, score_with or {}, max_new_tokens, components, sandbox
    )
    # requests are item-major; ids may repeat across benchmarks
    return [
        _eval_row(items[i // n_samples], req, traj, v, terms[i])
        for i, (req, traj, v) in enumerate(zip(requests, trajectories, verdicts))
    ]


def _prompt_items(tokenizer, items: Sequence[BenchmarkItem], templates: dict[str, str | None]) -> list:
    """Each item as a prompt, put in its benchmark's template (or a code benchmark's)."""
    return [
        PromptItem(
            prompt_id=it.problem_id,
            text=it.problem,
            answer=it.answer,
            prompt_tokens=encode_prompt(
                tokenizer, build_prompt(it, templates.get(it.benchmark) or CODE_TEMPLATES.get(it.benchmark))
            ),
            level=None,
        )
        for it in items
    ]


def _eval_row(item: BenchmarkItem, req, traj, v, terms) -> EvalRow:
    """One sample's row: the trajectory, its verdict and its reward terms."""
    return EvalRow(
        benchmark=item.benchmark,
        problem_id=item.problem_id,
        sample_idx=req.sample_idx,
        response=traj.text,
        pred=v.pred,
        correct=v.correct,
        error=v.error,
        length=len(traj.response_tokens),
        truncated=not traj.finished,
        level=item.level,
        subject=item.subject,
        prompt_length=len(traj.prompt.prompt_tokens),
        turns=traj.turns,
        tool_calls=traj.tool_calls,
        tool_errors=traj.tool_errors,
        terms=terms,
    )


def _terms(
    items, n_samples, trajectories, verdicts, score_with, max_new_tokens, components=(), sandbox=None
) -> list[tuple]:
    """Per trajectory, (name, score, failed) for each component of its benchmark's ``score_with``
    other than ``math_verify``, then each of ``components`` (built, scoring every benchmark), scored a
    benchmark at a time (``rewards.compose.safe_scores``: a component that raises gives its fallback
    score, counted)."""
    out: list[tuple] = [() for _ in trajectories]
    for bench in dict.fromkeys([*score_with, *(it.benchmark for it in items)]):
        named = [n for n in score_with.get(bench, ()) if n != MATH_VERIFY]
        built = [build_component(RewardComponentConfig.of(name=n), sandbox=sandbox) for n in named]
        shaping = built + list(components)
        idx = [i for i in range(len(trajectories)) if items[i // n_samples].benchmark == bench]
        if not shaping or not idx:
            continue
        samples = [
            Sample(
                text=trajectories[i].text,
                answer=trajectories[i].prompt.answer or "",
                n_tokens=trajectories[i].longest_turn(),  # an episode: its longest turn
                max_tokens=max_new_tokens,
                prompt=items[i // n_samples].problem,
            )
            for i in idx
        ]
        correct = [verdicts[i].correct for i in idx]
        for component in shaping:
            scores, failed = safe_scores(component, samples, correct)
            for i, x, f in zip(idx, scores, failed):
                out[i] = (*out[i], (component.name, x, f))
    return out


def _verdicts(
    items: Sequence[BenchmarkItem],
    trajectories,
    verifier,
    sandbox=None,
    judges: Mapping[str, object] | None = None,
) -> list:
    """One verdict per trajectory, by its benchmark's judge: ``judges[benchmark]`` where given, a code
    benchmark's tests in the sandbox (``code_tests``, ``all_pass``, under ``sandbox``), else the math
    ``verifier``; each judge sees its benchmark's trajectories as one batch."""
    out: list = [None] * len(trajectories)
    groups: dict[str, list[int]] = {}
    for i, it in enumerate(items):
        groups.setdefault(it.benchmark, []).append(i)
    for bench, idx in groups.items():
        texts = [trajectories[i].text for i in idx]
        golds = [trajectories[i].prompt.answer for i in idx]
        if bench in (judges or {}):
            got = judges[bench].verify_batch(texts, golds)
        elif bench in CODE_TEMPLATES:
            got = code_verdicts(texts, golds, sandbox=sandbox)
        else:
            got = verifier.verify_batch(texts, golds)
        for i, v in zip(idx, got):
            out[i] = v
    return out


def _episodes(
    model, tokenizer, requests, env, max_new_tokens, temperature, generator, device, batch_size, sandbox=None
):
    """Whole episodes of ``env`` for ``requests``: the engine's noise seed drawn from ``generator`` as
    ``Engine.generate`` draws it, ``max_new_tokens`` per turn."""
    from environments.registry import wrap_engine
    from generation.sampler import seed_from

    engine = Engine(
        model,
        tokenizer,
        EngineOptions(
            capacity=batch_size,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            seed=seed_from(generator, None),
        ),
        device=device,
    )
    runner = wrap_engine(engine, env, tokenizer, sandbox)
    try:
        return runner.generate(requests)
    finally:
        runner.close()


def model_context(model) -> int | None:
    """The positions the model was built for (``max_position_embeddings``), or None when it does not say."""
    value = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return int(value) if value else None


def count_too_long(rows: Sequence[EvalRow | dict], context: int | None) -> int:
    """Problems whose prompt alone is longer than ``context`` positions (0 when the context is unknown)."""
    if not context:
        return 0
    get = (lambda r, k: r[k]) if rows and isinstance(rows[0], dict) else getattr
    return len({get(r, "problem_id") for r in rows if get(r, "prompt_length") > context})


def summarize_rows(
    rows: Sequence[EvalRow], n_samples: int, context: int | None = None, totals: dict[str, int] | None = None
) -> dict[str, dict]:
    """Benchmark -> metrics (avg@n, pass@k, maj@n, mean length, truncation, by level), with
    ``too_long`` (problems whose prompt exceeds the model's ``context``), ``context`` and, when only a
    subset was evaluated, ``problems_total`` (``totals``: benchmark -> problems in the full set)."""
    out: dict[str, dict] = {}
    for bench in sorted({r.benchmark for r in rows}):
        subset = [r.__dict__ for r in rows if r.benchmark == bench]
        out[bench] = summarize(subset, n_samples)
        out[bench]["verifier_errors"] = sum(1 for r in subset if r["error"])
        out[bench]["accuracy"] = out[bench][f"avg@{n_samples}"]
        out[bench].update(shaping_metrics(subset))
        out[bench]["too_long"] = count_too_long(subset, context)
        out[bench]["context"] = context
        if totals and totals.get(bench, 0) > out[bench]["n_problems"]:
            out[bench]["problems_total"] = totals[bench]
        for name in dict.fromkeys(t[0] for r in subset for t in r["terms"]):
            scored = [t for r in subset for t in r["terms"] if t[0] == name]
            out[bench][f"reward/{name}"] = sum(t[1] for t in scored) / len(scored)
            out[bench][f"reward_errors/{name}"] = sum(1 for t in scored if t[2])
        if any(t[0] == REWARD_MODEL for r in subset for t in r["terms"]):
            out[bench][f"rm_best@{n_samples}"] = reranked_accuracy(subset, REWARD_MODEL)
        if any(r["turns"] != 1 or r["tool_calls"] for r in subset):  # multi-turn episodes (env)
            n = len(subset)
            out[bench]["tool_calls_per_episode"] = sum(r["tool_calls"] for r in subset) / n
            out[bench]["tool_errors_per_episode"] = sum(r["tool_errors"] for r in subset) / n
            out[bench]["turns_per_episode"] = sum(r["turns"] for r in subset) / n
    return out
