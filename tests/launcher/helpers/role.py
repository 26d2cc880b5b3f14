"""Test helper run by pslaunch: records its role, argv and environment, then behaves as told.

Usage: role.py OUTDIR [ARG...]. Writes OUTDIR/<role>.<rank>.json with argv[2:], the contract
variables and the variables named in $CHECK_VARS. Then, by environment:
  EXIT_<role>_<rank>=N     exit with N (default 0)
  SLEEP_<role>_<rank>, SLEEP_<role>=S   sleep S seconds first ("forever": until stopped;
                           "until:PATH": until PATH exists, at most 120 s)
  SIGNAL_<role>_<rank>=N   kill itself with signal N after the sleep
  IGNORE_TERM_<role>=1     ignore SIGTERM (only SIGKILL stops it)
  TERM_DELAY_<role>=S      on SIGTERM, take S seconds to end, then exit 75
  PS_DUMP_<role>_<rank>=1  also write `ps -eww -o args` (every command line on the machine) to
                           OUTDIR/<role>.<rank>.ps while the job runs
  STOP_SELF_<role>_<rank>=1  stop itself (SIGSTOP) once started: only a SIGCONT lets it go on
The record also holds its pid and sys.executable.
"""

import json
import os
import signal
import subprocess
import sys
import time

from handed_key import handed_value  # beside this script

role = os.environ.get("DMLC_ROLE", "worker")
rank = os.environ.get("PSLAUNCH_RANK", "0")
out = sys.argv[1]
if os.environ.get(f"IGNORE_TERM_{role}"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if os.environ.get(f"TERM_DELAY_{role}"):
    def _slow_end(signum, frame):
        time.sleep(float(os.environ[f"TERM_DELAY_{role}"]))
        sys.exit(75)
    signal.signal(signal.SIGTERM, _slow_end)
names = [n for n in os.environ.get("CHECK_VARS", "").split(",") if n]


record = {
    "argv": sys.argv[2:],
    "cwd": os.getcwd(),
    "env": {k: v for k, v in os.environ.items() if k.startswith(("DMLC_", "PSLAUNCH_", "PS_"))},
    "checked": {n: handed_value(n) for n in names},
    "pid": os.getpid(),
    "executable": sys.executable,
}
os.makedirs(out, exist_ok=True)
# Written under another name and renamed: a reader polling for *.json never sees a half-written record.
final = os.path.join(out, f"{role}.{rank}.json")
with open(final + ".part", "w") as fh:
    json.dump(record, fh)
os.replace(final + ".part", final)
if os.environ.get(f"PS_DUMP_{role}_{rank}"):
    listing = subprocess.run(["ps", "-eww", "-o", "args"], capture_output=True, text=True, timeout=10).stdout
    with open(os.path.join(out, f"{role}.{rank}.ps"), "w") as fh:
        fh.write(listing)
print(f"{role} {rank} started", flush=True)
if os.environ.get(f"STOP_SELF_{role}_{rank}"):
    os.kill(os.getpid(), signal.SIGSTOP)
sleep = os.environ.get(f"SLEEP_{role}_{rank}", os.environ.get(f"SLEEP_{role}"))
if sleep == "forever":
    while True:
        time.sleep(1)
elif sleep and sleep.startswith("until:"):
    deadline = time.monotonic() + 120
    while not os.path.exists(sleep[len("until:"):]) and time.monotonic() < deadline:
        time.sleep(0.05)
elif sleep:
    time.sleep(float(sleep))
if f"SIGNAL_{role}_{rank}" in os.environ:
    os.kill(os.getpid(), int(os.environ[f"SIGNAL_{role}_{rank}"]))
    time.sleep(5)
sys.exit(int(os.environ.get(f"EXIT_{role}_{rank}", "0")))
