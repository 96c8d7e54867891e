"""The pipeline's stages: what each reads and writes, which config and code enter its cache key,
and which catalog rows it records. Bodies call one library function each; no stage logic here.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from conf.schema import Config
from core.artifacts import ArtifactRef, ArtifactStore
from core.catalog import Catalog

MODEL, DATASET, EVAL = "model", "dataset", "eval"


@dataclass
class StageContext:
    cfg: Config
    store: ArtifactStore
    inputs: dict[str, ArtifactRef]
    device: str


@dataclass
class StageResult:
    """What a stage produced: named artifacts and headline metrics (JSON-ready)."""

    artifacts: dict[str, ArtifactRef]
    metrics: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"artifacts": {k: v.to_dict() for k, v in self.artifacts.items()}, "metrics": self.metrics}

    @classmethod
    def from_dict(cls, d: dict) -> "StageResult":
        return cls({k: ArtifactRef.from_dict(v) for k, v in d["artifacts"].items()}, d.get("metrics", {}))


@dataclass(frozen=True)
class Stage:
    """``inputs`` maps an input name to (upstream stage, its output name). ``config`` picks the
    config subtree that enters the cache key; ``modules`` the library code that does."""

    name: str
    inputs: dict[str, tuple[str, str]]
    config: Callable[[Config], dict]
    modules: tuple[str, ...]
    body: Callable[[StageContext], StageResult]
    record: Callable[[Any, StageContext, StageResult, str], None] | None = None
    headline: Callable[[dict], str] = lambda m: ""
    external: Callable[[Config], dict[str, str]] | None = None
    """Hashes of inputs from outside the store (a local model folder, vendored benchmark files):
    they enter the cache key like artifact inputs, so replacing the files reruns the stage."""


def stage_headline(stage: str, metrics: dict) -> str:
    """The stage's one-line metric summary; empty when its metrics lack what the line shows."""
    try:
        return STAGE_BY_NAME[stage].headline(metrics)
    except (KeyError, TypeError, ValueError):
        return ""


def _produce(ctx: StageContext, kind: str, fn: Callable[[Path], dict], meta: dict | None = None) -> tuple[ArtifactRef, dict]:
    """Run ``fn`` into a new artifact of ``kind``; ``meta`` (which ``fn`` may fill) goes into its manifest."""
    with ctx.store.create(kind, meta) as pending:
        metrics = fn(pending.dir)
    assert pending.ref is not None
    return pending.ref, metrics


# ---- bodies -------------------------------------------------------------------------------------

def _data_body(ctx: StageContext) -> StageResult:
    from data_curation.synthetic import write_dataset

    d = ctx.cfg.data
    ref, metrics = _produce(ctx, DATASET, lambda out: write_dataset(
        out, seed=ctx.cfg.seed, pool_size=d.pool_size, heldout_size=d.heldout_size, levels=list(d.levels),
        demo_error_rate=d.demo_error_rate))
    return StageResult({DATASET: ref}, metrics)


def _base_model_body(ctx: StageContext) -> StageResult:
    from training.base import build_base_model
    from training.setup import setup_torch

    setup_torch(ctx.cfg.threads, ctx.cfg.seed)
    ref, metrics = _produce(ctx, MODEL, lambda out: build_base_model(ctx.cfg.model, ctx.cfg.seed, out))
    return StageResult({MODEL: ref}, metrics)


def _warmup_body(ctx: StageContext) -> StageResult:
    from data_curation.synthetic import PROMPT_TEMPLATE
    from training.setup import setup_torch
    from training.warmup import warmup

    setup_torch(ctx.cfg.threads, ctx.cfg.seed)
    ref, metrics = _produce(ctx, MODEL, lambda out: warmup(
        Path(ctx.inputs[MODEL].path), Path(ctx.inputs[DATASET].path), ctx.cfg.sft, template=PROMPT_TEMPLATE,
        seed=ctx.cfg.seed, device=ctx.device, out_dir=out))
    return StageResult({MODEL: ref}, metrics)


