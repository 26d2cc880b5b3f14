"""What a job costs as it grows: every table of docs/scale.md, in one run.

    python -m benchmarks.scale [--workers 96] [--servers 32] [--rounds 10] [--skip-job]
                               [--scheduler-nodes 1024,4096] [--server-workers 64,256,1024]
                               [--many-keys 1000000] [--per-call-servers 2,4,8,16] [--json out.json]

(``--scheduler-nodes ''`` / ``--server-workers ''`` / ``--many-keys 0`` / ``--per-call-servers ''``
leave that table out.)

* **Placement.** For ResNet-50, BERT-base and 100 keys of random sizes (``testkit.model_shapes``),
  the busiest server's bytes over the mean at 2, 4, 8 and 16 servers, by the key-hash rule
  (``kvcore.stores.sharding``, what every key got before) and by bytes (``kvcore.stores.placement``, the Trainer's
  one init call), with how many keys under the big-array bound the placement split. Pure arithmetic.
* **A big local job.** ``pslaunch -n 96 -s 32 --launcher local`` of a dist_sync job of ``--rounds``
  rounds (one push and pull of a 64 KiB key per worker and round, a key per server), on this
  machine: the job's wall time, the peak RSS of each role (the largest and the median of the
  processes of the role, from ``/proc/PID/status`` sampled every 0.2 s), pslaunch's own CPU seconds
  and peak RSS, and which of torch, sklearn, scipy, numpy and CuPy each role's processes mapped
  (``/proc/PID/maps``: a server must not pay for what only workers use).
* **Placement in real jobs** (``benchmarks.placement_jobs``): a million keys in one init call (each
  call's seconds, the scheduler's and the workers' peak RSS), and the balance when each worker inits
  one key per call, the two in opposite orders.
* **The scheduler with 1,024 and 4,096 nodes** (``benchmarks.scheduler_scale``, simulated nodes).
* **One server with 64 to 1,024 workers** in rounds of a 1 MiB key (``benchmarks.server_scale``,
  simulated workers): its CPU per byte, and its memory, with pushes by invitation.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import textwrap
from pathlib import Path

import click
import numpy as np

from benchmarks import placement_jobs
from benchmarks.job_watch import psnode_role, watch_job

REPO = Path(__file__).resolve().parent.parent
BOUND = 1_000_000

WORKER = textwrap.dedent("""
    import os
    import numpy as np
    import kvcore
    kv = kvcore.create("dist_sync")
    keys = list(range(kv.num_servers))
    kv.init(keys, [np.zeros(16384, np.float32) for _ in keys])
    out = np.empty(16384, np.float32)
    key = kv.rank % kv.num_servers
    for _ in range(int(os.environ.get("ROUNDS", "10"))):
        for k in keys:
            kv.push(k, np.ones(16384, np.float32))
        kv.pull(key, out=out)
    assert out[0] == kv.num_workers, out[0]  # no optimizer: a round's pull is that round's sum
