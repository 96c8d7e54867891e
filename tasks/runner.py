"""Runs the pipeline: one run under the workspace lock, and each of its stages as a Prefect task with
the pipeline's cache key; the only caller of ``tasks.recording`` (every catalog write).

- ``run_pipeline``: one run, for the CLI and for scheduled runs alike. It marks the runs that died
  without finishing (their row still says ``running``; holding the lock proves no one else runs) as
  ``interrupted``, writes the ``runs`` row, the run files and ``summary.json``, and closes the row as
  ``completed``, ``failed`` or ``interrupted``.
- ``run_stages`` (inside the Prefect flow) runs the selected stages in DAG order. A Prefect task's
  ``cache_key_fn`` returns the stage's key, so an unchanged stage returns its cached result (small
  artifact refs, JSON-serialised) without running its body; its catalog rows are written after every
  stage, ran or cached. ``replay_cached`` records a run in which nothing would run without Prefect.
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any

from conf.schema import Config
from core.artifacts import ArtifactRef
from core.workspace import Workspace
from tasks import recording
from tasks.dag import STAGE_BY_NAME, Selection, stage_inputs, stage_key
from tasks.plan import finished_result
from tasks.records import INTERRUPTED, RunResult, Stage, StageContext, StageOutcome, StageResult

LOG = logging.getLogger("laminar.tasks")
RunRecordError = recording.RunRecordError


# ---- one stage --------------------------------------------------------------------------------------


def _execute(
    stage_name: str, key: str, cfg: Config, workspace: str, inputs: dict[str, dict], device: str
) -> dict:
    """The body of every stage task: run the library function, return JSON-ready artifact refs."""
    if (progress := _PROGRESS.get()) is not None:
        progress.stage_started()  # the quick stages before this one print if it takes a while
    ws = Workspace.at(workspace)
    state = ws.stage_state(stage_name, key)
    ctx = StageContext(
        cfg=cfg,
        store=ws.artifacts,
        inputs={k: ArtifactRef.from_dict(v) for k, v in inputs.items()},
        device=device,
        catalog=ws.catalog,
        state_dir=state,
    )
    # Prefect stores paths relative to the workspace
    out = STAGE_BY_NAME[stage_name].body(ctx).to_dict(ws.artifacts)
    if state.exists():  # the artifact is complete: its resumable state is spent
        shutil.rmtree(state, ignore_errors=True)
    return out


_TASKS: dict[str, Any] = {}


def prefect_task(stage: Stage) -> Any:
    """One Prefect task per stage, keyed by the pipeline's cache key, results stored as JSON."""
    if stage.name not in _TASKS:
        from prefect import task

        _TASKS[stage.name] = task(
            _execute,
            name=stage.name,
            cache_key_fn=lambda _ctx, params: params["key"],
            persist_result=True,
            result_serializer="json",
            log_prints=False,
        )
    return _TASKS[stage.name]


class _Progress:
    """One line per stage that took a while; consecutive quick stages (cached, or ran in under
    ``quick_s``) share one line, printed when a slow stage finishes, when the next stage has run for
    ``quick_s`` (so a long stage is announced by what came before it, before its own output), or when
    the run ends. A fresh run's failure is not preceded by a line per curation stage, nor a rerun's
    by a screen of cache hits."""

    def __init__(self, quick_s: float = 2.0) -> None:
        self.quick_s = quick_s
        self.held: list[StageOutcome] = []
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None

    def __call__(self, outcome: StageOutcome) -> None:
        self._cancel()
        slow = outcome.status == "ran" and outcome.seconds >= self.quick_s
        if slow:
            self.flush()  # what came before, on its own line
        with self._lock:
            self.held.append(outcome)
        if slow:
            self.flush()

    def stage_started(self) -> None:
        """A stage body starts: what is held prints if the stage is still running ``quick_s`` later."""
        self._cancel()
        if self.held:
            self._timer = threading.Timer(self.quick_s, self.flush)
            self._timer.daemon = True
            self._timer.start()

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def flush(self) -> None:
        self._cancel()
        with self._lock:
            held, self.held = self.held, []
        if len(held) == 1:
            o = held[0]
            print(f"laminar: stage {o.stage:<14} {o.status:<6} {o.seconds:6.1f}s", flush=True)
        elif held:
            status = {o.status for o in held}
            names = ", ".join(o.stage if len(status) == 1 else f"{o.stage} ({o.status})" for o in held)
            what = status.pop() if len(status) == 1 else "ran or cached"
            print(f"laminar: stages {names} {what} {sum(o.seconds for o in held):.1f}s", flush=True)


