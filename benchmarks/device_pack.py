"""Pack the Python packages the device proof needs for the lent GPU machine, and unpack them there.

The lent H200 machine (Python 3.12, torch 2.11 and the image's packages, no package registry) lacks
Ray, DeepSpeed, Hydra/OmegaConf and math-verify. They travel as cp312 wheels (DeepSpeed as its
sdist, built there) in the ignored folder ``.devicepack/``, named in the device call's ``carry``.
A call moves at most 64 MiB, the working tree included, and Ray's wheel alone is 79 MB: its Java
jars (``ray/jars``, 32 MB, for Java workers only) are dropped, the rest is rewritten as an
uncompressed zip and xz-compressed (about 32 MB), and the result is split into chunks that fit the
calls' budget; each chunk, the joined archive and the rebuilt wheel carry a sha256 in
``manifest.json``. One call does when everything fits (the default); ``--full-ray`` keeps the jars
and needs two consecutive calls (a warm machine keeps the first call's chunk).

    python benchmarks/device_pack.py pack            # here: download, build, split; prints the call plan
    python benchmarks/device_pack.py plan            # the call plan of an existing pack
    python3 benchmarks/device_pack.py unpack --dest /tmp/laminar-wheels   # there: verify, join, rebuild

``unpack`` uses the standard library only (it runs before anything is installed) and fails on any
sha256 mismatch or a missing chunk, naming it. ``benchmarks/device_proof.sh`` calls it, then
``pip install --no-index --no-deps --target /tmp/site`` of the wheels and the DeepSpeed sdist.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import math
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACK = ROOT / ".devicepack"
MIB = 1 << 20
CALL_LIMIT = 64 * MIB
"""What one device call may move: the working tree plus the carried paths."""
MARGIN = 3 * MIB
"""Headroom under ``CALL_LIMIT`` for files added to the working tree after packing."""

PLATFORM_ARGS = [
    "--python-version",
    "3.12",
    "--implementation",
    "cp",
    *[
        a
        for p in (
            "manylinux_2_28_x86_64",
            "manylinux_2_27_x86_64",
            "manylinux_2_17_x86_64",
            "manylinux2014_x86_64",
            "manylinux1_x86_64",
        )
        for a in ("--platform", p)
    ],
]
RAY = "ray==2.60.0"
WHEELS = [
    # DeepSpeed's needs the image lacks (../shared/DESIGN.md: measured on the lent H200)
    "hjson==3.1.0",
    "pydantic==2.14.4",
    "pydantic_core==2.50.5",
    "annotated-types==0.8.0",
    "typing-inspection==0.4.5",
    "typing_extensions==4.16.0",
    # the config loader (conf/loader.py) and the verifier (rewards/verifier.py)
    "hydra-core==1.3.8",
    "omegaconf==2.3.0",
    "math-verify==0.9.0",
    "latex2sympy2_extended==1.11.0",
    # Ray's needs the image lacks (click, filelock, msgpack, packaging, protobuf, pyyaml, requests are there)
    "jsonschema==4.26.0",
    "jsonschema-specifications==2025.9.1",
    "referencing==0.37.0",
    "rpds-py==2026.9.1",
]
BUILT = ["antlr4-python3-runtime==4.9.3"]
"""Published as an sdist only: built here into a pure-Python wheel (Hydra and math-verify need it)."""
SDISTS = ["deepspeed==0.19.8"]
"""Built there (``--no-build-isolation``, no ops compiled ahead: DS_BUILD_OPS=0)."""


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(MIB), b""):
            h.update(block)
    return h.hexdigest()


# ------------------------------------------------------------------------------------------ chunks
def split(path: Path, chunk_bytes: int, out_dir: Path) -> list[dict]:
    """``path`` cut into ``out_dir/<name>.partNN`` of at most ``chunk_bytes``: [{name, bytes, sha256}]."""
    out_dir.mkdir(parents=True, exist_ok=True)
    parts = []
    with open(path, "rb") as f:
        for i in range(max(1, math.ceil(path.stat().st_size / chunk_bytes))):
            data = f.read(chunk_bytes)
            part = out_dir / f"{path.name}.part{i:02d}"
            part.write_bytes(data)
            parts.append({"name": part.name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    return parts


def join(parts: list[dict], search: list[Path], out: Path, whole_sha256: str) -> Path:
    """Concatenate the chunks (each found in the first folder of ``search`` holding it, its sha256
    checked) into ``out`` and check the whole's sha256. Raises ``FileNotFoundError`` naming the
    missing chunks, ``ValueError`` on a mismatch."""
    found, missing = [], []
    for p in parts:
        hit = next((d / p["name"] for d in search if (d / p["name"]).is_file()), None)
        (found if hit else missing).append(hit or p["name"])
    if missing:
        raise FileNotFoundError(
            f"missing chunks {missing} (looked in {[str(d) for d in search]}); "
            "carry them in consecutive calls (docs/device_proof.md)"
        )
    h = hashlib.sha256()
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "wb") as w:
        for p, path in zip(parts, found):
            data = path.read_bytes()
            if hashlib.sha256(data).hexdigest() != p["sha256"]:
                raise ValueError(f"chunk {path} is corrupt (sha256 mismatch)")
            h.update(data)
            w.write(data)
    if h.hexdigest() != whole_sha256:
        raise ValueError(
            f"joined {out.name} has the wrong sha256 ({h.hexdigest()[:12]} != {whole_sha256[:12]})"
        )
    return out


# ------------------------------------------------------------------------------------------ ray
def slim_stored(wheel: Path, out: Path, drop: tuple[str, ...]) -> dict:
    """``wheel`` rewritten as an uncompressed zip without the members under ``drop`` (and their RECORD
    lines): xz then compresses across files, which the wheel's per-file deflate cannot."""
    dropped = 0
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            if info.filename.startswith(drop):
                dropped += info.file_size
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                data = b"".join(
                    line for line in data.splitlines(keepends=True) if not line.decode().startswith(drop)
                )
            info.compress_type = zipfile.ZIP_STORED
            dst.writestr(info, data)
    return {"dropped": list(drop), "dropped_bytes": dropped}


