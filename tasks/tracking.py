"""Experiment tracking: every pipeline run's curves in TensorBoard, MLflow and Weights & Biases.

One tracker run per pipeline run (``tasks.operate.run_pipeline`` opens it), named by the run id, with
the resolved config as parameters and the git revision, checkpoint and artifact shas as tags. Every
stage logs its seconds and headline metrics as it finishes (``log_stage``), a cached one as cached
with its metrics from the catalog; the RL stage logs every step while it runs (``step_logger``,
called by the RL loops' ``on_step`` on the driver, in every mode). Each write is flushed at once, so
a run killed midway keeps its curves so far.

Backends are the real libraries, imported only when configured: TensorBoard's ``SummaryWriter``
(``torch.utils.tensorboard``), MLflow's ``MlflowClient`` (a SQLite store under the workspace unless
``tracking.mlflow_uri``; MLflow refuses new file stores) and ``wandb`` (offline unless logged in).
A backend that fails mid-run is logged once and dropped: the tracker's view never fails a run.

Where a run's tracker runs are: ``<workspace>/runs/<run-id>/tracking.json`` (``locations``), printed
by ``laminar runs`` and ``laminar lineage``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import subprocess
import threading
import time
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterable, Mapping

from conf.schema import Config, TrackingBackend, TrackingConfig
from core import nested
from tasks.records import StageOutcome
from tasks.stages.common import ATTEMPTS, EVAL, MODEL, RFT_DATA, SELECTION
from core.workspace import Workspace

LOG = logging.getLogger("laminar.tracking")
TRACKING_DIR = "tracking"
LOCATIONS_FILE = "tracking.json"
ROOT = Path(__file__).resolve().parent.parent
_KEY_BAD = re.compile(r"[^\w./\- ]")


def metric_key(*parts: str) -> str:
    """One metric name for every backend: ``/``-joined, ``@`` spelled ``_at_`` (``pass@4`` ->
    ``pass_at_4``), any other character MLflow refuses replaced by ``_``."""
    return _KEY_BAD.sub("_", "/".join(str(p) for p in parts if p != "").replace("@", "_at_"))


def flatten(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The finite numeric leaves of a nested metrics dict, keyed ``a/b/c`` (bools as 0/1; strings,
    None and non-finite values left out)."""
    out: dict[str, float] = {}
    for path, v in nested.flatten(metrics, "/", prefix).items():
        if isinstance(v, bool) or (isinstance(v, (int, float)) and math.isfinite(float(v))):
            out[metric_key(path)] = float(v)
    return out


def flat_params(obj: Mapping[str, Any]) -> dict[str, str]:
    """The resolved config as ``a.b.c -> value`` strings (lists as JSON)."""
    return {
        k: json.dumps(v) if isinstance(v, (list, tuple)) else str(v) for k, v in nested.flatten(obj).items()
    }


def git_revision(root: Path = ROOT) -> str:
    """The project's git commit (``+dirty`` with uncommitted changes to tracked files), or ``unknown``."""
    try:
        rev = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
        if rev.returncode != 0:
            return "unknown"
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return rev.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# ---- backends --------------------------------------------------------------------------------------