_PROGRESS: ContextVar[_Progress | None] = ContextVar("laminar_progress", default=None)
"""The progress of the stages the current flow runs (a stage body that starts flushes it)."""


def record_outcome(
    ws: Workspace,
    run_id: str,
    stage: Stage,
    outcome: StageOutcome,
    inputs: Mapping[str, ArtifactRef],
    started: datetime,
    cfg: Config,
    device: str,
    lineage: bool = True,
) -> None:
    """A finished stage's catalog rows (and, with ``lineage``, what its key was made of), then its
    tracker entries."""
    from tasks.tracking import log_stage

    recording.record_stage_run(ws, run_id, stage, outcome, inputs, started, cfg, device)
    if lineage:
        recording.record_lineage(ws, stage, cfg, outcome, inputs)
    log_stage(ws, stage.name, outcome)


def run_stage(
    stage: Stage,
    cfg: Config,
    ws: Workspace,
    run_id: str,
    inputs: Mapping[str, ArtifactRef],
    device: str,
    force: bool = False,
    progress: Callable[[StageOutcome], None] | None = None,
) -> StageOutcome:
    """Run ``stage`` (or take it from cache) as its Prefect task, and record it."""
    key = stage_key(stage, cfg, inputs, ws)
    t0 = time.perf_counter()
    started = datetime.now(UTC)
    task = prefect_task(stage)
    params = dict(
        stage_name=stage.name,
        key=key.digest,
        cfg=cfg,
        workspace=str(ws.root),
        inputs={k: v.to_dict() for k, v in inputs.items()},
        device=device,
    )
    state = task.with_options(refresh_cache=force or None)(**params, return_state=True)
    result = StageResult.from_dict(state.result(), ws.artifacts)
    status = "cached" if state.name == "Cached" else "ran"
    if status == "cached" and not all(ws.artifacts.exists(r) for r in result.artifacts.values()):
        # Prefect remembers a result whose artifact is gone (workspace cleaned by hand): rebuild it.
        state = task.with_options(refresh_cache=True)(**params, return_state=True)
        result, status = StageResult.from_dict(state.result(), ws.artifacts), "ran"
    task_run_id = state.state_details.task_run_id
    outcome = StageOutcome(
        stage.name, status, time.perf_counter() - t0, key, result, str(task_run_id) if task_run_id else None
    )
    record_outcome(ws, run_id, stage, outcome, inputs, started, cfg, device)
    LOG.info("stage %s %s in %.1fs key %s", stage.name, status, outcome.seconds, key.digest[:16])
    (progress or _Progress())(outcome)
    return outcome


def run_stages(
    cfg: Config, ws: Workspace, run_id: str, selection: Selection, flow_run_id: str | None
) -> list[StageOutcome]:
    """The selected stages in DAG order (call inside the Prefect flow), each with its Prefect
    artifacts and asset events; the stage table as a Prefect artifact at the end."""
    from generation.model import resolve_device
    from tasks.prefect_publish import publish_stage
    from tasks.summary import publish_prefect_artifacts

    recording.record_flow_run(ws, run_id, flow_run_id)
    device = resolve_device(cfg.device)
    outcomes: dict[str, StageOutcome] = {}
    progress = _Progress()
    token = _PROGRESS.set(progress)
    try:
        for stage in selection.stages_to_run(cfg):
            inputs = stage_inputs(stage, {n: o.result.artifacts for n, o in outcomes.items()}, cfg)
            if inputs is None:
                raise ValueError(f"stage {stage.name} needs its upstream stages in the selection")
            outcomes[stage.name] = run_stage(
                stage, cfg, ws, run_id, inputs, device, force=stage.name in selection.force, progress=progress
            )
            try:
                publish_stage(ws, stage, outcomes[stage.name], inputs)
            except Exception as err:  # noqa: BLE001 - the UI's view never fails a run
                LOG.warning("stage %s: Prefect artifacts/assets not published: %s", stage.name, err)
    finally:
        _PROGRESS.reset(token)
        progress.flush()
    publish_prefect_artifacts(list(outcomes.values()))
    return list(outcomes.values())


