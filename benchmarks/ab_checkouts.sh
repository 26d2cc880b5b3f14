#!/usr/bin/env bash
# Before/after: the benchmark runner of two checkouts of pslaunch, alternating one repetition each,
# REPS times, so that both see the same minutes of the machine. Each checkout needs its own .venv
# (bash scripts/test.sh makes one). JSON reports go to OUT as before-<i>.json and after-<i>.json.
#   bash benchmarks/ab_checkouts.sh OLD_CHECKOUT NEW_CHECKOUT OUT [REPS] [SYSTEMS] [EXTRA_NEW_SYSTEMS]
# e.g. bash benchmarks/ab_checkouts.sh ../pslaunch-ce4edb6 . /tmp/ab 3 \
#        pslaunch_tcp,pslaunch_fast,mxnet_tcp,mxnet_ipc pslaunch_tcp_noauth,pslaunch_fast_noauth,pslaunch_tcp_curve
set -euo pipefail
old=$(cd "$1" && pwd); new=$(cd "$2" && pwd); out=$3
reps=${4:-3}; systems=${5:-pslaunch_tcp,pslaunch_fast,mxnet_tcp,mxnet_ipc}; extra=${6:-}
mkdir -p "$out"
runner() {  # the runner of checkout $1: a package (python -m benchmarks.run) or, before it was one, a script
    if [ -f "$1/benchmarks/__init__.py" ]; then echo "-m benchmarks.run"; else echo "benchmarks/run.py"; fi
}
for i in $(seq 1 "$reps"); do
    (cd "$old" && timeout 1500 .venv/bin/python $(runner "$old") --reps 1 --sizes 4,64 --systems "$systems" \
        --json "$out/before-$i.json" > "$out/before-$i.log" 2>&1)
    (cd "$new" && timeout 1500 .venv/bin/python $(runner "$new") --reps 1 --sizes 4,64 \
        --systems "$systems${extra:+,$extra}" --json "$out/after-$i.json" > "$out/after-$i.log" 2>&1)
    echo "pair $i of $reps done"
done
