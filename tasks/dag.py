"""The DAG: the stage table (``STAGES``, in DAG order) and the operations on the graph.

Each stage is one module of ``tasks.stages`` whose ``Stage`` declaration says what the stage reads
(its upstream stages' outputs), which config enters its cache key (the library code that does is what
the module imports), the body that makes its artifacts, the catalog rows it records, its one-line
headline and what the run's summary, report and trackers read of it. Every stage selection
(``laminar rerun STAGE``, ``laminar run --until STAGE``) is computed from the declared inputs, never
from a list of names, and every stage's inputs are resolved by ``stage_inputs``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from conf.schema import Config
from core.artifacts import ArtifactRef
from core.workspace import Workspace
from tasks import rounds
from tasks.cache import CacheKey
from tasks.records import Stage
from tasks.stages import (
    base_model,
    dart,
    data,
    decontaminate,
    difficulty,
    evaluate,
    ingest,
    preferences,
    reward_model,
    rft,
    rl,
    select as select_stage,
    warmup,
)
from tasks.stages.common import MODEL

# ---- the table: one module per stage, in DAG order -----------------------------------------------------

STAGES: tuple[Stage, ...] = (
    data.STAGE,
    ingest.STAGE,
    decontaminate.STAGE,
    base_model.STAGE,
    warmup.STAGE,
    # the learned reward model (reward=reward_model): annotators rate the warm-up model's responses
    preferences.STAGE,
    reward_model.STAGE,
    evaluate.stage_for("warmup"),
    difficulty.STAGE,
    dart.STAGE,
    rft.STAGE,
    evaluate.stage_for("rft"),
    difficulty.RFT_STAGE,
    select_stage.STAGE,
    rl.STAGE,
    evaluate.stage_for("rl"),
)


class _StageTable(Mapping[str, Stage]):
    """Stage name -> its ``Stage``: the chain's (``STAGES``) and every round's copy (``rl@2``:
    ``tasks.rounds``), built on first use. Iterates over the chain's own."""

    def __init__(self, stages: Sequence[Stage]) -> None:
        self._base = {s.name: s for s in stages}
        self._rounds: dict[str, Stage] = {}

    def __getitem__(self, name: str) -> Stage:
        if name in self._base:
            return self._base[name]
        if name not in self._rounds:
            parsed = rounds.parse(name)
            if parsed is None or parsed[1] < 2:
                raise KeyError(name)
            self._rounds[name] = rounds.round_stage(self._base[parsed[0]], parsed[1])
        return self._rounds[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._base)

    def __len__(self) -> int:
        return len(self._base)


STAGE_BY_NAME: Mapping[str, Stage] = _StageTable(STAGES)
"""Every stage by name, round copies (``NAME@k``) included."""

EVAL_STAGE = evaluate.ADHOC
"""``laminar eval`` on any checkpoint: not part of the DAG, same body and key scheme as its eval stages."""

__all__ = ["MODEL", "STAGES", "STAGE_BY_NAME", "EVAL_STAGE"]


# ---- operations on the graph --------------------------------------------------------------------------


class UnknownStage(ValueError):
    pass


DEFAULT_CONFIG = Config()
"""The config the graph operations assume when given none: its stages are the default run's."""


def _live(cfg: Config | None) -> Config:
    return cfg if cfg is not None else DEFAULT_CONFIG


def stages_of(cfg: Config | None = None) -> list[Stage]:
    """The stages that run under ``cfg`` (None: the default config), in DAG order: the chain, then
    each round k >= 2's copies of its curate -> RFT -> RL stages (``rounds``)."""
    live = _live(cfg)
    chain = [s for s in STAGES if s.active(live)]
    copies = [STAGE_BY_NAME[n] for n in rounds.round_names(live.rounds)]
    return chain + [s for s in copies if s.active(live)]


def check_stages(names: Iterable[str], cfg: Config | None = None) -> list[str]:
    names = list(names)
    known = [s.name for s in stages_of(cfg)]
    unknown = [n for n in names if n not in known]
    if unknown:
        later = [n for n in unknown if n in STAGE_BY_NAME and rounds.round_of(n) > _live(cfg).rounds]
        gated = [n for n in unknown if n in STAGE_BY_NAME and n not in later]
        if later:
            most = max(rounds.round_of(n) for n in later)
            now = _live(cfg).rounds
            why = f"stage {', '.join(later)} runs only with rounds={most} or more (rounds={now})"
        elif gated:
            why = (
                f"stage {', '.join(gated)} runs only when reward.components names reward_model "
                "(reward=reward_model)"
            )
        else:
            why = f"unknown stage {', '.join(unknown)}"
        raise UnknownStage(f"{why}; stages are {', '.join(known)}")
    return names


