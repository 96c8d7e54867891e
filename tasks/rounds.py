"""Rounds (``rounds=N``, docs/rounds.md): round k >= 2 repeats the curate -> RFT -> RL stages as copies
named ``NAME@k`` whose inputs from the warm-up model come from round k-1's RL model (RLoop's iterative
policy initialisation, expert iteration), whose inputs from the round's own stages come from their
round-k copies, and whose config is round k's (``conf.rounds.round_config``). Round 1 is the chain of
``tasks.dag.STAGES`` itself, unchanged. HIVE's selection in round k also reads round k-1's selection
history and RL rewards (``PRIOR_HISTORY``, ``PRIOR_REWARDS``): the history carries across rounds.

A round stage keeps its base stage's body, record hook and library code (so its source fingerprint is
the base's), and its cache key is its own: its name, its round's config and its own inputs."""

from __future__ import annotations

import functools
import re
from dataclasses import replace

from conf.rounds import round_config
from conf.schema import Config
from tasks.records import Stage, StageContext, StageResult
from tasks.stages.common import MODEL, SELECTION
from tasks.stages.select import PRIOR_HISTORY, PRIOR_REWARDS

ROUND_STAGES = ("difficulty", "dart", "rft", "difficulty_rft", "select", "rl", "eval_rl")
"""The stages each round k >= 2 repeats (in DAG order); round 1 runs them as part of the chain."""
RESTART_FROM = "warmup"
"""The stage whose model round 1 samples with and starts from: round k's reads round k-1's RL model."""
ROUND_MODEL = "rl"
"""The stage whose model ends a round (and starts the next one)."""

_NAME = re.compile(r"^([A-Za-z_]+)@([0-9]{1,3})$")


def at(name: str, k: int) -> str:
    """Round ``k``'s name of stage ``name`` (round 1: the name itself)."""
    return name if k == 1 else f"{name}@{k}"


def parse(name: str) -> tuple[str, int] | None:
    """``rl@2`` -> ("rl", 2); a plain name -> (name, 1); None for a malformed round name (``rl@1``,
    ``rl@x``)."""
    if "@" not in name:
        return name, 1
    m = _NAME.match(name)
    if m is None or int(m.group(2)) < 2 or m.group(1) not in ROUND_STAGES:
        return None
    return m.group(1), int(m.group(2))


def _source(stage: str, src: str, k: int) -> str:
    """Where round ``k``'s copy of ``stage`` takes an input from ``src``: the warm-up model is round
    k-1's RL model; a round stage before ``stage`` is its round-k copy, one at or after it (an input
    from a previous run's stage, such as DART sampling with the RL model) its round k-1 copy."""
    if src == RESTART_FROM:
        return at(ROUND_MODEL, k - 1)
    if src not in ROUND_STAGES:
        return src
    later = ROUND_STAGES.index(src) >= ROUND_STAGES.index(stage)
    return at(src, k - 1 if later else k)


def round_stage(base: Stage, k: int) -> Stage:
    """Round ``k``'s copy of ``base`` (one of ``ROUND_STAGES``)."""
    name = at(base.name, k)
    inputs = {n: (_source(base.name, src, k), out) for n, (src, out) in base.inputs.items()}
    if base.name == "select":
        inputs[PRIOR_HISTORY] = (at("select", k - 1), SELECTION)
        inputs[PRIOR_REWARDS] = (at(ROUND_MODEL, k - 1), MODEL)

    def cfg_of(c: Config) -> Config:
        return round_config(c, k)

    @functools.wraps(base.body)  # keeps __module__: the round copy's source fingerprint is its base's
    def body(ctx: StageContext) -> StageResult:
        return base.body(replace(ctx, cfg=cfg_of(ctx.cfg), stage=name))

    record = None
    if base.record is not None:
        base_record = base.record

        def record(con, ctx: StageContext, res: StageResult, key: str) -> None:
            base_record(con, replace(ctx, cfg=cfg_of(ctx.cfg), stage=name), res, key)

    def when(c: Config) -> bool:
        return c.rounds >= k and base.active(cfg_of(c))

    return replace(
        base,
        name=name,
        inputs=inputs,
        config=lambda c: base.config(cfg_of(c)),
        body=body,
        record=record,
        external=(lambda c, cat: base.external(cfg_of(c), cat)) if base.external is not None else None,
        when=when,
        reads={n: (lambda c, f=f: f(cfg_of(c))) for n, f in base.reads.items()},
        plugins=(lambda c: base.plugins(cfg_of(c))) if base.plugins is not None else None,
        evaluates=at(base.evaluates, k) if base.evaluates else None,
        title=f"{base.title} round {k}" if base.title else "",
        summary=None,
        curation=None,
        warnings=None,
    )


def round_names(rounds: int) -> list[str]:
    """Every round stage's name for ``rounds`` rounds, round by round (round 1's are the chain's)."""
    return [at(n, k) for k in range(2, rounds + 1) for n in ROUND_STAGES]


def round_of(name: str) -> int:
    """The round a stage belongs to (1 for the chain's own stages)."""
    parsed = parse(name)
    return parsed[1] if parsed is not None else 1
