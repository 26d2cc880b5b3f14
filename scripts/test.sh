#!/usr/bin/env bash
# Sets up everything the test suite needs on a fresh Debian/Ubuntu machine, then runs every test.
#   system packages: openssh-server + client (ssh backend tests), rsync (code sync), Open MPI (mpi backend),
#                    tmux (a real terminal for the Ctrl-Z test), iproute2 (network namespaces for the
#                    simulated cluster of the `netns` tests)
#   Python: a virtual environment in .venv with pslaunch installed editable, plus the test extra and
#           the torch extra (torch==2.13.0, the CPU build, for the PyTorch training example)
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
if [ ${#missing[@]} -gt 0 ]; then
    sudo=""
    [ "$(id -u)" = 0 ] || sudo=sudo
    echo "installing system packages: ${missing[*]}"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test,torch]'
exec .venv/bin/python -m pytest "$@"
