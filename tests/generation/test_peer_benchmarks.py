"""The peer benchmarks' bookkeeping (benchmarks/trl_peer.py --model, benchmarks/vllm_cpu.py
--decode-table) without TRL or vLLM: the inputs a real-model run resolves, the ratios it reports, and
the log-prob gap's token alignment (the built-in engine against the trainer on a tiny model)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def _args(**kw):
    base = dict(model=None, workspace=None, model_dir=None, prompts=None)
    base.update(prompts_per_step=None, group_size=None, max_new_tokens=None)
    return argparse.Namespace(**{**base, **kw})


class _Parser:
    def error(self, msg):
        raise SystemExit(msg)


def test_trl_peer_model_mode_takes_the_recipes_sizes_and_refuses_a_bad_folder(tmp_path):
    from benchmarks import trl_peer

    with pytest.raises(SystemExit, match="one of smollm2"):
        trl_peer.resolve_inputs(_Parser(), _args(model=["gpt2", str(tmp_path)]))
    with pytest.raises(SystemExit, match="no model.safetensors"):
        trl_peer.resolve_inputs(_Parser(), _args(model=["smollm2", str(tmp_path)]))
    (tmp_path / "model.safetensors").write_bytes(b"")
    args = _args(model=["smollm2", str(tmp_path)], group_size=4)
    trl_peer.resolve_inputs(_Parser(), args)
    rl = yaml.safe_load((ROOT / "conf/recipe/smollm2_arith.yaml").read_text())["rl"]
    assert (args.prompts_per_step, args.group_size, args.max_new_tokens) == (rl["prompts_per_step"], 4, 24)
    assert args.model_dir == tmp_path


def test_trl_peer_ratios_are_each_variant_over_trl():
    from benchmarks import trl_peer

    run = dict(median_step_s=2.0, step_tokens_per_s=10.0, gen_tokens_per_s=20.0, update_tokens_per_s=5.0)
    runs = [{**run, "variant": "trl"}, {**run, "variant": "laminar", "median_step_s": 1.0}]
    runs[1].update(step_tokens_per_s=30.0, gen_tokens_per_s=40.0, update_tokens_per_s=20.0)
    summary, ratios = trl_peer.summarize(["trl", "laminar"], runs)
    assert summary["trl"]["median_step_s"] == 2.0
    assert ratios["laminar"] == {
        "step_tokens_per_s": 3.0,
        "gen_tokens_per_s": 2.0,
        "update_tokens_per_s": 4.0,
        "seconds_per_step": 2.0,
    }


def test_decode_table_log_prob_gap_aligns_the_sampled_tokens(tmp_path):
    """The engine's behaviour log-probs against the trainer on the same tokens: float32 agrees to
    rounding, so a gap above that is a misalignment of tokens and log-probs."""
    import torch

    from benchmarks import vllm_cpu
    from benchmarks.engine_smollm2 import prompts
    from generation.model import load_model

    torch.set_num_threads(1)
    model, tok = load_model(vllm_cpu.build_dir("tiny_vllm", tmp_path / "m"), "cpu")
    items = prompts(tok, "{problem}\n", 3)
    samples = vllm_cpu.engine_samples(model.eval(), tok, items, 6, "float32")
    assert [len(t) for t, _ in samples] == [6, 6, 6]
    gap = vllm_cpu.logprob_gap(model, samples, [list(p.prompt_tokens) for p in items])
    assert gap["tokens"] == 18
    assert gap["abs_diff_max"] < 1e-4
    shifted = [(t, b[1:] + b[:1]) for t, b in samples]  # log-probs one token off
    assert vllm_cpu.logprob_gap(model, shifted, [list(p.prompt_tokens) for p in items])["abs_diff_max"] > 1e-3


def test_decode_table_times_the_engine_in_both_dtypes_and_leaves_the_cast_to_the_caller(tmp_path):
    """``engine_tps`` (the engine's column of the decode table) runs on the helpers
    ``benchmarks/engine_smollm2.py`` has now: a rename there broke the table once, unseen by any test."""
    import torch

    from benchmarks import vllm_cpu
    from benchmarks.engine_smollm2 import prompts
    from generation.model import load_model

    torch.set_num_threads(1)
    model, tok = load_model(vllm_cpu.build_dir("tiny_vllm", tmp_path / "m"), "cpu")
    items = prompts(tok, "{problem}\n", 2)
    for dtype in ("float32", "bfloat16"):
        assert vllm_cpu.engine_tps(model.eval(), tok, items, 4, dtype, 1) > 0
        assert next(model.parameters()).dtype == getattr(torch, dtype)
        model.float()