def xz(src: Path, out: Path, preset: int = 6) -> None:
    with open(src, "rb") as r, lzma.open(out, "wb", preset=preset) as w:
        shutil.copyfileobj(r, w, 4 * MIB)


def unxz(src: Path, out: Path) -> None:
    with lzma.open(src, "rb") as r, open(out, "wb") as w:
        shutil.copyfileobj(r, w, 4 * MIB)


# ------------------------------------------------------------------------------------------ plan
def tree_bytes(root: Path = ROOT) -> int:
    """Bytes of what a device call sends besides the carried paths: tracked and untracked,
    not-ignored files (as ``git ls-files -co --exclude-standard`` lists them)."""
    out = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root, capture_output=True, check=True
    ).stdout.decode()
    return sum((root / f).stat().st_size for f in out.split("\0") if f and (root / f).is_file())


def plan_calls(manifest: dict, tree: int, limit: int = CALL_LIMIT, margin: int = MARGIN) -> list[dict]:
    """The device calls: every chunk but the last in a call of its own (``device_proof.sh --stash``),
    then one call carrying the last chunk, the wheels and the manifest that runs the proof. Raises
    ``ValueError`` when a call would exceed ``limit - margin``."""

    def rel(name: str) -> str:
        return f".devicepack/{name}"

    small = [rel("manifest.json"), rel("wheels")]
    small_bytes = manifest["manifest_bytes"] + sum(f["bytes"] for f in manifest["files"])
    parts = manifest["ray"]["parts"]
    calls = [
        {
            "carry": [rel(f"chunks/{p['name']}")],
            "bytes": tree + p["bytes"],
            "command": "bash benchmarks/device_proof.sh --stash",
            "timeout_s": 60,
        }
        for p in parts[:-1]
    ]
    calls.append(
        {
            "carry": [*small, rel(f"chunks/{parts[-1]['name']}")],
            "bytes": tree + small_bytes + parts[-1]["bytes"],
            "command": "bash benchmarks/device_proof.sh",
            "timeout_s": 600,
        }
    )
    for i, c in enumerate(calls, 1):
        c["call"] = i
        if c["bytes"] > limit - margin:
            raise ValueError(
                f"call {i} would move {c['bytes'] / MIB:.1f} MiB (limit {limit / MIB:.0f} MiB less "
                f"{margin / MIB:.0f} MiB headroom): pack with a smaller --chunk-mib"
            )
    return calls


