"""The stage records: what a stage is (``Stage``; the table of them is ``tasks.dag.STAGES``, each
declared in its module of ``tasks.stages``), what its
body reads (``StageContext``) and returns (``StageResult``), what one stage of a run was
(``StageOutcome``) or would be (``StagePlan``), and one run's summary (``RunSummary``, written as
``summary.json``). Typed records; nothing here runs a stage or writes the catalog."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from conf.schema import Config
from core.artifacts import ArtifactRef, ArtifactStore
from core.catalog import Catalog
from tasks.cache import CacheKey, make_key, stage_modules

if TYPE_CHECKING:
    from duckdb import DuckDBPyConnection as Connection

StageStatus = Literal["ran", "cached"]
INTERRUPTED = "interrupted"
RunStatus = Literal["running", "completed", "failed", "interrupted"]


@dataclass
class StageContext:
    cfg: Config
    store: ArtifactStore
    inputs: dict[str, ArtifactRef]
    device: str
    catalog: Catalog | None = None
    """Read-only use in bodies (HIVE's workspace history); only the record hooks write."""
    state_dir: Path | None = None
    """Where a long stage keeps resumable state between attempts (RL checkpoints); None: no resume."""
    stage: str = ""
    """The stage's name when it is a round's copy (``rl@2``: ``tasks.rounds``); "" for the chain's own."""


@dataclass
class StageResult:
    """What a stage produced: named artifacts and headline metrics (JSON-ready)."""

    artifacts: dict[str, ArtifactRef]
    metrics: dict[str, Any] = field(default_factory=dict)

    def to_dict(self, store: ArtifactStore | None = None) -> dict:
        """JSON-ready; with ``store``, artifact paths as stored (relative to the workspace root)."""
        conv = store.stored if store is not None else ArtifactRef.to_dict
        return {"artifacts": {k: conv(v) for k, v in self.artifacts.items()}, "metrics": self.metrics}

    @classmethod
    def from_dict(cls, d: dict, store: ArtifactStore | None = None) -> StageResult:
        """With ``store``, stored paths (relative, or absolute from a workspace since moved) are
        located in it."""
        conv = store.locate if store is not None else ArtifactRef.from_dict
        return cls({k: conv(v) for k, v in d["artifacts"].items()}, d.get("metrics", {}))


def no_headline(metrics: dict) -> str:
    return ""


def plugin_hashes(targets: Iterable[str]) -> dict[str, str]:
    """``plugin:<target>`` -> sha256 of the file each target lives in (``core.plugins.source_record``)."""
    from core.plugins import source_record

    return {f"plugin:{t}": source_record(t)["sha256"] for t in sorted(set(targets))}


@dataclass(frozen=True, kw_only=True)
class Stage:
    """One stage of the DAG, declared in its own module of ``tasks.stages`` next to its body (the
    table of them is ``tasks.dag.STAGES``). ``inputs``: input name -> (upstream stage, its output
    name). ``config``: the config subtree that enters the cache key; the library code whose source
    does is what the body's module imports (``modules``, read from its imports). ``body`` makes the
    artifacts; ``record`` writes the stage's own catalog rows (inside the runner's transaction),
    after ``tables`` (``CREATE TABLE IF NOT EXISTS ...``: tables of the stage's own that the shared
    schema in ``core.catalog`` lacks); ``headline`` is its one-line metric summary; ``external``
    hashes its inputs from outside the store (a local model folder, vendored benchmark files, the
    workspace's reward history): they enter the cache key like artifact inputs, so replacing them
    reruns the stage. ``when``: the configs the stage runs under (None: all); a stage's input from a
    stage that does not run under the config is left out of its inputs (and of its key). ``reads``:
    input name -> the configs under which the stage reads that input (absent: all); under the others
    it is left out the same way.

    What the run's summary, report and trackers read of it (none of them names a stage): ``policy``
    (its ``model`` output is a policy checkpoint: the report gives it a role, and ``title`` names it
    in the held-out accuracy line), ``evaluates`` (an evaluation stage: the stage whose model it
    scores), ``step_metrics`` (it records per-step metrics in the catalog's ``metrics`` table: the
    report plots them, a tracker replays them when the stage is cached), ``curates`` (a curation
    stage: ``laminar lineage`` lists its config and metrics among a checkpoint's curation),
    ``summary`` (its metrics -> ``summary.json``'s metrics it adds), ``curation`` (its metrics -> the
    pool counts it adds to the curation reconciliation) and ``warnings`` (the run's metrics by stage
    -> what is clearly broken)."""

    name: str
    inputs: Mapping[str, tuple[str, str]]
    config: Callable[[Config], dict]
    body: Callable[[StageContext], StageResult]
    record: Callable[[Connection, StageContext, StageResult, str], None] | None = None
    tables: str = ""
    headline: Callable[[dict], str] = no_headline
    external: Callable[[Config, Catalog | None], dict[str, str]] | None = None
    when: Callable[[Config], bool] | None = None
    reads: Mapping[str, Callable[[Config], bool]] = field(default_factory=dict)
    plugins: Callable[[Config], Iterable[str]] | None = None
    """The plug-ins (``module:attr`` targets) the stage runs under ``cfg``: each one's source file
    enters the key as ``plugin:<target>`` -> its sha256, like ``external`` inputs (so lineage names it)."""
    policy: bool = False
    title: str = ""
    evaluates: str | None = None
    step_metrics: bool = False
    curates: bool = False
    summary: Callable[[dict], dict] | None = None
    curation: Callable[[dict], dict] | None = None
    warnings: Callable[[Mapping[str, dict]], list[str]] | None = None

    @property
    def modules(self) -> tuple[str, ...]:
        """The library modules the stage's module imports (``tasks.cache.stage_modules``): their
        source, and that of every project module they import, is the key's source fingerprint."""
        return stage_modules(self.body.__module__)

    def active(self, cfg: Config | None) -> bool:
        """Whether the stage runs under ``cfg`` (None: the config is unknown, so it may)."""
        return self.when is None or cfg is None or self.when(cfg)

    def external_hashes(self, cfg: Config, catalog: Catalog | None) -> dict[str, str]:
        out = self.external(cfg, catalog) if self.external is not None else {}
        return out | (plugin_hashes(self.plugins(cfg)) if self.plugins is not None else {})

    def key(self, cfg: Config, inputs: Mapping[str, ArtifactRef], catalog: Catalog | None = None) -> CacheKey:
        """The cache key for ``cfg`` and these input artifacts (``catalog``: the workspace's, for
        ``external`` hashes that read it)."""
        hashes = {k: v.sha256 for k, v in inputs.items()} | self.external_hashes(cfg, catalog)
        return make_key(self.name, self.config(cfg), hashes, self.modules, cfg.seed)


@dataclass(frozen=True)
class StageOutcome:
    """One stage of one run: ran or came from cache, under ``key``, producing ``result``."""

    stage: str
    status: StageStatus
    seconds: float
    key: CacheKey
    result: StageResult
    task_run_id: str | None


@dataclass(frozen=True)
class StagePlan:
    """What ``laminar status`` says of a stage: cached or stale for a config, and why (``key`` is None
    while an upstream stage must run first)."""

    stage: str
    status: Literal["cached", "stale"]
    reason: str
    key: CacheKey | None


@dataclass
class RunSummary:
    """The end-of-run record (``summary.json``): per stage its status, seconds, key, artifact hashes and
    metrics; the headline held-out accuracies; checkpoints, curation counts, certificates and warnings.
    ``metrics_from_catalog`` names the headline eval stages the run did not select whose metrics came
    from an earlier run with the same key."""

    run_id: str
    seconds: float
    warnings: list[str]
    stages: dict[str, dict[str, Any]]
    metrics: dict[str, float | None]
    checkpoints: dict[str, str]
    curation: dict[str, int]
    certificates: dict[str, dict[str, str]]
    metrics_from_catalog: list[str]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class RunResult:
    run_id: str
    summary: RunSummary