class TensorBoardBackend:
    """Event files under ``<workspace>/tracking/tensorboard/<run-id>``."""

    name: TrackingBackend = "tensorboard"

    def __init__(self, root: Path, run_id: str):
        from torch.utils.tensorboard import SummaryWriter

        self.dir = root / "tensorboard" / run_id
        self.writer = SummaryWriter(log_dir=str(self.dir), max_queue=1000, flush_secs=5)
        self.location = {"logdir": str(self.dir)}

    def scalars(self, values: dict[str, float], step: int | None) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, global_step=step or 0)
        self.writer.flush()

    def summary(self, values: dict[str, float]) -> None:
        self.scalars(values, 0)

    def params(self, params: dict[str, str]) -> None:
        self.writer.add_text("config", "\n".join(f"    {k} = {v}" for k, v in sorted(params.items())))
        self.writer.flush()

    def tags(self, tags: dict[str, str]) -> None:
        for k, v in tags.items():
            self.writer.add_text(metric_key("tags", k), v)
        self.writer.flush()

    def histogram(self, name: str, values: list[float], step: int | None) -> None:
        import numpy as np

        self.writer.add_histogram(name, np.asarray(values, dtype=np.float64), global_step=step or 0)
        self.writer.flush()

    def image(self, name: str, path: Path) -> None:
        import matplotlib.image as mpimg

        img = mpimg.imread(str(path))  # HWC floats in [0, 1]
        self.writer.add_image(
            name, img[..., :3] if img.ndim == 3 else img, dataformats="HWC" if img.ndim == 3 else "HW"
        )
        self.writer.flush()

    def close(self, status: str) -> None:
        self.writer.add_text("status", status)
        self.writer.close()


def _quiet_mlflow() -> None:
    """No telemetry (no network at run time), and no INFO lines of its store's migrations."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    import mlflow  # noqa: F401 - configures its loggers on import; quiet them after

    for name in ("mlflow", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)


class MlflowBackend:
    """An MLflow run (``run_name`` = the run id, tag ``laminar.run_id``) in ``tracking.mlflow_experiment``."""

    name: TrackingBackend = "mlflow"
    STATUS = {"completed": "FINISHED", "failed": "FAILED", "interrupted": "KILLED"}

    def __init__(self, root: Path, run_id: str, t: TrackingConfig):
        _quiet_mlflow()
        from mlflow.tracking import MlflowClient

        self.uri = mlflow_uri(root, t)
        self.client = MlflowClient(tracking_uri=self.uri)
        exp = self.client.get_experiment_by_name(t.mlflow_experiment)
        if exp is None:
            local = t.mlflow_uri is None
            exp_id = self.client.create_experiment(
                t.mlflow_experiment,
                artifact_location=(root / "mlflow" / "artifacts").as_uri() if local else None,
            )
        else:
            exp_id = exp.experiment_id
        self.run = self.client.create_run(exp_id, run_name=run_id, tags={"laminar.run_id": run_id})
        self.id = self.run.info.run_id
        self.location = {
            "uri": self.uri,
            "experiment": t.mlflow_experiment,
            "experiment_id": exp_id,
            "run": self.id,
        }

    def scalars(self, values: dict[str, float], step: int | None) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        items = [Metric(k, v, ts, step or 0) for k, v in values.items()]
        for i in range(0, len(items), 1000):  # MLflow's batch limit
            self.client.log_batch(self.id, metrics=items[i : i + 1000], synchronous=True)

    def summary(self, values: dict[str, float]) -> None:
        self.scalars(values, 0)

    def params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(k, v[:6000]) for k, v in sorted(params.items())]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.id, params=items[i : i + 100], synchronous=True)

    def tags(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        self.client.log_batch(self.id, tags=[RunTag(k, v) for k, v in tags.items()], synchronous=True)

    def histogram(self, name: str, values: list[float], step: int | None) -> None:
        import numpy as np

        counts, edges = np.histogram(np.asarray(values, dtype=np.float64), bins=10)
        self.client.log_dict(
            self.id,
            {"edges": edges.tolist(), "counts": counts.tolist(), "step": step or 0},
            f"histograms/{name}.json",
        )

    def image(self, name: str, path: Path) -> None:
        self.client.log_artifact(self.id, str(path), "plots")

    def close(self, status: str) -> None:
        self.client.set_terminated(self.id, status=self.STATUS.get(status, "FAILED"))


def _wandb_logged_in() -> bool:
    """Credentials ``wandb login`` leaves (a netrc entry for the W&B host) or WANDB_API_KEY."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    import netrc

    try:
        hosts = netrc.netrc(os.environ.get("NETRC")).hosts
    except (OSError, netrc.NetrcParseError):
        return False
    base = os.environ.get("WANDB_BASE_URL", "")
    return any("wandb" in h or (base and h in base) for h in hosts)


