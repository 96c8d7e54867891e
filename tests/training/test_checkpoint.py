"""Atomic RL checkpoints: marker-last writes, corruption and partial folders ignored, pruning,
bit-identical trainer resume (no pickle), and a writer SIGKILLed mid-checkpoint."""

import functools
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from training.rl.checkpoint import (
    MARKER,
    latest_checkpoint,
    list_checkpoints,
    load_json,
    load_trainer_state,
    save_json,
    save_trainer_state,
    write_checkpoint,
)

ROOT = Path(__file__).resolve().parents[2]


def _files_writer(payload: dict[str, bytes]):
    def writer(d: Path) -> None:
        for name, data in payload.items():
            (d / name).parent.mkdir(parents=True, exist_ok=True)
            (d / name).write_bytes(data)

    return writer


def _names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_write_then_read_back(tmp_path):
    path = write_checkpoint(tmp_path, 3, _files_writer({"a.bin": b"aaa", "sub/b.txt": b"bb"}))
    assert path == tmp_path / "step-000003"
    marker = json.loads((path / MARKER).read_text())
    assert marker["step"] == 3 and set(marker["files"]) == {"a.bin", "sub/b.txt"}
    assert latest_checkpoint(tmp_path) == path
    assert list_checkpoints(tmp_path) == [path]
    assert _names(tmp_path) == ["step-000003"]  # no temp folder left
    assert latest_checkpoint(tmp_path / "missing") is None


