"""What the training examples share: their flags, the choice of store and the lines they print."""

from __future__ import annotations

import argparse
import os
import time
from typing import Any


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
    parser.add_argument("--save-weights", default=None, metavar="PATH",
                        help="worker 0 writes the final weights there (numpy .npz, one array per parameter)")
    parser.add_argument("--compression", default="none",
                        choices=["none", "fp16", "bf16", "1bit_scaled", "topk", "randomk", "2bit", "1bit"],
                        help="gradient compression (a dist_* or allreduce store; docs/compression.md)")
    parser.add_argument("--compression-threshold", type=float, default=0.5, help="2bit and 1bit's threshold")
    parser.add_argument("--compression-ratio", type=float, default=0.01, help="topk and randomk: the fraction sent")
    parser.add_argument("--compression-block", type=int, default=0,
                        help="1bit_scaled: values per scale (0: one per key part)")
    parser.add_argument("--compression-pull", choices=["default", "float32", "fp16", "bf16"], default="default",
                        help="the width pulls travel at (default: fp16/bf16's own, else float32)")
    parser.add_argument("--momentum-correction", action="store_true",
                        help="1bit_scaled/topk/randomk: the workers keep the momentum and encode their velocity "
                             "(the optimizer then runs without momentum; docs/compression.md)")
    return parser


def optimizer_momentum(args: argparse.Namespace) -> float:
    """The optimizer's momentum: none when the compression keeps it on the workers (``--momentum-correction``)."""
    return 0.0 if args.momentum_correction and args.compression != "none" else args.momentum


def compression_params(args: argparse.Namespace) -> dict | None:
    """``--compression`` and its parameters as ``set_gradient_compression`` takes them (None: none)."""
    if args.compression == "none":
        return None
    pull = {} if args.compression_pull == "default" else {"pull": args.compression_pull}
    if args.compression in ("2bit", "1bit"):
        return {"type": args.compression, "threshold": args.compression_threshold, **pull}
    extra = {"topk": {"ratio": args.compression_ratio}, "randomk": {"ratio": args.compression_ratio, "seed": args.seed},
             "1bit_scaled": {"block": args.compression_block}}
    if args.momentum_correction:
        pull["momentum"] = args.momentum
    return {"type": args.compression, **extra.get(args.compression, {}), **pull}


class _Unkept:
    """The face of ``kvcore.elastic.State`` for a store that keeps nothing (local, allreduce, DDP):
    the scalars as attributes; ``restore`` finds nothing, ``commit`` keeps nothing."""

    def __init__(self, **scalars: Any) -> None:
        self.__dict__.update(scalars)

    def restore(self) -> bool:
        return False

    def commit(self) -> None:
        return None


def resumable(kv: Any, **scalars: Any) -> Any:
    """Where training is (``scalars``, e.g. ``epoch=0, step=0``), kept so that a restart resumes there.

    For a distributed store (``dist_sync``, ``dist_async``, ``dist_device_sync``) a
    ``kvcore.elastic.State``: under ``pslaunch --checkpoint-dir`` a restarted job restores the last
    commit (``commit_if_kept``), and under ``--restart-scope worker`` a ``dist_sync`` worker replaced in
    place resumes where its predecessor last set the scalars (docs/failures.md). For any other
    store (or None: torch DDP) the same face, keeping nothing.
    """
    if kv is not None and getattr(kv, "type", "").startswith("dist"):
        import kvcore

        return kvcore.elastic.State(kv, **scalars)
    return _Unkept(**scalars)


def commit_if_kept(state: Any, environ=os.environ) -> None:
    """``state.commit()`` when the job keeps checkpoints (``pslaunch --checkpoint-dir`` set
    ``PSLAUNCH_CHECKPOINT_DIR``); without one a commit would keep nothing (and warn)."""
    if environ.get("PSLAUNCH_CHECKPOINT_DIR"):
        state.commit()


def save_weights(path: str | None, rank: int, weights: dict[str, Any]) -> None:
    """Worker 0 writes ``weights`` (name -> numpy array) to ``path`` (``--save-weights``)."""
    if path and rank == 0:
        import numpy as np

        np.savez(path, **weights)


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
