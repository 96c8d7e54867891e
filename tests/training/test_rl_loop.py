"""What the drivers share on a micro model (grouping, the data cursor) and real learning through the
local driver."""

import torch
from rl_fakes import MICRO, Verdict, saved_model

from generation.model import build_char_tokenizer, build_tiny_model, encode_prompt
from conf.schema import RLConfig
from training.objectives import PRESETS
from training.rl.drivers.local import LocalDriver
from training.rl.loop import PromptCursor, score_phase
from generation.records import PromptItem, Trajectory


class StartsWithDigit:
    """A small real fake of the verifier: correct when the response starts with a digit."""

    def verify_batch(self, responses, golds):
        return [Verdict(r[:1].isdigit()) for r in responses]


def _prompts(tok, n=8):
    return [PromptItem(f"p{i}", f"q{i}", "7", encode_prompt(tok, f"q{i}\n"), 1) for i in range(n)]


def test_cursor_is_seeded_and_covers_each_epoch():
    tok = build_char_tokenizer()
    items = _prompts(tok, 10)
    a, b = PromptCursor(items, 3), PromptCursor(items, 3)
    first = a.take(10)
    assert sorted(p.prompt_id for p in first) == sorted(p.prompt_id for p in items)
    assert [p.prompt_id for p in first] == [p.prompt_id for p in b.take(10)]
    second = a.take(10)
    assert [p.prompt_id for p in second] != [p.prompt_id for p in first] and a.position == 20


def test_score_phase_groups_by_prompt_in_order():
    tok = build_char_tokenizer()
    p0, p1 = _prompts(tok, 2)
    mk = lambda p, i, text: Trajectory("trajectory", p, i, (1,), (0.0,), 0, True, text)  # noqa: E731
    groups = score_phase([mk(p0, 0, "7"), mk(p1, 0, "a"), mk(p0, 1, "b"), mk(p1, 1, "70")], StartsWithDigit())
    assert [g.prompt_id for g in groups] == ["p0", "p1"]
    assert groups[0].rewards == (1.0, 0.0) and groups[1].rewards == (0.0, 1.0)


def test_grpo_really_learns_a_simple_preference(tmp_path):
    torch.manual_seed(0)
    tok = build_char_tokenizer()
    model = build_tiny_model(MICRO, tok, seed=0)
    rl = RLConfig(steps=30, prompts_per_step=8, group_size=8, lr=1e-2, max_new_tokens=3, micro_batch_tokens=0)
    driver = LocalDriver(
        saved_model(tmp_path, model, tok),
        _prompts(tok),
        StartsWithDigit(),
        PRESETS["grpo"],
        rl,
        seed=0,
        device="cpu",
    )
    result = driver.run()
    first = sum(m.reward for m in result.history[:3]) / 3
    last = sum(m.reward for m in result.history[-3:]) / 3
    assert first < 0.3 and last > 0.7, (first, last)
    assert sum(result.consumed.values()) == 30 * 8 * 8
