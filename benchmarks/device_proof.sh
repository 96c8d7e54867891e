#!/usr/bin/env bash
# The device proof (docs/device_proof.md): one prepared script for the lent H200 machine (16 cores,
# Python 3.12, torch 2.11, no package registry). Within PROOF_BUDGET seconds (default 560, under the
# call's 600 s limit) it
#   1. installs the carried packages: benchmarks/device_pack.py unpack (sha256-checked, Ray's chunks
#      joined), pip install --no-index --no-deps --target /tmp/site, then DeepSpeed from its sdist;
#   2. runs benchmarks/gpu_check.py on CUDA (engine variants vs the eager KV-cache loop at batch
#      1/64/256, tiny and 0.5B shapes; publish stall vs raw D2H copy; torch AdamW, ZeRO-2, ZeRO-3);
#   3. runs benchmarks/rl_throughput.py's four modes on the CPU cores, 3 rounds;
#   4. the same on device=cuda with the time left (one GPU shared by fractions);
#   5. writes the report (benchmarks/device_report.py) and bundles the timelines.
# Every step has its own timeout inside the budget and is recorded (ok / failed / timeout / skipped)
# in proof.log and proof.json, so a partial result still comes back. Output: at most 8 files in
# $OUT (else PROOF_OUT, else ./workspace-device-proof/out): proof.log, proof.json, gpu_check.json,
# rl_throughput_cpu.json, rl_throughput_cuda.json, gpu_check.png, rl_throughput.png, timelines.tar.gz.
#
#   bash benchmarks/device_proof.sh              # on the lent machine (docs/device_proof.md: the call)
#   bash benchmarks/device_proof.sh --stash      # a call that only brings one of Ray's chunks (two-call plan)
#   bash benchmarks/device_proof.sh --cpu-smoke  # here: tiny shapes on the CPU, same steps and layout
set -u
SMOKE=0
STASH=0
for arg in "$@"; do
    case "$arg" in
        --cpu-smoke) SMOKE=1 ;;
        --stash) STASH=1 ;;
        *) echo "usage: device_proof.sh [--cpu-smoke | --stash]" >&2; exit 2 ;;
    esac
done
cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD
PY=${PYTHON:-python3}
STASH_DIR=/tmp/laminar-devicepack
if [ "$STASH" = 1 ]; then  # keep this call's chunk for the next call on the same warm machine
    exec "$PY" benchmarks/device_pack.py stash --stash "$STASH_DIR"
fi
OUTDIR=${OUT:-${PROOF_OUT:-$ROOT/workspace-device-proof/out}}
WORK=${PROOF_WORK:-/tmp/laminar-proof}
SITE=${PROOF_SITE:-/tmp/site}
if [ "$SMOKE" = 1 ]; then BUDGET=${PROOF_BUDGET:-480}; else BUDGET=${PROOF_BUDGET:-560}; fi
RESERVE=25  # seconds kept for the report and the bundle
mkdir -p "$OUTDIR" "$WORK"
rm -f "$WORK/steps.jsonl"
LOG=$OUTDIR/proof.log
exec > >(tee -a "$LOG") 2>&1
T0=$(date +%s)
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false TORCH_EXTENSIONS_DIR=$WORK/torch_ext
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}

left() { echo $((BUDGET - ($(date +%s) - T0))); }

record() {  # step status seconds note
    "$PY" - "$@" >>"$WORK/steps.jsonl" <<'EOF'
import json, sys
step, status, seconds, note = sys.argv[1:5]
print(json.dumps({"step": step, "status": status, "seconds": float(seconds), "note": note}))
EOF
    echo "== step $1: $2 (${3} s) $4"
}

step() {  # name max_seconds command...: runs within min(max, time left - RESERVE)
    local name=$1 max=$2
    shift 2
    local t
    t=$(($(left) - RESERVE))
    [ "$max" -lt "$t" ] && t=$max
    if [ "$t" -lt 15 ]; then
        record "$name" skipped 0 "time budget (${t} s left for it)"
        return 1
    fi
    echo "== step $name (at most ${t} s): $*"
    local s rc status
    s=$(date +%s)
    timeout -k 10 "$t" "$@"
    rc=$?
    case $rc in 0) status=ok ;; 124 | 137) status=timeout ;; *) status=failed ;; esac
    record "$name" "$status" $(($(date +%s) - s)) "exit $rc, limit ${t} s"
    return $rc
}

echo "== device proof: smoke=$SMOKE budget=${BUDGET}s out=$OUTDIR work=$WORK $(date -u +%FT%TZ)"
nproc; cat /proc/loadavg
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv

# ---- 1. packages
if [ "$SMOKE" = 1 ]; then
    if [ -f .devicepack/manifest.json ]; then  # the pack's integrity, not its install (this Python may not be 3.12)
        step unpack 120 "$PY" benchmarks/device_pack.py unpack --dest "$WORK/wheels" --stash "$STASH_DIR"
    else
        record unpack skipped 0 "no .devicepack (python benchmarks/device_pack.py pack)"
    fi
    record install skipped 0 "cpu smoke: this environment's packages"