def test_writer_raising_leaves_previous_checkpoint(tmp_path):
    first = write_checkpoint(tmp_path, 1, _files_writer({"w": b"one"}))

    def failing(d: Path) -> None:
        (d / "w").write_bytes(b"two-half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        write_checkpoint(tmp_path, 2, failing)
    assert latest_checkpoint(tmp_path) == first
    assert _names(tmp_path) == ["step-000001"]  # no step-000002, no .tmp-*


def test_writer_must_not_write_marker(tmp_path):
    with pytest.raises(ValueError):
        write_checkpoint(tmp_path, 1, _files_writer({MARKER: b"{}"}))
    assert _names(tmp_path) == []


def test_markerless_and_corrupted_folders_are_ignored(tmp_path):
    good = write_checkpoint(tmp_path, 1, _files_writer({"w": b"one"}), keep=5)
    corrupt = write_checkpoint(tmp_path, 2, _files_writer({"w": b"two", "x": b"xx"}), keep=5)
    (corrupt / "w").write_bytes(b"tw0")  # same size, different bytes
    missing_file = write_checkpoint(tmp_path, 4, _files_writer({"w": b"four"}), keep=5)
    (missing_file / "w").unlink()
    bad_marker = write_checkpoint(tmp_path, 5, _files_writer({"w": b"five"}), keep=5)
    (bad_marker / MARKER).write_text("{not json")
    markerless = tmp_path / "step-000006"  # killed between rename and marker
    markerless.mkdir()
    (markerless / "w").write_bytes(b"six")
    (tmp_path / ".tmp-step-000009-999999").mkdir()  # someone's temp folder

    assert latest_checkpoint(tmp_path) == good
    assert markerless not in list_checkpoints(tmp_path) and bad_marker not in list_checkpoints(tmp_path)
    assert list_checkpoints(tmp_path, verify=True) == [good]


def test_rewriting_a_step_replaces_a_markerless_folder(tmp_path):
    stale = tmp_path / "step-000002"
    stale.mkdir(parents=True)
    (stale / "junk").write_bytes(b"partial")
    path = write_checkpoint(tmp_path, 2, _files_writer({"w": b"two"}))
    assert path == stale and sorted(p.name for p in path.iterdir()) == [MARKER, "w"]
    assert latest_checkpoint(tmp_path) == path


def test_keep_prunes_older_complete_checkpoints(tmp_path):
    for step in range(1, 5):
        write_checkpoint(tmp_path, step, _files_writer({"w": str(step).encode()}), keep=2)
    assert _names(tmp_path) == ["step-000003", "step-000004"]
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000003", "step-000004"]
    # keep=1; a marker-less leftover of a lower step is cleared as well
    (tmp_path / "step-000004" / MARKER).unlink()
    write_checkpoint(tmp_path, 5, _files_writer({"w": b"5"}), keep=1)
    assert _names(tmp_path) == ["step-000005"]
    assert latest_checkpoint(tmp_path).name == "step-000005"


def test_save_and_load_json(tmp_path):
    state = {"cursor": 17, "buffer": [{"prompt_id": "p1", "logprobs": [-0.5, -1.25]}], "in_flight": ["p2"]}
    save_json(tmp_path, "coordinator", state)
    assert (tmp_path / "coordinator.json").exists()
    assert load_json(tmp_path, "coordinator") == state
    with pytest.raises(TypeError):
        save_json(tmp_path, "bad", {"x": object()})


# ---- trainer state: bit-identical resume -------------------------------------------------------


class Tiny(torch.nn.Module):
    """Embedding tied to the output head, plus dropout so a step consumes the torch RNG."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(11, 8)
        self.hidden = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.head = torch.nn.Linear(8, 11, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.drop = torch.nn.Dropout(0.2)

    def forward(self, x):
        return self.head(self.drop(self.norm(torch.tanh(self.hidden(self.emb(x))))))


def _build(seed=0):
    torch.manual_seed(seed)
    model = Tiny()
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (n.endswith("weight") and "norm" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-2,
        betas=(0.85, 0.97),
        eps=1e-7,
    )
    return model, opt


def _step(model, opt):
    # the batch and the dropout masks come from the global RNGs, so they must be restored exactly
    x = torch.randint(0, 11, (4, 5))
    y = torch.tensor([random.randrange(11) for _ in range(4 * 5)]).view(4, 5)
    noise = float(np.random.random())
    loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()) * (1.0 + noise)
    opt.zero_grad()
    loss.backward()
    opt.step()


def _seed_all(seed):
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def test_resume_is_bit_identical(tmp_path):
    model_a, opt_a = _build()
    _seed_all(123)
    for _ in range(3):
        _step(model_a, opt_a)
    draws_a = (torch.rand(3), random.random(), np.random.random())

    model_b, opt_b = _build()
    _seed_all(123)
    for _ in range(2):
        _step(model_b, opt_b)
    ckpt = write_checkpoint(
        tmp_path,
        2,
        functools.partial(save_trainer_state, model=model_b, optimizer=opt_b, version=2, extra={"cursor": 8}),
    )
    assert {"model.safetensors", "optimizer.safetensors", "rng.safetensors", "trainer_state.json"} <= set(
        json.loads((ckpt / MARKER).read_text())["files"]
    )
    del model_b, opt_b
    _seed_all(999)  # the fresh process would have other RNG states

    model_c, opt_c = _build(seed=7)  # different init: everything must come from the checkpoint
    info = load_trainer_state(latest_checkpoint(tmp_path), model_c, opt_c)
    assert info["version"] == 2 and info["extra"] == {"cursor": 8}
    assert model_c.head.weight is model_c.emb.weight  # still tied after load
    g = opt_c.param_groups
    assert g[0]["betas"] == (0.85, 0.97) and g[0]["eps"] == 1e-7 and g[0]["weight_decay"] == 0.1
    assert g[1]["weight_decay"] == 0.0 and g[0]["lr"] == 1e-2
    _step(model_c, opt_c)

    for (name, pa), (_, pc) in zip(model_a.named_parameters(), model_c.named_parameters()):
        assert torch.equal(pa, pc), name
    for pa, pc in zip(model_a.parameters(), model_c.parameters()):
        sa, sc = opt_a.state[pa], opt_c.state[pc]
        assert set(sa) == set(sc) == {"step", "exp_avg", "exp_avg_sq"}
        for k in sa:
            assert torch.equal(sa[k], sc[k]), k
    draws_c = (torch.rand(3), random.random(), np.random.random())
    assert torch.equal(draws_a[0], draws_c[0]) and draws_a[1:] == draws_c[1:]


def test_optimizer_tensors_are_keyed_by_param_index(tmp_path):
    from safetensors import safe_open

    model, opt = _build()
    _seed_all(0)
    _step(model, opt)
    save_trainer_state(tmp_path, model, opt, version=1)
    with safe_open(str(tmp_path / "optimizer.safetensors"), "pt") as f:
        keys = set(f.keys())
    n_params = sum(len(g["params"]) for g in opt.param_groups)
    assert keys == {f"state.{i}.{k}" for i in range(n_params) for k in ("step", "exp_avg", "exp_avg_sq")}
    state = json.loads((tmp_path / "trainer_state.json").read_text())
    assert state["version"] == 1 and len(state["optimizer"]["param_groups"]) == 2


# ---- a writer SIGKILLed in the middle of a checkpoint ------------------------------------------

_CHILD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    sys.path.insert(0, {root!r})
    from training.rl.checkpoint import write_checkpoint

    root = Path({ckpt!r})

    def full(d):
        for i in range(4):
            (d / f"part{{i}}").write_bytes(b"one" * 100)

    def half_then_hang(d):
        for i in range(2):
            (d / f"part{{i}}").write_bytes(b"two" * 100)
        (d / "READY").write_bytes(b"")
        time.sleep(120)
        for i in range(2, 4):
            (d / f"part{{i}}").write_bytes(b"two" * 100)

    write_checkpoint(root, 1, full)
    write_checkpoint(root, 2, half_then_hang)
""")


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_sigkill_inside_writer_keeps_previous_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    proc = subprocess.Popen([sys.executable, "-c", _CHILD.format(root=str(ROOT), ckpt=str(ckpt))])
    try:
        deadline = time.monotonic() + 120
        while not list(ckpt.glob(".tmp-step-000002-*/READY")):
            assert proc.poll() is None, "child exited before reaching the writer"
            assert time.monotonic() < deadline, "child never reached checkpoint 2"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    latest = latest_checkpoint(ckpt)
    assert latest == ckpt / "step-000001"
    assert (latest / "part3").read_bytes() == b"one" * 100
    assert not (ckpt / "step-000002").exists()
    assert list(ckpt.glob(".tmp-step-000002-*"))  # the dead writer's temp folder is still there...

    # ...until the next write (the resumed trainer) clears it and completes step 2
    path = write_checkpoint(ckpt, 2, _files_writer({"part0": b"again"}))
    assert latest_checkpoint(ckpt) == path
    assert _names(ckpt) == ["step-000001", "step-000002"]


def test_tied_llama_round_trip(tmp_path):
    """The runtime's real model: HF Llama with tied embeddings, stored once and re-tied on load."""
    from rl_fakes import MICRO
    from safetensors import safe_open

    from generation.model import build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer()
    model = build_tiny_model(MICRO, tok, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.tensor([[1, 5, 6, 7, 2]])
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    save_trainer_state(tmp_path, model, opt, version=1)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert len({"model.embed_tokens.weight", "lm_head.weight"} & set(f.keys())) == 1

    fresh = build_tiny_model(MICRO, tok, seed=1)
    load_trainer_state(tmp_path, fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-3))
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight
    for (name, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(a, b), name
