"""LoRA through the real `laminar` CLI on a micro config: warm-up, RFT and RL write PEFT adapter
folders on the base model (the lineage's root), `laminar eval ckpt=` takes the adapter checkpoint and
`laminar export` writes it merged as a plain save_pretrained folder."""

from __future__ import annotations

import json

import pytest

from tests.configs import TINY_CURATED
from tests.e2e.cli import laminar, latest_summary

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # two minutes on the loaded 2-core machine: make test-slow


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    ws = tmp_path_factory.mktemp("ws-lora")
    laminar(
        "run", *TINY_CURATED, "model.lora.enabled=true", "model.lora.rank=4", "tracking.backends=[]", ws=ws
    )
    return ws, latest_summary(ws)


def test_adapter_stages_write_peft_folders_on_the_base(lora_run):
    from peft import PeftModel

    from generation.adapter import base_dir
    from generation.model import load_model

    ws, summary = lora_run
    sha = {s: summary["stages"][s]["artifacts"]["model"] for s in ("base_model", "warmup", "rft", "rl")}
    base = ws / "artifacts" / "model" / sha["base_model"]
    assert (base / "model.safetensors").is_file() and not (base / "adapter_config.json").exists()
    for stage in ("warmup", "rft", "rl"):
        folder = ws / "artifacts" / "model" / sha[stage]
        assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in folder.iterdir()}
        assert not (folder / "model.safetensors").exists(), f"{stage} wrote full weights"
        assert (
            json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"]
            == sha["base_model"]
        )
        assert base_dir(folder) == base.resolve()
    PeftModel.from_pretrained(load_model(base)[0], str(ws / "artifacts" / "model" / sha["rl"]))


def test_eval_and_export_take_the_adapter_checkpoint(lora_run, tmp_path):
    import numpy as np

    from generation.adapter import sequence_logprobs
    from generation.model import load_model

    ws, summary = lora_run
    rl_sha = summary["stages"]["rl"]["artifacts"]["model"]
    out = laminar("eval", f"ckpt={rl_sha[:10]}", "eval.n_samples=1", ws=ws)
    assert "arith_heldout" in out.stdout
    laminar("export", f"ckpt={rl_sha[:10]}", f"out={tmp_path / 'merged'}", ws=ws)
    merged = tmp_path / "merged"
    assert (merged / "model.safetensors").is_file() and not (merged / "adapter_config.json").exists()
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(str(merged), use_safetensors=True)
    adapted, tok = load_model(ws / "artifacts" / "model" / rl_sha)
    seq = [tok.bos_token_id] + list(tok("1+2=3", add_special_tokens=False)["input_ids"])
    np.testing.assert_allclose(sequence_logprobs(plain, seq), sequence_logprobs(adapted, seq), atol=1e-5)
    lineage = laminar("lineage", rl_sha[:10], ws=ws).stdout
    base16 = summary["stages"]["base_model"]["artifacts"]["model"][:16]
    assert (
        f"base model {base16}" in lineage and f"LoRA adapter (rank 4, alpha 32.0) on base {base16}" in lineage
    )