else
    if step unpack 90 "$PY" benchmarks/device_pack.py unpack --dest "$WORK/wheels" --stash "$STASH_DIR"; then
        step install 150 bash -c "set -e
            '$PY' -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target '$SITE' '$WORK'/wheels/*.whl
            PYTHONPATH='$SITE' DS_BUILD_OPS=0 '$PY' -m pip install -q --no-index --no-deps --no-build-isolation \
                --no-cache-dir --target '$SITE' '$WORK'/wheels/deepspeed-*.tar.gz"
    else
        record install skipped 0 "unpack failed"
    fi
    export PYTHONPATH=$ROOT:$SITE
fi
timeout 90 "$PY" - "$WORK/env.json" <<'EOF'
import importlib, json, os, platform, sys
env = {"python": sys.version.split()[0], "cpu_count": os.cpu_count(), "loadavg": os.getloadavg(),
       "machine": platform.machine()}
for name in ("torch", "transformers", "ray", "deepspeed", "hydra", "omegaconf", "math_verify", "pydantic", "numpy"):
    try:
        env[name] = getattr(importlib.import_module(name), "__version__", "imported")
    except Exception as err:  # noqa: BLE001
        env[name] = f"missing: {type(err).__name__}: {str(err)[:120]}"
try:
    import torch
    env["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
except Exception:  # noqa: BLE001
    env["cuda"] = None
open(sys.argv[1], "w").write(json.dumps(env, indent=1))
print("env:", json.dumps(env))
EOF

# ---- 2. gpu_check
if [ "$SMOKE" = 1 ]; then
    step gpu_check 120 "$PY" benchmarks/gpu_check.py --cpu-smoke --no-deepspeed --out "$OUTDIR/gpu_check.json" \
        --time-budget 100
else
    GPU_S=${GPU_CHECK_S:-180}
    step gpu_check "$GPU_S" "$PY" benchmarks/gpu_check.py --out "$OUTDIR/gpu_check.json" --time-budget $((GPU_S - 40))
fi

# ---- 3./4. rl_throughput: the four modes, CPU then CUDA
# 16 cores: trainer 4 threads, 6 rollouts of 1 thread, the driver 1, the rest for Ray, relays and the verifier
RL_CPU_ARGS=${RL_CPU_ARGS:-"--small-model --updates 12 --chunk-steps 16 --rollouts 6 --capacity 64 --cpus 16 \
    cluster.trainer_cpus=4 cluster.trainer_threads=4 cluster.rollout_cpus=1 cluster.actor_threads=1"}
RL_CUDA_ARGS=${RL_CUDA_ARGS:-"--small-model --updates 12 --chunk-steps 16 --rollouts 4 --capacity 128 --cpus 16 \
    cluster.trainer_cpus=4 cluster.trainer_threads=4 cluster.rollout_cpus=1 cluster.actor_threads=1 \
    cluster.rollout_gpus=0.2 cluster.trainer_gpus=0.2"}
SMOKE_RL="--small-model --updates 2 --chunk-steps 4 --rollouts 2 --capacity 8 --prompts-per-step 4 --group-size 2 \
    --cpus 2 data.pool_size=64 data.heldout_size=8 sft.steps=3 sft.batch_size=4 rl.max_new_tokens=24"
modes="sync one_step partial laminar"
if [ "$SMOKE" = 1 ]; then
    # shellcheck disable=SC2086
    step rl_cpu 360 "$PY" benchmarks/rl_throughput.py --modes $modes --repeats 1 --device cpu \
        --warm-start "$WORK/warm_smoke" --warm-device cpu --out "$WORK/timelines/cpu" \
        --json-out "$OUTDIR/rl_throughput_cpu.json" --time-budget 330 $SMOKE_RL
    record rl_cuda skipped 0 "no CUDA (cpu smoke)"
else
    warm_dev=cpu
    "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" && warm_dev=cuda
    t=$(($(left) - RESERVE - ${RL_CUDA_MIN_S:-60}))
    [ "$t" -gt "${RL_CPU_S:-260}" ] && t=${RL_CPU_S:-260}
    # shellcheck disable=SC2086
    step rl_cpu "$t" "$PY" benchmarks/rl_throughput.py --modes $modes --repeats 3 --device cpu \
        --warm-start "$WORK/warm" --warm-device "$warm_dev" --out "$WORK/timelines/cpu" \
        --json-out "$OUTDIR/rl_throughput_cpu.json" --time-budget $((t - 15)) --run-estimate 30 $RL_CPU_ARGS
    t=$(($(left) - RESERVE))
    if [ "$warm_dev" = cuda ] && [ "$t" -ge 60 ]; then
        # shellcheck disable=SC2086
        step rl_cuda "$t" "$PY" benchmarks/rl_throughput.py --modes $modes --repeats 3 --device cuda \
            --warm-start "$WORK/warm" --warm-device cuda --out "$WORK/timelines/cuda" \
            --json-out "$OUTDIR/rl_throughput_cuda.json" --time-budget $((t - 15)) --run-estimate 30 $RL_CUDA_ARGS
    elif [ "$warm_dev" = cuda ]; then
        record rl_cuda skipped 0 "time budget (${t} s left)"
    else
        record rl_cuda skipped 0 "no CUDA"
    fi
fi

# ---- 5. report and bundle
if [ -d "$WORK/timelines" ]; then
    tar -czf "$OUTDIR/timelines.tar.gz" -C "$WORK" timelines
    if [ "$(stat -c %s "$OUTDIR/timelines.tar.gz")" -gt 15000000 ]; then  # the 16 MB limit per file: plots only
        (cd "$WORK" && find timelines -name '*.png' -print0 | tar -czf "$OUTDIR/timelines.tar.gz" --null -T -)
    fi
fi
record total ok $(($(date +%s) - T0)) "budget ${BUDGET} s"
"$PY" benchmarks/device_report.py "$OUTDIR" "$WORK"
echo "== done in $(($(date +%s) - T0)) s; files in $OUTDIR:"
ls -la "$OUTDIR"
