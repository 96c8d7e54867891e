"""``rounds=N`` (tasks.rounds, conf.rounds): the round copies of the curate -> RFT -> RL stages, their
edges and keys, ``round_overrides``, the selections over them and what the summary lists per round."""

from __future__ import annotations

import pytest

from conf.loader import load_config
from conf.rounds import round_config
from conf.schema import ConfigError
from core.artifacts import ArtifactRef
from tasks.cache import CacheKey
from tasks.dag import STAGES, STAGE_BY_NAME, UnknownStage, active_inputs, select, stages_of
from tasks.records import StageOutcome, StageResult
from tasks.rounds import ROUND_STAGES, parse
from tasks.summary import build_summary, format_table


def fake_inputs(stage, cfg) -> dict[str, ArtifactRef]:
    """One artifact per input, its hash named after the stage and output it comes from."""
    return {
        n: ArtifactRef(kind=out, sha256=f"{src}:{out}".encode().hex()[:64].ljust(64, "0"), path="/x")
        for n, (src, out) in active_inputs(stage, cfg).items()
    }


def keys(cfg) -> dict[str, str]:
    return {s.name: s.key(cfg, fake_inputs(s, cfg)).digest for s in stages_of(cfg)}


def edges(cfg) -> dict[str, dict[str, str]]:
    return {s.name: {n: src for n, (src, _) in active_inputs(s, cfg).items()} for s in stages_of(cfg)}


def test_rounds_one_is_the_chain_with_the_same_keys():
    one = load_config([])
    assert one.rounds == 1
    assert [s.name for s in stages_of(one)] == [s.name for s in STAGES if s.active(one)]
    assert [s.name for s in stages_of(load_config(["rounds=1"]))] == [s.name for s in stages_of(one)]
    chain = {s.name: s.key(one, fake_inputs(s, one)).digest for s in STAGES if s.active(one)}
    assert keys(one) == chain
    # more rounds add stages; round 1's keys stay what they are (rounds enters no key)
    three = keys(load_config(["rounds=3", "round_overrides.2.rl.steps=7"]))
    assert {n: three[n] for n in chain} == chain


def test_three_rounds_expand_to_named_copies_with_round_edges():
    cfg = load_config(["rounds=3"])
    names = [s.name for s in stages_of(cfg)]
    chain = [s.name for s in STAGES if s.active(cfg)]
    assert names == chain + [f"{n}@{k}" for k in (2, 3) for n in ROUND_STAGES]
    e = edges(cfg)
    # round 2 samples with, and starts from, round 1's RL model
    assert e["difficulty@2"]["model"] == e["dart@2"]["model"] == e["rft@2"]["model"] == "rl"
    assert e["dart@2"]["attempts"] == "difficulty@2" and e["rft@2"]["rft_data"] == "dart@2"
    assert e["difficulty_rft@2"]["model"] == "rft@2"
    assert e["select@2"] == {
        "prompts": "decontaminate",
        "attempts": "difficulty_rft@2",
        "prior_history": "select",  # HIVE's history carried from round 1
        "prior_rewards": "rl",
    }
    assert e["rl@2"] == {"model": "rft@2", "selection": "select@2", "dataset": "data"}
    assert e["eval_rl@2"]["model"] == "rl@2"
    # round 3 from round 2's
    assert e["difficulty@3"]["model"] == e["rft@3"]["model"] == "rl@2"
    assert e["select@3"]["prior_history"] == "select@2" and e["select@3"]["prior_rewards"] == "rl@2"
    assert STAGE_BY_NAME["eval_rl@3"].evaluates == "rl@3"
    assert "eval_rft@2" not in names  # a round ends with its RL model's evaluation only
    ks = keys(cfg)
    assert len(set(ks.values())) == len(ks)  # every round's stages cached separately


def test_round_names_parse_and_bad_names_are_refused():
    assert parse("rl@2") == ("rl", 2) and parse("rl") == ("rl", 1)
    assert parse("rl@1") is None and parse("warmup@2") is None and parse("rl@x") is None
    cfg = load_config(["rounds=2"])
    with pytest.raises(UnknownStage, match=r"rl@3 runs only with rounds=3 or more \(rounds=2\)"):
        select(rerun="rl@3", cfg=cfg)
    with pytest.raises(UnknownStage, match="unknown stage warmup@2"):
        select(until="warmup@2", cfg=cfg)
    with pytest.raises(UnknownStage, match="rounds=2 or more"):
        select(until="rl@2")  # the default config has one round