class WandbBackend:
    """A W&B run with id and name = the run id; offline files under ``<workspace>/tracking/wandb``
    unless logged in (``tracking.wandb_mode``). Per-step curves use their own x axis (``rl/step``)."""

    name: TrackingBackend = "wandb"

    def __init__(self, root: Path, run_id: str, t: TrackingConfig, config: dict):
        os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
        import wandb

        mode = t.wandb_mode if t.wandb_mode != "auto" else ("online" if _wandb_logged_in() else "offline")
        self.dir = root  # wandb writes <dir>/wandb/<offline-run-...>
        root.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=t.wandb_project,
            name=run_id,
            id=run_id,
            dir=str(root),
            mode=mode,
            config=config,
            resume="allow",
            reinit="create_new",
            settings=wandb.Settings(
                console="off", silent=True, x_disable_stats=True, disable_git=True, save_code=False
            ),
        )
        self._wandb = wandb
        self._axes: set[str] = set()
        self.location = {
            "mode": mode,
            "project": t.wandb_project,
            "id": run_id,
            "dir": str(Path(self.run.dir).parent),
        }

    def scalars(self, values: dict[str, float], step: int | None) -> None:
        if step is None:
            return self.summary(values)
        by_axis: dict[str, dict[str, float]] = {}
        for k, v in values.items():
            by_axis.setdefault(k.split("/")[0], {})[k] = v
        for top, vals in by_axis.items():
            axis = f"{top}/step"
            if axis not in self._axes:
                self.run.define_metric(axis, hidden=True)
                self.run.define_metric(f"{top}/*", step_metric=axis)
                self._axes.add(axis)
            self.run.log({**vals, axis: step})

    def summary(self, values: dict[str, float]) -> None:
        self.run.summary.update(values)

    def params(self, params: dict[str, str]) -> None:
        pass  # the resolved config went to wandb.init

    def tags(self, tags: dict[str, str]) -> None:
        self.run.config.update(
            {"lineage": {**dict(self.run.config.get("lineage", {}) or {}), **tags}}, allow_val_change=True
        )

    def histogram(self, name: str, values: list[float], step: int | None) -> None:
        self.run.summary[name] = self._wandb.Histogram(values, num_bins=10)

    def image(self, name: str, path: Path) -> None:
        self.run.log({name: self._wandb.Image(str(path))})

    def close(self, status: str) -> None:
        self.run.finish(exit_code=0 if status == "completed" else 1)


def tracking_root(ws: Workspace) -> Path:
    return ws.root / TRACKING_DIR


def mlflow_uri(root: Path, t: TrackingConfig) -> str:
    """``tracking.mlflow_uri``, or the workspace's SQLite store ``<workspace>/tracking/mlflow/mlflow.db``."""
    if t.mlflow_uri:
        return t.mlflow_uri
    (root / "mlflow").mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{(root / 'mlflow' / 'mlflow.db').resolve()}"


# ---- the tracker every stage writes through ------------------------------------------------------


