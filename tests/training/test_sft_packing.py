"""SFT packs each batch's examples into few rows instead of padding them: the same loss and
gradients as the padded batch, checked once per run, and a model that cannot attend within packed
examples is trained on padded batches instead."""

import torch

from conf.schema import ModelConfig
from data_curation.synthetic import PROMPT_TEMPLATE, generate
from generation.model import build_char_tokenizer, build_tiny_model
from training.sft import SFTExample, collate, pack, packing_matches, train_sft


def _examples(tok, n=24):
    pool, _ = generate(0, 200, 10, [1, 2, 3, 4, 5], 0.15)
    return [
        SFTExample(
            tuple(tok(PROMPT_TEMPLATE.format(problem=p.problem))["input_ids"]),
            tuple(tok(p.demonstration)["input_ids"]) + (tok.eos_token_id,),
        )
        for p in pool[:n]
    ]


def _grads(model, **inputs):
    model.zero_grad()
    loss = model(**inputs).loss
    loss.backward()
    return float(loss.detach()), torch.cat([p.grad.flatten() for p in model.parameters()])


def test_pack_fills_few_rows_and_keeps_every_response_token():
    tok = build_char_tokenizer()
    exs = _examples(tok)
    ids, pos, labels = pack(exs, tok.pad_token_id, width=64)
    padded_ids, attn, padded_labels = collate(exs, tok.pad_token_id)
    assert ids.shape[0] < len(exs) and ids.numel() < padded_ids.numel()
    assert (
        int((labels != -100).sum())
        == int((padded_labels != -100).sum())
        == sum(len(e.response_tokens) for e in exs)
    )
    assert int((ids != tok.pad_token_id).sum()) == int(attn.sum())
    # every example starts at position 0 and counts up through its own tokens
    assert int((pos == 0).sum()) >= len(exs)


def test_packed_loss_and_gradients_equal_the_padded_batch():
    tok = build_char_tokenizer()
    exs = _examples(tok)
    model = build_tiny_model(ModelConfig(), tok, seed=0).train()
    ids, attn, labels = collate(exs, tok.pad_token_id)
    loss_pad, g_pad = _grads(model, input_ids=ids, attention_mask=attn, labels=labels)
    ids, pos, labels = pack(exs, tok.pad_token_id, width=64)
    loss_pack, g_pack = _grads(model, input_ids=ids, position_ids=pos, labels=labels, use_cache=False)
    assert abs(loss_pad - loss_pack) < 1e-5
    assert torch.allclose(g_pad, g_pack, atol=1e-6, rtol=1e-4)
    assert packing_matches(model, exs, tok.pad_token_id, "cpu")


class _IgnoresPositions(torch.nn.Module):
    """A model whose attention spans the whole row: packed examples would see each other."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, labels, attention_mask=None, position_ids=None, use_cache=None):
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


def test_a_model_that_attends_across_packed_examples_is_trained_padded():
    tok = build_char_tokenizer()
    exs = _examples(tok)
    model = _IgnoresPositions(build_tiny_model(ModelConfig(), tok, seed=0))
    assert not packing_matches(model, exs, tok.pad_token_id, "cpu")
    metrics = train_sft(
        model,
        exs,
        steps=2,
        batch_size=8,
        lr=1e-3,
        warmup_steps=1,
        weight_decay=0.0,
        max_grad_norm=1.0,
        pad_id=tok.pad_token_id,
        seed=0,
    )
    assert metrics["sft_packed"] == 0.0


def test_train_sft_packs_by_default_and_learns():
    tok = build_char_tokenizer()
    exs = _examples(tok)
    model = build_tiny_model(ModelConfig(), tok, seed=0)
    metrics = train_sft(
        model,
        exs,
        steps=30,
        batch_size=8,
        lr=3e-3,
        warmup_steps=2,
        weight_decay=0.0,
        max_grad_norm=1.0,
        pad_id=tok.pad_token_id,
        seed=0,
    )
    assert metrics["sft_packed"] == 1.0
    assert metrics["sft_loss_last"] < 0.6 * metrics["sft_loss_first"]
