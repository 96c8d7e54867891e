"""The device pack (benchmarks/device_pack.py) and the proof's report (benchmarks/device_report.py),
without the network or a GPU: Ray's chunks split and join with sha256 checks, a missing or corrupt
chunk is named, the slimmed wheel survives xz and the rebuild byte for byte, the call plan keeps every
call under the transfer limit, and the report calls a target met only when its measurement is there."""

from __future__ import annotations

import hashlib
import json
import random
import sys
import zipfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import device_pack as dp
import device_report as dr

ROOT = Path(__file__).resolve().parents[2]


def _fake_ray_wheel(path: Path) -> Path:
    """A wheel-shaped zip with a ray/jars member, a module and a RECORD listing both."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("ray/__init__.py", "VERSION = 'fake'\n" * 200)
        z.writestr("ray/jars/ray_dist.jar", b"\x00java" * 5000)
        z.writestr("ray/core/bin", random.Random(0).randbytes(20_000))  # incompressible: several chunks
        z.writestr(
            "ray-2.60.0.dist-info/RECORD",
            "ray/__init__.py,sha256=x,1\nray/jars/ray_dist.jar,sha256=y,2\nray/core/bin,sha256=z,3\n"
            "ray-2.60.0.dist-info/RECORD,,\n",
        )
    return path


def _pack(tmp: Path, chunk: int) -> tuple[Path, dict]:
    """A pack folder as ``pack`` lays it out, from the fake wheel, without pip."""
    pack = tmp / "pack"
    (pack / "wheels").mkdir(parents=True)
    (pack / "wheels" / "small-1.0-py3-none-any.whl").write_bytes(b"small wheel")
    whl = _fake_ray_wheel(tmp / "ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl")
    stored = tmp / "stored" / whl.name
    stored.parent.mkdir()
    slim = dp.slim_stored(whl, stored, ("ray/jars/",))
    blob = tmp / f"{whl.name}.xz"
    dp.xz(stored, blob, preset=1)
    ray = {
        "wheel": whl.name,
        "wheel_sha256": dp.sha256(stored),
        "xz_name": blob.name,
        "xz_sha256": dp.sha256(blob),
        "xz_bytes": blob.stat().st_size,
        **slim,
        "parts": dp.split(blob, chunk, pack / "chunks"),
    }
    f = pack / "wheels" / "small-1.0-py3-none-any.whl"
    manifest = {
        "files": [{"name": f.name, "bytes": f.stat().st_size, "sha256": dp.sha256(f)}],
        "ray": ray,
        "manifest_bytes": 4096,
    }
    (pack / "manifest.json").write_text(json.dumps(manifest))
    return pack, manifest


def test_split_join_round_trip_and_checks(tmp_path):
    src = tmp_path / "blob.bin"
    data = bytes(range(256)) * 1000
    src.write_bytes(data)
    parts = dp.split(src, 100_000, tmp_path / "chunks")
    assert [p["bytes"] for p in parts] == [100_000, 100_000, 56_000]
    whole = hashlib.sha256(data).hexdigest()
    out = dp.join(parts, [tmp_path / "elsewhere", tmp_path / "chunks"], tmp_path / "joined.bin", whole)
    assert out.read_bytes() == data

    with pytest.raises(ValueError, match="wrong sha256"):
        dp.join(parts, [tmp_path / "chunks"], tmp_path / "j2.bin", "0" * 64)
    (tmp_path / "chunks" / parts[1]["name"]).write_bytes(b"x" * 100_000)
    with pytest.raises(ValueError, match=f"{parts[1]['name']} is corrupt"):
        dp.join(parts, [tmp_path / "chunks"], tmp_path / "j3.bin", whole)
    (tmp_path / "chunks" / parts[2]["name"]).unlink()
    with pytest.raises(FileNotFoundError, match=parts[2]["name"]):
        dp.join(parts, [tmp_path / "chunks"], tmp_path / "j4.bin", whole)


def test_unpack_rebuilds_the_slim_wheel_from_chunks_and_stash(tmp_path):
    pack, manifest = _pack(tmp_path, chunk=2000)
    parts = manifest["ray"]["parts"]
    assert len(parts) >= 2
    # the two-call plan: the first chunk came in an earlier call and waits in the stash
    stash = tmp_path / "stash"
    assert dp.stash(pack, stash) == sorted(p["name"] for p in parts)
    (pack / "chunks" / parts[0]["name"]).unlink()
    out = dp.unpack(pack, tmp_path / "dest", stash)
    wheel = tmp_path / "dest" / manifest["ray"]["wheel"]
    assert wheel in out and (tmp_path / "dest" / "small-1.0-py3-none-any.whl") in out
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        assert "ray/__init__.py" in names and not any(n.startswith("ray/jars/") for n in names)
        assert z.testzip() is None
        assert all(i.compress_type == zipfile.ZIP_STORED for i in z.infolist())
        record = z.read("ray-2.60.0.dist-info/RECORD").decode()
    assert "ray/jars" not in record and "ray/core/bin" in record
    assert manifest["ray"]["dropped_bytes"] == 5 * 5000

    (pack / "wheels" / "small-1.0-py3-none-any.whl").write_bytes(b"tampered")
    with pytest.raises(ValueError, match="small-1.0-py3-none-any.whl is corrupt"):
        dp.unpack(pack, tmp_path / "dest2", stash)


def test_unpack_names_a_chunk_no_call_brought(tmp_path):
    pack, manifest = _pack(tmp_path, chunk=2000)
    (pack / "chunks" / manifest["ray"]["parts"][0]["name"]).unlink()
    with pytest.raises(FileNotFoundError, match=manifest["ray"]["parts"][0]["name"]):
        dp.unpack(pack, tmp_path / "dest", tmp_path / "no-stash")


def test_plan_keeps_every_call_under_the_limit():
    mib = dp.MIB
    manifest = {
        "manifest_bytes": 4096,
        "files": [{"bytes": 5 * mib}],
        "ray": {"parts": [{"name": "r.part00", "bytes": 40 * mib}, {"name": "r.part01", "bytes": 30 * mib}]},
    }
    calls = dp.plan_calls(manifest, tree=10 * mib)
    assert [c["call"] for c in calls] == [1, 2]
    assert calls[0]["carry"] == [".devicepack/chunks/r.part00"] and "--stash" in calls[0]["command"]
    assert (
        ".devicepack/wheels" in calls[1]["carry"] and calls[1]["command"] == "bash benchmarks/device_proof.sh"
    )
    assert all(c["bytes"] <= dp.CALL_LIMIT - dp.MARGIN for c in calls)
    assert len(calls[-1]["carry"]) <= 8
    manifest["ray"]["parts"] = [{"name": "r.part00", "bytes": 60 * mib}]
    with pytest.raises(ValueError, match="call 1 would move"):
        dp.plan_calls(manifest, tree=10 * mib)


def _gpu_rows(engine_ratio: float, publish_ratio: float, zero3: bool) -> dict:
    rows = [
        {
            "section": "engine",
            "model": "0.5b-shape",
            "dtype": "bfloat16",
            "batch": 256,
            "variant": v,
            "new_tokens": 128,
            "engine_tokens_per_s": 1000 * r,
            "eager_tokens_per_s": 1000.0,
            "eager_ms_per_step": 17.0,
            "engine_ms_per_step": 17.0 / r,
            "ratio": r,
        }
        for v, r in (("dynamic", engine_ratio - 0.5), ("graphs", engine_ratio))
    ]
    rows.append(
        {
            "section": "engine",
            "model": "0.5b-shape",
            "batch": 256,
            "variant": "static",
            "skipped": "time budget",
        }
    )
    rows.append(
        {
            "section": "publish",
            "model": "0.5b-shape",
            "dtype": "bfloat16",
            "gbytes": 1.26,
            "publish_ms": 25 * publish_ratio,
            "raw_copy_ms": 25.0,
            "ratio": publish_ratio,
            "raw_gb_per_s": 50.0,
        }
    )
    rows.append(
        {
            "section": "trainer",
            "model": "0.5b-shape",
            "case": "deepspeed ZeRO-2, 64 seqs",
            "ours": "900 ms/update",
            "update_ms": 900.0,
        }
    )
    rows.append(
        {
            "section": "trainer",
            "model": "0.5b-shape",
            "case": "deepspeed ZeRO-3, 64 seqs",
            **({"ours": "1,200 ms/update", "update_ms": 1200.0} if zero3 else {"ours": "FAILED: OOM"}),
        }
    )
    return {"env": {}, "rows": rows}


def test_report_targets_and_plots(tmp_path):
    (tmp_path / "gpu_check.json").write_text(json.dumps(_gpu_rows(2.5, 1.4, zero3=False)))
    modes = [
        {
            "mode": m,
            "tokens_per_s": t,
            "tokens_per_s_runs": [t] * 3,
            "ratio_runs": [t / 100] * 3,
            "ratio": t / 100,
            "runs": 3,
            "cores_trainer": 3.5,
            "cores_rollout": 5.0,
            "cores_driver": 0.8,
            "machine_busy": 0.6,
        }
        for m, t in (("sync", 100.0), ("one_step", 150.0), ("partial", 160.0), ("laminar", 230.0))
    ]
    (tmp_path / "rl_throughput_cpu.json").write_text(
        json.dumps({"modes": modes, "shape": {"cpus": 16, "rollouts": 6}})
    )
    (tmp_path / "steps.jsonl").write_text(
        json.dumps({"step": "gpu_check", "status": "ok", "seconds": 1.0, "note": ""}) + "\n"
    )
    res = dr.report(tmp_path)
    g = res["targets"]["gpu_check"]
    assert g["engine_0.5b_batch256_vs_eager"]["ok"] is True
    assert g["engine_0.5b_batch256_vs_eager"]["value"]["variant"] == "graphs"
    assert g["publish_stall_vs_raw_copy"]["ok"] is True
    assert g["deepspeed_zero2_update"]["ok"] is True and g["deepspeed_zero3_update"]["ok"] is None
    cpu = res["targets"]["rl_throughput_cpu"]
    assert cpu["laminar_vs_sync"]["ok"] is True and cpu["laminar_ahead_of_one_step_and_partial"]["ok"] is True
    assert cpu["rounds"]["ok"] is True
    assert all(t["ok"] is None for t in res["targets"]["rl_throughput_cuda"].values())  # nothing measured
    assert res["plots"] == {"gpu_check.png": True, "rl_throughput.png": True}
    assert (tmp_path / "gpu_check.png").stat().st_size > 1000
    saved = json.loads((tmp_path / "proof.json").read_text())
    assert saved["steps"][0]["step"] == "gpu_check"

    (tmp_path / "gpu_check.json").write_text(json.dumps(_gpu_rows(1.5, 2.6, zero3=True)))
    modes[-1]["ratio"] = 1.4
    modes[-1]["tokens_per_s"] = 140.0
    (tmp_path / "rl_throughput_cpu.json").write_text(json.dumps({"modes": modes, "shape": {}}))
    res = dr.report(tmp_path)
    g = res["targets"]["gpu_check"]
    assert g["engine_0.5b_batch256_vs_eager"]["ok"] is False and g["publish_stall_vs_raw_copy"]["ok"] is False
    assert g["deepspeed_zero3_update"]["ok"] is True
    cpu = res["targets"]["rl_throughput_cpu"]
    assert (
        cpu["laminar_vs_sync"]["ok"] is False and cpu["laminar_ahead_of_one_step_and_partial"]["ok"] is False
    )

    # the CPU smoke's stand-in shape measures nothing the targets are about
    smoke = _gpu_rows(3.0, 1.0, zero3=True)
    for r in smoke["rows"]:
        r["model"] = "0.5b-shape(smoke)"
    (tmp_path / "gpu_check.json").write_text(json.dumps(smoke))
    assert all(t["ok"] is None for t in dr.report(tmp_path)["targets"]["gpu_check"].values())
