"""The device proof's report: reads the folder ``benchmarks/device_proof.sh`` wrote, checks the issue's
targets and writes ``proof.json`` (steps, environment, targets, the gpu_check rows and the
rl_throughput modes) and two plots, ``gpu_check.png`` and ``rl_throughput.png``.

    python benchmarks/device_report.py OUT_DIR [WORK_DIR]

``WORK_DIR`` (default ``OUT_DIR``) holds the script's ``steps.jsonl`` and ``env.json``.

Targets (docs/device_proof.md): the engine at batch 256 on the 0.5B shape >= 2x the eager KV-cache
loop; the publish stall <= 2x the raw device-to-pinned-host copy; DeepSpeed ZeRO-2 and ZeRO-3 updates
ran; on the 16 cores laminar >= 2x sync and ahead of one_step and partial, over 3 rounds. A target
whose measurement is missing (skipped, failed, or a CPU smoke) is ``null``, never ``true``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

RL_FILES = {"cpu": "rl_throughput_cpu.json", "cuda": "rl_throughput_cuda.json"}


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _steps(work: Path) -> list[dict]:
    path = work / "steps.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def gpu_targets(gpu: dict | None) -> dict:
    """The gpu_check targets, each ``{"ok": bool | None, "value": ..., "target": ...}``."""
    rows = (gpu or {}).get("rows", [])
    # the targets are for the real 0.5B shape ("0.5b-shape(smoke)" is the CPU smoke's stand-in)
    big = [
        r
        for r in rows
        if r.get("section") == "engine"
        and r.get("model") == "0.5b-shape"
        and r.get("batch") == 256
        and "ratio" in r
    ]
    best = max(big, key=lambda r: r["ratio"], default=None)
    pubs = [
        r for r in rows if r.get("section") == "publish" and r.get("model") == "0.5b-shape" and "ratio" in r
    ]
    worst = max(pubs, key=lambda r: r["ratio"], default=None)
    ds = {
        stage: next(
            (
                r
                for r in rows
                if r.get("section") == "trainer"
                and r.get("model") == "0.5b-shape"
                and f"ZeRO-{stage}" in r.get("case", "")
            ),
            None,
        )
        for stage in (2, 3)
    }
    return {
        "engine_0.5b_batch256_vs_eager": {
            "target": ">= 2.0x",
            "ok": None if best is None else best["ratio"] >= 2.0,
            "value": None
            if best is None
            else {
                "ratio": best["ratio"],
                "variant": best["variant"],
                "engine_tokens_per_s": best["engine_tokens_per_s"],
                "eager_tokens_per_s": best["eager_tokens_per_s"],
            },
        },
        "publish_stall_vs_raw_copy": {
            "target": "<= 2.0x",
            "ok": None if worst is None else worst["ratio"] <= 2.0,
            "value": None
            if worst is None
            else {
                "ratio": worst["ratio"],
                "dtype": worst["dtype"],
                "publish_ms": worst["publish_ms"],
                "raw_copy_ms": worst["raw_copy_ms"],
            },
        },
        **{
            f"deepspeed_zero{stage}_update": {
                "target": "runs",
                "ok": None if r is None or "update_ms" not in r else True,
                "value": None if r is None else r.get("ours"),
            }
            for stage, r in ds.items()
        },
    }


def rl_targets(rl: dict | None) -> dict:
    modes = {r["mode"]: r for r in (rl or {}).get("modes", [])}
    lam, sync = modes.get("laminar"), modes.get("sync")
    rounds = min((r.get("runs", 0) for r in modes.values()), default=0)
    ahead = None
    if lam and modes.get("one_step") and modes.get("partial"):
        ahead = lam["tokens_per_s"] > max(modes["one_step"]["tokens_per_s"], modes["partial"]["tokens_per_s"])
    return {
        "laminar_vs_sync": {
            "target": ">= 2.0x",
            "ok": None if not (lam and sync) else lam["ratio"] >= 2.0,
            "value": None if not lam else lam["ratio"],
        },
        "laminar_ahead_of_one_step_and_partial": {
            "target": "true",
            "ok": ahead,
            "value": {m: r["tokens_per_s"] for m, r in modes.items()},
        },
        "rounds": {"target": ">= 3", "ok": None if not modes else rounds >= 3, "value": rounds},
        "cores_busy": {
            "target": "per role, below its threads",
            "ok": None,
            "value": {
                m: {k: r.get(k) for k in ("cores_trainer", "cores_rollout", "cores_driver", "machine_busy")}
                for m, r in modes.items()
            },
        },
    }


def plot_gpu(gpu: dict | None, path: Path) -> bool:
    rows = [r for r in (gpu or {}).get("rows", []) if r.get("section") == "engine" and "ratio" in r]
    if not rows:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        mine = [r for r in rows if r["model"] == model]
        batches = sorted({r["batch"] for r in mine})
        eager = {r["batch"]: r["eager_tokens_per_s"] for r in mine}
        ax.plot(batches, [eager[b] for b in batches], "k--o", label="eager KV loop")
        for variant in sorted({r["variant"] for r in mine}):
            pts = sorted((r["batch"], r["engine_tokens_per_s"]) for r in mine if r["variant"] == variant)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "-o", label=variant)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch")
        ax.set_ylabel("tokens/s")
        ax.set_title(f"engine: {model}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def plot_rl(rls: dict[str, dict | None], path: Path) -> bool:
    present = {dev: rl for dev, rl in rls.items() if rl and rl.get("modes")}
    if not present:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(present), figsize=(6 * len(present), 4), squeeze=False)
    for ax, (dev, rl) in zip(axes[0], present.items()):
        modes = rl["modes"]
        xs = range(len(modes))
        ax.bar(xs, [m["tokens_per_s"] for m in modes], color="lightsteelblue", label="median run")
        for x, m in zip(xs, modes):
            ax.plot(
                [x] * len(m["tokens_per_s_runs"]),
                m["tokens_per_s_runs"],
                "k.",
                label="each round" if x == 0 else None,
            )
            ax.text(x, m["tokens_per_s"], f"{m['ratio']:.2f}x", ha="center", va="bottom")
        ax.set_xticks(list(xs), [m["mode"] for m in modes])
        ax.set_ylabel("trained tokens/s")
        shape = rl.get("shape", {})
        ax.set_title(
            f"rl_throughput, device={dev}, {shape.get('cpus')} CPUs, {shape.get('rollouts')} rollouts"
        )
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def report(out: Path, work: Path | None = None) -> dict:
    work = work or out
    gpu = _load(out / "gpu_check.json")
    rls = {dev: _load(out / name) for dev, name in RL_FILES.items()}
    env = _load(work / "env.json") or {}
    result = {
        "env": env,
        "steps": _steps(work),
        "targets": {
            "gpu_check": gpu_targets(gpu),
            **{f"rl_throughput_{d}": rl_targets(rl) for d, rl in rls.items()},
        },
        "gpu_check": gpu,
        "rl_throughput": rls,
        "plots": {
            "gpu_check.png": plot_gpu(gpu, out / "gpu_check.png"),
            "rl_throughput.png": plot_rl(rls, out / "rl_throughput.png"),
        },
    }
    (out / "proof.json").write_text(json.dumps(result, indent=1, default=str))
    return result


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) not in (1, 2):
        raise SystemExit("usage: device_report.py OUT_DIR [WORK_DIR]")
    result = report(Path(argv[0]), Path(argv[1]) if len(argv) == 2 else None)
    for group, targets in result["targets"].items():
        for name, t in targets.items():
            mark = {True: "met", False: "NOT MET", None: "no measurement"}[t["ok"]]
            print(
                f"{group:22s} {name:40s} {t['target']:>12s}  {mark:15s} "
                f"{json.dumps(t['value'], default=str)[:160]}"
            )
    for s in result["steps"]:
        print(f"step {s['step']:14s} {s['status']:10s} {s.get('seconds', 0):6.1f} s  {s.get('note', '')}")


if __name__ == "__main__":
    main()
