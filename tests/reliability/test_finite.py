"""A non-finite loss or gradient stops the stage with one clear line and publishes nothing.

The checks sit in the shared training steps (``training/finite.py``, called by ``train_sft`` for
warm-up and RFT and by ``PolicyTrainer.update`` for RL, DeepSpeed's included); the config refuses
non-finite or out-of-range optimizer settings before any write. Issue 26, case 1: ``sft.lr=1e30``
used to give ``warmup`` status "ran" with a NaN loss, a cached NaN checkpoint, and an eval that
failed later with "probability tensor contains either inf, nan"."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from conf.loader import load_config
from conf.schema import ConfigError, RFTConfig, SFTConfig
from core.artifacts import ArtifactStore
from core.errors import StageError
from data_curation.synthetic import PROMPT_TEMPLATE
from generation.model import build_char_tokenizer, build_tiny_model, save_model
from tests.training.dist_worker import TRAIN_KW, random_groups
from tests.training.rl_fakes import MICRO, Verdict
from training.finite import NonFiniteError
from training.objectives import PRESETS
from training.rft import rft
from training.rl.trainer import PolicyTrainer
from training.sft import SFTExample, train_sft
from training.warmup import warmup
from training.rl.sections import RLSections

ROOT = Path(__file__).resolve().parents[2]


def base_model(tmp_path) -> Path:
    tok = build_char_tokenizer()
    out = tmp_path / "base"
    save_model(build_tiny_model(MICRO, tok, seed=0), tok, out)
    return out


def pool(tmp_path, n: int = 24) -> Path:
    rows = [
        {
            "prompt_id": f"p{i}",
            "problem": f"{i % 7}+{i % 5}",
            "answer": str(i % 7 + i % 5),
            "level": 1,
            "demonstration": f"{i % 7}+{i % 5}={i % 7 + i % 5}\n#### {i % 7 + i % 5}",
        }
        for i in range(n)
    ]
    path = tmp_path / "prompts.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def assert_one_clear_line(err: StageError, *fragments: str) -> None:
    text = str(err)
    assert "\n" not in text and "not finite" in text and "publishes nothing" in text, text
    for fragment in fragments:
        assert fragment in text, (fragment, text)


def test_warmup_with_lr_1e30_fails_and_publishes_no_checkpoint(tmp_path):
    store = ArtifactStore(tmp_path / "artifacts")
    cfg = SFTConfig(steps=6, batch_size=4, lr=1e30, warmup_steps=0, levels=[1])
    with pytest.raises(NonFiniteError) as err:
        with store.create("model") as pending:
            warmup(
                base_model(tmp_path),
                pool(tmp_path),
                cfg,
                template=PROMPT_TEMPLATE,
                seed=0,
                device="cpu",
                out_dir=pending.dir,
            )
    assert_one_clear_line(
        err.value, "stage warmup, SFT step 2/6", "sft.lr=1e+30", "sft.max_grad_norm=1", "sft.weight_decay=0"
    )
    assert not (tmp_path / "artifacts" / "model").exists()  # nothing sealed, nothing to serve from cache
    assert not any((tmp_path / "artifacts" / ".tmp").iterdir())


def test_a_blow_up_in_the_last_step_is_caught_before_the_model_is_saved():
    """One step at lr=1e30 leaves weights of 1e30 whose loss is still finite: the trained model's
    gradient on the last batch is checked too."""
    tok = build_char_tokenizer()
    examples = [
        SFTExample(
            tuple(tok(f"{i}+1=", add_special_tokens=False)["input_ids"]),
            tuple(tok(str(i + 1), add_special_tokens=False)["input_ids"]) + (tok.eos_token_id,),
        )
        for i in range(8)
    ]
    model = build_tiny_model(MICRO, tok, seed=0)
    with pytest.raises(NonFiniteError) as err:
        train_sft(
            model,
            examples,
            steps=1,
            batch_size=4,
            lr=1e30,
            warmup_steps=0,
            weight_decay=0.0,
            max_grad_norm=1.0,
            pad_id=tok.pad_token_id,
            seed=0,
            stage="warmup",
            keys={"sft.lr": 1e30},
        )
    assert_one_clear_line(err.value, "stage warmup, after SFT step 1/1", "sft.lr=1e+30")
    # a sane rate trains as before: finite losses, no error
    model = build_tiny_model(MICRO, tok, seed=0)
    m = train_sft(
        model,
        examples,
        steps=3,
        batch_size=4,
        lr=1e-3,
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        pad_id=tok.pad_token_id,
        seed=0,
    )
    assert all(v == v for v in m.values())


def test_rft_with_lr_1e30_names_its_own_config_keys(tmp_path):
    rows = [{"problem": f"{i}+1", "response": f"{i}+1={i + 1}\n#### {i + 1}"} for i in range(8)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rft.parquet")
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(NonFiniteError) as err:
        rft(
            base_model(tmp_path),
            tmp_path / "rft.parquet",
            RFTConfig(steps=4, batch_size=4, lr=1e30, warmup_steps=0),
            template=PROMPT_TEMPLATE,
            seed=0,
            device="cpu",
            out_dir=out,
        )
    assert_one_clear_line(err.value, "stage rft, SFT step", "curation.rft.lr=1e+30")
    assert not any(out.iterdir())


def _trainer(**kw):
    tok = build_char_tokenizer()
    trainer = PolicyTrainer(
        build_tiny_model(MICRO, tok, seed=0), PRESETS["grpo"], pad_id=tok.pad_token_id, **{**TRAIN_KW, **kw}
    )
    return trainer, tok


def _weights(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def test_rl_update_with_a_nan_loss_stops_before_the_optimizer_step(monkeypatch):
    import training.rl.trainer as trainer_mod

    trainer, tok = _trainer()
    before = _weights(trainer)
    real = trainer_mod.policy_loss
    monkeypatch.setattr(
        trainer_mod,
        "policy_loss",
        lambda batch, params, **kw: (lambda out: (out[0] * float("nan"), out[1]))(real(batch, params, **kw)),
    )
    with pytest.raises(NonFiniteError) as err:
        trainer.update(random_groups(tok, seed=0))
    assert_one_clear_line(
        err.value, "stage rl, update 1: the loss is nan", "rl.lr=0.001", "rl.max_grad_norm=100"
    )
    assert trainer.version == 0  # no new version to publish
    assert all(torch.equal(v, before[k]) for k, v in _weights(trainer).items())  # the weights never saw it


def test_rl_update_with_an_infinite_gradient_stops_before_the_optimizer_step():
    trainer, tok = _trainer(minibatches=2)
    before = _weights(trainer)
    next(trainer.model.parameters()).register_hook(lambda g: g * float("inf"))
    with pytest.raises(NonFiniteError) as err:
        trainer.update(random_groups(tok, seed=0))
    assert_one_clear_line(
        err.value, "stage rl, update 1 (minibatch 1/2): the gradient norm is", "rl.lr=0.001"
    )
    assert trainer.version == 0
    assert all(torch.equal(v, before[k]) for k, v in _weights(trainer).items())


class HalfRight:
    """Right when the response starts with a digit of the gold's parity: groups get varied rewards."""

    def verify_batch(self, responses, golds):
        return [Verdict(r[:1].isdigit() and int(r[0]) % 2 == int(g) % 2) for r, g in zip(responses, golds)]


