"""Curation through the real CLI: a copy of a real pool with planted malformed rows, duplicates and
benchmark problems; every planted row is caught, the reconciliation adds up, and the decisions are
in the catalog with their reasons."""

import json

import duckdb
import pytest
from test_cli import ROOT, laminar, latest_summary

pytestmark = pytest.mark.e2e

TINY = [
    "sft.steps=5",
    "sft.batch_size=8",
    "model.max_seq_len=1024",
    "curation.difficulty.max_prompts=16",
    "curation.difficulty.samples=2",
    "curation.difficulty.max_new_tokens=8",
    "eval.n_samples=1",
]


def _planted_pool(path):
    math = json.loads((ROOT / "data_curation/data/math_train.json").read_text())[:150]
    gsm = [
        json.loads(line) for line in (ROOT / "evaluation/data/gsm8k_test.jsonl").read_text().splitlines()[:3]
    ]
    m500 = [
        json.loads(line)
        for line in (ROOT / "evaluation/data/math500_test.jsonl").read_text().splitlines()[:2]
    ]
    lines = [json.dumps({"problem": r["problem"], "answer": r["answer"]}) for r in math]
    lines += [
        '{"problem": "What is 2+2?", "answer": ',  # bad JSON
        json.dumps({"answer": "3"}),  # missing problem
        json.dumps({"problem": "Compute 7 times 6.", "answer": ""}),
    ]  # empty answer
    lines += [
        json.dumps({"problem": math[0]["problem"], "answer": math[0]["answer"]}),  # exact duplicate
        json.dumps({"problem": "  " + math[1]["problem"].upper() + " ", "answer": math[1]["answer"]}),
    ]
    lines += [
        json.dumps({"problem": g["question"], "answer": g["answer"].split("####")[-1].strip()}) for g in gsm
    ]
    lines += [json.dumps({"problem": m["problem"], "answer": m["answer"]}) for m in m500]
    data = "\n".join(lines).encode() + b"\n" + b'{"problem": "bad \xff\xfe bytes", "answer": "1"}\n'
    path.write_bytes(data)
    return {"rows_in": len(lines) + 1, "quarantined": 4, "duplicates": 2, "contaminated": 5, "clean": 150}


def test_planted_rows_are_caught_and_reconciled(tmp_path):
    pool = tmp_path / "pool.jsonl"
    expect = _planted_pool(pool)
    ws = tmp_path / "ws"
    proc = laminar(
        "run",
        "data.source=files",
        f"data.sources=[{{name: planted, path: {pool}, format: jsonl}}]",
        "eval.benchmarks=[gsm8k,math500]",
        *TINY,
        "--until",
        "select",
        ws=ws,
    )
    assert "curation: rows in" in proc.stdout
    c = latest_summary(ws)["curation"]
    assert c["rows_in"] == expect["rows_in"]
    assert c["quarantined"] == expect["quarantined"] and c["duplicates"] == expect["duplicates"]
    assert c["contaminated"] == expect["contaminated"]
    assert c["rows_in"] == c["ingested"] + c["quarantined"] + c["duplicates"]
    assert c["ingested"] - c["contaminated"] == expect["clean"]
    con = duckdb.connect(str(ws / "catalog.duckdb"), read_only=True)
    reasons = sorted(r[0].split(":")[0] for r in con.execute("SELECT reason FROM quarantine").fetchall())
    assert (
        len(reasons) == 4 and any("json" in r for r in reasons) and any("undecodable" in r for r in reasons)
    )
    assert (
        sorted(r[0] for r in con.execute("SELECT benchmark FROM contamination").fetchall())
        == ["gsm8k"] * 3 + ["math500"] * 2
    )
    assert con.execute("SELECT count(*) FROM duplicates WHERE kind = 'exact'").fetchone()[0] == 2
    assert con.execute("SELECT count(*) FROM attempts").fetchone()[0] == 16
    assert con.execute("SELECT count(*) FROM selections").fetchone()[0] == 16
    stages = set(latest_summary(ws)["stages"])
    assert "select" in stages and "rl" not in stages and "eval_rl" not in stages


def test_math_preset_config_resolves_sources():
    proc = laminar("config", "data=math", ws=ROOT / "workspace-unused")
    assert "math_train" in proc.stdout and "data_curation/data/math_train.json" in proc.stdout
