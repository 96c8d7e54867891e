"""The vLLM worker's LoRA request path, over ``tests/generation/fake_vllm`` (whose ``enable_lora`` mode
runs the real model and applies the adapter a request names, as vLLM does): a published adapter
version becomes one PEFT folder that ``peft`` loads, every request after it is sampled under it, and
the behaviour log-probs the worker returns equal those of the base with that adapter computed here
with ``peft``. The negative control: a worker that submits without the ``lora_request`` fails the same
check. vLLM itself is not run here (no GPU); ``test_rollout_protocol`` runs its conformance part where
vLLM is installed."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conf.schema import (
    LLAMA_LINEAR_MODULES,
    ConfigError,
    EngineOptions,
    LoraConfig,
    ModelConfig,
    RolloutConfig,
)
from generation.adapter import SCALING_KEY, adapter_rank, sequence_logprobs
from generation.engines import make_engine, worker_command
from generation.model import build_char_tokenizer, build_tiny_model, encode_prompt, load_model, save_model
from generation.protocol import REPO_ROOT, ProtocolError, weights_dir, write_weights
from generation.records import GenRequest, PromptItem

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = ModelConfig(
    hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=128
)
FAKE = str(Path(__file__).resolve().parent / "fake_vllm")
RANK, TEMP, MAX_NEW, TOL = 4, 0.8, 10, 1e-4


def _peft_version(base_dir, seed):
    """A PEFT model on the base with a random adapter (lora_B not zero: it changes the outputs)."""
    from peft import get_peft_model

    from training.lora import peft_config

    model, _ = load_model(base_dir)
    torch.manual_seed(seed)
    model = get_peft_model(
        model,
        peft_config(
            LoraConfig(enabled=True, rank=RANK, alpha=2.0 * RANK, target_modules=list(LLAMA_LINEAR_MODULES))
        ),
    )
    g = torch.Generator().manual_seed(100 + seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model.eval()


@pytest.fixture(scope="module")
def assets(tmp_path_factory, one_thread):
    from training.lora import adapter_state

    tok = build_char_tokenizer()
    base = build_tiny_model(SMALL, tok, seed=0)
    with torch.no_grad():  # EOS scaled up: responses end at varied lengths
        base.get_input_embeddings().weight[tok.eos_token_id] *= 40
    base_dir = tmp_path_factory.mktemp("vllm-lora-base")
    save_model(base, tok, base_dir)
    versions = {k: _peft_version(base_dir, seed=k) for k in (1, 2)}
    states = {k: adapter_state(m) for k, m in versions.items()}
    items = [
        PromptItem(
            f"p{i}", f"What is {i}+2?", str(i + 2), encode_prompt(tok, f"What is {i}+2?" + "y" * (i % 3))
        )
        for i in range(4)
    ]
    reqs = [GenRequest(p, s, group_uid=i) for i, p in enumerate(items) for s in range(2)]
    return {
        "tok": tok,
        "dir": str(base_dir),
        "versions": versions,
        "states": states,
        "reqs": reqs,
        "base": load_model(base_dir)[0].eval(),
    }


def _drain(engine):
    out = []
    for _ in range(500):
        st = engine.status()
        if st["active"] == 0 and st["queued"] == 0:
            return out
        out.extend(engine.step(3))
    raise AssertionError("engine did not drain")


def _gaps(trajs, model) -> list[float]:
    """Per trajectory: the largest |behaviour log-prob - log-prob under ``model``| over its tokens."""
    gaps = []
    for t in trajs:
        prompt = list(t.prompt.prompt_tokens)
        ref = sequence_logprobs(model, prompt + list(t.response_tokens), TEMP)[len(prompt) - 1 :]
        assert len(ref) == len(t.behaviour_logprobs) > 0
        gaps.append(max(abs(a - b) for a, b in zip(t.behaviour_logprobs, ref)))
    return gaps


def _lora_folders(pid: int) -> list[Path]:
    return sorted(Path(weights_dir()).glob(f"laminar-lora-{pid}-*/v*-id*"))


@pytest.fixture(scope="module")
def worker(assets):
    rollout = RolloutConfig(engine="vllm", vllm_python=sys.executable)
    eng = make_engine(
        assets["dir"],
        EngineOptions(
            capacity=4, max_new_tokens=MAX_NEW, temperature=TEMP, seed=0, lora_rank=RANK, rollout=rollout
        ),
        env={"PYTHONPATH": os.pathsep.join([FAKE, str(REPO_ROOT)]), "OMP_NUM_THREADS": "1"},
    )
    yield eng
    eng.close()


def test_each_adapter_version_is_one_peft_folder_and_samples_under_it(worker, assets):
    from peft import PeftModel

    eng, versions, probe = worker, assets["versions"], [assets["tok"].bos_token_id] + list(range(5, 25))
    assert eng.info["features"]["lora"]
    pid = eng.info["pid"]
    seen = {}
    for k in (1, 2):
        eng.load_weights(k, state=assets["states"][k])
        folders = _lora_folders(pid)
        assert [f.name.split("-")[0] for f in folders] == [f"v{k}"], folders  # the one before is deleted
        seen[k] = folders[0]
        assert sorted(p.name for p in folders[0].iterdir()) == [
            "adapter_config.json",
            "adapter_model.safetensors",
        ]
        loaded = PeftModel.from_pretrained(load_model(assets["dir"])[0], str(folders[0])).eval()
        gap = max(
            abs(a - b)
            for a, b in zip(sequence_logprobs(loaded, probe), sequence_logprobs(versions[k], probe))
        )
        assert gap < 1e-5, f"peft loads the worker's folder for version {k} as another model ({gap:.3g})"
        eng.submit(assets["reqs"])
        out = _drain(eng)
        assert len(out) == len(assets["reqs"]) and all(t.version == k == t.last_version for t in out)
        gaps = _gaps(out, versions[k])
        assert max(gaps) <= TOL, (
            f"version {k}: behaviour log-probs differ from the peft model's by {max(gaps):.3g}"
        )
        other = _gaps(out, versions[3 - k]) + _gaps(out, assets["base"])
        assert min(other) > 100 * TOL, "the check cannot tell this version from the other one or the base"
    assert seen[1].name != seen[2].name and not seen[1].exists()


def test_a_load_in_flight_continues_under_the_new_adapter(worker, assets):
    eng, versions = worker, assets["versions"]
    eng.load_weights(1, state=assets["states"][1])
    eng.submit(assets["reqs"])
    done = eng.step(2)  # every live request has two tokens from version 1
    eng.load_weights(2, state=assets["states"][2])
    out = done + _drain(eng)
    assert len(out) == len(assets["reqs"])
    moved = [t for t in out if t.version == 1 and t.last_version == 2]
    assert moved, "no sequence was in flight across the load"
    for t in moved:  # version 1's tokens, then version 2's: each part under exactly its own adapter
        g1, g2 = _per_token_gaps(t, versions[1]), _per_token_gaps(t, versions[2])
        split = next(i for i, g in enumerate(g1) if g > TOL)
        assert split >= 2 and max(g2[split:]) <= TOL, (g1, g2)
    assert all(max(_gaps([t], versions[2])) <= TOL for t in out if t.version == 2)


def _per_token_gaps(t, model) -> list[float]:
    prompt = list(t.prompt.prompt_tokens)
    ref = sequence_logprobs(model, prompt + list(t.response_tokens), TEMP)[len(prompt) - 1 :]
    return [abs(a - b) for a, b in zip(t.behaviour_logprobs, ref)]


@pytest.fixture
def in_process(monkeypatch):
    """``generation.vllm_worker.VllmEngine`` in this process over the fake vLLM; the fake is taken off
    ``sys.modules`` afterwards (other tests decide by ``find_spec("vllm")`` whether vLLM is here)."""
    monkeypatch.syspath_prepend(FAKE)
    yield
    for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
        del sys.modules[name]


def test_a_worker_that_submits_without_the_adapter_fails_the_check(in_process, assets, monkeypatch):
    from generation.vllm_worker import VllmEngine

    eng = VllmEngine(
        assets["dir"], capacity=4, max_new_tokens=MAX_NEW, temperature=TEMP, seed=0, lora_rank=RANK
    )
    try:
        path = write_weights(assets["states"][1])
        try:
            eng.load_weights(1, path=path)
        finally:
            os.unlink(path)
        eng.submit(assets["reqs"][:4])
        assert max(_gaps(_drain(eng), assets["versions"][1])) <= TOL  # as it is: right
        add = eng.engine.add_request
        monkeypatch.setattr(
            eng.engine, "add_request", lambda rid, prompt, params, lora_request=None: add(rid, prompt, params)
        )  # the adapter dropped on submit
        eng.submit(assets["reqs"][:4])
        gaps = _gaps(_drain(eng), assets["versions"][1])
        assert min(gaps) > 100 * TOL, "a worker that ignores the adapter passed the check"
    finally:
        eng.close()
    assert not Path(eng._lora_root).exists()


def test_bad_adapters_give_clear_errors(in_process, assets):
    from generation.vllm_worker import VllmEngine, vllm_max_lora_rank

    def load(eng, state):
        path = write_weights(state)
        try:
            eng.load_weights(7, path=path)
        finally:
            os.unlink(path)

    plain = VllmEngine(assets["dir"], capacity=2, max_new_tokens=4, temperature=TEMP, seed=0)
    with pytest.raises(ProtocolError, match="started without --lora-rank"):
        load(plain, assets["states"][1])
    eng = VllmEngine(assets["dir"], capacity=2, max_new_tokens=4, temperature=TEMP, seed=0, lora_rank=RANK)
    assert eng.max_lora_rank == 8 and eng.llm.adapters.max_lora_rank == 8 and eng.llm.adapters.capacity == 1
    name = "base_model.model.model.layers.0.self_attn.q_proj"
    h = SMALL.hidden_size
    wide = {
        f"{name}.lora_A.weight": np.zeros((16, h), np.float32),
        f"{name}.lora_B.weight": np.zeros((h, 16), np.float32),
        SCALING_KEY: np.array([2.0], np.float32),
    }
    with pytest.raises(ProtocolError, match="rank 16 > the worker's max_lora_rank 8"):
        load(eng, wide)
    with pytest.raises(ProtocolError, match="does not fit the base weight"):
        load(eng, {**wide, f"{name}.lora_B.weight": np.zeros((h + 1, 16), np.float32)})
    ghost = "base_model.model.model.layers.9.self_attn.q_proj"
    with pytest.raises(ProtocolError, match="which the base model"):
        load(
            eng,
            {
                f"{ghost}.lora_A.weight": np.zeros((4, h), np.float32),
                f"{ghost}.lora_B.weight": np.zeros((h, 4), np.float32),
                SCALING_KEY: np.array([2.0], np.float32),
            },
        )
    with pytest.raises(ProtocolError, match="lora_A or lora_B missing"):
        load(
            eng,
            {f"{name}.lora_A.weight": np.zeros((4, h), np.float32), SCALING_KEY: np.array([2.0], np.float32)},
        )
    assert eng.version == 0 and eng.lora_request is None  # nothing changed
    assert [vllm_max_lora_rank(r) for r in (1, 8, 9, 512)] == [8, 8, 16, 512]
    with pytest.raises(ValueError, match="above vLLM's largest max_lora_rank"):
        vllm_max_lora_rank(513)
    plain.close()
    eng.close()


def test_the_lora_rank_travels_from_the_adapter_folder_to_the_worker_flags(tmp_path, assets):
    from conf.loader import load_config

    assets["versions"][1].save_pretrained(tmp_path / "adapter")
    assert adapter_rank(tmp_path / "adapter") == RANK and adapter_rank(assets["dir"]) == 0
    opts = EngineOptions(lora_rank=adapter_rank(tmp_path / "adapter"), rollout=RolloutConfig(engine="vllm"))
    assert worker_command("/m", opts, python="py", device="cuda")[-2:] == ["--lora-rank", str(RANK)]
    process = EngineOptions(lora_rank=RANK, rollout=RolloutConfig(engine="torch-process"))
    assert "--lora-rank" not in worker_command("/m", process, python="py", device="cuda")
    lora_vllm = [
        "device=cuda",
        "rollout.engine=vllm",
        "model.lora.enabled=true",
        "model.lora.stages=[rft,rl]",
    ]
    assert load_config(lora_vllm).model.lora.on("rl")  # accepted now
    with pytest.raises(ConfigError, match="vLLM takes adapters up to rank 512"):
        load_config(lora_vllm + ["model.lora.rank=1024"])