def test_rl_with_lr_1e30_stops_the_sync_loop(tmp_path):
    from conf.schema import RLConfig
    from generation.model import encode_prompt
    from generation.records import PromptItem
    from tests.training.rl_fakes import saved_model
    from training.rl.drivers.local import LocalDriver

    tok = build_char_tokenizer()
    model = build_tiny_model(MICRO, tok, seed=0)
    items = [PromptItem(f"p{i}", f"{i}+1", str(i % 2), encode_prompt(tok, f"{i}+1\n"), 1) for i in range(16)]
    rl = RLConfig(
        steps=6,
        prompts_per_step=4,
        group_size=4,
        lr=1e30,
        max_new_tokens=3,
        micro_batch_tokens=0,
        eval_every=0,
    )
    model_dir = saved_model(tmp_path, model, tok)
    with pytest.raises(NonFiniteError) as err:
        LocalDriver(
            model_dir, items, HalfRight(), PRESETS["grpo"], RLSections(rl, seed=0), device="cpu"
        ).run()
    assert_one_clear_line(err.value, "stage rl, update", "rl.lr=1e+30")


@pytest.mark.parametrize(
    "override",
    [
        "sft.lr=inf",
        "sft.lr=nan",
        "rl.lr=inf",
        "rl.lr=nan",
        "curation.rft.lr=inf",
        "sft.max_grad_norm=0",
        "rl.max_grad_norm=-1",
        "sft.weight_decay=-0.1",
        "rl.weight_decay=-1",
        "eval.verifier_timeout_s=0",
        "eval.verifier_timeout_s=inf",
        "rl.temperature=inf",
        "rl.kl_coef=nan",
        "rl.clip_high=nan",
        "rl.is_cap=0",
        "curation.select.round_headroom=nan",
        "sft.warmup_steps=-1",
        "cluster.trainer_gpus=-1",
        "model.num_heads=0",
        "data.max_prompt_chars=0",
    ],
)
def test_config_refuses_non_finite_and_out_of_range_optimizer_settings(override):
    key = override.split("=")[0]
    with pytest.raises(ConfigError) as err:
        load_config([override])
    assert f"{key}=" in str(err.value) and "\n" not in str(err.value), str(err.value)


