"""Training step time on capped links: each gradient compression against none, and torch DDP with and
without its hooks, on the ResNet-20 and MLP examples.

    python -m benchmarks.capped_training [--rates 1gbit,100mbit] [--models resnet20,mlp]
        [--configs ...] [--reps 1] [--quick] [--json out.json]

A simulated cluster (``testkit.netns``: network namespaces on a bridge, every host's link shaped with
``tc tbf`` at the rate, each way): the scheduler on h1, and on each of h2 and h3 one worker (and,
for kvcore, one server: ``pslaunch -n 2 -s 2`` on two hosts), so each worker's gradients cross its
link as a ring's would. Every process is started inside its host's namespace with the environment
contract (DDP: torchrun's variables, gloo on the namespace's interface).

A job trains ``--epochs`` epochs (``examples/train_resnet.py`` on ``--train-size`` images, or
``examples/train_mlp.py`` with a ``--hidden``-wide layer); the first epoch is left out (start-up,
warm-up). A job's step time is the mean over the other epochs and both workers of ``worker batch /
images_per_s`` (the training loop alone: testing is left out). The bytes per step are what crossed
the two workers' links (both ways, frames' headers included: the veths' counters) over the whole
job, divided by its steps. The last column is the step time over the uncompressed one (kvcore) at
the same rate and model; DDP's rows are against plain DDP. Configurations run back to back in a
rotating order within each repetition; figures are medians over repetitions.

Needs root and iproute2 (the namespaces) and torch (the examples). Exit status: 0 when every job
ran, 1 when any failed (the JSON says which), 2 for bad options or no namespaces here.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

from testkit import JobFailed, LocalJob
from testkit.netns import NetnsCluster, NetnsError, usable

HERE = Path(__file__).resolve().parent
EXAMPLES = HERE.parent / "examples"
EPOCH = re.compile(r"^worker (\d+) epoch (\d+) .* images_per_s ([0-9.]+)$", re.M)

# name -> (family, the example's flags); the first kvcore row and the first DDP row are the references.
# The codecs with error feedback run with momentum correction, as they train best (docs/training.md).
CONFIGS = {
    "uncompressed": ("kvcore", []),
    "fp16": ("kvcore", ["--compression", "fp16"]),
    "bf16": ("kvcore", ["--compression", "bf16"]),
    "1bit_scaled": ("kvcore", ["--compression", "1bit_scaled", "--momentum-correction"]),
    "topk 1%": ("kvcore", ["--compression", "topk", "--compression-ratio", "0.01", "--momentum-correction"]),
    "topk 1% + bf16 pulls": ("kvcore", ["--compression", "topk", "--compression-ratio", "0.01", "--momentum-correction",
                                        "--compression-pull", "bf16"]),
    "DDP": ("ddp", ["--ddp"]),
    "DDP + fp16 hook": ("ddp", ["--ddp", "--ddp-hook", "fp16"]),
    "DDP + PowerSGD rank 2": ("ddp", ["--ddp", "--ddp-hook", "powersgd", "--powersgd-rank", "2",
                                      "--powersgd-start", "2"]),
}
REFERENCES = {"kvcore": "uncompressed", "ddp": "DDP"}
MODELS = ("resnet20", "mlp")
WORKERS = ("h2", "h3")


def model_argv(model: str, args: argparse.Namespace) -> list[str]:
    """The example and its flags: one thread per worker, small test sets (testing is not timed)."""
    if model == "resnet20":
        return [str(EXAMPLES / "train_resnet.py"), "--epochs", str(args.epochs), "--train-size", str(args.train_size),
                "--test-size", "100", "--threads", "1"]
    return [str(EXAMPLES / "train_mlp.py"), "--epochs", str(args.epochs), "--hidden", str(args.hidden)]


def run_job(cluster: NetnsCluster, model: str, config: str, args: argparse.Namespace, log_dir: Path) -> dict:
    """One training job across the cluster: ``{"step_ms", "bytes_per_step", "steps"}``.

    Raises:
        JobFailed: a process failed, or a worker printed no timed epoch.
    """
    family, flags = CONFIGS[config]
    if family == "ddp" and model != "resnet20":
        raise ValueError(f"{config} runs the ResNet-20 example only (the MLP example is not a torch model)")
    argv = [sys.executable, *model_argv(model, args), *flags]
    root = cluster.address("h1")
    threads = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    before = [cluster.link_bytes(h) for h in WORKERS]
    started = time.perf_counter()
    servers = len(WORKERS) if family == "kvcore" else 0
    with LocalJob(len(WORKERS), servers, start_scheduler=False, start_servers=0, root_uri=root, env=threads,
                  log_dir=log_dir, test_settings=False) as job:
        if family == "kvcore":
            job.start("scheduler", 0, cluster.run_in("h1", [sys.executable, "-m", "psnode", "scheduler"]), node_host=root)
            for i, host in enumerate(WORKERS):
                job.start("server", i, cluster.run_in(host, [sys.executable, "-m", "psnode", "server"]),
                          node_host=cluster.address(host))
        for i, host in enumerate(WORKERS):
            ddp = {"DMLC_ROLE": "", "RANK": str(i), "LOCAL_RANK": "0", "WORLD_SIZE": str(len(WORKERS)),
                   "MASTER_ADDR": cluster.address(WORKERS[0]), "MASTER_PORT": "29511",
                   "GLOO_SOCKET_IFNAME": cluster.nic(host)}
            job.start("worker", i, cluster.run_in(host, argv), ddp if family == "ddp" else {},
                      node_host=cluster.address(host))
        job.wait_ok(["worker"], args.job_timeout)
        outputs = [job.output_of("worker", i) for i in range(len(WORKERS))]
        if family == "kvcore":
            job.wait_ok(["scheduler", "server"], 60)
    wall = time.perf_counter() - started
    after = [cluster.link_bytes(h) for h in WORKERS]
    worker_batch = args.batch // len(WORKERS)
    step_ms = []
    for out in outputs:
        rates = [float(rate) for _, epoch, rate in EPOCH.findall(out) if int(epoch) >= 1]
        if not rates:
            raise JobFailed(f"{model} {config}: a worker printed no timed epoch:\n{out[-2000:]}")
        step_ms += [1e3 * worker_batch / rate for rate in rates]
    samples = {"resnet20": args.train_size, "mlp": 1437}[model]  # the digits' training split
    steps = args.epochs * (samples // args.batch)
    crossed = sum(sum(a) - sum(b) for a, b in zip(after, before))
    return {"step_ms": statistics.fmean(step_ms), "bytes_per_step": crossed / max(1, steps), "steps": steps,
            "wall_s": wall}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="1gbit,100mbit", help="link rates (tc), comma-separated")
    parser.add_argument("--models", default="resnet20,mlp", help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of: {', '.join(CONFIGS)}")
    parser.add_argument("--epochs", type=int, default=3, help="epochs per job (the first is not timed)")
    parser.add_argument("--train-size", type=int, default=1280, help="ResNet-20's training images")
    parser.add_argument("--hidden", type=int, default=8192,
                        help="the MLP's hidden width (8192: 2.4 MB of weights, a step the link sets at 100 Mbit)")
    parser.add_argument("--batch", type=int, default=64, help="the examples' global batch (their default)")
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="2 epochs, 640 images, one rate: a smoke test")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--job-timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    rates = [r for r in args.rates.split(",") if r]
    models = [m for m in args.models.split(",") if m]
    configs = [c for c in args.configs.split(",") if c]
    bad = [m for m in models if m not in MODELS] + [c for c in configs if c not in CONFIGS]
    if bad or not rates or args.epochs < 2 or args.reps < 1:
        parser.error(f"unknown models or configurations {bad}; --epochs is at least 2, --reps at least 1")
    if args.quick:
        args.epochs, args.train_size, rates = 2, 640, rates[:1]
    why = usable()
    if why is not None:
        print(f"capped_training needs network namespaces: {why}", file=sys.stderr)
        return 2
    jobs = [(rate, model, config) for rate in rates for model in models for config in configs
            if not (CONFIGS[config][0] == "ddp" and model != "resnet20")]
    rows: list[dict] = []
    failed = False
    with tempfile.TemporaryDirectory(prefix="pslaunch-capped-training-") as tmp, \
            NetnsCluster(nics=("eth0",) * (1 + len(WORKERS))) as cluster:
        for rate in rates:
            cluster.shape(rate)
            mine = [j for j in jobs if j[0] == rate]
            for rep in range(args.reps):
                for _, model, config in mine[rep % len(mine):] + mine[:rep % len(mine)]:
                    row = {"rate": rate, "model": model, "config": config, "rep": rep}
                    try:
                        row.update(run_job(cluster, model, config, args, Path(tmp) / f"{rate}-{model}-{config}-{rep}"))
                    except (JobFailed, OSError, ValueError, NetnsError) as exc:
                        row["error"] = str(exc)[-2000:]
                        failed = True
                    rows.append(row)
                    print(f"{rate:8} {model:9} {config:22} rep {rep}: "
                          + (f"{row['step_ms']:8.1f} ms/step {row['bytes_per_step'] / 1e6:8.2f} MB/step"
                             if "step_ms" in row else f"FAILED {row['error'][-300:]}"), file=sys.stderr, flush=True)
    summary = summarise(rows)
    print(render(summary, args))
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": rows, "summary": summary, "epochs": args.epochs,
                                         "train_size": args.train_size, "hidden": args.hidden,
                                         "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=2))
    return 1 if failed else 0


def summarise(rows: list[dict]) -> list[dict]:
    """Medians over repetitions per (rate, model, configuration), with the ratio to its family's reference."""
    keys = list(dict.fromkeys((r["rate"], r["model"], r["config"]) for r in rows))
    summary = []
    for rate, model, config in keys:
        done = [r for r in rows if (r["rate"], r["model"], r["config"]) == (rate, model, config) and "step_ms" in r]
        entry = {"rate": rate, "model": model, "config": config}
        if done:
            entry["step_ms"] = statistics.median(r["step_ms"] for r in done)
            entry["bytes_per_step"] = statistics.median(r["bytes_per_step"] for r in done)
        summary.append(entry)
    for entry in summary:
        reference = next((e for e in summary if (e["rate"], e["model"]) == (entry["rate"], entry["model"])
                          and e["config"] == REFERENCES[CONFIGS[entry["config"]][0]]), None)
        if reference and "step_ms" in entry and "step_ms" in reference:
            entry["vs_reference"] = entry["step_ms"] / reference["step_ms"]
    return summary


def render(summary: list[dict], args: argparse.Namespace) -> str:
    lines = [f"2 workers on their own hosts (kvcore: a server beside each), global batch {args.batch}; "
             f"{args.epochs} epochs, the first not timed",
             "| rate | model | configuration | step | MB per step (both workers' links) | vs its reference |",
             "| --- | --- | --- | --- | --- | --- |"]
    for e in summary:
        step = f"{e['step_ms']:.1f} ms" if "step_ms" in e else "failed"
        mb = f"{e['bytes_per_step'] / 1e6:.2f}" if "bytes_per_step" in e else "-"
        ratio = f"{e['vs_reference']:.2f}x" if "vs_reference" in e else "-"
        lines.append(f"| {e['rate']} | {e['model']} | {e['config']} | {step} | {mb} | {ratio} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