def replay_cached(
    cfg: Config, ws: Workspace, run_id: str, stages: list[str] | None = None, force: list[str] | None = None
) -> list[StageOutcome] | None:
    """A run in which nothing would run, without Prefect: when no stage is forced and every selected
    stage's key matches a finished run whose artifacts are in the store (what ``plan`` calls cached),
    each stage's outcome is read from the catalog and recorded like a cached Prefect task's (stage
    rows, lineage, tracker), and the run needs no orchestrator, so no Prefect server is started (its
    start is most of a cached rerun's time). Returns None, having written nothing, when any stage
    would run; the caller then runs the Prefect flow. Never used with ``PREFECT_API_URL`` set: runs
    reported to a server stay visible there."""
    if force or os.environ.get("PREFECT_API_URL"):
        return None
    from generation.model import resolve_device

    device = resolve_device(cfg.device)
    found: dict[str, tuple[StageOutcome, dict[str, ArtifactRef]]] = {}
    for stage in Selection(stages, []).stages_to_run(cfg):
        t0 = time.perf_counter()
        inputs = stage_inputs(stage, {n: o.result.artifacts for n, (o, _) in found.items()}, cfg)
        if inputs is None:
            return None
        key = stage_key(stage, cfg, inputs, ws)
        result = finished_result(ws, stage.name, key)
        if result is None or not all(ws.artifacts.exists(r) for r in result.artifacts.values()):
            return None
        outcome = StageOutcome(stage.name, "cached", time.perf_counter() - t0, key, result, None)
        found[stage.name] = (outcome, inputs)
    progress = _Progress()
    for name, (outcome, inputs) in found.items():
        record_outcome(ws, run_id, STAGE_BY_NAME[name], outcome, inputs, datetime.now(UTC), cfg, device)
        progress(outcome)
    progress.flush()
    return [o for o, _ in found.values()]


# ---- one run under the workspace lock -----------------------------------------------------------------


def new_run_id(prefix: str = "") -> str:
    return prefix + datetime.now(UTC).strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]


def command_line() -> str:
    return shlex.join(["laminar", *sys.argv[1:]])


def save_run_files(ws: Workspace, run_id: str, cfg: Config, command: str) -> None:
    """The resolved config and the exact command beside the run's outputs."""
    from conf.loader import to_yaml

    run_dir = ws.run_dir(run_id)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    (run_dir / "command.txt").write_text(command + "\n")


def clear_dead_runs(ws: Workspace, say: Callable[[str], None]) -> None:
    """Under the lock, before any run: folders, writers' leftovers, and the rows of runs that died
    (marked ``interrupted``)."""
    ws.create()
    ws.artifacts.clean_tmp()
    for run_id in recording.mark_interrupted(ws):
        say(f"laminar: run {run_id} never finished (its process was killed); marked {INTERRUPTED}")


def prepare_workspace(ws: Workspace, say: Callable[[str], None]) -> None:
    """Under the lock, before a pipeline run: ``clear_dead_runs``, Prefect's settings, and the Prefect
    servers of runs that died."""
    from tasks.operate import stop_orphan_prefect_servers
    from tasks.prefect_env import configure_prefect
    from tasks.serving import attach_served_api

    clear_dead_runs(ws, say)
    configure_prefect(ws)
    attach_served_api(ws)
    for pid in stop_orphan_prefect_servers(ws):
        say(f"laminar: stopped Prefect server pid {pid} left behind by a killed run")