class Tracker:
    """Fans each call out to the configured backends; thread-safe (the Laminar runtime's driver and
    in-run evaluations log from their own threads). A backend whose call raises is dropped with one
    warning: tracking never fails a run."""

    def __init__(self, run_id: str, backends: Iterable[Any] = ()):
        self.run_id = run_id
        self.backends = list(backends)
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return bool(self.backends)

    def _each(self, method: str, *args) -> None:
        with self._lock:
            for b in list(self.backends):
                try:
                    getattr(b, method)(*args)
                except Exception as err:  # noqa: BLE001 - the tracker's view never fails a run
                    LOG.warning(
                        "tracking: %s backend failed (%s: %s); it logs nothing more in run %s",
                        b.name,
                        type(err).__name__,
                        err,
                        self.run_id,
                    )
                    self.backends.remove(b)

    def log_metrics(self, prefix: str, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """The numeric leaves of ``metrics`` under ``prefix/``; ``step`` None: one value for the run."""
        values = flatten(metrics, prefix)
        if not values or not self.backends:
            return
        if step is None:
            self._each("summary", values)
        else:
            self._each("scalars", values, int(step))

    def step_logger(self, prefix: str) -> Callable[[dict], None]:
        """An ``on_step`` callback: every RL step's metrics dict, at its ``step``."""

        def log(m: dict) -> None:
            self.log_metrics(prefix, {k: v for k, v in m.items() if k != "step"}, int(m["step"]))

        return log

    def log_params(self, params: dict[str, str]) -> None:
        self._each("params", params)

    def set_tags(self, tags: dict[str, str]) -> None:
        if tags:
            self._each("tags", tags)

    def log_histogram(self, name: str, values: list[float], step: int | None = None) -> None:
        if values:
            self._each("histogram", metric_key(name), [float(v) for v in values], step)

    def log_image(self, name: str, path: Path) -> None:
        self._each("image", metric_key(name), Path(path))

    def close(self, status: str) -> None:
        self._each("close", status)
        self.backends = []


NULL = Tracker("")
_ACTIVE: Tracker = NULL


def active() -> Tracker:
    """The tracker of the pipeline run in progress in this process (one without backends otherwise)."""
    return _ACTIVE


def open_backends(t: TrackingConfig, root: Path, run_id: str, config: dict) -> list[Any]:
    """The configured backends, opened; one that cannot open (an MLflow server that does not answer)
    is left out with a warning on stderr: the run goes on without it."""
    import sys

    out: list[Any] = []
    for name in t.backends:
        try:
            if name == "tensorboard":
                out.append(TensorBoardBackend(root, run_id))
            elif name == "mlflow":
                out.append(MlflowBackend(root, run_id, t))
            elif name == "wandb":
                out.append(WandbBackend(root, run_id, t, config))
        except Exception as err:  # noqa: BLE001 - the tracker's view never fails a run
            msg = (
                f"laminar: tracking: {name} could not open a run ({type(err).__name__}: {err}); "
                f"run {run_id} goes on without it"
            )
            LOG.warning(msg)
            print(msg, file=sys.stderr)
    return out


def start_run(cfg: Config, ws: Workspace, run_id: str, command: str) -> Tracker:
    """Open the run's tracker runs (config as parameters, git revision and command as tags), write
    ``tracking.json`` beside the run's files and make it the ``active()`` tracker."""
    global _ACTIVE
    from conf.loader import to_dict

    if not cfg.tracking.backends:
        _ACTIVE = Tracker(run_id)
        return _ACTIVE
    config = to_dict(cfg)
    root = tracking_root(ws)
    tracker = Tracker(run_id, open_backends(cfg.tracking, root, run_id, config))
    tracker.log_params(flat_params(config))
    tracker.set_tags(
        {
            "laminar.run_id": run_id,
            "git.revision": git_revision(),
            "laminar.command": command[:5000],
            "laminar.workspace": str(ws.root),
        }
    )
    run_dir = ws.run_dir(run_id)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / LOCATIONS_FILE).write_text(
        json.dumps(
            {"workspace": str(ws.root.resolve()), **{b.name: b.location for b in tracker.backends}}, indent=1
        )
    )
    _ACTIVE = tracker
    return tracker


def finish_run(tracker: Tracker, status: str) -> None:
    global _ACTIVE
    tracker.set_tags({"laminar.status": status})
    tracker.close(status)
    if _ACTIVE is tracker:
        _ACTIVE = NULL


# ---- what each stage logs --------------------------------------------------------------------------

CHECKPOINT_KIND = MODEL