def _rl_body(ctx: StageContext) -> StageResult:
    from data_curation.synthetic import PROMPT_TEMPLATE
    from evaluation.verifier import Verifier
    from training.rl.stage import TIMING_KEYS, rl
    from training.setup import setup_torch

    setup_torch(ctx.cfg.threads, ctx.cfg.seed)
    meta: dict = {}

    def run(out: Path) -> dict:
        with Verifier(timeout_s=ctx.cfg.eval.verifier_timeout_s) as verifier:
            result = rl(Path(ctx.inputs[MODEL].path), Path(ctx.inputs[DATASET].path), ctx.cfg.rl,
                        template=PROMPT_TEMPLATE, seed=ctx.cfg.seed, device=ctx.device, out_dir=out,
                        verifier=verifier)
        meta["timings"] = [{k: m[k] for k in ("step", *TIMING_KEYS)} for m in result.history]
        last = result.history[-5:] if result.history else []
        mean = lambda k: sum(m[k] for m in last) / max(1, len(last))  # noqa: E731
        return {"steps": len(result.history), "trajectories": sum(result.consumed.values()),
                "reward_last5": mean("reward") if last else None,
                "reward_first": result.history[0]["reward"] if result.history else None}

    ref, metrics = _produce(ctx, MODEL, run, meta)
    return StageResult({MODEL: ref}, metrics)


def _eval_body(ctx: StageContext) -> StageResult:
    from data_curation.synthetic import PROMPT_TEMPLATE
    from evaluation.stages import HELDOUT, evaluate_checkpoint
    from training.setup import setup_torch

    setup_torch(ctx.cfg.threads, ctx.cfg.seed)
    data = ctx.inputs.get(DATASET)  # absent for `laminar eval` when no data artifact exists
    ref, summary = _produce(ctx, EVAL, lambda out: evaluate_checkpoint(
        Path(ctx.inputs[MODEL].path), Path(data.path) if data else None, ctx.cfg.eval,
        templates={HELDOUT: PROMPT_TEMPLATE}, seed=ctx.cfg.seed, device=ctx.device, out_dir=out),
        meta={"checkpoint": ctx.inputs[MODEL].sha256})
    return StageResult({EVAL: ref}, eval_metrics(ctx.inputs[MODEL].sha256, summary, ctx.cfg.eval.n_samples))


def eval_metrics(checkpoint: str, summary: dict, n_samples: int) -> dict:
    """A stage result's metrics from an evaluation summary (benchmark -> evaluation.metrics summary)."""
    avg = f"avg@{n_samples}"
    return {"checkpoint": checkpoint,
            **{b: {"accuracy": s["accuracy"], "mean_length": s["mean_length"],
                   "by_level": {lv: v[avg] for lv, v in s.get("by_level", {}).items()}}
               for b, s in summary.items()}}


# ---- catalog records beyond the generic lineage rows ---------------------------------------------

def _record_data(con, ctx: StageContext, res: StageResult, key: str) -> None:
    ref = res.artifacts[DATASET]
    for split in ("pool", "heldout"):
        con.execute(
            "INSERT INTO prompts SELECT ?, prompt_id, 'arith', split, problem, answer, level "
            "FROM read_parquet(?) ON CONFLICT DO NOTHING", [ref.sha256, str(ref.file(f"{split}.parquet"))])


def _record_checkpoint(con, ctx: StageContext, res: StageResult, key: str, stage: str, step: int | None) -> None:
    ref = res.artifacts[MODEL]
    base = ctx.inputs.get(MODEL)
    con.execute("INSERT INTO checkpoints VALUES (?, ?, ?, ?, ?, now()) ON CONFLICT DO NOTHING",
                [ref.sha256, stage, step, base.sha256 if base else None, key])


def _record_rl(con, ctx: StageContext, res: StageResult, key: str) -> None:
    ref = res.artifacts[MODEL]
    _record_checkpoint(con, ctx, res, key, "rl", int(res.metrics.get("steps") or 0))
    rows = []
    with open(ref.file("history.jsonl")) as f:
        steps = [json.loads(line) for line in f]
    timings = ctx.store.manifest(ref).get("meta", {}).get("timings", [])
    for m in steps + timings:
        rows += [(key, "rl", int(m["step"]), name, float(v)) for name, v in m.items() if name != "step"]
    con.executemany("INSERT INTO metrics VALUES (?, ?, ?, ?, ?) ON CONFLICT DO UPDATE SET value = excluded.value",
                    rows)
    with open(ref.file("consumed.json")) as f:
        consumed = json.load(f)
    con.executemany("INSERT INTO consumed_prompts VALUES (?, ?, ?) ON CONFLICT DO NOTHING",
                    [(ref.sha256, pid, n) for pid, n in consumed.items()])


