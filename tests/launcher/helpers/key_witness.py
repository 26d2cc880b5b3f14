"""Worker: where the job key can be seen. Before anything of pslaunch is imported it records its own
start-up environment (/proc/self/environ) and the environment of a child it starts; then ``import
kvcore`` takes the key (from the pipe pslaunch hands over) and the witness searches, for that key:
its own environment, the child's, every process's command line and every process's environment on
this machine. Then it ends the job normally."""

import os
import subprocess
import sys
from pathlib import Path

initial = Path("/proc/self/environ").read_bytes()
names_before = sorted(name for name in os.environ if name.startswith("PSLAUNCH_JOB_KEY"))
child = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.environ.items()))"], capture_output=True,
                       check=True).stdout

import kvcore  # noqa: E402
from psnode.transport import security  # noqa: E402

key = security.taken_key().hex().encode()
print("HAS_KEY", len(key) == 64, flush=True)
print("KEY_VARIABLES_BEFORE_IMPORT", names_before, flush=True)  # PSLAUNCH_JOB_KEY_FD only: a number
print("IN_OWN_ENVIRON", key in initial, flush=True)
print("IN_A_CHILDS_ENVIRON", key in child, flush=True)
print("VISIBLE_TO_USER_CODE", any(name.startswith("PSLAUNCH_JOB_KEY") for name in os.environ), flush=True)
in_cmdline, in_environ = [], []
for proc in Path("/proc").iterdir():
    if proc.name.isdigit():
        try:
            if key in (proc / "cmdline").read_bytes():
                in_cmdline.append(proc.name)
            if key in (proc / "environ").read_bytes():
                in_environ.append((proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:80])
        except OSError:
            continue
print("IN_A_COMMAND_LINE", in_cmdline, flush=True)
print("IN_AN_ENVIRON", in_environ, flush=True)
kv = kvcore.create("dist_sync")
kv.init(0, kvcore.arrays.zeros((2,)))
kv.push(0, kvcore.arrays.zeros((2,)) + 1)
kv.barrier()
print("DONE", kv.rank, flush=True)