def log_stage(ws: Workspace, stage_name: str, outcome: StageOutcome, tracker: Tracker | None = None) -> None:
    """One finished stage (ran or cached): its seconds, status and headline metrics, its artifacts'
    shas as tags, pass-rate histograms and evaluation summaries from its artifacts; a cached RL stage
    its per-step curve from the catalog (the live one was logged by the run that trained it)."""
    tracker = tracker or active()
    if not tracker.enabled:
        return
    cached = outcome.status == "cached"
    tracker.log_metrics(stage_name, {"seconds": outcome.seconds, "cached": cached})
    metrics = dict(outcome.result.metrics)
    tracker.log_metrics(stage_name, metrics)
    tags = {f"stage.{stage_name}": outcome.status, f"cache_key.{stage_name}": outcome.key.digest}
    for name, ref in outcome.result.artifacts.items():
        tags[f"artifact.{stage_name}.{name}"] = ref.sha256
        if ref.kind == CHECKPOINT_KIND:
            tags[f"checkpoint.{stage_name}"] = ref.sha256
        _log_artifact_contents(tracker, stage_name, ref, metrics)
    tracker.set_tags(tags)
    if cached and _has_steps(stage_name):
        for step, values in rl_curve(ws, outcome.key.digest, stage_name).items():
            tracker.log_metrics(stage_name, values, step)


def _has_steps(stage_name: str) -> bool:
    """Whether the stage records per-step metrics in the catalog (``Stage.step_metrics``)."""
    from tasks.dag import STAGE_BY_NAME

    stage = STAGE_BY_NAME.get(stage_name)
    return stage is not None and stage.step_metrics


def _log_artifact_contents(tracker: Tracker, stage_name: str, ref: Any, metrics: dict) -> None:
    """What a stage's headline metrics leave out: an evaluation's pass@k/maj@k per benchmark and
    level (its ``summary.json``), a difficulty stage's pass-rate histogram."""
    try:
        summary = ref.file("summary.json")
        if ref.kind == EVAL and summary.exists():
            done = set(flatten(metrics, stage_name))
            values = {
                k: v for k, v in flatten(json.loads(summary.read_text()), stage_name).items() if k not in done
            }
            tracker.log_metrics("", values)
        attempts = ref.file("attempts.parquet")
        if ref.kind == ATTEMPTS and attempts.exists():
            import polars as pl

            rates = pl.read_parquet(attempts, columns=["pass_rate"])["pass_rate"].drop_nulls().to_list()
            tracker.log_histogram(f"{stage_name}/pass_rate", rates)
        dart = ref.file("dart_stats.parquet")
        if ref.kind == RFT_DATA and dart.exists():
            tracker.log_metrics(f"{stage_name}/by_level", dart_by_level(dart))
        if ref.kind == SELECTION and "candidates" in metrics and "selected" in metrics:
            tracker.log_metrics(stage_name, {"skipped": metrics["candidates"] - metrics["selected"]})
    except Exception as err:  # noqa: BLE001 - an unreadable artifact file is fsck's business, not the tracker's
        LOG.warning("tracking: stage %s artifact %s not read: %s", stage_name, ref.sha256[:12], err)


def dart_by_level(path: Path) -> dict[str, dict[str, float]]:
    """DART per difficulty level: trials, correct responses and acceptance (correct / trials)."""
    import polars as pl

    rows = (
        pl.read_parquet(path, columns=["level", "trials", "corrects"])
        .group_by("level")
        .agg(pl.col("trials").sum(), pl.col("corrects").sum(), pl.len().alias("prompts"))
        .sort("level", nulls_last=True)
        .to_dicts()
    )
    return {
        str(r["level"]): {
            "prompts": float(r["prompts"]),
            "trials": float(r["trials"]),
            "corrects": float(r["corrects"]),
            "acceptance": float(r["corrects"]) / r["trials"] if r["trials"] else 0.0,
        }
        for r in rows
    }