def upstream_of(names: Iterable[str], cfg: Config | None = None) -> set[str]:
    """``names`` and every stage they read from under ``cfg`` (None: the default config), transitively."""
    todo, seen = check_stages(names, cfg), set()
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(src for src, _ in active_inputs(STAGE_BY_NAME[name], _live(cfg)).values())
    return seen


def downstream_of(names: Iterable[str], cfg: Config | None = None) -> set[str]:
    """``names`` and every stage that reads from them under ``cfg`` (None: the default config),
    transitively (whatever the order of STAGES)."""
    seen = set(check_stages(names, cfg))
    changed = True
    while changed:
        changed = False
        for stage in stages_of(cfg):
            reads = active_inputs(stage, _live(cfg)).values()
            if stage.name not in seen and any(src in seen for src, _ in reads):
                seen.add(stage.name)
                changed = True
    return seen


def in_dag_order(names: Iterable[str]) -> list[str]:
    """``names`` in DAG order: the chain's stages, then round 2's, round 3's..."""
    wanted = set(names)
    most = max((rounds.round_of(n) for n in wanted), default=1)
    order = [s.name for s in STAGES] + rounds.round_names(most)
    return [n for n in order if n in wanted]


@dataclass(frozen=True)
class Selection:
    """What one ``laminar run``/``rerun`` executes: ``stages`` (None: all of them) and ``force``."""

    stages: list[str] | None
    force: list[str]

    def stages_to_run(self, cfg: Config | None = None) -> list[Stage]:
        """The selected stages that run under ``cfg`` (None: the default config)."""
        return [s for s in stages_of(cfg) if self.stages is None or s.name in self.stages]


def select(
    until: str | None = None, force: Sequence[str] = (), rerun: str | None = None, cfg: Config | None = None
) -> Selection:
    """``until``: only that stage and its upstream. ``rerun``: that stage and its downstream are forced,
    their upstream comes from cache, and stages that neither feed nor follow it are left out. The
    graph is the one ``cfg`` runs (None: the default config's)."""
    force = check_stages(force, cfg)
    stages: set[str] | None = None
    if rerun is not None:
        forced = downstream_of([rerun], cfg)
        force = sorted(set(force) | forced)
        stages = upstream_of(forced, cfg)
    if until is not None:
        up = upstream_of([until], cfg)
        stages = up if stages is None else stages & up
    if stages is not None:
        force = [f for f in force if f in stages]
    return Selection(in_dag_order(stages) if stages is not None else None, in_dag_order(force))


def active_inputs(stage: Stage, cfg: Config | None) -> dict[str, tuple[str, str]]:
    """``stage.inputs`` less those from stages that do not run under ``cfg`` (``Stage.when``) and those
    the stage does not read under it (``Stage.reads``; with no ``cfg``, it may)."""
    return {
        n: (src, out)
        for n, (src, out) in stage.inputs.items()
        if STAGE_BY_NAME[src].active(cfg) and (cfg is None or stage.reads.get(n, _always)(cfg))
    }


def _always(cfg: Config) -> bool:
    return True


def stage_inputs(
    stage: Stage, produced: Mapping[str, Mapping[str, ArtifactRef]], cfg: Config | None = None
) -> dict[str, ArtifactRef] | None:
    """The stage's input artifacts under ``cfg``, from ``produced`` (upstream stage -> its artifacts by
    output name); None when an upstream stage or one of its outputs is missing. With no ``cfg``, an
    input from a stage that runs only under some configs is taken when it was produced."""
    inputs = active_inputs(stage, cfg)
    optional = {n for n, (src, _) in inputs.items() if cfg is None and STAGE_BY_NAME[src].when is not None}
    try:
        return {
            name: produced[src][out]
            for name, (src, out) in inputs.items()
            if name not in optional or src in produced
        }
    except KeyError:
        return None


def missing_upstream(
    stage: Stage, produced: Mapping[str, Mapping[str, ArtifactRef]], cfg: Config | None = None
) -> list[str]:
    """The upstream stages of ``stage`` (under ``cfg``) absent from ``produced``, sorted."""
    return sorted({src for src, _ in active_inputs(stage, cfg).values() if src not in produced})


def stage_key(
    stage: Stage, cfg: Config, inputs: Mapping[str, ArtifactRef], ws: Workspace | None = None
) -> CacheKey:
    return stage.key(cfg, inputs, ws.catalog if ws is not None else None)


def stage_headline(stage: str, metrics: dict) -> str:
    """The stage's one-line metric summary; empty when its metrics lack what the line shows."""
    try:
        return STAGE_BY_NAME[stage].headline(metrics)
    except (KeyError, TypeError, ValueError):
        return ""
