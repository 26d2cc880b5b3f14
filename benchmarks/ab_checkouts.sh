#!/usr/bin/env bash
# Before/after: a benchmark runner of two checkouts of pslaunch, alternating one repetition each,
# REPS times, so that both see the same minutes of the machine. Each checkout needs its own .venv
# (bash scripts/test.sh makes one). JSON reports go to OUT as before-<i>.json and after-<i>.json.
#   bash benchmarks/ab_checkouts.sh OLD_CHECKOUT NEW_CHECKOUT OUT [REPS] [SYSTEMS] [EXTRA_NEW_SYSTEMS]
# e.g. bash benchmarks/ab_checkouts.sh ../pslaunch-ce4edb6 . /tmp/ab 3 \
#        pslaunch_tcp,pslaunch_fast,mxnet_tcp,mxnet_ipc pslaunch_tcp_noauth,pslaunch_fast_noauth,pslaunch_tcp_curve
# BENCH=allreduce runs python -m benchmarks.allreduce instead (2 workers, 4 and 64 MiB; SYSTEMS is then
# ignored and BENCH_ARGS, default --skip-train, chooses the part: --skip-collectives for the training step).
set -euo pipefail
old=$(cd "$1" && pwd); new=$(cd "$2" && pwd); out=$3
reps=${4:-3}; systems=${5:-pslaunch_tcp,pslaunch_fast,mxnet_tcp,mxnet_ipc}; extra=${6:-}
bench=${BENCH:-run}; bench_args=${BENCH_ARGS:---skip-train}
mkdir -p "$out"
runner() {  # the runner of checkout $1: a package (python -m benchmarks.run) or, before it was one, a script
    if [ -f "$1/benchmarks/__init__.py" ]; then echo "-m benchmarks.$bench"; else echo "benchmarks/$bench.py"; fi
}
one() {  # one repetition of checkout $1, its systems $2, the report $3
    # PYTHONPATH: every process of the job imports the checkout's own code, even where the checkouts share
    # one editable install (a script started by path would otherwise import the install's checkout)
    if [ "$bench" = allreduce ]; then
        (cd "$1" && PYTHONPATH="$1${PYTHONPATH:+:$PYTHONPATH}" timeout 1500 .venv/bin/python $(runner "$1") --reps 1 --ranks 2 --sizes 4,64 $bench_args \
            --json "$3.json" > "$3.log" 2>&1)
    else
        (cd "$1" && PYTHONPATH="$1${PYTHONPATH:+:$PYTHONPATH}" timeout 1500 .venv/bin/python $(runner "$1") --reps 1 --sizes 4,64 --systems "$2" \
            --json "$3.json" > "$3.log" 2>&1)
    fi
}
for i in $(seq 1 "$reps"); do
    one "$old" "$systems" "$out/before-$i"
    one "$new" "$systems${extra:+,$extra}" "$out/after-$i"
    echo "pair $i of $reps done"
done
