"""One benchmark job per system: who is started, with which argv and environment, and what it measured.

A KVStore job (pslaunch or MXNet) is 1 scheduler, 1 server and N workers on 127.0.0.1, started
directly with the DMLC_* contract of docs/env.md, exactly as any launcher would: through
``testkit.LocalJob``, the tests' starter (the contract is written by
``pscontract``). A ceiling job is one raw pyzmq ROUTER and N DEALERs. Each job returns its
figures per measure (the mean over workers of each worker's median), or raises ``JobFailed``.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from testkit import JobFailed, LocalJob, free_port

from . import kv_suite

__all__ = ["KVSystem", "kv_systems", "run_kv_job", "run_zmq_job", "read_result", "ZMQ_TRANSPORTS"]

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

#: ``PSLAUNCH_TIMELINE`` value a system's env gives for "a timeline file in the job's log directory".
TIMELINE_IN_LOG_DIR = "<log_dir>/timeline.json"

# How pslaunch is told which path to take between co-located peers (docs/env.md): PSLAUNCH_SAME_HOST
# is "shm" (the default: ipc for messages, shared memory for values of 1 MiB or more), "ipc" (Unix
# socket only) or "tcp". DMLC_LOCAL=1 says every node is on one host.
PSLAUNCH_PATH_ENV = {
    "tcp": {"PSLAUNCH_SAME_HOST": "tcp"},
    "fast": {"PSLAUNCH_SAME_HOST": "shm", "DMLC_LOCAL": "1"},
    "ipc": {"PSLAUNCH_SAME_HOST": "ipc", "DMLC_LOCAL": "1"},
    # the TCP path with ZeroMQ's I/O threads under the normal scheduling policy (the default is
    # SCHED_BATCH, see PSLAUNCH_IO_SCHED in docs/env.md): shows what that choice is worth
    "tcp_normal": {"PSLAUNCH_SAME_HOST": "tcp", "PSLAUNCH_IO_SCHED": "normal"},
    # every job has a key (as under pslaunch), so its connections are authenticated; these run without
    # one (what authentication costs) or encrypted with CurveZMQ (what --encrypt costs)
    "tcp_noauth": {"PSLAUNCH_SAME_HOST": "tcp"},
    "fast_noauth": {"PSLAUNCH_SAME_HOST": "shm", "DMLC_LOCAL": "1"},
    "tcp_curve": {"PSLAUNCH_SAME_HOST": "tcp", "PSLAUNCH_ENCRYPT": "curve"},
    # the TCP path with every node writing a timeline (PSLAUNCH_TIMELINE, a file in the job's log
    # directory): what a trace of the job costs
    "tcp_timeline": {"PSLAUNCH_SAME_HOST": "tcp", "PSLAUNCH_TIMELINE": TIMELINE_IN_LOG_DIR},
    # the TCP path with big values through ZeroMQ instead of data lanes (psnode.node.data_lanes)
    "tcp_nolanes": {"PSLAUNCH_SAME_HOST": "tcp", "PSLAUNCH_LANES": "off"},
    # the TCP path with pushes that send the caller's array (push(..., copy=False)) instead of a copy
    "tcp_nocopy": {"PSLAUNCH_SAME_HOST": "tcp", "PSLAUNCH_BENCH_PUSH_COPY": "0"},
    # every message between a worker and a server through ZeroMQ, none on streams (PSLAUNCH_STREAMS):
    # what the streams are worth, TCP and same host
    "tcp_nostreams": {"PSLAUNCH_SAME_HOST": "tcp", "PSLAUNCH_STREAMS": "off"},
    "fast_nostreams": {"PSLAUNCH_SAME_HOST": "shm", "DMLC_LOCAL": "1", "PSLAUNCH_STREAMS": "off"},
}

# ps-lite binds ipc:// endpoints instead of tcp:// when DMLC_LOCAL is set.
MXNET_PATH_ENV = {
    "tcp": {},
    "ipc": {"DMLC_LOCAL": "1"},
}

ZMQ_TRANSPORTS = ("tcp", "ipc")


@dataclass(frozen=True)
class KVSystem:
    """A KVStore system to run: its name in the table, how its nodes start, and checks."""

    name: str
    python: str
    scheduler: list[str]
    server: list[str]
    worker: list[str]  # after ``python``: the worker script (the plan's JSON follows it)
    env: dict[str, str] = field(default_factory=dict)
    check_values: bool = False  # whether pulled values must equal the number of workers
    keyed: bool = True  # the job has a key (its connections are authenticated), as every pslaunch job


def kv_systems(mxnet_python: str | None, profile_dir: Path | None = None) -> dict[str, KVSystem]:
    """Every KVStore system by name; MXNet ones only when ``mxnet_python`` is given."""
    py = sys.executable
    systems = {}
    for path, extra in PSLAUNCH_PATH_ENV.items():
        env = dict(extra)
        if profile_dir is not None:
            env["PSLAUNCH_BENCH_PROFILE"] = str(profile_dir / f"pslaunch_{path}.prof")
        server = [py, "-m", "psnode", "server"]
        if profile_dir is not None:
            # the server's work all happens on its main thread, which cProfile sees
            server = [py, "-m", "cProfile", "-o", str(profile_dir / f"pslaunch_{path}.server.prof"), "-m", "psnode", "server"]
        systems[f"pslaunch_{path}"] = KVSystem(
            name=f"pslaunch_{path}", python=py,
            scheduler=[py, "-m", "psnode", "scheduler"], server=server,
            worker=[str(HERE / "ps_worker.py")], env=env, check_values=True, keyed=not path.endswith("_noauth"),
        )
    if mxnet_python:
        for path, extra in MXNET_PATH_ENV.items():
            node = [mxnet_python, "-c", "import mxnet"]
            systems[f"mxnet_{path}"] = KVSystem(
                name=f"mxnet_{path}", python=mxnet_python, scheduler=node, server=node,
                worker=[str(HERE / "mx_worker.py")],
                # one engine thread each, as MXNet is run on a 2-core machine
                env={"OMP_NUM_THREADS": "1", "MXNET_CPU_WORKER_NTHREADS": "1", **extra},
            )
    return systems


def read_result(job: LocalJob, role: str, index: int) -> dict[str, Any]:
    """The ``RESULT`` line process ``role`` ``index`` printed (``kv_suite.emit_result``), parsed.

    Raises:
        JobFailed: it printed none.
    """
    for line in job.output_of(role, index).splitlines():
        if line.startswith(kv_suite.RESULT_PREFIX):
            return json.loads(line[len(kv_suite.RESULT_PREFIX):])
    raise JobFailed(f"{role} {index} printed no {kv_suite.RESULT_PREFIX.strip()} line")


def run_kv_job(system: KVSystem, plan: kv_suite.Plan, num_workers: int, log_dir: Path, timeout_s: float,
               cpu_bind: bool = False) -> dict:
    """Run one KVStore job of ``system``; return ``{"system", "measures", "workers"}``. ``cpu_bind``:
    each process on one core, in turn (``LocalJob(cpu_bind=True)``).

    Raises:
        JobFailed: a node failed, a worker printed no result, a value check failed, or the job
            ran past ``timeout_s``.
    """
    env = dict(system.env)
    if env.get("PSLAUNCH_TIMELINE") == TIMELINE_IN_LOG_DIR:
        log_dir.mkdir(parents=True, exist_ok=True)
        timeline = log_dir / "timeline.json"
        timeline.unlink(missing_ok=True)  # every node appends to it: start from nothing
        env["PSLAUNCH_TIMELINE"] = str(timeline)
    with LocalJob(num_workers, 1, worker=[*system.worker, plan.to_json()], env=env, scheduler=system.scheduler,
                  server=system.server, python=system.python, log_dir=log_dir, test_settings=False,
                  job_key=system.keyed or None, cpu_bind=cpu_bind) as job:
        job.wait_ok(["worker"], timeout_s)
        results = [read_result(job, "worker", i) for i in range(num_workers)]
        # the scheduler and server end by themselves once the workers are done
        job.wait_ok(["scheduler", "server"], min(timeout_s, 30))
    if system.check_values:
        _check_values(system.name, results, num_workers)
    return {"system": results[0].get("system", system.name), "measures": _merge_workers(results),
            "workers": results}


def _check_values(name: str, results: list[dict], num_workers: int) -> None:
    # with no optimizer a dist_sync round stores the sum of every worker's ones
    for result in results:
        for measure, summary in result["measures"].items():
            if summary["pulled"] != float(num_workers):
                raise JobFailed(
                    f"{name}: worker rank {result['rank']} pulled {summary['pulled']} for {measure}, "
                    f"expected {float(num_workers)} (the sum of {num_workers} workers' ones)"
                )


def _merge_workers(results: list[dict]) -> dict[str, dict]:
    merged: dict[str, dict] = {}
    for measure in results[0]["measures"]:
        summaries = [r["measures"][measure] for r in results]
        median = statistics.mean(s["median"] for s in summaries)
        row = {"unit": summaries[0]["unit"], "median": median, "rounds": summaries[0]["rounds"],
               "push_call_median": statistics.mean(s["push_call_median"] for s in summaries)}
        if measure.startswith("pushpull_"):
            nbytes = int(measure.split("_")[1])
            row["bytes_per_s"] = 2 * nbytes / (median / 1e3)
        merged[measure] = row
    return merged


def run_zmq_job(transport: str, plan: kv_suite.Plan, num_dealers: int, log_dir: Path, timeout_s: float,
                cpu_bind: bool = False) -> dict:
    """Run the raw pyzmq ceiling over ``transport`` (tcp or ipc) with the KV suite's shapes; ``cpu_bind``
    as for ``run_kv_job``.

    Returns figures under the KV suite's measure names (``pushpull_<bytes>`` from the echo of that
    size, ``roundtrip_4elem`` from the 16-byte echo) plus ``oneway_<bytes>``.
    """
    with tempfile.TemporaryDirectory(prefix="pslaunch-bench-") as tmp:
        endpoint = f"tcp://127.0.0.1:{free_port()}" if transport == "tcp" else f"ipc://{tmp}/ceiling.sock"
        script = str(HERE / "zmq_ceiling.py")
        no_role = {"DMLC_ROLE": "", "OMP_NUM_THREADS": "1"}  # raw pyzmq: the job's contract is not read
        with LocalJob(num_dealers, 1, start_scheduler=False, start_servers=0, log_dir=log_dir, test_settings=False,
                      cpu_bind=cpu_bind) as job:
            job.start("router", 0, [sys.executable, script, "router", endpoint, str(num_dealers)], no_role)
            for i in range(num_dealers):
                job.start("dealer", i, [sys.executable, script, "dealer", endpoint, plan.to_json()], no_role)
            job.wait_ok(["dealer", "router"], timeout_s)
            results = [read_result(job, "dealer", i) for i in range(num_dealers)]
    measures: dict[str, dict] = {}
    for key in results[0]["measures"]:
        rows = [r["measures"][key] for r in results]
        if key.startswith("oneway_"):
            measures[key] = {"unit": "B/s", "bytes_per_s": statistics.mean(r["bytes_per_s"] for r in rows)}
            continue
        median = statistics.mean(r["median"] for r in rows)
        if key == "echo_16":
            measures["roundtrip_4elem"] = {"unit": "us", "median": median, "rounds": rows[0]["rounds"]}
        else:
            nbytes = int(key.split("_")[1])
            measures[f"pushpull_{nbytes}"] = {"unit": "ms", "median": median, "rounds": rows[0]["rounds"],
                                              "bytes_per_s": 2 * nbytes / (median / 1e3)}
    return {"system": results[0]["system"], "measures": measures, "workers": results}
