"""On-policy distillation (issue 54): the advantage, the teachers, and a few updates on a micro model."""

from dataclasses import replace

import pytest
import torch
from rl_fakes import MICRO, saved_model

from conf.loader import load_config
from conf.schema import ConfigError, RLConfig, TeacherConfig
from generation.model import build_char_tokenizer, build_tiny_model, encode_prompt
from generation.records import PromptItem, ScoredGroup, Trajectory
from training.objectives import PRESETS, TokenInputs, advantages_of, opd_advantages, reverse_kl_tokens
from training.rl.sections import RLSections
from training.rl.stage import objective_params
from training.rl.teacher import SELF, with_teacher
from training.rl.trainer import PolicyTrainer


def test_opd_advantage_is_the_negative_reverse_kl_and_zero_for_an_equal_teacher():
    g = torch.Generator().manual_seed(0)
    student = torch.log_softmax(torch.randn(3, 5, 7, generator=g), -1)[..., 0]
    teacher = torch.log_softmax(torch.randn(3, 5, 7, generator=g), -1)[..., 0]
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.float32)
    kl = reverse_kl_tokens(student, teacher)
    adv = opd_advantages(kl, mask)
    assert torch.equal(adv, torch.where(mask.bool(), teacher - student, 0.0))
    assert torch.equal(opd_advantages(reverse_kl_tokens(student, student), mask), torch.zeros(3, 5))
    p = PRESETS["opd"]
    rewards, groups = torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0, 0, 1])
    inp = TokenInputs(rewards=rewards, mask=mask, teacher_kl=kl)
    assert torch.equal(advantages_of(p, rewards, groups, inp), adv)
    mixed = advantages_of(replace(p, reward_weight=0.5, distill_weight=2.0), rewards, groups, inp)
    grpo = PRESETS["grpo"]
    want = 2.0 * adv + 0.5 * torch.where(mask.bool(), advantages_of(grpo, rewards, groups)[:, None], 0.0)
    assert torch.allclose(mixed, want)
    with pytest.raises(ValueError, match="teacher_kl"):
        advantages_of(p, rewards, groups, TokenInputs(rewards=rewards, mask=mask))


def test_config_opd_needs_a_teacher_and_reaches_the_objective(tmp_path):
    with pytest.raises(ConfigError, match="rl.algorithm=opd needs a teacher"):
        load_config(["rl.algorithm=opd"])
    with pytest.raises(ConfigError, match="teacher.path is read only by rl.algorithm=opd"):
        load_config(["teacher.path=self"])
    with pytest.raises(ConfigError, match="must contain"):
        load_config(["rl.algorithm=opd", "teacher.path=self", "teacher.hint=no answer here"])
    cfg = load_config(["rl.algorithm=opd", "teacher.path=self", "teacher.reward_weight=0.5"])
    tok = build_char_tokenizer()
    folder = saved_model(tmp_path / "m", build_tiny_model(MICRO, tok, seed=0), tok)
    p = with_teacher(objective_params(cfg.rl), cfg.teacher, folder, "{problem}=")
    assert (p.distill_weight, p.reward_weight, p.teacher.path, p.loss_agg) == (1.0, 0.5, SELF, "token_mean")
    plain = objective_params(cfg.rl)
    assert with_teacher(plain, None, folder, "") is plain and plain.teacher is None
    with pytest.raises(ValueError, match="no model folder"):
        with_teacher(PRESETS["opd"], TeacherConfig(path=str(tmp_path / "none")), folder, "")


def _groups(tok, prompts, responses):
    out = []
    for p in prompts:
        trajs = tuple(
            Trajectory(
                kind="trajectory",
                prompt=p,
                sample_idx=i,
                response_tokens=tuple(tok(r, add_special_tokens=False)["input_ids"]),
                behaviour_logprobs=(0.0,) * len(r),
                version=0,
                finished=True,
                text=r,
            )
            for i, r in enumerate(responses)
        )
        out.append(
            ScoredGroup(
                kind="scored_group",
                prompt_id=p.prompt_id,
                trajectories=trajs,
                rewards=(1.0, 0.0),
                correct=(True, False),
            )
        )
    return out


def _trainer(model, params, tok):
    return PolicyTrainer.from_config(
        model, params, RLConfig(micro_batch_tokens=0), pad_id=tok.pad_token_id, device="cpu"
    )


def test_the_self_teacher_sees_the_answer_and_the_student_does_not(tmp_path):
    tok = build_char_tokenizer()
    model = build_tiny_model(MICRO, tok, seed=0)
    folder = saved_model(tmp_path / "m", model, tok)
    prompts = [PromptItem(f"p{i}", f"{i}+3", str(i + 3), encode_prompt(tok, f"{i}+3=")) for i in range(2)]
    params = with_teacher(PRESETS["opd"], TeacherConfig(path=SELF, sync_every=1), folder, "{problem}=")
    trainer = _trainer(model, params, tok)
    groups = _groups(tok, prompts, ["4", "7"])
    seen = trainer.teacher.groups(groups)
    for g, t in zip(groups, seen):
        student = tok.decode(g.trajectories[0].prompt.prompt_tokens, skip_special_tokens=True)
        teacher = tok.decode(t.trajectories[0].prompt.prompt_tokens, skip_special_tokens=True)
        answer = g.trajectories[0].prompt.answer
        assert student == f"{g.trajectories[0].prompt.text}=" and f"Answer: {answer}" not in student
        assert teacher == f"Answer: {answer}\n{g.trajectories[0].prompt.text}="
        assert [x.response_tokens for x in t.trajectories] == [x.response_tokens for x in g.trajectories]
    stats = trainer.update(groups)
    assert stats.metrics["teacher_kl"] != 0.0 and stats.metrics["teacher_sync"] == 1.0
    teacher_w = trainer.teacher.model.state_dict()
    assert all(torch.equal(v, teacher_w[k]) for k, v in trainer.model.state_dict().items())


