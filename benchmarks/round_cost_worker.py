"""A worker of ``benchmarks.round_cost``: push and pull one float32 key, timed after a warm-up; rank 0
prints ``ROUND_COST {json}`` with the round's time, its own and the server's CPU, and push()'s call, per
round in ms. ``$ROUND_COST`` holds ``{"size": bytes, "rounds": n, "copy": bool}``."""

import json
import os
import time

import numpy as np
from job_watch import context_switches, cpu_seconds  # beside this script, whichever checkout's code the job runs

import kvcore

plan = json.loads(os.environ["ROUND_COST"])
kv = kvcore.create("dist_sync")
value = np.ones(plan["size"] // 4, np.float32)
out = np.zeros_like(value)
kv.init(7, value)
for _ in range(5):
    kv.push(7, value, copy=plan["copy"])
    kv.pull(7, out=out)


def servers_of_this_job() -> list[str]:
    """The pids of this job's servers: the processes whose environment names its role and port."""
    mine = f"DMLC_PS_ROOT_PORT={os.environ['DMLC_PS_ROOT_PORT']}".encode()
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if b"DMLC_ROLE=server" in env and mine in env:
            pids.append(pid)
    return pids


servers = servers_of_this_job()
kv.barrier()
rounds = plan["rounds"]
switches0, server_switches0 = context_switches(os.getpid()), sum(map(context_switches, servers))
cpu0, server0, start, in_push = time.process_time(), sum(map(cpu_seconds, servers)), time.perf_counter(), 0.0
for _ in range(rounds):
    before = time.perf_counter()
    kv.push(7, value, copy=plan["copy"])
    in_push += time.perf_counter() - before
    kv.pull(7, out=out)
elapsed = time.perf_counter() - start
cpu, server = time.process_time() - cpu0, sum(map(cpu_seconds, servers)) - server0
switches = context_switches(os.getpid()) - switches0
server_switches = sum(map(context_switches, servers)) - server_switches0
assert (out == kv.num_workers).all(), out[:4]
if kv.rank == 0:
    per_round = {"round_ms": elapsed, "worker_cpu_ms": cpu, "server_cpu_ms": server, "push_call_ms": in_push}
    per_round = {k: 1e3 * v / rounds for k, v in per_round.items()}
    per_round.update(worker_switches=switches / rounds, server_switches=server_switches / rounds)
    print("ROUND_COST", json.dumps(per_round), flush=True)
kv.barrier()
kv.close()
