"""Curation on episodes (issue 52, part 4): under a multi-turn ``env`` difficulty and DART sample whole
episodes through the rollout's episode runner, and RFT trains on DART's correct episodes exactly as
they ran: the model's turns (its tool call included) with loss mask 1, the tool's results with 0."""

from __future__ import annotations

import polars as pl
import pytest

from conf.loader import load_config
from conf.schema import ModelConfig
from data_curation.dart import DartParams
from data_curation.sampling import dart_sample, estimate_difficulty
from environments.calculator import Calculator
from generation.model import build_char_tokenizer, build_tiny_model, encode_problem, save_model
from rewards.verifier import Verifier
from training.rft import rft_examples
from training.sft import SFTExample, train_sft
from training.warmup import tool_demonstrations

TEMPLATE = "{problem}\n"
ROWS = [
    {"prompt_id": f"p{i}", "problem": f"What is {i}+{i + 2}-1?", "answer": str(2 * i + 1), "level": 1}
    for i in range(1, 5)
]


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    """A tiny model that learnt (SFT on the calculator's two-turn demonstrations) to call the tool and
    then answer: ``calc: EXPR``, the observation ``= VALUE``, ``#### VALUE``."""
    tmp = tmp_path_factory.mktemp("episodes")
    tok = build_char_tokenizer()
    cfg = ModelConfig(
        hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1, max_seq_len=64
    )
    model = build_tiny_model(cfg, tok, 0)
    env = load_config(["env=calculator", "env.demo_tool_share=1.0"]).env
    plain = [SFTExample(encode_problem(tok, TEMPLATE, r["problem"]), (tok.eos_token_id,)) for r in ROWS]
    demos = tool_demonstrations(plain, ROWS, env, tok)
    assert all(0 in ex.loss_mask for ex in demos)
    m = train_sft(
        model, demos, steps=60, batch_size=4, lr=3e-2, warmup_steps=5, weight_decay=0.0,
        max_grad_norm=1.0, pad_id=tok.pad_token_id, seed=0,
    )  # fmt: skip
    assert m["sft_loss_ema"] < 0.2
    save_model(model, tok, tmp / "lm")
    pl.DataFrame(ROWS).write_parquet(tmp / "prompts.parquet")
    return tmp, tok, env


def _difficulty(tmp, out_name, env, verifier):
    out = tmp / out_name
    out.mkdir()
    m = estimate_difficulty(
        tmp / "lm", tmp / "prompts.parquet", out, samples=4, max_prompts=0, temperature=1.0,
        max_new_tokens=24, template=TEMPLATE, seed=0, device="cpu", verifier=verifier, env=env,
    )  # fmt: skip
    return m, out


def test_rft_on_dart_episodes_keeps_the_tool_call_and_masks_the_tool_result(tool_model):
    tmp, tok, env = tool_model
    with Verifier(timeout_s=5.0) as verifier:
        single, _ = _difficulty(tmp, "single", None, verifier)
        episodic, out = _difficulty(tmp, "episodic", env, verifier)
        # single-turn, a turn that calls the tool has no answer: the tool-using model looks hopeless
        assert single["mean_pass_rate"] < 0.25 and "tool_calls_per_episode" not in single
        assert episodic["mean_pass_rate"] > 0.5 and episodic["tool_calls_per_episode"] > 0.5
        responses = pl.read_parquet(out / "responses.parquet")
        assert responses["tool_calls"].sum() > 0 and set(responses["turns"]) <= {1, 2, 3, 4}
        (tmp / "dart").mkdir()
        params = DartParams(strategy="uniform", k_u=2, k_p=2, max_trials=4, budget=16, round_size=8)
        m = dart_sample(
            tmp / "lm", tmp / "prompts.parquet", out / "attempts.parquet", tmp / "dart", params,
            max_new_tokens=24, temperature=1.0, template=TEMPLATE, seed=0, device="cpu",
            verifier=verifier, env=env,
        )  # fmt: skip
    rows = pl.read_parquet(tmp / "dart" / "rft.parquet").to_dicts()
    assert m["rft_examples"] == len(rows) > 0 and m["rft_tool_episodes"] > 0
    examples = rft_examples(rows, tok, TEMPLATE)
    tool_rows = 0
    for r, ex in zip(rows, examples):
        toks, mask = r["response_tokens"], r["loss_mask"]
        assert len(toks) == len(mask) and tok.decode(toks, skip_special_tokens=True) == r["response"]
        assert ex.response_tokens == tuple(toks) and ex.prompt_tokens == tuple(r["prompt_tokens"])
        labels = ex.labels().tolist()
        assert [lab == -100 for lab in labels] == [m == 0 for m in mask]  # observations carry no loss
        if 0 not in mask:
            continue
        tool_rows += 1
        first_obs = mask.index(0)
        end_obs = first_obs + mask[first_obs:].index(1)
        turn, obs, last = toks[:first_obs], toks[first_obs:end_obs], toks[end_obs:]
        call = tok.decode(turn[:-1])
        assert turn[-1] == tok.eos_token_id and call.startswith("calc: ")  # the model's call: mask 1
        assert tok.decode(obs) == f"\n= {Calculator()(call.removeprefix('calc: '))}\n"  # tool: mask 0
        assert last[-1] == tok.eos_token_id and tok.decode(last[:-1]) == f"#### {r['answer']}"
    assert tool_rows == m["rft_tool_episodes"] > 0
