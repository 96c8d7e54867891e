"""A file benchmark's ``score_with``: the components beside the correctness verdict are scored per
response and reported per benchmark as ``reward/<name>`` (and their fallbacks counted), the verdict
stays the verifier's."""

from __future__ import annotations

from types import SimpleNamespace

from evaluation.benchmarks import BenchmarkItem
from evaluation.evaluate import EvalRow, _terms, summarize_rows
from generation.records import PromptItem, Trajectory
from rewards.components import repeated_ngram_rate


def _traj(text: str, answer: str, n: int):
    prompt = PromptItem("p", "", answer, (1,))
    return Trajectory("trajectory", prompt, 0, (0,) * n, (0.0,) * n, 0, True, text)


def test_score_with_components_are_scored_per_row_and_summarised_per_benchmark():
    items = [BenchmarkItem("mine", "a", "1+1", "2"), BenchmarkItem("other", "b", "2+2", "4")]
    texts = ["the the the the the \\boxed{2}", "no answer here", "\\boxed{4}", "\\boxed{5}"]
    trajs = [_traj(t, items[i // 2].answer, 8) for i, t in enumerate(texts)]
    verdicts = [SimpleNamespace(correct=c) for c in (True, False, True, False)]
    terms = _terms(items, 2, trajs, verdicts, {"mine": ("math_verify", "repetition", "format")}, 16)
    assert [t[0] for t in terms[0]] == ["repetition", "format"] and terms[2] == terms[3] == ()
    rep0 = dict((n, x) for n, x, _ in terms[0])["repetition"]
    assert rep0 < 0 and repeated_ngram_rate(texts[0], 3) > 0  # the repeated words are penalised
    assert dict((n, x) for n, x, _ in terms[1])["format"] < dict((n, x) for n, x, _ in terms[0])["format"]
    rows = [
        EvalRow(
            it.benchmark, it.problem_id, s, texts[2 * k + s], None, v.correct, None, 8, False, None, terms=tm
        )
        for k, it in enumerate(items)
        for s, v, tm in ((s, verdicts[2 * k + s], terms[2 * k + s]) for s in range(2))
    ]
    summary = summarize_rows(rows, 2)
    mine = summary["mine"]
    assert mine["accuracy"] == 0.5  # the verdict is the verifier's, not a shaping term's
    assert (
        mine["reward/repetition"] == sum(dict((n, x) for n, x, _ in t)["repetition"] for t in terms[:2]) / 2
    )
    assert mine["reward_errors/format"] == 0
    assert not any(k.startswith("reward/") for k in summary["other"])


def test_a_component_that_fails_on_a_row_gives_its_fallback_and_is_counted():
    items = [BenchmarkItem("mine", "a", "1+1", "2")]
    trajs = [_traj("\\boxed{2}", "2", 4), _traj("\\boxed{2}", "2", 0)]
    verdicts = [SimpleNamespace(correct=True)] * 2
    # cosine_length with the default limit (the generation's max_new_tokens): 0 means no limit -> fails
    terms = _terms(items, 2, trajs, verdicts, {"mine": ("cosine_length",)}, 0)
    assert all(t[0][2] for t in terms)  # both failed: no length limit
    rows = [
        EvalRow("mine", "a", s, "\\boxed{2}", "2", True, None, 4, False, None, terms=terms[s])
        for s in range(2)
    ]
    assert summarize_rows(rows, 2)["mine"]["reward_errors/cosine_length"] == 2


class _LengthScorer:
    """A stand-in reward model: scores the longer response higher (one built component)."""

    name = "reward_model"
    fallback = 0.0

    def score(self, samples, correct):
        return [float(len(s.text)) + (0.5 if s.prompt == "1+1" else 0.0) for s in samples]


def test_a_reward_model_scores_every_benchmark_and_reranks_best_of_n():
    items = [BenchmarkItem("mine", "a", "1+1", "2"), BenchmarkItem("other", "b", "2+2", "4")]
    texts = ["\\boxed{3}", "so \\boxed{2}", "the answer \\boxed{5}", "\\boxed{4}"]
    trajs = [_traj(t, items[i // 2].answer, 8) for i, t in enumerate(texts)]
    verdicts = [SimpleNamespace(correct=c) for c in (False, True, False, True)]
    terms = _terms(items, 2, trajs, verdicts, {}, 16, [_LengthScorer()])
    assert [t[0][1] for t in terms] == [9.5, 12.5, 20.0, 9.0]  # each reads its own problem
    rows = [
        EvalRow(
            it.benchmark,
            it.problem_id,
            s,
            texts[2 * k + s],
            None,
            verdicts[2 * k + s].correct,
            None,
            8,
            False,
            None,
            terms=terms[2 * k + s],
        )  # fmt: skip
        for k, it in enumerate(items)
        for s in range(2)
    ]
    summary = summarize_rows(rows, 2)
    assert summary["mine"]["rm_best@2"] == 1.0  # the longer response is the right one
    assert summary["other"]["rm_best@2"] == 0.0  # here the longer one is wrong
    assert summary["mine"]["avg@2"] == summary["other"]["avg@2"] == 0.5
    assert summary["other"]["reward/reward_model"] == 14.5


def test_reranked_accuracy_breaks_ties_by_the_first_sample():
    from evaluation.metrics import reranked_accuracy

    rows = [
        {"problem_id": "a", "sample_idx": 1, "correct": True, "terms": (("rm", 1.0, False),)},
        {"problem_id": "a", "sample_idx": 0, "correct": False, "terms": (("rm", 1.0, False),)},
        {"problem_id": "b", "sample_idx": 0, "correct": True, "terms": (("rm", -2.0, False),)},
        {"problem_id": "b", "sample_idx": 1, "correct": False, "terms": ()},
    ]
    assert reranked_accuracy(rows, "rm") == 0.5


def test_eval_metrics_carry_the_reward_model_columns_only_with_a_reward_model():
    from tasks.stages.evaluate import eval_metrics

    base = {"accuracy": 0.5, "mean_length": 3.0, "maj@2": 0.5, "n_problems": 2}
    plain = eval_metrics("sha", {"mine": base}, 2)["mine"]
    assert "maj@2" not in plain and "rm_best@2" not in plain
    scored = eval_metrics("sha", {"mine": {**base, "reward/reward_model": 0.1, "rm_best@2": 1.0}}, 2)["mine"]
    assert (scored["reward/reward_model"], scored["rm_best@2"], scored["maj@2"]) == (0.1, 1.0, 0.5)


def test_eval_metrics_carry_episode_tool_metrics_when_the_evaluation_ran_episodes():
    from tasks.stages.evaluate import eval_metrics

    base = {"accuracy": 0.5, "mean_length": 3.0, "n_problems": 2}
    assert "tool_calls_per_episode" not in eval_metrics("sha", {"mine": base}, 2)["mine"]
    episodes = {"tool_calls_per_episode": 0.9, "tool_errors_per_episode": 0.01, "turns_per_episode": 1.9}
    got = eval_metrics("sha", {"mine": {**base, **episodes}}, 2)["mine"]
    assert {k: got[k] for k in episodes} == episodes
