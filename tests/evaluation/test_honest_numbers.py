"""Numbers that say what they cover: a seeded subset (`eval.max_problems`), prompts longer than the
model's context, plots that never draw an evaluation that did not happen, and every plot naming its
run."""

from __future__ import annotations

import pytest

from evaluation.evaluate import EvalRow, count_too_long, summarize_rows
from evaluation.report import (
    PLOTS,
    EvalGroup,
    ReportData,
    coverage_note,
    format_eval_table,
    markdown_benchmark_table,
    plot_benchmarks,
    plot_levels,
    plot_rl,
    summarize_eval_rows,
    write_report,
)
from evaluation.stages import subset


def _row(pid: str, correct: bool, prompt_length: int, bench: str = "gsm8k", sample: int = 0) -> EvalRow:
    return EvalRow(
        benchmark=bench,
        problem_id=pid,
        sample_idx=sample,
        response="",
        pred=None,
        correct=correct,
        error=None,
        length=5,
        truncated=False,
        level=None,
        prompt_length=prompt_length,
    )


def test_subset_is_seeded_sized_and_in_file_order():
    items = list(range(1319))
    a = subset(items, 100, seed=0, name="gsm8k")
    assert len(a) == 100 == len(set(a)) and a == sorted(a)
    assert a == subset(items, 100, seed=0, name="gsm8k")  # the same problems for every checkpoint
    assert a != subset(items, 100, seed=1, name="gsm8k") and a != subset(items, 100, seed=0, name="math500")
    assert subset(items, 0, seed=0, name="gsm8k") == items == subset(items, 5000, seed=0, name="gsm8k")


def test_too_long_counts_problems_not_samples_and_needs_a_context():
    rows = [
        _row("a", True, 170, sample=0),
        _row("a", False, 170, sample=1),
        _row("b", True, 100, sample=0),
        _row("b", True, 100, sample=1),
        _row("c", False, 161, sample=0),
        _row("c", False, 161, sample=1),
    ]
    assert (
        count_too_long(rows, 160) == 2 and count_too_long(rows, 170) == 0 and count_too_long(rows, None) == 0
    )
    s = summarize_rows(rows, 2, context=160, totals={"gsm8k": 1319})["gsm8k"]
    assert (s["too_long"], s["context"], s["n_problems"], s["problems_total"]) == (2, 160, 3, 1319)
    whole = summarize_rows(rows, 2, context=160, totals={"gsm8k": 3})["gsm8k"]
    assert "problems_total" not in whole  # the full set: nothing to say


def test_every_printed_score_says_what_it_covers():
    rows = [_row("a", True, 170), _row("b", False, 100)]
    s = summarize_rows(rows, 1, context=160, totals={"gsm8k": 1319})
    table = format_eval_table(s)
    assert "2/1319" in table and "1 > 160" in table
    assert "1 of 2 prompts are longer than the model's 160-token context" in table
    assert coverage_note(s["gsm8k"]) == (
        " (2 of 1319 problems (eval.max_problems), 1 prompt longer than the 160-token context)"
    )
    assert coverage_note(summarize_rows(rows, 1, context=1000)["gsm8k"]) == ""
    md = markdown_benchmark_table(
        [EvalGroup("rl", "r" * 64, "e" * 64, "gsm8k", s["gsm8k"] | {"verifier_errors": 0}, True)]
    )
    assert "| 2/1319 |" in md and "| 1 > 160 |" in md


def _summary(correct: list[bool], level: str | None = None) -> dict:
    return summarize_eval_rows(
        [
            {
                "problem_id": str(i),
                "sample_idx": 0,
                "pred": "1",
                "correct": c,
                "error": None,
                "length": 3,
                "truncated": False,
                "level": level,
            }
            for i, c in enumerate(correct)
        ]
    )


