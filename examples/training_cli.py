"""What the training examples share: their flags, the choice of store and the lines they print."""

from __future__ import annotations

import argparse
import os
import time


def default_kvstore(environ=os.environ) -> str:
    """``dist_sync`` when a launcher set up a job (a scheduler address is given), ``allreduce`` when
    that job has no servers (``pslaunch -s 0``), else ``local``."""
    if not environ.get("DMLC_PS_ROOT_URI"):
        return "local"
    return "allreduce" if environ.get("DMLC_NUM_SERVER", "").strip() == "0" else "dist_sync"


def training_parser(description: str, hidden_layer: bool = True) -> argparse.ArgumentParser:
    """A parser with the flags every training example takes; an example adds its own after.

    ``hidden_layer``: the model has a hidden layer whose width ``--hidden`` sets (the MLPs).
    """
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--kvstore", default=None,
                        help="store type (default: dist_sync under a launcher, allreduce when it started no "
                             "servers, else local)")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch over all workers and devices")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--momentum", type=float, default=0.9)
    if hidden_layer:
        parser.add_argument("--hidden", type=int, default=128, help="width of the hidden layer")
    parser.add_argument("--update-on", choices=["auto", "store", "worker"], default="auto",
                        help="where the optimizer runs (auto: in the store for dist_* stores)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the split, the weights and the shuffles")
    return parser


def update_on_kvstore(choice: str) -> bool | None:
    """``--update-on`` as ``kvcore.Trainer``'s ``update_on_kvstore``: None lets the store type decide."""
    return {"auto": None, "store": True, "worker": False}[choice]


def report_epoch(rank: int, epoch: int, accuracy: float, loss_sum: float, samples: int, epoch_start: float,
                 train_seconds: float | None = None) -> None:
    """Print the line a worker prints after each epoch (the tests and the docs read this format).

    ``loss_sum`` is summed over the epoch's ``samples`` training samples of this worker;
    ``epoch_start`` is the ``time.perf_counter()`` taken when the epoch began. With
    ``train_seconds`` (the epoch's training time, testing left out) the line ends with this worker's
    ``images_per_s``.
    """
    rate = "" if train_seconds is None else f" images_per_s {samples / max(train_seconds, 1e-9):.1f}"
    print(f"worker {rank} epoch {epoch} test_accuracy {accuracy:.4f} "
          f"train_loss {loss_sum / max(1, samples):.4f} "
          f"time {time.perf_counter() - epoch_start:.2f}{rate}", flush=True)


def report_final(rank: int, accuracy: float, started: float) -> None:
    """Print the worker's last line: final test accuracy and wall time since ``started`` (perf_counter)."""
    print(f"worker {rank} final test_accuracy {accuracy:.4f} wall_time {time.perf_counter() - started:.2f}",
          flush=True)