def test_rerun_and_until_of_a_round_stage():
    cfg = load_config(["rounds=3"])
    sel = select(rerun="rl@2", cfg=cfg)
    assert sel.force == ["rl@2", "eval_rl@2", *(f"{n}@3" for n in ROUND_STAGES)]
    assert "select@2" in sel.stages and "eval_rl" not in sel.stages  # upstream from cache, side stages out
    until = select(until="difficulty@2", cfg=cfg).stages
    assert until[-1] == "difficulty@2" and "rl" in until and "eval_rl" not in until


def test_round_overrides_change_only_their_rounds_keys():
    base = load_config(["rounds=3"])
    over = load_config(["rounds=3", "round_overrides.2.curation.rft.steps=7"])
    assert round_config(over, 1) is over and round_config(over, 1).curation.rft.steps == 30
    assert round_config(over, 2).curation.rft.steps == round_config(over, 3).curation.rft.steps == 7
    a, b = keys(base), keys(over)
    changed = {n for n in a if a[n] != b[n]}
    assert changed == {"rft@2", "rft@3"}  # with fake inputs: only the stages that read the setting
    three = load_config(["rounds=3", "round_overrides.3.curation.rft.steps=7"])
    assert {n for n, k in keys(three).items() if a[n] != k} == {"rft@3"}


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["round_overrides.2.rl.steps=7"], "round_overrides.2: rounds are 2..rounds=1"),
        (["rounds=2", "round_overrides.2.rl.stepz=7"], "round_overrides.2: unknown config key 'rl.stepz'"),
        (["rounds=2", "round_overrides.2.rl.steps=-1"], "round_overrides.2: rl.steps=-1 must be >= 0"),
        (["rounds=2", "round_overrides.2.seed=3"], "cannot set rounds, round_overrides or seed"),
        (["rounds=0"], "rounds=0 must be > 0"),
    ],
)
def test_bad_round_settings_fail_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        load_config(overrides)
    assert "\n" not in str(err.value)


def _outcome(stage: str, metrics: dict, artifacts: dict | None = None) -> StageOutcome:
    result = StageResult(artifacts or {}, metrics)
    return StageOutcome(stage, "ran", 1.0, CacheKey(stage, "c", "i", "s", 0), result, None)


def test_summary_lists_each_rounds_rl_checkpoint_and_accuracy():
    def model(sha):
        return {"model": ArtifactRef("model", sha * 64, "/x")}

    def acc(a):
        return {"arith_heldout": {"accuracy": a}}

    outcomes = [
        _outcome("warmup", {}, model("a")),
        _outcome("eval_warmup", acc(0.5)),
        _outcome("rft", {}, model("b")),
        _outcome("eval_rft", acc(0.6)),
        _outcome("rl", {}, model("c")),
        _outcome("eval_rl", acc(0.7)),
        _outcome("rft@2", {}, model("d")),
        _outcome("rl@2", {}, model("e")),
        _outcome("eval_rl@2", acc(0.75)),
        _outcome("rl@3", {}, model("f")),
        _outcome("eval_rl@3", acc(0.8)),
    ]
    s = build_summary("run", outcomes, 1.0)
    assert {k: v[0] for k, v in s.checkpoints.items() if k.startswith("rl")} == {
        "rl": "c",
        "rl@2": "e",
        "rl@3": "f",
    }
    assert s.metrics["heldout_accuracy_rl"] == 0.7
    assert s.metrics["heldout_accuracy_rl@2"] == 0.75 and s.metrics["heldout_accuracy_rl@3"] == 0.8
    assert abs(s.metrics["heldout_accuracy_gain"] - 0.2) < 1e-9  # round 1's, as with one round
    assert "RL 0.700 -> RL round 2 0.750 -> RL round 3 0.800" in format_table(s)
    one = build_summary("run", outcomes[:6], 1.0)
    assert set(one.checkpoints) == {"warmup", "rft", "rl"} and "heldout_accuracy_rl@2" not in one.metrics