def _run_logging(ws: Workspace, run_id: str) -> logging.Handler:
    logging.getLogger("transformers").setLevel(logging.ERROR)
    handler = logging.FileHandler(ws.logs / f"{run_id}.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    laminar_log = logging.getLogger("laminar")
    laminar_log.setLevel(logging.INFO)
    laminar_log.addHandler(handler)
    laminar_log.propagate = False
    return handler


class _Status:
    """How a recorded run ended; ``recorded_run`` closes the row with it."""

    def __init__(self) -> None:
        self.value = "failed"


@contextmanager
def recorded_run(
    ws: Workspace, run_id: str, command: str, config: dict, flow_run_id: str | None = None
) -> Iterator[_Status]:
    """The ``runs`` row around one run: opened ``running``; closed ``completed`` when the body set
    ``status.value`` so, ``interrupted`` on Ctrl-C, ``failed`` otherwise (``recording.finish_run``)."""
    recording.open_run(ws, run_id, command, config, flow_run_id)
    status = _Status()
    error: BaseException | None = None
    try:
        yield status
    except KeyboardInterrupt as err:
        status.value, error = INTERRUPTED, err
        raise
    except BaseException as err:
        error = err
        raise
    finally:
        try:
            recording.finish_run(ws, run_id, status.value, error)
        finally:
            error = None  # this frame must not keep the traceback (and its frames) alive in a cycle


def run_pipeline(
    cfg: Config,
    ws: Workspace,
    pipeline: Callable[..., list[StageOutcome]],
    *,
    overrides: Sequence[str],
    selection: Selection,
    command: str,
    flow_run_id: str | None = None,
    say: Callable[[str], None] = print,
    warn: Callable[[str], None] | None = None,
) -> RunResult:
    """One pipeline run: lock, runs row, ``pipeline(...)`` (the Prefect flow), summary, final status.

    Raises ``core.workspace.WorkspaceBusy`` at once, before writing anything, when another laminar
    process holds the workspace."""
    from conf.loader import to_dict
    from core.artifacts import write_json_atomic
    from tasks import tracking
    from tasks.summary import build_summary, catalog_metrics, format_table

    warn = warn or (lambda m: print(m, file=sys.stderr))
    with ws.lock():
        prepare_workspace(ws, warn)
        run_id = new_run_id()
        save_run_files(ws, run_id, cfg, command)
        handler = _run_logging(ws, run_id)
        t0 = time.perf_counter()
        n = len(selection.stages_to_run(cfg))
        try:
            with recorded_run(ws, run_id, command, to_dict(cfg), flow_run_id) as status:
                say(
                    f"laminar: run {run_id}: {n} stages, each runs or comes from cache (when any must run, "
                    "Prefect's local server starts first: ~15 s)"
                )
                tracker = tracking.start_run(cfg, ws, run_id, command)
                try:
                    outcomes = pipeline(
                        overrides=list(overrides),
                        workspace=str(ws.root),
                        run_id=run_id,
                        force=list(selection.force),
                        stages=selection.stages,
                    )
                    summary = build_summary(
                        run_id, outcomes, time.perf_counter() - t0, catalog_metrics(cfg, ws, outcomes)
                    )
                    tracker.log_metrics("summary", {"seconds": summary.seconds, **summary.metrics})
                    write_json_atomic(ws.run_dir(run_id) / "summary.json", summary.to_dict())
                    say(format_table(summary))
                    say(f"summary: {ws.run_dir(run_id) / 'summary.json'}")
                    status.value = "completed"
                except KeyboardInterrupt:
                    status.value = INTERRUPTED
                    raise
                finally:
                    tracking.finish_run(tracker, status.value)
        finally:
            logging.getLogger("laminar").removeHandler(handler)
            handler.close()
    return RunResult(run_id, summary)
