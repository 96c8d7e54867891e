"""ReLIFT (issue 54, part 4): failed groups collect solutions, fine-tuning steps interleaved with RL."""

from __future__ import annotations

import pytest
from rl_fakes import MICRO, Verdict, cpu_trainer, fit, saved_model

from conf.loader import load_config
from conf.schema import ConfigError, ReliftConfig, RLConfig
from generation.model import build_char_tokenizer, build_tiny_model, encode_prompt, encode_response
from generation.records import PromptItem, ScoredGroup, Trajectory
from training.objectives import PRESETS
from training.rl.relift import Relift, Solution, TeacherSolver, collate, failed, mean_nll
from training.rl.sections import RLSections

ANSWERS = {f"p{i}": str(i) for i in range(6)}


def _prompts(tok):
    return [PromptItem(pid, f"{a}", a, encode_prompt(tok, f"{a}=")) for pid, a in ANSWERS.items()]


def _group(prompt: PromptItem, correct: list[bool]) -> ScoredGroup:
    trajs = tuple(
        Trajectory(
            kind="trajectory",
            prompt=prompt,
            sample_idx=i,
            response_tokens=(5,),
            behaviour_logprobs=(0.0,),
            version=0,
            finished=True,
            text="x",
        )
        for i in range(len(correct))
    )
    return ScoredGroup(
        kind="scored_group",
        prompt_id=prompt.prompt_id,
        trajectories=trajs,
        rewards=tuple(float(c) for c in correct),
        correct=tuple(correct),
    )


def _solution(tok, p: PromptItem) -> Solution:
    return Solution(tuple(p.prompt_tokens), encode_response(tok, p.answer))


def _scorer(trajs) -> ScoredGroup:
    """The verdict of the tests: a response is right when it is the prompt's answer."""
    ok = [t.text.strip() == t.prompt.answer for t in trajs]
    return ScoredGroup(
        kind="scored_group",
        prompt_id=trajs[0].prompt.prompt_id,
        trajectories=tuple(trajs),
        rewards=tuple(map(float, ok)),
        correct=tuple(ok),
    )


def _teacher_model(tok, prompts):
    """A micro model fitted to answer ``prompts`` (the teacher better than the student)."""
    model = build_tiny_model(MICRO, tok, seed=1)
    ids, attn, labels = collate([_solution(tok, p) for p in prompts], tok.pad_token_id)
    return fit(model, ids, labels, steps=150, lr=1e-2, attention_mask=attn)


def test_failed_is_all_wrong_or_at_most_the_threshold():
    tok = build_char_tokenizer()
    p = _prompts(tok)[0]
    assert failed(_group(p, [False] * 4), 0.0)
    assert not failed(_group(p, [True, False, False, False]), 0.0)
    assert failed(_group(p, [True, False, False, False]), 0.25)
    assert not failed(_group(p, [True, True, False, False]), 0.25)


def test_failed_groups_collect_dart_answers_then_verified_teacher_solutions(tmp_path):
    tok = build_char_tokenizer()
    prompts = _prompts(tok)
    folder = saved_model(tmp_path / "teacher", _teacher_model(tok, prompts), tok)
    teacher = TeacherSolver(folder, _scorer, samples=4, max_new_tokens=4, temperature=1.0, seed=0)
    dart = {"p0": _solution(tok, prompts[0])}
    cfg = ReliftConfig(enabled=True, source="dart_then_teacher", buffer_size=3)
    relift = Relift(cfg, dart=dart, teacher=teacher, lr=1e-3, seed=0)
    # p0, p1, p2 fail (all wrong), p3 is half right: only the failures wait for a solution
    relift.observe([_group(p, [False] * 4) for p in prompts[:3]] + [_group(prompts[3], [True, False])])
    assert list(relift.pending) == ["p0", "p1", "p2"]
    assert relift.collect() == 3 and not relift.pending
    assert relift.buffer["p0"] == dart["p0"]  # DART's answer where it has one: the teacher is not asked
    assert teacher.sampled == 2 * 4
    for pid in ("p1", "p2"):  # the teacher's verified solution: the answer and EOS
        ex = relift.buffer[pid]
        assert ex.prompt_tokens == prompts[int(pid[1])].prompt_tokens
        assert tok.decode(ex.response_tokens, skip_special_tokens=True) == ANSWERS[pid]
        assert ex.response_tokens[-1] == tok.eos_token_id
    relift.observe([_group(p, [False] * 2) for p in prompts[4:6]])
    assert relift.collect() == 2 and list(relift.buffer) == ["p2", "p4", "p5"]  # the newest 3 kept
    only_dart = Relift(ReliftConfig(enabled=True, source="dart"), dart=dart, teacher=teacher, lr=1e-3, seed=0)
    only_dart.observe([_group(p, [False] * 2) for p in prompts[:2]])
    assert only_dart.collect() == 1 and list(only_dart.buffer) == ["p0"]  # no DART answer: nothing


