"""``rounds=2`` through the real CLI on a micro config: round 2 samples with round 1's RL model, the
summary lists each round's RL checkpoint and accuracy, ``laminar rerun rl@2`` reruns only rl@2 and what
follows, a round-2 setting (``round_overrides.2...``) makes ``laminar status`` show only round 2 stale
and reruns only round 2, lineage of the last checkpoint walks through both rounds, and the report
plots accuracy per round."""

from __future__ import annotations

import json

import duckdb
import polars as pl
import pytest

from tests.configs import TINY_CURATED
from tests.e2e.test_operate import latest_summary, laminar
from tasks.rounds import ROUND_STAGES

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # four tiny runs: about 4 minutes on 2 loaded cores

TWO = [*TINY_CURATED, "rounds=2"]
ROUND2 = [f"{n}@2" for n in ROUND_STAGES]


def statuses(summary: dict) -> dict[str, str]:
    return {k: v["status"] for k, v in summary["stages"].items()}


def status_lines(ws, *overrides: str) -> dict[str, str]:
    out = laminar("status", *overrides, ws=ws).stdout
    return {line.split()[0]: line for line in out.strip().splitlines()}


def test_two_rounds_rerun_round_setting_lineage_and_report(tmp_path):
    ws = tmp_path / "ws"
    laminar("run", *TWO, ws=ws)
    first = latest_summary(ws)
    assert set(ROUND2) <= set(first["stages"])
    ck = first["checkpoints"]
    assert {k for k in ck if k.startswith("rl")} == {"rl", "rl@2"}
    assert {"heldout_accuracy_rl", "heldout_accuracy_rl@2"} <= set(first["metrics"])
    # round 2 samples with round 1's RL model and its RFT starts from it (what each key was made of)
    con = duckdb.connect(str(ws / "catalog.duckdb"), read_only=True)
    try:
        for stage in ("difficulty@2", "dart@2", "rft@2"):
            key = first["stages"][stage]["cache_key"]
            (inputs,) = con.execute(
                "SELECT inputs_json FROM stage_lineage WHERE cache_key = ?", [key]
            ).fetchone()
            assert json.loads(inputs)["model"]["sha256"] == ck["rl"] != ck["warmup"], stage
    finally:
        con.close()
    # HIVE's history carried: select@2's history holds round 1's RL group rewards before its own rows
    sel2 = first["stages"]["select@2"]["artifacts"]["selection"]
    history = pl.read_parquet(ws / "artifacts" / "selection" / sel2 / "history.parquet")
    rewards = pl.read_parquet(ws / "artifacts" / "model" / ck["rl"] / "rewards.parquet")
    assert history.filter(pl.col("origin") == "rl").height == rewards.height > 0
    lineage = json.loads(laminar("lineage", ck["rl@2"], "--json", ws=ws).stdout)
    walked = [s["stage"] for s in lineage["stages"]]
    assert {"warmup", "rft", "rl", "difficulty@2", "dart@2", "rft@2", "select@2", "rl@2"} <= set(walked)
    assert walked.index("rl") < walked.index("difficulty@2")

    # rerun rl@2: it and what follows run, everything before it comes from cache
    laminar("rerun", "rl@2", *TWO, ws=ws)
    ran = {k for k, v in statuses(latest_summary(ws)).items() if v == "ran"}
    assert ran == {"rl@2", "eval_rl@2"}

    # a round-2 setting: status shows round 1 cached and round 2 stale from the stage that reads it
    changed = [*TWO, "round_overrides.2.curation.rft.steps=7"]
    lines = status_lines(ws, *changed)
    stale = {n for n, line in lines.items() if line.split()[1] == "stale"}
    assert stale == {"rft@2", "difficulty_rft@2", "select@2", "rl@2", "eval_rl@2"}, lines
    assert "config (round_overrides.2.curation.rft.steps 5 -> 7)" in lines["rft@2"], lines["rft@2"]
    laminar("run", *changed, ws=ws)
    got = statuses(latest_summary(ws))
    ran = {k for k, v in got.items() if v == "ran"}
    # rft@2 reruns; after it, a stage whose inputs came out the same (content-addressed) is cached
    assert "rft@2" in ran and ran <= stale, got
    assert all(v == "cached" for k, v in got.items() if "@" not in k), got

    laminar("report", ws=ws)
    report = next((ws / "runs").glob("*/report/rounds.png"))
    assert report.stat().st_size > 0
    assert "## Rounds" in (report.parent / "report.md").read_text()