def print_plan(calls: list[dict]) -> None:
    total = sum(c["bytes"] for c in calls)
    print(f"{len(calls)} device call(s), {total / MIB:.1f} MiB moved in all:")
    for c in calls:
        print(
            f"  call {c['call']}: {c['bytes'] / MIB:.1f} MiB, timeout_s={c['timeout_s']}, "
            f"carry={json.dumps(c['carry'])}"
            f"\n          command: {c['command']}"
        )


# ------------------------------------------------------------------------------------------ pack
def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def pack(pack_dir: Path, *, full_ray: bool, chunk_mib: float | None, preset: int) -> dict:
    wheels = pack_dir / "wheels"
    chunks = pack_dir / "chunks"
    for d in (wheels, chunks):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix="devicepack-") as tmp:
        tmp = Path(tmp)
        _pip("download", "-q", "--no-deps", "--only-binary=:all:", *PLATFORM_ARGS, "-d", str(wheels), *WHEELS)
        _pip("download", "-q", "--no-deps", "--no-binary=:all:", "-d", str(wheels), *SDISTS)
        _pip("wheel", "-q", "--no-deps", "--no-binary=:all:", "-w", str(wheels), *BUILT)
        _pip("download", "-q", "--no-deps", "--only-binary=:all:", *PLATFORM_ARGS, "-d", str(tmp), RAY)
        (ray_whl,) = tmp.glob("ray-*.whl")
        stored = tmp / "stored" / ray_whl.name
        stored.parent.mkdir()
        slim = slim_stored(ray_whl, stored, () if full_ray else ("ray/jars/",))
        print(
            f"ray: {ray_whl.stat().st_size / 1e6:.1f} MB wheel -> {stored.stat().st_size / 1e6:.1f} MB stored"
            f"{', without ray/jars' if not full_ray else ''}; xz -{preset} ...",
            flush=True,
        )
        blob = tmp / f"{ray_whl.name}.xz"
        xz(stored, blob, preset)
        ray = {
            "wheel": ray_whl.name,
            "pypi_sha256": sha256(ray_whl),
            "wheel_sha256": sha256(stored),
            "wheel_bytes": stored.stat().st_size,
            "xz_name": blob.name,
            "xz_sha256": sha256(blob),
            "xz_bytes": blob.stat().st_size,
            **slim,
        }
        files = [
            {"name": f.name, "bytes": f.stat().st_size, "sha256": sha256(f)} for f in sorted(wheels.iterdir())
        ]
        tree = tree_bytes()
        small = sum(f["bytes"] for f in files) + 16384
        if chunk_mib:
            chunk = int(chunk_mib * MIB)
        elif tree + small + ray["xz_bytes"] <= CALL_LIMIT - MARGIN:
            chunk = ray["xz_bytes"]  # one call carries everything
        else:
            chunk = min(60 * MIB, CALL_LIMIT - MARGIN - tree - small)
        ray["parts"] = split(blob, chunk, chunks)
    manifest = {"python": "cp312", "files": files, "ray": ray, "tree_bytes_at_pack": tree}
    text = json.dumps(manifest, indent=1)
    manifest["manifest_bytes"] = len(text) + 4096
    manifest["calls"] = plan_calls(manifest, tree)
    (pack_dir / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


# ------------------------------------------------------------------------------------------ unpack
def unpack(pack_dir: Path, dest: Path, stash: Path | None = None) -> list[Path]:
    """Verify every file of the pack, join Ray's chunks (from ``pack_dir/chunks`` or ``stash``) and
    rebuild its wheel into ``dest``: returns the wheels and sdists to install, in ``dest``."""
    manifest = json.loads((pack_dir / "manifest.json").read_text())
    dest.mkdir(parents=True, exist_ok=True)
    out = []
    for f in manifest["files"]:
        src = pack_dir / "wheels" / f["name"]
        if not src.is_file():
            raise FileNotFoundError(f"{src} is missing: carry .devicepack/wheels")
        if sha256(src) != f["sha256"]:
            raise ValueError(f"{src} is corrupt (sha256 mismatch)")
        shutil.copy2(src, dest / f["name"])
        out.append(dest / f["name"])
    ray = manifest["ray"]
    search = [pack_dir / "chunks", *([stash] if stash else [])]
    blob = join(ray["parts"], search, dest / ray["xz_name"], ray["xz_sha256"])
    wheel = dest / ray["wheel"]
    unxz(blob, wheel)
    blob.unlink()
    if sha256(wheel) != ray["wheel_sha256"]:
        raise ValueError(f"rebuilt {wheel.name} has the wrong sha256")
    with zipfile.ZipFile(wheel) as z:
        bad = z.testzip()
        if bad:
            raise ValueError(f"rebuilt {wheel.name}: member {bad} is corrupt")
    return [*out, wheel]


def stash(pack_dir: Path, stash_dir: Path) -> list[str]:
    """Copy the chunks present (sha256 checked) to ``stash_dir``, outside the working tree, so a later
    call on the same warm machine finds them whatever it carries."""
    manifest_path = pack_dir / "manifest.json"
    stash_dir.mkdir(parents=True, exist_ok=True)
    kept = []
    for part in sorted((pack_dir / "chunks").glob("*.part*")):
        shutil.copy2(part, stash_dir / part.name)
        kept.append(part.name)
    if manifest_path.is_file():  # check what it can
        want = {p["name"]: p["sha256"] for p in json.loads(manifest_path.read_text())["ray"]["parts"]}
        for name in kept:
            if name in want and sha256(stash_dir / name) != want[name]:
                raise ValueError(f"chunk {name} is corrupt (sha256 mismatch)")
    return kept


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="download and build the cp312 wheels, split Ray's; print the call plan")
    p.add_argument("--pack-dir", type=Path, default=PACK)
    p.add_argument("--full-ray", action="store_true", help="keep ray/jars (Java workers): two calls")
    p.add_argument("--chunk-mib", type=float, default=None, help="chunk size (default: what fits the calls)")
    p.add_argument("--xz-preset", type=int, default=6)
    p = sub.add_parser("plan", help="print the call plan of an existing pack (the working tree as it is now)")
    p.add_argument("--pack-dir", type=Path, default=PACK)
    p = sub.add_parser("unpack", help="there: verify, join and rebuild into --dest (standard library only)")
    p.add_argument("--pack-dir", type=Path, default=PACK)
    p.add_argument("--dest", type=Path, required=True)
    p.add_argument("--stash", type=Path, default=Path("/tmp/laminar-devicepack"))
    p = sub.add_parser("stash", help="there: keep this call's chunks for the next call")
    p.add_argument("--pack-dir", type=Path, default=PACK)
    p.add_argument("--stash", type=Path, default=Path("/tmp/laminar-devicepack"))
    args = ap.parse_args(argv)
    if args.cmd == "pack":
        m = pack(args.pack_dir, full_ray=args.full_ray, chunk_mib=args.chunk_mib, preset=args.xz_preset)
        print(
            f"packed {len(m['files'])} wheels/sdists and Ray in {len(m['ray']['parts'])} chunk(s) "
            f"in {args.pack_dir}"
        )
        print_plan(m["calls"])
    elif args.cmd == "plan":
        m = json.loads((args.pack_dir / "manifest.json").read_text())
        print_plan(plan_calls(m, tree_bytes()))
    elif args.cmd == "unpack":
        for w in unpack(args.pack_dir, args.dest, args.stash):
            print(w)
    else:
        print("stashed:", " ".join(stash(args.pack_dir, args.stash)) or "nothing")


if __name__ == "__main__":
    main()
