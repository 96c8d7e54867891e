"""The decontamination certificate of a score, from the checkpoint's lineage in the catalog."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from core.catalog import Catalog
from tasks.certificate import certify

H_MATH, H_AIME = "a" * 64, "b" * 64


def _pool(tmp: Path, name: str, benchmarks: dict) -> str:
    folder = tmp / name
    folder.mkdir()
    (folder / "certificate.json").write_text(
        json.dumps({"rules": ["ngram(n=13, min_coverage=0.7)", "paraphrase(...)"], "benchmarks": benchmarks})
    )
    return str(folder)


def _catalog(tmp: Path, *, model_kind: str = "tiny", pool: dict | None = None) -> Catalog:
    """base (B) + decontaminated pool (P, from ingest I) -> warm-up (W) -> RL (R), as the runner
    records it."""
    cat = Catalog(tmp / "catalog.duckdb")
    pool = {"math500": {"sha256": H_MATH, "items": 500, "removed": 0}} if pool is None else pool
    with cat.transaction() as con:
        con.execute(
            "INSERT INTO runs VALUES ('r1', now(), now(), 'completed', 'laminar run', ?, NULL)",
            [json.dumps({"model": {"kind": model_kind}})],
        )
        con.execute(
            "INSERT INTO stage_runs (run_id, stage, status, cache_key) "
            "VALUES ('r1', 'base_model', 'ran', 'kB')"
        )
        for kind, sha, stage, path, key in (
            ("model", "B", "base_model", None, "kB"),
            ("prompts", "I", "ingest", None, "kI"),
            ("prompts", "P", "decontaminate", _pool(tmp, "P", pool), "kP"),
            ("model", "W", "warmup", None, "kW"),
            ("model", "R", "rl", None, "kR"),
            ("selection", "S", "select", None, "kS"),
        ):
            con.execute(
                "INSERT INTO artifacts VALUES (?, ?, ?, now(), ?, ?, '{}')", [kind, sha, path, stage, key]
            )
        for parent, child, stage in (
            ("I", "P", "decontaminate"),
            ("B", "W", "warmup"),
            ("P", "W", "warmup"),
            ("P", "S", "select"),
            ("W", "R", "rl"),
            ("S", "R", "rl"),
        ):
            kinds = {
                "B": "model",
                "W": "model",
                "R": "model",
                "I": "prompts",
                "P": "prompts",
                "S": "selection",
            }
            con.execute(
                "INSERT INTO artifact_edges VALUES (?, ?, ?, ?, ?, 'k')",
                [kinds[parent], parent, kinds[child], child, stage],
            )
    return cat


def test_checked_benchmark_is_clean_and_others_not_checked(tmp_path):
    cat = _catalog(tmp_path)
    certs = certify(cat.query, "R", {"math500": H_MATH, "aime24": H_AIME})
    assert certs["math500"]["status"] == "clean" and certs["math500"]["benchmark_sha256"] == H_MATH
    assert certs["math500"]["pools"] == ["P"] and certs["math500"]["rules"][0].startswith("ngram")
    assert certs["aime24"]["status"] == "not-checked" and "['math500']" in certs["aime24"]["detail"]
    # another version of the file than the pool was checked against
    assert certify(cat.query, "R", {"math500": "c" * 64})["math500"]["status"] == "not-checked"
    # a from-scratch base model learned from nothing
    base = certify(cat.query, "B", {"aime24": H_AIME})["aime24"]
    assert base["status"] == "clean" and "no training data" in base["detail"]


def test_removed_prompts_and_unknown_origins(tmp_path):
    (tmp_path / "a").mkdir()
    removed = _catalog(tmp_path / "a", pool={"math500": {"sha256": H_MATH, "items": 500, "removed": 3}})
    cert = certify(removed.query, "W", {"math500": H_MATH})["math500"]
    assert cert["status"] == "contaminated-removed" and "3 matching" in cert["detail"]

    (tmp_path / "b").mkdir()
    hf = _catalog(tmp_path / "b", model_kind="hf")
    for ckpt in ("W", "R", "B"):
        cert = certify(hf.query, ckpt, {"math500": H_MATH})["math500"]
        assert cert["status"] == "unknown-origin" and "model.path" in cert["detail"]
    outside = certify(hf.query, "X" * 64, {"math500": H_MATH})["math500"]  # `laminar eval ckpt=<folder>`
    assert outside["status"] == "unknown-origin" and "outside the store" in outside["detail"]


def test_a_trained_checkpoint_without_a_checked_pool_is_not_checked(tmp_path):
    cat = _catalog(tmp_path)
    with cat.transaction() as con:
        con.execute("DELETE FROM artifact_edges WHERE parent_sha = 'P'")
    cert = certify(cat.query, "W", {"math500": H_MATH})["math500"]
    assert cert["status"] == "not-checked" and "no decontaminated pool" in cert["detail"]


def _with_reward_model(tmp: Path, cat: Catalog, comparisons: dict) -> None:
    """RL (R) also learned from a reward model (M) trained on comparisons (C, stage ``preferences``,
    their prompts' certificate in ``decontam/``), as the reward_model stages record it."""
    (tmp / "C").mkdir()
    _pool(tmp / "C", "decontam", comparisons)
    with cat.transaction() as con:
        for kind, sha, stage, path in (("comparisons", "C", "preferences", str(tmp / "C")),
                                       ("model", "M", "reward_model", None)):  # fmt: skip
            con.execute(
                "INSERT INTO artifacts VALUES (?, ?, ?, now(), ?, 'k', '{}')", [kind, sha, path, stage]
            )
        for pk, parent, ck, child, stage in (("comparisons", "C", "model", "M", "reward_model"),
                                             ("model", "M", "model", "R", "rl")):  # fmt: skip
            con.execute(
                "INSERT INTO artifact_edges VALUES (?, ?, ?, ?, ?, 'k')", [pk, parent, ck, child, stage]
            )


def test_a_reward_models_preference_prompts_are_a_pool_of_the_certificate(tmp_path):
    for name, comparisons, status in (
        ("checked", {"math500": {"sha256": H_MATH, "items": 500, "removed": 0}}, "clean"),
        ("removed", {"math500": {"sha256": H_MATH, "items": 500, "removed": 2}}, "contaminated-removed"),
        ("unchecked", {}, "not-checked"),
        ("other_file", {"math500": {"sha256": "c" * 64, "items": 500, "removed": 0}}, "not-checked"),
    ):
        (tmp_path / name).mkdir()
        cat = _catalog(tmp_path / name)
        _with_reward_model(tmp_path / name, cat, comparisons)
        cert = certify(cat.query, "R", {"math500": H_MATH})["math500"]
        assert cert["status"] == status and "C" in cert["pools"], (name, cert)
        assert certify(cat.query, "W", {"math500": H_MATH})["math500"]["status"] == "clean"  # no RM there
    assert "pool C" in cert["detail"]


@pytest.mark.parametrize("status", ["clean", "not-checked"])
def test_report_marks_scores_that_are_not_clean(status):
    from evaluation.report import EvalGroup, markdown_benchmark_table

    summary = {
        "n_problems": 2,
        "n_samples": 1,
        "accuracy": 0.5,
        "avg@1": 0.5,
        "maj@1": 0.5,
        "mean_length": 3.0,
        "truncation_rate": 0.0,
        "verifier_errors": 0,
    }
    table = markdown_benchmark_table(
        [EvalGroup("rl", "c" * 64, "e" * 64, "aime24", summary, True, certificate=status)]
    )
    assert ("aime24 (not-checked)" in table) == (status == "not-checked")
