"""RL trains on the composed reward: every component's mean lands in each step's history line, and
every response's score per component in the RL records and the catalog."""

import duckdb
import pytest
import torch
from rl_fakes import MICRO, Verdict, saved_model

from conf.schema import RewardComponentConfig, RewardConfig, RLConfig
from core.artifacts import ArtifactRef
from core.catalog import SCHEMA
from generation.model import build_char_tokenizer, build_tiny_model, encode_prompt
from generation.records import PromptItem
from rewards.compose import Reward
from tasks.stages.rl import record_reward
from training.objectives import PRESETS
from training.rl.drivers.local import LocalDriver
from training.rl.loop import rl_reward
from training.rl.stage import write_rl_records
from training.rl.sections import RLSections

COMPONENTS = ("math_verify", "cosine_length", "repetition")


class StartsWithDigit:
    def verify_batch(self, responses, golds):
        return [Verdict(r[:1].isdigit()) for r in responses]


def _run(tmp_path):
    torch.manual_seed(0)
    tok = build_char_tokenizer()
    model = build_tiny_model(MICRO, tok, seed=0)
    prompts = [PromptItem(f"p{i}", f"q{i}", "7", encode_prompt(tok, f"q{i}\n"), 1) for i in range(4)]
    cfg = RewardConfig(
        components=[
            RewardComponentConfig.of(name="math_verify"),
            RewardComponentConfig.of(name="cosine_length", weight=0.5),
            RewardComponentConfig.of(name="repetition", ngram=1),
        ]
    )
    reward = rl_reward(Reward.of(StartsWithDigit(), cfg), PRESETS["grpo"])
    rl = RLConfig(steps=3, prompts_per_step=4, group_size=4, lr=1e-2, max_new_tokens=6, micro_batch_tokens=0)
    driver = LocalDriver(
        saved_model(tmp_path, model, tok),
        prompts,
        reward,
        PRESETS["grpo"],
        RLSections(rl, seed=0),
        device="cpu",
    )
    return driver.run(), reward


def test_each_components_mean_is_in_every_step_and_each_response_in_the_catalog(tmp_path):
    result, reward = _run(tmp_path)
    assert len(result.history) == 3
    by_step = {}
    for step, _pid, _idx, name, value in result.terms:
        by_step.setdefault((step, name), []).append(value)
    for m in result.history:
        d = m.as_dict()
        for name in COMPONENTS:
            values = by_step[(m.step, name)]
            assert d[f"reward/{name}"] == pytest.approx(sum(values) / len(values))
            assert d[f"reward_errors/{name}"] == 0.0
        assert m.reward == pytest.approx(sum(by_step[(m.step, "total")]) / len(by_step[(m.step, "total")]))
        assert m.reward == pytest.approx(
            d["reward/math_verify"] + 0.5 * d["reward/cosine_length"] + d["reward/repetition"]
        )
        assert "cosine_length" in m.line(3)

    out = tmp_path / "out"
    out.mkdir()
    write_rl_records(result, out, reward)
    con = duckdb.connect()
    con.execute(SCHEMA)
    record_reward(con, ArtifactRef("model", "c" * 64, str(out)))
    rows = con.execute(
        "SELECT component, weight, correctness FROM reward_components WHERE checkpoint_sha = ? "
        "ORDER BY position",
        ["c" * 64],
    ).fetchall()
    assert rows == [("math_verify", 1.0, True), ("cosine_length", 0.5, False), ("repetition", 1.0, False)]
    means = dict(
        con.execute(
            "SELECT component, avg(value) FROM reward_terms WHERE step = ? GROUP BY component",
            [result.history[-1].step],
        ).fetchall()
    )
    last = result.history[-1].as_dict()
    assert set(means) == {*COMPONENTS, "total"}
    for name in COMPONENTS:
        assert means[name] == pytest.approx(last[f"reward/{name}"])
    n = con.execute("SELECT count(*) FROM reward_terms").fetchone()[0]
    assert n == len(result.terms) == 4 * 3 * 4 * 4  # steps x prompts x responses x (3 terms + total)


def _old_overlong(n, max_len, cache_len):
    """The old ``training.objectives.overlong_penalty`` on one length (float32, as it computed)."""
    lengths = torch.tensor([n], dtype=torch.float32)
    ramp = ((max_len - cache_len) - lengths) / cache_len
    return float(torch.where(lengths > max_len, -1.0, ramp.clamp(max=0.0))[0])


@pytest.mark.parametrize("algorithm", ["grpo", "dapo"])
def test_the_default_reward_scores_a_fixed_batch_as_before(algorithm):
    from conf.loader import load_config
    from generation.records import Trajectory
    from rewards.verifier import Verifier
    from training.rl.loop import score_phase
    from training.rl.stage import objective_params

    cfg = load_config([f"rl.algorithm={algorithm}"])
    params = objective_params(cfg.rl)
    tok = build_char_tokenizer()
    p = PromptItem("p0", "1+2", "3", encode_prompt(tok, "1+2\n"), 1)
    texts = ["#### 3", "#### 4", "1+2=3 #### 3", "no answer", "\\boxed{3.0}", "#### 03"]
    lengths = [6, 40, 50, 64, 58, 12]
    trajs = [
        Trajectory("trajectory", p, i, tuple([5] * n), tuple([0.0] * n), 0, n < 64, t)
        for i, (t, n) in enumerate(zip(texts, lengths))
    ]
    with Verifier() as verifier:  # the fast path decides all of these
        (g,) = score_phase(trajs, rl_reward(Reward.of(verifier, cfg.reward), params), cfg.rl.max_new_tokens)
        verdicts = verifier.verify_batch(texts, ["3"] * len(texts))
    shaping = [
        _old_overlong(n, cfg.rl.max_new_tokens, params.overlong_cache_len) if params.overlong_shaping else 0.0
        for n in lengths
    ]
    assert g.rewards == tuple(v.reward + s for v, s in zip(verdicts, shaping))
    assert g.correct == tuple(v.correct for v in verdicts) == (True, False, True, False, True, True)
