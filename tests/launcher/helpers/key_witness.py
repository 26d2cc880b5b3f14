"""Worker: where the job key can be seen. Prints whether user code still sees PSLAUNCH_JOB_KEY after
``import kvcore``, and whether any process's command line on this machine holds the key (read from
this process's own start-up environment, which keeps it), then ends the job normally."""

import os
from pathlib import Path

initial = Path("/proc/self/environ").read_bytes().split(b"\0")
key = next((item.split(b"=", 1)[1].decode() for item in initial if item.startswith(b"PSLAUNCH_JOB_KEY=")), "")

import kvcore  # noqa: E402

print("HAS_KEY", bool(key) and len(key) == 64, flush=True)
print("VISIBLE_TO_USER_CODE", "PSLAUNCH_JOB_KEY" in os.environ, flush=True)
found = []
for proc in Path("/proc").iterdir():
    if proc.name.isdigit():
        try:
            if key and key.encode() in (proc / "cmdline").read_bytes():
                found.append(proc.name)
        except OSError:
            continue
print("IN_A_COMMAND_LINE", found, flush=True)
kv = kvcore.create("dist_sync")
kv.init(0, kvcore.arrays.zeros((2,)))
kv.push(0, kvcore.arrays.zeros((2,)) + 1)
kv.barrier()
print("DONE", kv.rank, flush=True)
