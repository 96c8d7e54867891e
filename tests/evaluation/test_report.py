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
    assert not (tmp_path / "report" / PLOTS["reward_model"]).exists()  # only a run with a reward model
    for name in (PLOTS[k] for k in PLOTS if k not in ("timeline", "reward_model")):
        png = (tmp_path / "report" / name).read_bytes()
        assert png[:4] == b"\x89PNG" and len(png) > 5000


def _with_rm(summary: dict, score: float, best: float) -> dict:
    """A summary as an evaluation scored with a learned reward model leaves it (summary.json)."""
    n = summary["n_samples"]
    return {**summary, "reward/reward_model": score, "reward_errors/reward_model": 0, f"rm_best@{n}": best}


def test_the_report_plots_the_reward_model_per_checkpoint(tmp_path):
    from evaluation.report import plot_reward_model

    level = {"a": "1", "b": "2"}
    warm = summarize_eval_rows(_rows({"a": [True, False], "b": [False, False]}, level))
    rl = summarize_eval_rows(_rows({"a": [True, True], "b": [True, False]}, level))
    evals = [
        EvalGroup("warmup", "w" * 64, "e" * 64, "arith_heldout", _with_rm(warm, -0.4, 0.5), True),
        EvalGroup("rl", "r" * 64, "f" * 64, "arith_heldout", _with_rm(rl, 1.25, 1.0), True),
        EvalGroup("rl", "r" * 64, "g" * 64, "gsm8k", rl, False),  # a `laminar eval` without a reward model
    ]
    drawn = plot_reward_model(evals, tmp_path / "rm.png")
    assert drawn["score"] == {("arith_heldout", "warm-up"): -0.4, ("arith_heldout", "RL"): 1.25}
    assert drawn["best"] == {
        ("arith_heldout warm-up", "avg@n"): 0.25,
        ("arith_heldout warm-up", "maj@n"): 0.5,
        ("arith_heldout warm-up", "rm_best@n"): 0.5,
        ("arith_heldout RL", "avg@n"): 0.75,
        ("arith_heldout RL", "maj@n"): 1.0,
        ("arith_heldout RL", "rm_best@n"): 1.0,
    }
    md = markdown_benchmark_table(evals)
    head, _, warm_row, rl_row, gsm_row = md.splitlines()
    assert head.endswith("| RM score | rm_best@n |")
    assert warm_row.endswith("| -0.400 | 0.500 |") and rl_row.endswith("| 1.250 | 1.000 |")
    assert gsm_row.endswith("| - | - |")
    data = ReportData("run-1", "completed", "laminar run reward=reward_model", [], evals)
    report = write_report(data, tmp_path / "report").read_text()
    section = report.split("## Learned reward model per checkpoint")[1].split("##")[0]
    assert "| warm-up | arith_heldout | 2 | -0.400 | 0.250 | 0.500 | 0.500 | 0 |" in section
    assert "| RL | arith_heldout | 2 | 1.250 | 0.750 | 1.000 | 1.000 | 0 |" in section
    assert "gsm8k" not in section and f"]({PLOTS['reward_model']})" in section
    png = (tmp_path / "report" / PLOTS["reward_model"]).read_bytes()
    assert png[:4] == b"\x89PNG" and len(png) > 5000


def test_a_report_without_a_reward_model_has_no_reward_model_panel(tmp_path):
    rl = summarize_eval_rows(_rows({"a": [True, True], "b": [True, False]}, {"a": "1", "b": "2"}))
    evals = [EvalGroup("rl", "r" * 64, "f" * 64, "arith_heldout", rl, True)]
    assert "RM score" not in markdown_benchmark_table(evals)
    out = tmp_path / "report"
    out.mkdir()
    (out / PLOTS["reward_model"]).write_bytes(b"stale")  # left by an earlier report of the run
    report = write_report(ReportData("run-1", "completed", "laminar run", [], evals), out).read_text()
    assert "reward model" not in report.lower() and "rm_best" not in report
    assert not (out / PLOTS["reward_model"]).exists()
