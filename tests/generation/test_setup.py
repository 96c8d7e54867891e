"""Process set-up: DeepSpeed's accelerator probe stays quiet on a machine without CUDA."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the probe only warns without CUDA")
def test_a_stage_process_saving_a_model_prints_no_deepspeed_accelerator_warning(tmp_path):
    # transformers imports DeepSpeed when it saves a model; without DS_ACCELERATOR its probe warns
    script = (
        "from pathlib import Path\n"
        "from conf.schema import ModelConfig\n"
        "from generation.setup import setup_torch\n"
        "from training.base import build_base_model\n"
        "setup_torch(1, 0)\n"
        f"build_base_model(ModelConfig(), 0, Path({str(tmp_path / 'm')!r}))\n"
        "import sys; assert 'deepspeed' in sys.modules, 'no DeepSpeed import: nothing proven'\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout + proc.stderr
    assert "Setting accelerator to CPU" not in out, out
    assert "Setting ds_accelerator" not in out, out
