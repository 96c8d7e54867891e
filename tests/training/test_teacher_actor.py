"""OPD's teacher as a Ray actor (issue 54, ``training.rl.teacher_actor``): on the same groups it gives
the in-process teacher's log-probs (a folder teacher, and the self-teacher through its syncs), and on
the Ray driver a teacher equal to the student gives the first update a KL of 0, as on the local
driver. Starts Ray: marked slow."""

from __future__ import annotations

import pytest
import torch
from rl_fakes import MICRO, saved_model

from conf.schema import ClusterConfig, RLConfig, TeacherConfig
from generation.model import build_char_tokenizer, build_tiny_model, encode_prompt
from generation.records import PromptItem, ScoredGroup, Trajectory
from training.objectives import PRESETS
from training.rl.sections import RLSections
from training.rl.teacher import SELF, Teacher, with_teacher
from training.rl.teacher_actor import RemoteTeacher, start_teacher
from training.rl.trainer import PolicyTrainer

pytestmark = pytest.mark.slow

RL = RLConfig(micro_batch_tokens=24, temperature=0.9)  # several micro-batches; a temperature not 1


def _groups(tok, n_prompts: int, seed: int) -> list[ScoredGroup]:
    """``n_prompts`` groups of 3 responses of uneven lengths (drawn with ``seed``)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n_prompts):
        p = PromptItem(f"p{i}", f"{i}+{i}", str(2 * i), encode_prompt(tok, f"{i}+{i}="))
        trajs = []
        for j in range(3):
            text = "".join(
                "0123456789+="[int(k)] for k in torch.randint(0, 12, (1 + (i + j) % 5,), generator=g)
            )
            ids = tuple(tok(text, add_special_tokens=False)["input_ids"])
            trajs.append(
                Trajectory(
                    kind="trajectory",
                    prompt=p,
                    sample_idx=j,
                    response_tokens=ids,
                    behaviour_logprobs=(0.0,) * len(ids),
                    version=0,
                    finished=True,
                    text=text,
                )
            )
        out.append(
            ScoredGroup(
                kind="scored_group",
                prompt_id=p.prompt_id,
                trajectories=tuple(trajs),
                rewards=(1.0, 0.0, 0.0),
                correct=(True, False, False),
            )
        )
    return out


def _trainer(model, params, tok) -> PolicyTrainer:
    return PolicyTrainer.from_config(model, params, RL, pad_id=tok.pad_token_id, device="cpu")


@pytest.mark.parametrize("kind", ["folder", "self"])
def test_the_teacher_actor_gives_the_in_process_teachers_logprobs(local_ray, tmp_path, kind):
    ray = local_ray
    tok = build_char_tokenizer()
    student_dir = saved_model(tmp_path / "student", build_tiny_model(MICRO, tok, seed=0), tok)
    teacher_dir = saved_model(tmp_path / "teacher", build_tiny_model(MICRO, tok, seed=1), tok)
    cfg = TeacherConfig(path=str(teacher_dir)) if kind == "folder" else TeacherConfig(path=SELF, sync_every=1)
    params = with_teacher(PRESETS["opd"], cfg, student_dir, "{problem}=")
    remote_params, handle = start_teacher(
        ray, params, RL, node=ray.get_runtime_context().get_node_id(), device="cpu", seed=0, threads=1
    )
    assert handle is not None and start_teacher(
        ray, PRESETS["grpo"], RL, node="", device="cpu", seed=0, threads=1
    ) == (PRESETS["grpo"], None)
    local = _trainer(build_tiny_model(MICRO, tok, seed=0), params, tok)
    remote = _trainer(build_tiny_model(MICRO, tok, seed=0), remote_params, tok)
    assert type(local.teacher) is Teacher and isinstance(remote.teacher, RemoteTeacher)
    assert not hasattr(remote.teacher, "model")  # the trainer holds no teacher weights
    for step in range(3):  # the self-teacher syncs after every update: the actor follows
        groups = _groups(tok, 4, seed=step)
        a, b = local._update_inputs(groups), remote._update_inputs(groups)
        assert a.teacher_kl.shape == b.teacher_kl.shape
        assert torch.allclose(a.teacher_kl, b.teacher_kl, atol=1e-5), (
            step,
            (a.teacher_kl - b.teacher_kl).abs().max(),
        )
        assert float(a.teacher_kl[a.mask.bool()].abs().max()) > 1e-3  # a teacher unlike the student
        sa, sb = local.update(groups), remote.update(groups)
        assert sa.metrics["teacher_kl"] == pytest.approx(sb.metrics["teacher_kl"], abs=1e-5)
        assert ("teacher_sync" in sb.metrics) == (kind == "self")
    # one forward per update (each update's batch asked for twice above, the second time answered
    # from the first, as a second trainer rank's request would be); other groups are scored anew
    assert ray.get(handle.count.remote()) == 3
    for seed in (5, 5, 6):
        ray.get(handle.logprobs.remote(remote.version, _groups(tok, 4, seed=seed)))
    assert ray.get(handle.count.remote()) == 5
    ray.kill(handle)


def test_opd_on_the_ray_driver_scores_with_the_teacher_actor(local_ray, tmp_path):
    """A teacher equal to the student, with the verdict's reward added (so the student moves): the
    first update's samples come from the RL-start weights, so their KL to the teacher is 0 on the Ray
    driver as on the local driver (the actor's log-probs line up with the trainer's), and once the
    reward has moved the student it is not."""
    from rl_fakes import ray_rl

    from training.rl.drivers.local import LocalDriver
    from training.rl.drivers.ray import LaminarRuntime
    from training.rl.stage import objective_params

    tok = build_char_tokenizer()
    folder = saved_model(tmp_path / "policy", build_tiny_model(MICRO, tok, seed=0), tok)
    prompts = [PromptItem(f"p{i}", f"{i}+1", str(i + 1), encode_prompt(tok, f"{i}+1=")) for i in range(16)]

    class EvenLength:
        def verify_batch(self, texts, golds):
            from rl_fakes import Verdict

            return [Verdict(len(t) % 2 == 0) for t in texts]

    rl = ray_rl("sync", algorithm="opd", max_new_tokens=6, lr=3e-2)
    params = with_teacher(
        objective_params(rl), TeacherConfig(path=str(folder), reward_weight=1.0), folder, "{problem}="
    )
    kls = {}
    for name in ("local", "ray"):
        sections = RLSections(rl, seed=0, cluster=ClusterConfig(rollouts=1, actor_threads=1))
        if name == "local":
            run = LocalDriver(folder, prompts, EvenLength(), params, sections, device="cpu")
        else:
            run = LaminarRuntime(folder, prompts, EvenLength(), params, sections, device="cpu")
        kls[name] = [m.as_dict()["teacher_kl"] for m in run.run().history]
        if name == "ray":  # the teacher's forwards ran in its actor
            assert run.teacher_actor is not None and run.summary["cpu_seconds"]["teacher"] > 0
    for name, kl in kls.items():
        assert len(kl) == rl.steps and abs(kl[0]) < 1e-5, (name, kl)
        assert max(abs(k) for k in kl[1:]) > 1e-4, (name, kl)
