"""An update split over host threads (``PolicyTrainer.update_threads``: whole groups per thread, each
on a replica sharing the model's parameters, gradients added in thread order) against the same update
in one thread: losses, gradient norms, metrics and updated weights equal up to float rounding, the
same on every run, and none of it when the split is not allowed."""

import copy

import pytest
import torch

from generation.model import build_char_tokenizer, build_tiny_model
from tests.training.test_packed_forward import SMALL, _groups
from training.objectives import PRESETS
from training.rl import trainer as trainer_mod
from training.rl.trainer import PolicyTrainer, group_shards


def _trainer(model, tok, **kw):
    return PolicyTrainer(
        model,
        PRESETS[kw.pop("preset", "grpo")],
        lr=1e-3,
        weight_decay=0.0,
        max_grad_norm=1.0,
        temperature=1.0,
        max_new_tokens=20,
        pad_id=tok.pad_token_id,
        device="cpu",
        **kw,
    )


def _run(base, tok, groups, threads, **kw):
    model = copy.deepcopy(base)
    tr = _trainer(model, tok, **kw)
    tr.update_threads = threads
    calls = []
    original = tr._backward_in_threads
    tr._backward_in_threads = lambda fn, parts: calls.append(len(parts)) or original(fn, parts)
    stats = [tr.update(groups)]
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    stats += [tr.update(groups), tr.update(groups)]
    return stats, ({k: v.detach().clone() for k, v in model.state_dict().items()}, grads), calls


@pytest.mark.parametrize("kw", [{}, {"micro_batch_tokens": 96}, {"preset": "dapo", "minibatches": 2}])
def test_threaded_update_matches_one_thread(monkeypatch, kw):
    monkeypatch.setattr(trainer_mod, "MIN_THREAD_ROWS", 4)
    tok = build_char_tokenizer()
    base = build_tiny_model(SMALL, tok, seed=0)
    groups = _groups(base, tok, n_prompts=7, group=4, seed=1)
    one, one_w, calls1 = _run(base, tok, groups, 1, **kw)
    three, three_w, calls3 = _run(base, tok, groups, 3, **kw)
    again, again_w, _ = _run(base, tok, groups, 3, **kw)
    assert not calls1 and calls3 and set(calls3) == {3}
    for a, b, c in zip(one, three, again):
        assert abs(a.loss - b.loss) <= 1e-5 * max(1.0, abs(a.loss))
        assert abs(a.grad_norm - b.grad_norm) <= 1e-5 * max(1.0, a.grad_norm)
        assert a.metrics.keys() == b.metrics.keys()
        for k in a.metrics:  # token means per micro-batch, weighted by the loss shares: near, not equal
            assert abs(a.metrics[k] - b.metrics[k]) <= 1e-2 * max(1.0, abs(a.metrics[k])), k
        assert (b.loss, b.grad_norm, b.metrics) == (c.loss, c.grad_norm, c.metrics)  # the same on every run
    (one_w, one_g), (three_w, three_g), (again_w, again_g) = one_w, three_w, again_w
    for k, g in one_g.items():  # the first update's gradients (every thread's rows, summed)
        assert torch.allclose(g, three_g[k], atol=1e-7, rtol=1e-4), k
        assert torch.equal(three_g[k], again_g[k]), k
    for k, v in one_w.items():  # after three AdamW steps of 1e-3 (Adam magnifies rounding in tiny gradients)
        assert torch.allclose(v, three_w[k], atol=3e-5), k
        assert torch.equal(three_w[k], again_w[k]), k
        assert not torch.equal(v, base.state_dict()[k]), k


def test_no_split_with_dropout_or_few_rows(monkeypatch):
    tok = build_char_tokenizer()
    base = build_tiny_model(SMALL, tok, seed=0)
    groups = _groups(base, tok, n_prompts=4, group=4, seed=2)
    *_, calls = _run(base, tok, groups, 2)  # 16 rows: fewer than MIN_THREAD_ROWS a thread
    assert not calls
    monkeypatch.setattr(trainer_mod, "MIN_THREAD_ROWS", 4)
    *_, calls = _run(base, tok, groups, 2)
    assert calls == [2, 2, 2]
    dropped = copy.deepcopy(base)
    dropped.config.attention_dropout = 0.1
    *_, calls = _run(dropped, tok, groups, 2)
    assert not calls


def test_group_shards_keep_groups_whole_and_balanced():
    lengths = torch.tensor([10, 10, 3, 3, 8, 8, 1, 1, 5, 5])
    group_index = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3, 4, 4])
    shards = group_shards(torch.arange(10), lengths, group_index, 2)
    assert sorted(torch.cat(shards).tolist()) == list(range(10))
    for s in shards:
        assert all(
            ((group_index == group_index[i]).nonzero().squeeze(1) == s[:, None]).any(0).all() for i in s
        )
    loads = sorted(int(lengths[s].sum()) for s in shards)
    assert loads == [26, 28]  # 20, 16, 10, 6, 2: largest first onto the lighter shard
    assert len(group_shards(torch.arange(4), lengths, group_index, 5)) == 2  # no more shards than groups


def test_threaded_update_of_a_lora_model_matches_one_thread(monkeypatch):
    from peft import get_peft_model

    from conf.schema import LoraConfig
    from training.lora import peft_config

    monkeypatch.setattr(trainer_mod, "MIN_THREAD_ROWS", 4)
    tok = build_char_tokenizer()
    base = build_tiny_model(SMALL, tok, seed=0)
    groups = _groups(base, tok, n_prompts=6, group=4, seed=3)
    torch.manual_seed(0)
    lora = get_peft_model(copy.deepcopy(base), peft_config(LoraConfig(enabled=True, rank=4)))
    with torch.no_grad():  # B starts at zero: make the adapters matter from the first step
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    one, (one_w, _), calls1 = _run(lora, tok, groups, 1)
    two, (two_w, _), calls2 = _run(lora, tok, groups, 2)
    assert not calls1 and calls2 == [2, 2, 2]
    for a, b in zip(one, two):
        assert abs(a.loss - b.loss) <= 1e-5 * max(1.0, abs(a.loss))
        assert abs(a.grad_norm - b.grad_norm) <= 1e-5 * max(1.0, a.grad_norm)
    start = lora.state_dict()
    for k, v in one_w.items():
        if "lora_" in k:  # the adapters trained alike
            assert torch.allclose(v, two_w[k], atol=3e-5), k
            assert not torch.equal(v, start[k]), k
        else:  # the frozen base stays untouched in every thread
            assert torch.equal(v, start[k]) and torch.equal(two_w[k], start[k]), k
