#!/usr/bin/env bash
# Sets up everything the test suite needs on a fresh Debian/Ubuntu machine, then runs every test.
#   system packages: openssh-server + client (ssh backend tests), rsync (code sync), Open MPI (mpi backend),
#                    Slurm (slurmctld, slurmd, slurm-client) and SGE (gridengine-master, -exec, -client) for
#                    the batch backends' tests, which start their own one-machine clusters in temporary
#                    directories (nothing in /etc is configured or changed for them),
#                    tmux (a real terminal for the Ctrl-Z test), iproute2 (network namespaces for the
#                    simulated cluster of the `netns` tests, and tc for a benchmark's capped link)
#   Python: a virtual environment in .venv with pslaunch installed editable, plus the test extra, the
#           torch extra (torch==2.13.0, the CPU build, for the PyTorch training example) and the ray
#           extra (the `ray` tests start a two-node Ray cluster of their own)
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -k kvstore`).
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
[ -x /usr/sbin/sshd ] || missing+=(openssh-server)
command -v ssh >/dev/null 2>&1 || missing+=(openssh-client)
command -v rsync >/dev/null 2>&1 || missing+=(rsync)
command -v mpirun >/dev/null 2>&1 || missing+=(openmpi-bin)
command -v ps >/dev/null 2>&1 || missing+=(procps)
command -v tmux >/dev/null 2>&1 || missing+=(tmux)
command -v ip >/dev/null 2>&1 && command -v tc >/dev/null 2>&1 || missing+=(iproute2)
[ -x /usr/sbin/slurmctld ] || missing+=(slurmctld)
[ -x /usr/sbin/slurmd ] || missing+=(slurmd)
command -v srun >/dev/null 2>&1 || missing+=(slurm-client)
[ -x /usr/lib/gridengine/sge_qmaster ] || missing+=(gridengine-master)
[ -x /usr/lib/gridengine/sge_execd ] || missing+=(gridengine-exec)
[ -x /usr/lib/gridengine/qsub ] || missing+=(gridengine-client)
if [[ " ${missing[*]} " == *" gridengine-"* ]] && ! command -v mail >/dev/null 2>&1; then
    # gridengine wants a mailx; without a mail transport apt would add exim4's daemon for it.
    missing+=(bsd-mailx)
    [ -e /usr/sbin/sendmail ] || missing+=(dma)
fi
if [ ${#missing[@]} -gt 0 ]; then
    sudo=""
    [ "$(id -u)" = 0 ] || sudo=sudo
    echo "installing system packages: ${missing[*]}"
    # gridengine must not configure a cell of its own: the tests make a private one
    echo "gridengine-common shared/gridengineconfig boolean false" | $sudo debconf-set-selections
    # The packages' daemons (munge, slurm, sge) must not start: the tests start their own.
    policy=""
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        policy=/usr/sbin/policy-rc.d
        printf '#!/bin/sh\nexit 101\n' | $sudo tee "$policy" >/dev/null && $sudo chmod 755 "$policy"
        trap '$sudo rm -f "$policy"' EXIT
    fi
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    if [ -n "$policy" ]; then $sudo rm -f "$policy"; trap - EXIT; fi
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test,torch,ray]'
exec .venv/bin/python -m pytest "$@"