def test_a_teacher_equal_to_the_student_gives_zero_kl_and_no_gradient(tmp_path):
    tok = build_char_tokenizer()
    model = build_tiny_model(MICRO, tok, seed=0)
    folder = saved_model(tmp_path / "m", model, tok)
    params = with_teacher(PRESETS["opd"], TeacherConfig(path=str(folder)), folder, "{problem}=")
    trainer = _trainer(model, params, tok)
    prompts = [PromptItem("p", "1+1", "2", encode_prompt(tok, "1+1="))]
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    stats = trainer.update(_groups(tok, prompts, ["2", "35"]))
    assert abs(stats.metrics["teacher_kl"]) < 1e-6 and stats.grad_norm < 1e-6
    assert all(torch.allclose(v, before[k]) for k, v in trainer.model.state_dict().items())
    small = build_char_tokenizer("0123456789+=")
    other = saved_model(tmp_path / "other", build_tiny_model(MICRO, small, seed=0), small)
    with pytest.raises(ValueError, match="the teacher needs the student's tokenizer"):
        with_teacher(PRESETS["opd"], TeacherConfig(path=str(other)), folder, "{problem}=")


class DigitFirst:
    """Right when the response starts with a digit."""

    def verify_batch(self, responses, golds):
        from rl_fakes import Verdict

        return [Verdict(r[:1].isdigit()) for r in responses]


def _digit_mass(model, tok, prompts) -> float:
    """The model's mean probability of a digit as the first response token (its expected accuracy
    under ``DigitFirst`` at temperature 1), over ``prompts``."""
    digits = torch.tensor([tok.convert_tokens_to_ids(d) for d in "0123456789"])
    with torch.no_grad():
        probs = [torch.softmax(model(torch.tensor([p.prompt_tokens])).logits[0, -1], -1) for p in prompts]
    return float(torch.stack([p[digits].sum() for p in probs]).mean())


def _teacher(tok, prompts, steps=60):
    """A synthetic teacher: the student's initial weights taught to answer a digit (cross-entropy)."""
    model = build_tiny_model(MICRO, tok, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for i in range(steps):
        p = prompts[i % len(prompts)]
        ids = torch.tensor([list(p.prompt_tokens) + [tok.convert_tokens_to_ids(str(i % 10))]])
        logits = model(ids).logits[0, -2]
        loss = torch.nn.functional.cross_entropy(logits[None], ids[0, -1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def test_opd_updates_move_the_student_to_the_teacher(tmp_path):
    from training.rl.drivers.local import LocalDriver

    tok = build_char_tokenizer()
    train = [PromptItem(f"a{i}", f"a{i}", "0", encode_prompt(tok, f"q{i}\n")) for i in range(16)]
    heldout = [PromptItem(f"b{i}", f"b{i}", "0", encode_prompt(tok, f"q{i}{i}\n")) for i in range(16)]
    teacher_dir = saved_model(tmp_path / "teacher", _teacher(tok, train), tok)
    student = build_tiny_model(MICRO, tok, seed=0)
    student_dir = saved_model(tmp_path / "student", student, tok)
    params = with_teacher(PRESETS["opd"], TeacherConfig(path=str(teacher_dir)), student_dir, "{problem}")
    rl = RLConfig(
        algorithm="opd",
        lr=1e-2,
        micro_batch_tokens=0,
        steps=16,
        prompts_per_step=8,
        group_size=4,
        max_new_tokens=3,
    )
    driver = LocalDriver(student_dir, train, DigitFirst(), params, RLSections(rl, seed=0), device="cpu")
    history = driver.run().history
    kl = [m.as_dict()["teacher_kl"] for m in history]
    before, after = _digit_mass(student, tok, heldout), _digit_mass(driver.final_model, tok, heldout)
    teacher_acc = _digit_mass(load_teacher(teacher_dir), tok, heldout)
    print(f"teacher_kl {kl[0]:.3f} -> {kl[-1]:.3f}; held-out digit mass {before:.3f} -> {after:.3f}")
    print(f"teacher's held-out digit mass {teacher_acc:.3f}")
    assert sum(kl[-3:]) / 3 < 0.5 * sum(kl[:3]) / 3
    assert after > before + 0.3 * (teacher_acc - before)


def load_teacher(folder):
    from generation.model import load_model

    return load_model(folder, "cpu")[0].eval()


def test_the_teacher_enters_the_rl_key_and_its_folder_hash_the_lineage(tmp_path):
    from tasks.dag import STAGE_BY_NAME
    from tasks.stages.rl import rl_key, teacher_files

    base = load_config([])
    assert "teacher" not in rl_key(base) and teacher_files(base) == {}  # the default key is unchanged
    assert STAGE_BY_NAME["rl"].external is teacher_files
    tok = build_char_tokenizer()
    folder = saved_model(tmp_path / "t", build_tiny_model(MICRO, tok, seed=0), tok)
    cfg = load_config(["rl.algorithm=opd", f"teacher.path={folder}"])
    assert rl_key(cfg)["teacher"]["path"] == str(folder)
    before = teacher_files(cfg)["teacher.path"]
    saved_model(folder, build_tiny_model(MICRO, tok, seed=1), tok)
    assert teacher_files(cfg)["teacher.path"] != before
    assert teacher_files(load_config(["rl.algorithm=opd", "teacher.path=self"])) == {}
