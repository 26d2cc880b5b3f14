"""Test helper run by pslaunch on a batch scheduler: where can the secrets this process holds be seen?

Usage: secret_witness.py OUTDIR CLUSTERDIR NAME... For each variable NAME in this process's
environment (the job key: in the pipe ``PSLAUNCH_JOB_KEY_FD`` names, where pslaunch hands it over), looks for its value in what the scheduler shows about the running job (Slurm's squeue
and scontrol, SGE's qstat, in their most complete forms), in every file under CLUSTERDIR (the
daemons' spool, state and logs) and on every command line on this machine, and writes
OUTDIR/witness.json: ``{NAME: {"present": bool, "length": int, "seen_in": [where, ...]}}``.
It never prints or writes a value.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

from handed_key import handed_value  # beside this script

out, cluster_dir, names = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]


def tool(*argv: str) -> str:
    try:
        res = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    except OSError as exc:
        return f"cannot run {argv[0]}: {exc}"
    return res.stdout + res.stderr


if "SLURM_JOB_ID" in os.environ:
    job, step = os.environ["SLURM_JOB_ID"], os.environ.get("SLURM_STEP_ID", "0")
    shown = {"squeue -o %all": tool("squeue", "-o", "%all"), "squeue -s -o %all": tool("squeue", "-s", "-o", "%all"),
             "scontrol show job": tool("scontrol", "show", "job", "-dd", job),
             "scontrol show step": tool("scontrol", "show", "step", "-dd", f"{job}.{step}")}
else:
    job = os.environ.get("JOB_ID", "")
    shown = {"qstat -r": tool("qstat", "-u", "*", "-r"), "qstat -j": tool("qstat", "-j", job)}
# the witness must have seen its own job (pslaunch names it pslaunch-ID), or finding nothing proves nothing
looked = {where: bool(job) and job in text and "pslaunch-" in text for where, text in shown.items()}

report = {"job": job, "looked_at_own_job": looked}
for name in names:
    value = handed_value(name) or ""
    seen = [where for where, text in shown.items() if value and value in text]
    if value:
        for path in cluster_dir.rglob("*"):
            try:
                if path.is_file() and not path.is_symlink() and value.encode() in path.read_bytes():
                    seen.append(str(path))
            except OSError:
                continue
        for proc in Path("/proc").iterdir():
            try:
                if proc.name.isdigit() and value.encode() in (proc / "cmdline").read_bytes():
                    seen.append(f"command line of pid {proc.name}")
            except OSError:
                continue
    report[name] = {"present": bool(value), "length": len(value), "seen_in": seen}
out.mkdir(parents=True, exist_ok=True)
(out / "witness.json").write_text(json.dumps(report))
print("witness done", flush=True)
