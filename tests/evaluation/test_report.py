"""evaluation.report on hand-made records: summaries from catalog rows, tables and plot files."""

from __future__ import annotations

from evaluation.report import (
    PLOTS,
    EvalGroup,
    ReportData,
    format_eval_table,
    markdown_benchmark_table,
    summarize_eval_rows,
    write_report,
)


def _rows(correct_by_problem: dict[str, list[bool]], level: dict[str, str]) -> list[dict]:
    return [
        {
            "problem_id": pid,
            "sample_idx": i,
            "pred": "3" if c else "4",
            "correct": c,
            "error": None,
            "length": 10 + i,
            "truncated": i == 0,
            "level": level[pid],
        }
        for pid, cs in correct_by_problem.items()
        for i, c in enumerate(cs)
    ]


def test_summary_from_rows_matches_hand_computed():
    s = summarize_eval_rows(_rows({"a": [True, False], "b": [False, False]}, {"a": "1", "b": "2"}))
    assert s["n_samples"] == 2 and s["n_problems"] == 2
    assert s["accuracy"] == s["avg@2"] == 0.25
    assert s["pass@1"] == 0.25 and s["pass@2"] == 0.5
    assert s["truncation_rate"] == 0.5 and s["mean_length"] == 10.5
    assert s["by_level"] == {"1": {"avg@2": 0.5, "count": 1}, "2": {"avg@2": 0.0, "count": 1}}
    assert s["verifier_errors"] == 0


def test_tables_and_plots(tmp_path):
    level = {"a": "1", "b": "2"}
    warm = summarize_eval_rows(_rows({"a": [True, False], "b": [False, False]}, level))
    rl = summarize_eval_rows(_rows({"a": [True, True], "b": [True, False]}, level))
    evals = [
        EvalGroup("warmup", "w" * 64, "e" * 64, "arith_heldout", warm, True),
        EvalGroup("rl", "r" * 64, "f" * 64, "arith_heldout", rl, True),
        EvalGroup("rl", "r" * 64, "g" * 64, "gsm8k", rl, False),
    ]
    text = format_eval_table({"arith_heldout": rl})
    assert "avg@2" in text and "0.750" in text and "by level: 1 1.000" in text
    md = markdown_benchmark_table(evals)
    assert md.count("\n") == 4 and "(laminar eval)" in md
    data = ReportData(
        "run-1",
        "completed",
        "laminar run",
        [{"stage": "rl", "status": "ran", "seconds": 1.5}],
        evals,
        {"reward": [(1, 0.1), (2, 0.3)], "response_length": [(1, 20.0), (2, 18.0)]},
    )
    path = write_report(data, tmp_path / "report")
    assert path.read_text().startswith("# Laminar run run-1")
    assert not (tmp_path / "report" / PLOTS["timeline"]).exists()  # only a Ray-runtime RL run has a timeline
    for name in (PLOTS[k] for k in PLOTS if k != "timeline"):
        png = (tmp_path / "report" / name).read_bytes()
        assert png[:4] == b"\x89PNG" and len(png) > 5000