def rl_curve(ws: Workspace, cache_key: str, stage: str) -> dict[int, dict[str, float]]:
    """A stage's per-step metrics (the RL stage's) recorded in the catalog for ``cache_key``: step ->
    name -> value."""
    rows = ws.catalog.query(
        "SELECT step, name, value FROM metrics WHERE cache_key = ? AND stage = ? ORDER BY step, name",
        [cache_key, stage],
    )
    out: dict[int, dict[str, float]] = {}
    for r in rows:
        out.setdefault(int(r["step"]), {})[r["name"]] = r["value"]
    return out


# ---- where a run's tracker runs are ----------------------------------------------------------------


def locations(ws: Workspace, run_id: str) -> dict[str, dict]:
    """``tracking.json`` of a run: backend -> where its tracker run is ({} when it logged nowhere),
    its paths under the workspace's current folder (a moved workspace keeps its tracker runs)."""
    path = ws.run_dir(run_id) / LOCATIONS_FILE
    try:
        loc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    old, new = loc.pop("workspace", None), str(ws.root.resolve())
    if old and old != new:  # a workspace moved since: its paths move with it
        loc = json.loads(json.dumps(loc).replace(json.dumps(old)[1:-1], json.dumps(new)[1:-1]))
    return loc


def describe(loc: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """One line per backend: where its tracker run is."""
    lines = []
    for name, v in loc.items():
        if name == "tensorboard":
            lines.append(f"tensorboard  {v.get('logdir')}")
        elif name == "mlflow":
            lines.append(
                f"mlflow       run {v.get('run')} (experiment {v.get('experiment')}) in {v.get('uri')}"
            )
        elif name == "wandb":
            lines.append(
                f"wandb        {v.get('mode')} run {v.get('project')}/{v.get('id')} in {v.get('dir')}"
            )
    return lines


def format_locations(ws: Workspace, run_ids: Iterable[str]) -> str:
    """``laminar runs`` / ``laminar lineage``: each run's tracker runs."""
    lines = []
    for run_id in dict.fromkeys(r for r in run_ids if r):
        loc = locations(ws, run_id)
        lines.append(f"  {run_id}" + ("" if loc else "  (not tracked)"))
        lines += [f"    {line}" for line in describe(loc)]
    return "\n".join(["tracker runs:", *lines]) if lines else ""


def log_report(ws: Workspace, run_id: str, plots: Mapping[str, Path]) -> None:
    """``laminar report``'s plots into the run's tracker runs (reopened from ``tracking.json``)."""
    loc = locations(ws, run_id)
    if not loc:
        return
    rows = ws.catalog.query("SELECT config_json FROM runs WHERE run_id = ?", [run_id])
    tcfg = json.loads(rows[0]["config_json"]).get("tracking", {}) if rows else {}
    t = TrackingConfig(**{k: v for k, v in tcfg.items() if k in TrackingConfig.model_fields})
    root = tracking_root(ws)
    backends: list[Any] = []
    for name in loc:
        try:
            if name == "tensorboard":
                backends.append(TensorBoardBackend(root, run_id))
            elif name == "mlflow":
                b = MlflowBackend.__new__(MlflowBackend)
                _quiet_mlflow()
                from mlflow.tracking import MlflowClient

                b.uri, b.id = loc[name]["uri"], loc[name]["run"]
                b.client = MlflowClient(tracking_uri=b.uri)
                backends.append(b)
            elif name == "wandb":
                backends.append(WandbBackend(root, run_id, t, {}))
        except Exception as err:  # noqa: BLE001 - the report is written; the tracker copy is extra
            LOG.warning("tracking: report plots not sent to %s: %s", name, err)
    tracker = Tracker(run_id, backends)
    for name, path in plots.items():
        if Path(path).exists():
            tracker.log_image(f"report/{name}", Path(path))
    with tracker._lock:
        for b in tracker.backends:
            if b.name == "tensorboard":
                b.writer.close()
            elif b.name == "wandb":
                b.run.finish()