def _record_eval(con, ctx: StageContext, res: StageResult, key: str) -> None:
    ref = res.artifacts[EVAL]
    con.execute(
        "INSERT INTO eval_results SELECT ?, ?, benchmark, problem_id, sample_idx, response, pred, correct, error, "
        "length, truncated, level FROM read_parquet(?) ON CONFLICT DO NOTHING",
        [ctx.inputs[MODEL].sha256, ref.sha256, str(ref.file("rows.parquet"))])


def _record_adhoc_eval(con, ctx: StageContext, res: StageResult, key: str) -> None:
    """``laminar eval``: a checkpoint from outside the store gets a ``checkpoints`` row (stage
    ``external``); one from the store already has its row, which is left as it is."""
    con.execute("INSERT INTO checkpoints VALUES (?, 'external', NULL, NULL, NULL, now()) ON CONFLICT DO NOTHING",
                [ctx.inputs[MODEL].sha256])
    _record_eval(con, ctx, res, key)


def _eval_headline(m: dict) -> str:
    return "  ".join(f"{b} acc {v['accuracy']:.3f}" for b, v in m.items() if isinstance(v, dict))


# ---- inputs from outside the store ---------------------------------------------------------------

def _model_files(cfg: Config) -> dict[str, str]:
    from core.artifacts import hash_tree

    return {"model.path": hash_tree(Path(cfg.model.path).expanduser())} if cfg.model.kind == "hf" else {}


def _benchmark_files(cfg: Config) -> dict[str, str]:
    from core.artifacts import hash_file
    from evaluation.benchmarks import benchmark_path
    from evaluation.stages import HELDOUT

    return {f"benchmark:{b}": hash_file(benchmark_path(b)) for b in cfg.eval.benchmarks if b != HELDOUT}


# ---- the DAG --------------------------------------------------------------------------------------

_EVAL_MODULES = ("evaluation.stages", "data_curation.synthetic", "training.setup")

STAGES: tuple[Stage, ...] = (
    Stage("data", {}, lambda c: asdict(c.data), ("data_curation.synthetic",), _data_body, _record_data,
          lambda m: f"pool {int(m['pool_prompts'])}  heldout {int(m['heldout_prompts'])}"),
    Stage("base_model", {}, lambda c: asdict(c.model), ("training.base", "training.setup"), _base_model_body,
          lambda con, ctx, res, key: _record_checkpoint(con, ctx, res, key, "base_model", 0),
          lambda m: f"params {int(m['parameters']):,}", _model_files),
    Stage("warmup", {MODEL: ("base_model", MODEL), DATASET: ("data", DATASET)}, lambda c: asdict(c.sft),
          ("training.warmup", "training.setup", "data_curation.synthetic"), _warmup_body,
          lambda con, ctx, res, key: _record_checkpoint(con, ctx, res, key, "warmup", ctx.cfg.sft.steps),
          lambda m: f"loss {m['sft_loss_first']:.3f} -> {m['sft_loss_ema']:.3f}"),
    Stage("eval_warmup", {MODEL: ("warmup", MODEL), DATASET: ("data", DATASET)}, lambda c: asdict(c.eval),
          _EVAL_MODULES, _eval_body, _record_eval, _eval_headline, _benchmark_files),
    Stage("rl", {MODEL: ("warmup", MODEL), DATASET: ("data", DATASET)},
          lambda c: {**asdict(c.rl), "verifier_timeout_s": c.eval.verifier_timeout_s},
          ("training.rl.stage", "training.setup", "data_curation.synthetic", "evaluation.verifier"), _rl_body,
          _record_rl,
          lambda m: f"reward {m['reward_first']:.3f} -> {m['reward_last5']:.3f} (last 5)" if m.get("steps") else ""),
    Stage("eval_rl", {MODEL: ("rl", MODEL), DATASET: ("data", DATASET)}, lambda c: asdict(c.eval),
          _EVAL_MODULES, _eval_body, _record_eval, _eval_headline, _benchmark_files),
)
STAGE_BY_NAME = {s.name: s for s in STAGES}

EVAL_STAGE = Stage("eval", {MODEL: ("", MODEL), DATASET: ("", DATASET)}, lambda c: asdict(c.eval), _EVAL_MODULES,
                   _eval_body, _record_adhoc_eval, _eval_headline, _benchmark_files)
"""``laminar eval`` on any checkpoint: not part of the DAG (its inputs come from the command line:
a checkpoint and the latest data artifact, which may be absent), same body and key scheme as the
DAG's eval stages."""