def test_plots_draw_no_bar_for_an_evaluation_that_did_not_happen(tmp_path):
    """The RL checkpoint alone was evaluated on gsm8k (`laminar eval`): warm-up and RFT have no gsm8k
    bar at all, where a zero bar would claim they scored 0.00."""
    evals = [
        EvalGroup(
            "warmup", "w" * 64, "a" * 64, "arith_heldout", _summary([True, False], "1"), True, "eval_warmup"
        ),
        EvalGroup("rft", "f" * 64, "b" * 64, "arith_heldout", _summary([True, True], "1"), True, "eval_rft"),
        EvalGroup("rl", "r" * 64, "c" * 64, "arith_heldout", _summary([True, True], "1"), True, "eval_rl"),
        EvalGroup("rl", "r" * 64, "d" * 64, "gsm8k", _summary([False, False, False]), True, "eval"),
        EvalGroup("rl", "r" * 64, "e" * 64, "arith_heldout", _summary([False, True], "2"), False, "eval"),
    ]
    bars = plot_benchmarks(evals, tmp_path / "b.png", "run r1: laminar eval ...")
    assert bars[("gsm8k", "RL")] == 0.0  # a real zero is drawn
    assert ("gsm8k", "warm-up") not in bars and ("gsm8k", "RFT") not in bars
    assert bars[("arith_heldout", "warm-up")] == 0.5 and bars[("arith_heldout", "RFT")] == 1.0
    levels = plot_levels(evals, tmp_path / "l.png")
    assert set(levels) == {
        ("arith_heldout 1", "warm-up"),
        ("arith_heldout 1", "RFT"),
        ("arith_heldout 1", "RL"),
    }
    md = markdown_benchmark_table(evals)
    tags = [line.split("|")[4].strip() for line in md.splitlines()[2:]]
    # only `laminar eval`s that are not the run's own are tagged as such
    assert tags == ["a" * 12, "b" * 12, "c" * 12, "d" * 12, "e" * 12 + " (laminar eval)"]
    other = EvalGroup("rl", "r" * 64, "f" * 64, "arith_heldout", _summary([True]), False, "eval_rl")
    assert other.tag() == " (eval_rl, another run)"


def test_rl_plot_names_a_reward_that_is_the_accuracy_once_and_shows_the_final_eval(tmp_path):
    same = {
        "reward": [(1, 0.2), (2, 0.5)],
        "accuracy": [(1, 0.2), (2, 0.5)],
        "eval_arith_heldout": [(2, 0.4)],
        "response_length": [(1, 20.0), (2, 18.0)],
    }
    labels = plot_rl(same, tmp_path / "a.png", final_eval={"arith_heldout": 0.45})
    assert labels == [
        "reward = training accuracy (no shaping)",
        "held-out eval (in run): arith_heldout",
        "final held-out eval (eval_rl): arith_heldout 0.450",
    ]
    shaped = {**same, "reward": [(1, 0.1), (2, 0.4)]}
    assert plot_rl(shaped, tmp_path / "b.png")[:2] == ["reward", "training accuracy"]


@pytest.mark.parametrize(
    "command, shown",
    [
        ("laminar run rl.lr=3e-4 --workspace /w", "run run-1: laminar run rl.lr=3e-4"),
        ("laminar run", "run run-1: laminar run (default config)"),
        (
            "laminar eval ckpt=abc 'eval.benchmarks=[gsm8k]' --workspace=/w",
            "run run-1: laminar eval ckpt=abc eval.benchmarks=[gsm8k]",
        ),
    ],
)
def test_every_plot_carries_the_run_id_and_its_overrides(tmp_path, command, shown, monkeypatch):
    assert ReportData("run-1", "completed", command).caption == shown
    import evaluation.report as report

    captions = []
    real = report._caption
    monkeypatch.setattr(
        report, "_caption", lambda fig, caption: captions.append(caption) or real(fig, caption)
    )
    write_report(ReportData("run-1", "completed", command), tmp_path / "r")
    assert captions == [shown] * 3 and all(
        (tmp_path / "r" / PLOTS[k]).exists() for k in ("benchmarks", "rl", "levels")
    )