def test_the_interleaved_fine_tuning_step_lowers_the_nll_of_the_buffered_solutions(tmp_path):
    tok = build_char_tokenizer()
    prompts = _prompts(tok)
    model = build_tiny_model(MICRO, tok, seed=0)
    trainer = cpu_trainer(model, PRESETS["grpo"], tok, max_new_tokens=4, lr=1e-4)
    dart = {p.prompt_id: _solution(tok, p) for p in prompts}
    cfg = ReliftConfig(enabled=True, source="dart", every=2, sft_steps=3, batch_size=4)
    relift = Relift(cfg, dart=dart, lr=3e-3, seed=0)
    relift.observe([_group(p, [False] * 2) for p in prompts])
    solutions = list(dart.values())
    before = mean_nll(trainer.model, solutions, tok.pad_token_id)
    first: dict[str, float] = {}
    relift.after_update(trainer, first)  # update 1 of every=2: collect only
    assert first == {"relift/collected": 6.0, "relift/buffer": 6.0}
    assert mean_nll(trainer.model, solutions, tok.pad_token_id) == before
    second: dict[str, float] = {}
    relift.after_update(trainer, second)  # update 2: three fine-tuning steps
    after = mean_nll(trainer.model, solutions, tok.pad_token_id)
    assert second["relift/steps"] == 3.0 and second["relift/collected"] == 0.0
    assert after < before - 0.05
    assert second["relift/sft_loss"] == pytest.approx(before, rel=0.1)  # the mean loss before each step
    assert [g["lr"] for g in trainer.opt.param_groups] == [1e-4]  # the RL learning rate restored


def test_a_local_sync_run_fine_tunes_between_updates_and_resumes_with_its_buffer(tmp_path):
    from training.rl.drivers.local import LocalDriver

    tok = build_char_tokenizer()
    prompts = _prompts(tok)
    folder = saved_model(tmp_path / "student", build_tiny_model(MICRO, tok, seed=0), tok)

    class Exact:
        def verify_batch(self, texts, answers):
            return [Verdict(t.strip() == a) for t, a in zip(texts, answers)]

    rl = RLConfig(
        steps=3, prompts_per_step=2, group_size=2, lr=1e-3, max_new_tokens=4, micro_batch_tokens=0,
        checkpoint_every=1, eval_every=0, runtime="local",
    )  # fmt: skip
    cfg = ReliftConfig(enabled=True, source="dart", lr=1e-2)

    def run(steps: int):
        relift = Relift(cfg, dart={p.prompt_id: _solution(tok, p) for p in prompts}, lr=1e-2, seed=0)
        sections = RLSections(rl.model_copy(update={"steps": steps}), seed=0)
        driver = LocalDriver(
            folder, prompts, Exact(), PRESETS["grpo"], sections, device="cpu", state_dir=tmp_path / "state",
            relift=relift,
        )  # fmt: skip
        return driver.run(), relift

    result, relift = run(2)
    rows = [m.as_dict() for m in result.history]
    assert all("relift/buffer" in m and "relift/sft_loss" in m for m in rows)  # the untrained model fails all
    assert sum(m["relift/collected"] for m in rows) == relift.collected_total == 4
    assert (tmp_path / "state" / "checkpoints").exists()
    resumed, again = run(3)  # resumes from update 1's checkpoint, buffer and counters restored
    assert again.updates == 3 and again.collected_total >= 2
    assert len(resumed.history) == 3


def test_relift_config_is_validated_and_off_by_default():
    cfg = load_config([])
    assert cfg.rl.relift == ReliftConfig() and not cfg.rl.relift.enabled
    with pytest.raises(ConfigError, match="rl.relift.source=teacher needs a teacher model"):
        load_config(["rl.relift.enabled=true"])
    with pytest.raises(ConfigError, match="local driver only"):
        load_config(["rl.relift.enabled=true", "rl.relift.source=dart", "rl.mode=laminar"])
    with pytest.raises(ConfigError, match="local driver only"):
        load_config(["rl.relift.enabled=true", "rl.relift.source=dart", "trainer.backend=deepspeed"])
    with pytest.raises(ConfigError, match=r"rl.relift.threshold=1.5 must be in \[0, 1\]"):
        load_config(["rl.relift.threshold=1.5"])
    with pytest.raises(ConfigError, match="rl.relift.every"):
        load_config(["rl.relift.every=0"])
    ok = load_config(["rl.relift.enabled=true", "teacher.path=/some/dir", "rl.relift.every=4"])
    assert ok.teacher_readers() == ["rl.relift.source=teacher"] and ok.rl.relift.every == 4