@pytest.mark.slow
def test_deepspeed_trainer_inherits_the_check():
    """DeepSpeed's engine steps before its global norm is known: the update still raises (every
    rank sees the same norm) and publishes no version."""
    pytest.importorskip("deepspeed")
    # a one-rank group in a child process: DeepSpeed's process group must not outlive this test
    code = f"""
import os, socket, sys
sys.path.insert(0, {str(ROOT)!r})
import torch
from tests.training.dist_worker import TRAIN_KW, random_groups
from tests.training.rl_fakes import MICRO, Verdict
from generation.model import build_char_tokenizer, build_tiny_model
from training.finite import NonFiniteError
from training.objectives import PRESETS
from training.rl.trainer import DeepSpeedPolicyTrainer, init_distributed
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
init_distributed("gloo", 0, 1, "127.0.0.1", port, deepspeed_comm=True)
tok = build_char_tokenizer()
trainer = DeepSpeedPolicyTrainer(build_tiny_model(MICRO, tok, seed=0), PRESETS["grpo"],
                                 pad_id=tok.pad_token_id,
                                 ds_config={{"zero_optimization": {{"stage": 2}}}}, **TRAIN_KW)
next(trainer.model.parameters()).register_hook(lambda g: g * float("inf"))
try:
    trainer.update(random_groups(tok, seed=0))
except NonFiniteError as e:
    print("RAISED", trainer.version, e)
"""
    env = {
        **os.environ,
        "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", "/tmp/laminar-ds-ext"),
    }
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert "RAISED 0 stage rl, update 1: the gradient norm is" in proc.stdout, (
        proc.stdout[-2000:] + proc.stderr[-3000:]
    )


# ---- the real CLI ------------------------------------------------------------------------------


def laminar(*args: str, ws: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", *args, "--workspace", str(ws)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


def catalog_rows(ws: Path, sql: str) -> list[tuple]:
    import duckdb

    con = duckdb.connect(str(ws / "catalog.duckdb"), read_only=True)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


@pytest.mark.slow
@pytest.mark.e2e
def test_cli_warmup_with_lr_1e30_fails_caches_nothing_and_the_rerun_recomputes(tmp_path):
    ws = tmp_path / "ws"
    args = [
        "run",
        "--until",
        "warmup",
        "sft.lr=1e30",
        "sft.steps=5",
        "sft.batch_size=8",
        "data.pool_size=200",
        "data.heldout_size=20",
        "threads=1",
    ]
    for attempt in range(2):  # the second run must recompute warmup (and fail the same way), not reuse it
        proc = laminar(*args, ws=ws)
        assert proc.returncode != 0, proc.stdout[-2000:]
        out = proc.stderr + proc.stdout
        assert "stage warmup, SFT step" in out and "not finite" in out and "sft.lr=1e+30" in out, proc.stderr[
            -3000:
        ]
        statuses = catalog_rows(ws, "SELECT status FROM runs ORDER BY started_at")
        assert [s for (s,) in statuses] == ["failed"] * (attempt + 1)
        assert catalog_rows(ws, "SELECT count(*) FROM stage_runs WHERE stage = 'warmup'") == [(0,)]
        assert catalog_rows(ws, "SELECT stage FROM checkpoints ORDER BY stage") == [("base_model",)]
        models = [p for p in (ws / "artifacts" / "model").iterdir() if (p / "manifest.json").exists()]
        assert (
            len(models) == 1 and json.loads((models[0] / "manifest.json").read_text())["files"]
        )  # base_model
    ok = laminar(*[a for a in args if not a.startswith("sft.lr")], ws=ws)
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert catalog_rows(ws, "SELECT status FROM stage_runs WHERE stage = 'warmup'") == [("ran",)]
