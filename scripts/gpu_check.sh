#!/usr/bin/env bash
# One command for a machine with an NVIDIA GPU (CUDA 12 driver): installs the `gpu` extra into
# .venv-gpu, runs every GPU-marked test and the GPU benchmarks, and writes one JSON and one Markdown
# table of what ran, what failed and the figures. Finishes within about 9 minutes.
#
#   bash scripts/gpu_check.sh [OUTDIR]     # OUTDIR defaults to $OUT when set, else ./gpu-check
#
# Stops early, saying why, when the machine cannot run the rest: no NVIDIA driver, the install
# failed, or CuPy's probe finds no usable GPU. A failing test or benchmark is recorded and the rest
# still runs. Exit status: 0 all passed, 1 something failed, 2 no usable GPU or no install.
# Every stage's output is kept in OUTDIR/<stage>.log; the report names the log of each failure.
set -uo pipefail
cd "$(dirname "$0")/.."

out=${1:-${OUT:-gpu-check}}
mkdir -p "$out"
out=$(cd "$out" && pwd)
budget=${PSLAUNCH_GPU_CHECK_SECONDS:-540}  # the whole run, install included
start=$(date +%s)
: > "$out/stages.tsv"

remaining() { echo $(( budget - ($(date +%s) - start) )); }

# stage NAME LIMIT_SECONDS COMMAND...: runs COMMAND with its output in OUTDIR/NAME.log, at most
# LIMIT seconds (less when the budget is nearly spent), and records "NAME<TAB>status<TAB>seconds".
stage() {
    local name=$1 limit=$2
    shift 2
    local left
    left=$(remaining)
    if [ "$left" -lt 20 ]; then
        printf '%s\tskipped: the %s s budget was spent\t0\n' "$name" "$budget" >> "$out/stages.tsv"
        echo "== $name: skipped, the time budget is spent" >&2
        return 124
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "== $name (at most ${limit} s)" >&2
    local t0 rc
    t0=$(date +%s)
    timeout --kill-after=15 "$limit" "$@" > "$out/$name.log" 2>&1
    rc=$?
    local status=passed
    [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && status="timed out after ${limit} s"
    [ "$rc" -ne 0 ] && [ "$status" = passed ] && status="failed (exit $rc)"
    printf '%s\t%s\t%s\n' "$name" "$status" "$(( $(date +%s) - t0 ))" >> "$out/stages.tsv"
    echo "   $status; last lines of $out/$name.log:" >&2
    tail -n 5 "$out/$name.log" | sed 's/^/   | /' >&2
    return "$rc"
}

report() {
    local python=python3
    [ -x .venv-gpu/bin/python ] && python=.venv-gpu/bin/python
    "$python" scripts/gpu_check_report.py "$out" "$1"
    exit "$1"
}

if ! stage driver 30 nvidia-smi --query-gpu=index,name,driver_version,memory.total,pci.bus_id --format=csv; then
    echo "gpu_check: nvidia-smi failed: no NVIDIA driver here (see $out/driver.log)" >&2
    report 2
fi

if [ ! -x .venv-gpu/bin/python ]; then
    if ! python3 -m venv .venv-gpu > "$out/venv.log" 2>&1; then
        # Debian and Ubuntu ship venv separately
        sudo=""
        [ "$(id -u)" = 0 ] || sudo=sudo
        $sudo apt-get update -qq >> "$out/venv.log" 2>&1
        DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq python3-venv >> "$out/venv.log" 2>&1
        rm -rf .venv-gpu
        python3 -m venv .venv-gpu >> "$out/venv.log" 2>&1 || { echo "gpu_check: cannot create a venv (see $out/venv.log)" >&2; report 2; }
    fi
fi
# The gpu extra is CuPy for CUDA 12 with the CUDA libraries it loads (NVRTC, cuBLAS, ...) as wheels,
# and libnccl: about 3 GB, most of the install time (see docs/shared_model.md).
if ! stage install 300 .venv-gpu/bin/python -m pip install --progress-bar off --disable-pip-version-check \
        -e '.[gpu,test,examples]'; then
    echo "gpu_check: installing the gpu extra failed (see $out/install.log)" >&2
    report 2
fi

probe='import json; from kvcore import arrays
print(json.dumps({"gpu_available": arrays.gpu_available(), "num_gpus": arrays.num_gpus(),
                  "gpu_status": arrays.gpu_status(), "nccl_available": arrays.nccl_available()}))'
stage probe 120 .venv-gpu/bin/python -c "$probe"
if ! grep -q '"gpu_available": true' "$out/probe.log"; then
    echo "gpu_check: CuPy's probe finds no usable GPU (see $out/probe.log); nothing GPU-marked can run" >&2
    report 2
fi

failed=0
stage tests 300 .venv-gpu/bin/python -m pytest -m gpu -q -rfEs -p no:cacheprovider --timeout 150 \
    --junitxml="$out/tests.xml" tests || failed=1
stage bench_level1 120 .venv-gpu/bin/python benchmarks/gpu_level1_bandwidth.py --sizes-mib 1 4 16 64 256 \
    --repeat 10 --json "$out/level1.json" || failed=1
if ! grep -q '"num_gpus": 1,' "$out/probe.log"; then  # several GPUs: also the one-GPU round for reference
    stage bench_level1_one_gpu 90 .venv-gpu/bin/python benchmarks/gpu_level1_bandwidth.py --devices 0 \
        --sizes-mib 4 64 --repeat 10 --json "$out/level1_one_gpu.json" || failed=1
fi
stage bench_allreduce 120 .venv-gpu/bin/python -m benchmarks.gpu_allreduce --sizes-mib 4 64 256 \
    --rounds 10 --json "$out/allreduce.json" || failed=1
stage bench_server_shards 120 .venv-gpu/bin/python -m benchmarks.gpu_server_shards --sizes-mib 4 64 \
    --rounds 10 --json "$out/server_shards.json" || failed=1
stage bench_overlap 120 .venv-gpu/bin/python examples/overlap_mlp.py --device gpu --epochs 3 --repeat 2 \
    --hidden 2048 --json "$out/overlap.json" || failed=1
report "$failed"
