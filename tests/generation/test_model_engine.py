import torch

from conf.schema import EngineOptions, ModelConfig
from generation.model import (
    build_char_tokenizer,
    build_tiny_model,
    encode_prompt,
    encode_response,
    load_model,
    save_model,
)
from generation.engine import Engine
from generation.records import GenRequest, PromptItem
from training.rl.trainer import build_batch, response_logits, token_logprobs
from generation.records import ScoredGroup

SMALL = ModelConfig(
    hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=96
)


def _tiny(tmp_path):
    tok = build_char_tokenizer()
    model = build_tiny_model(SMALL, tok, seed=0)
    save_model(model, tok, tmp_path)
    return load_model(tmp_path)


def test_char_tokenizer_roundtrip_and_auto_loading(tmp_path):
    model, tok = _tiny(tmp_path)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert (tmp_path / "model.safetensors").exists() and not list(tmp_path.glob("*.bin"))
    text = "What is 3+4-1?\n3+4=7\n7-1=6\n#### 6"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text) and tok.decode(ids) == text
    assert encode_prompt(tok, "1+1")[0] == tok.bos_token_id
    assert encode_response(tok, "2")[-1] == tok.eos_token_id


def _requests(tok, n=6):
    items = [
        PromptItem(f"p{i}", f"What is {i}+1?", str(i + 1), encode_prompt(tok, f"What is {i}+1?\n" + "x" * i))
        for i in range(n)
    ]
    return [GenRequest(p, s) for p in items for s in range(2)]


def test_engine_logprobs_match_trainer_recomputation(tmp_path):
    model, tok = _tiny(tmp_path)
    engine = Engine(model, tok, EngineOptions(capacity=5))  # several batches, ragged prompts (left padding)
    reqs = _requests(tok)
    trajs = engine.generate(reqs, 12, 1.0, seed=0)
    assert [t.sample_idx for t in trajs] == [r.sample_idx for r in reqs]
    assert all(len(t.response_tokens) == len(t.behaviour_logprobs) and t.version == 0 for t in trajs)
    group = ScoredGroup(
        "scored_group", "all", tuple(trajs), tuple(0.0 for _ in trajs), tuple(False for _ in trajs)
    )
    batch = build_batch([group], tok.pad_token_id)
    with torch.no_grad():
        lp = token_logprobs(response_logits(model, batch, "cpu"), batch.targets, 1.0)
    assert torch.allclose(lp * batch.mask, batch.behaviour * batch.mask, atol=1e-4)


def test_engine_deterministic_and_stops_at_eos(tmp_path):
    model, tok = _tiny(tmp_path)
    engine = Engine(model, tok)
    reqs = _requests(tok, 3)
    a = engine.generate(reqs, 10, 1.0, seed=1)
    b = engine.generate(reqs, 10, 1.0, seed=1)
    assert [t.response_tokens for t in a] == [t.response_tokens for t in b]
    for t in a:
        eos = tok.eos_token_id
        assert (t.finished and t.response_tokens[-1] == eos and eos not in t.response_tokens[:-1]) or (
            not t.finished and len(t.response_tokens) == 10 and eos not in t.response_tokens
        )


def test_load_weights_changes_version_and_outputs(tmp_path):
    model, tok = _tiny(tmp_path)
    engine = Engine(model, tok)
    from generation.records import WeightsUpdate

    state = {k: (v.detach().numpy() * 0).copy() for k, v in model.state_dict().items()}
    engine.load_weights(WeightsUpdate("weights_update", 7, state))
    trajs = engine.generate(_requests(tok, 1), 4, 1.0, torch.Generator().manual_seed(0))
    assert all(t.version == 7 for t in trajs)
    # all-zero weights: uniform next-token distribution over the vocabulary
    assert abs(trajs[0].behaviour_logprobs[0] + torch.log(torch.tensor(float(len(tok)))).item()) < 1e-4


def test_a_prefill_computes_only_the_last_positions_logits(tmp_path):
    """Every layout's prefill asks the model for the last position's logits only (``logits_to_keep``):
    the lm_head never sees more than one position a row, and a forward without that argument is
    called without it."""
    model, tok = _tiny(tmp_path)
    seen = []
    model.lm_head.register_forward_hook(lambda mod, args, out: seen.append(tuple(args[0].shape)))
    for waves in (True, False):
        seen.clear()
        Engine(model, tok, EngineOptions(capacity=4), waves=waves).generate(_requests(tok), 6, 1.0, seed=0)
        assert seen and max(s[1] for s in seen) == 1, (waves, seen[:3])
    from generation.model_calls import last_logits_only

    class NoKeep(torch.nn.Module):
        def forward(self, input_ids, attention_mask=None):
            return input_ids

    assert last_logits_only(model) == {"logits_to_keep": 1}
    assert last_logits_only(NoKeep()) == {}
