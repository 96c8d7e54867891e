"""DeepSpeed's resume reads only what the checkpoint wrote: every file under ``deepspeed/`` must be
in the checkpoint's manifest with its sha256, and the files are read with ``weights_only=True``, so
a planted or rewritten pickle never runs code. Each case runs a single-rank DeepSpeed trainer (gloo,
CPU) in a fresh process, as the Ray trainer actor does."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")
ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import json, os, pickle, sys
    sys.path[:0] = [{root!r}, {training!r}]
    os.environ["TORCH_EXTENSIONS_DIR"] = {ext!r}
    import torch
    from dist_worker import TRAIN_KW, random_groups
    from rl_fakes import MICRO
    from generation.model import build_char_tokenizer, build_tiny_model
    from training.objectives import PRESETS
    from training.rl.checkpoint import MARKER, save_trainer_state, write_checkpoint
    from training.rl.trainer import DeepSpeedPolicyTrainer, init_distributed

    torch.set_num_threads(1)
    tok = build_char_tokenizer()
    init_distributed("gloo", 0, 1, "127.0.0.1", {port}, deepspeed_comm=True)

    def trainer():
        return DeepSpeedPolicyTrainer(build_tiny_model(MICRO, tok, seed=0), PRESETS["grpo"],
                                      ds_config={{"zero_optimization": {{"stage": 2}}}},
                                      pad_id=tok.pad_token_id, rank=0, world_size=1, **TRAIN_KW)

    a = trainer()
    a.update(random_groups(tok, seed=0))

    def writer(tmp):
        a.save(str(tmp))
        save_trainer_state(tmp, None, None, version=a.version)
    ckpt = write_checkpoint(__import__("pathlib").Path({ckpt!r}), 1, writer)
    case = {case!r}
    optim = next(p for p in (ckpt / "deepspeed").iterdir() if "optim" in p.name)
    if case == "planted":
        (ckpt / "deepspeed" / "extra.pt").write_bytes(optim.read_bytes())
    elif case == "rewritten":
        class Boom:
            def __reduce__(self):
                return (os.system, ("touch " + {flag!r},))
        optim.write_bytes(pickle.dumps(Boom()))
        # the attacker rewrites the manifest too: only weights_only stands between the file and a shell
        from core.artifacts import hash_file
        marker = json.loads((ckpt / MARKER).read_text())
        marker["files"][optim.relative_to(ckpt).as_posix()] = hash_file(optim)
        (ckpt / MARKER).write_text(json.dumps(marker))
    b = trainer()
    try:
        b.load(str(ckpt))
    except Exception as e:
        print("REFUSED", type(e).__name__, str(e).splitlines()[0][:300])
    else:
        same = all(torch.equal(x, y)
                   for x, y in zip(a.model.state_dict().values(), b.model.state_dict().values()))
        print("LOADED", same)
    import torch.distributed as dist
    dist.destroy_process_group()
""")


def load_case(tmp_path: Path, case: str, port: int) -> str:
    code = SCRIPT.format(
        root=str(ROOT),
        training=str(ROOT / "tests" / "training"),
        ext=str(tmp_path / "ext"),
        port=port,
        ckpt=str(tmp_path / "ckpt"),
        case=case,
        flag=str(tmp_path / "pwned"),
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=tmp_path
    )
    lines = [x for x in out.stdout.splitlines() if x.startswith(("REFUSED", "LOADED"))]
    assert lines, out.stderr[-3000:]
    return lines[-1]


def test_an_intact_deepspeed_checkpoint_loads_weights_only(tmp_path):
    assert load_case(tmp_path, "intact", 29611) == "LOADED True"


def test_a_file_the_checkpoint_did_not_write_is_refused(tmp_path):
    line = load_case(tmp_path, "planted", 29612)
    assert (
        line.startswith("REFUSED ValueError") and "extra.pt is not in the checkpoint's COMPLETE.json" in line
    )


def test_a_rewritten_pickle_never_runs(tmp_path):
    line = load_case(tmp_path, "rewritten", 29613)
    assert line.startswith("REFUSED UnpicklingError") and "Weights only load failed" in line, line
    assert not (tmp_path / "pwned").exists()
