"""What the training examples share on their command line: the flags and the choice of store."""

from __future__ import annotations

import argparse
import os


def default_kvstore(environ=os.environ) -> str:
    """``dist_sync`` when a launcher set up a job (a scheduler address is given), else ``local``."""
    return "dist_sync" if environ.get("DMLC_PS_ROOT_URI") else "local"


def training_parser(description: str) -> argparse.ArgumentParser:
    """A parser with the flags every training example takes; an example adds its own after."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--kvstore", default=None, help="store type (default: dist_sync under a launcher, else local)")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch over all workers and devices")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--hidden", type=int, default=128, help="width of the hidden layer")
    parser.add_argument("--update-on", choices=["auto", "store", "worker"], default="auto",
                        help="where the optimizer runs (auto: in the store for dist_* stores)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the split, the weights and the shuffles")
    return parser