""")


def placement_table() -> list[dict]:
    from kvcore.stores.placement import KeyRequest, Placement
    from kvcore.stores.sharding import layout
    from testkit.model_shapes import MODELS

    rows = []
    for model, shapes_of in MODELS.items():
        shapes = shapes_of()
        for servers in (2, 4, 8, 16):
            load = np.zeros(servers)
            for i, shape in enumerate(shapes):
                for part in layout(i, shape, np.float32, servers, BOUND).parts:
                    load[part.server] += part.size * 4
            placement = Placement(servers, BOUND)
            decisions = placement.place([KeyRequest(i, s, np.dtype(np.float32)) for i, s in enumerate(shapes)])
            extra = sum(1 for i, d in decisions.items() if d.split and int(np.prod(shapes[i])) < BOUND)
            rows.append({"model": model, "keys": len(shapes), "servers": servers,
                         "hash": float(load.max() / load.mean()), "by_bytes": placement.balance(),
                         "split_under_bound": extra})
    return rows


def big_job(workers: int, servers: int, rounds: int) -> dict:
    tag = f"scale-{os.getpid()}"
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / f"{tag}.py"
        script.write_text(WORKER)
        env = {**os.environ, "PYTHONPATH": str(REPO), "ROUNDS": str(rounds)}
        argv = [sys.executable, "-m", "launcher.cli", "-n", str(workers), "-s", str(servers), "--launcher", "local",
                "--env", "ROUNDS", "--job-id", tag, "--timeout", "900", "--no-dashboard", sys.executable, str(script)]
        watch = watch_job(argv, env, tag, psnode_role(str(script)))
    if watch.returncode != 0:
        raise RuntimeError(f"the {workers} x {servers} job failed ({watch.returncode}):\n{watch.stderr[-3000:]}")
    return {"workers": workers, "servers": servers, "rounds": rounds, "wall_s": watch.wall_s,
            "rss_mib": watch.rss_mib(), "launcher_cpu_s": watch.launcher_cpu_s,
            "launcher_rss_mib": watch.launcher_rss_kib / 1024, "libraries": watch.libraries_by_role()}


@click.command()
@click.option("--workers", default=96, show_default=True)
@click.option("--servers", default=32, show_default=True)
@click.option("--rounds", default=10, show_default=True)
@click.option("--skip-job", is_flag=True, help="Leave out the job of real processes.")
@click.option("--scheduler-nodes", default="1024,4096", show_default=True,
              help="Job sizes of the scheduler's table (benchmarks.scheduler_scale); '' leaves it out.")
@click.option("--death-timeout", default=10.0, show_default=True, help="The scheduler table's heartbeat timeout.")
@click.option("--server-workers", default="64,256,1024", show_default=True,
              help="Worker counts of the server's table (benchmarks.server_scale); '' leaves it out.")
@click.option("--many-keys", default=1_000_000, show_default=True,
              help="Keys of the one-init-call job (benchmarks.placement_jobs); 0 leaves it out.")
@click.option("--per-call-servers", default="2,4,8,16", show_default=True,
              help="Server counts of the one-key-per-call table (benchmarks.placement_jobs); '' leaves it out.")
@click.option("--json", "json_path", default=None)
def main(workers: int, servers: int, rounds: int, skip_job: bool, scheduler_nodes: str, death_timeout: float,
         server_workers: str, many_keys: int, per_call_servers: str, json_path: str | None) -> None:
    sys.path.insert(0, str(REPO))
    report: dict = {"placement": placement_table()}
    print("busiest server's bytes / mean (hash rule -> by bytes; keys under the bound split)")
    print(f"{'model':18s} " + "  ".join(f"S={s:<14d}" for s in (2, 4, 8, 16)))
    for model in dict.fromkeys(r["model"] for r in report["placement"]):
        cells = [f"{r['hash']:.2f} -> {r['by_bytes']:.3f} ({r['split_under_bound']})"
                 for r in report["placement"] if r["model"] == model]
        print(f"{model:18s} " + "  ".join(f"{c:16s}" for c in cells))
    if per_call_servers:
        report["per_call"] = placement_jobs.per_call_table([int(n) for n in per_call_servers.split(",")])
        print()
        placement_jobs.print_per_call(report["per_call"])
    if many_keys:
        report["many_keys"] = placement_jobs.many_keys(many_keys)
        print()
        placement_jobs.print_many_keys(report["many_keys"])
    if not skip_job:
        job = report["job"] = big_job(workers, servers, rounds)
        print(f"\n{workers} workers x {servers} servers, {rounds} rounds, --launcher local: {job['wall_s']:.1f} s")
        for role, rss in sorted(job["rss_mib"].items()):
            print(f"  {role:9s} peak RSS max {rss['max']:.0f} MiB, median {rss['median']:.0f} MiB ({rss['seen']} seen)")
        print(f"  pslaunch: {job['launcher_cpu_s']:.1f} CPU s, peak RSS {job['launcher_rss_mib']:.0f} MiB")
        print("  libraries mapped: " + "; ".join(f"{role} {', '.join(found) or 'none of them'}"
                                                 for role, found in sorted(job["libraries"].items())))
    if scheduler_nodes:
        from benchmarks import scheduler_scale

        rows = report["scheduler"] = [scheduler_scale.run_one(int(n), 8, death_timeout) for n in scheduler_nodes.split(",")]
        print("\nthe scheduler, simulated nodes (one server per 8 nodes, at most 64)\n" + scheduler_scale.table(rows))
    if server_workers:
        from benchmarks import server_scale

        rows = report["server"] = [server_scale.run_one(int(n), 5, 1.0) for n in server_workers.split(",")]
        print("\none server, simulated workers in dist_sync rounds of a 1 MiB key\n" + server_scale.table(rows))
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
