"""The trainer's shared-prompt packed forward (``packed_response_logits``, the default) against the
padded one it replaced (``response_logits``): the same logits, loss, gradient norm and updated weights
up to float rounding, on groups that share prompts, with ragged prompts and responses."""

import copy
import random

import torch

from conf.schema import ModelConfig
from generation.engine import Engine
from generation.model import build_char_tokenizer, build_tiny_model, encode_prompt
from generation.records import GenRequest, PromptItem, ScoredGroup
from training.objectives import PRESETS
from training.rl import trainer as trainer_mod
from training.rl.trainer import (
    PolicyTrainer,
    build_batch,
    packed_layout,
    packed_response_logits,
    response_logits,
)

SMALL = ModelConfig(
    hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=128
)


def _groups(model, tok, n_prompts=5, group=4, seed=0):
    items = [
        PromptItem(f"p{i}", "", "", encode_prompt(tok, f"{i}+{i % 3}=?\n" + "y" * (i % 4)))
        for i in range(n_prompts)
    ]
    engine = Engine(copy.deepcopy(model), tok)
    engine.eos_id = tok.convert_tokens_to_ids("1")  # a frequent token: ragged response lengths
    trajs = engine.generate([GenRequest(p, s) for p in items for s in range(group)], 20, 1.0, seed=seed)
    rng = random.Random(seed)
    return [
        ScoredGroup(
            "scored_group",
            p.prompt_id,
            tuple(trajs[g * group : (g + 1) * group]),
            tuple(float(rng.random() < 0.5) for _ in range(group)),
            tuple(False for _ in range(group)),
        )
        for g, p in enumerate(items)
    ]


def test_packed_logits_equal_padded_logits():
    tok = build_char_tokenizer()
    model = build_tiny_model(SMALL, tok, seed=0).eval()
    groups = _groups(model, tok)
    batch = build_batch(groups, tok.pad_token_id)
    ids, pos, mask, gather = packed_layout(batch)
    assert ids.numel() < batch.input_ids.numel() and ids.shape[0] < batch.input_ids.shape[0]  # fewer tokens
    assert len({len(t.response_tokens) for g in groups for t in g.trajectories}) > 3
    with torch.no_grad():
        ref = response_logits(model, batch, "cpu")
        got = packed_response_logits(model, batch, "cpu")
    m = batch.mask.bool()
    assert got.shape == ref.shape
    assert torch.allclose(got[m], ref[m], atol=1e-5, rtol=1e-5)


def test_packed_update_matches_padded_update():
    tok = build_char_tokenizer()
    base = build_tiny_model(SMALL, tok, seed=0)
    groups = _groups(base, tok, n_prompts=6, group=4, seed=1)
    out = {}
    for pack in (False, True):
        model = copy.deepcopy(base)
        tr = PolicyTrainer(
            model,
            PRESETS["grpo"],
            lr=1e-3,
            weight_decay=0.0,
            max_grad_norm=1.0,
            temperature=1.0,
            max_new_tokens=20,
            pad_id=tok.pad_token_id,
            device="cpu",
            micro_batch_tokens=96,
        )
        tr.pack = pack
        stats = [tr.update(groups), tr.update(groups)]  # several micro-batches; the second step off-policy
        out[pack] = (stats, {k: v.detach().clone() for k, v in model.state_dict().items()})
    for a, b in zip(out[False][0], out[True][0]):
        assert abs(a.loss - b.loss) <= 1e-5 * max(1.0, abs(a.loss))
        assert abs(a.grad_norm - b.grad_norm) <= 1e-5 * max(1.0, a.grad_norm)
        assert abs(a.metrics["entropy"] - b.metrics["entropy"]) < 1e-5
    for k, v in out[False][1].items():
        assert torch.allclose(v, out[True][1][k], atol=1e-6, rtol=1e-5), k


def test_reference_switch_takes_the_padded_forward(monkeypatch):
    tok = build_char_tokenizer()
    model = build_tiny_model(SMALL, tok, seed=0)
    groups = _groups(model, tok, n_prompts=2, group=2)
    calls = []
    monkeypatch.setattr(trainer_mod, "response_logits", lambda *a: calls.append(1) or response_logits(*a))
    tr = PolicyTrainer(
        model,
        PRESETS["grpo"],
        lr=1e-3,
        weight_decay=0.0,
        max_grad_norm=1.0,
        temperature=1.0,
        max_new_tokens=20,
        pad_id=tok.pad_token_id,
        device="cpu",
    )
    tr.update(groups)
    assert not calls
    monkeypatch.setattr(trainer_mod, "REFERENCE_FORWARD", True)
    tr.update(groups)
    assert calls
