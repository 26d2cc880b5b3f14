"""Data-parallel training of a PyTorch model on scikit-learn's digits, gradients synchronised through kvcore.

One worker, local store:       python examples/torch_train.py
Two workers and two servers:   pslaunch -n 2 -s 2 examples/torch_train.py

PyTorch computes the gradients (CPU); ``kvcore.Trainer`` takes the model's parameters through its
PyTorch adapter (numpy views of the tensors, no copies), pushes the gradients to the store and pulls
back the new weights (``--update-on store``, the default for dist stores) or the summed gradients,
stepping SGD here (``--update-on worker``, the default for the local store). ``--batch-size`` is the
global batch over all workers. Each worker prints, per epoch:

    worker 0 epoch 3 test_accuracy 0.9711 train_loss 0.1234 time 0.41

and at the end ``worker 0 final test_accuracy 0.9711 wall_time 2.31``. Needs the torch and examples
extras: ``pip install 'pslaunch[torch,examples]'`` (a CPU build of torch is enough).
"""

from __future__ import annotations

import argparse
import os
import sys
import time


import kvcore

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from digits import load_digits_split  # noqa: E402  (the examples directory is not a package)
from training_cli import (  # noqa: E402
    default_kvstore, report_epoch, report_final, training_parser, update_on_kvstore)

try:
    import torch
    from torch import nn
except ImportError:
    raise SystemExit("this example needs PyTorch: pip install 'pslaunch[torch]'") from None


def parse_args(argv=None) -> argparse.Namespace:
    parser = training_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per worker")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    kv = kvcore.create(args.kvstore or default_kvstore())
    rank, num_workers = kv.rank, kv.num_workers
    if args.batch_size % num_workers:
        print(f"worker {rank}: --batch-size {args.batch_size} must be a multiple of {num_workers} workers",
              file=sys.stderr)
        return 2
    worker_batch = args.batch_size // num_workers

    x_train, y_train, x_test, y_test = (torch.from_numpy(a) for a in load_digits_split(args.seed))
    model = nn.Sequential(nn.Linear(x_train.shape[1], args.hidden), nn.ReLU(), nn.Linear(args.hidden, 10))
    loss_fn = nn.CrossEntropyLoss(reduction="sum")  # the Trainer divides by the global batch
    trainer = kvcore.Trainer(model, kvcore.optim.SGD(learning_rate=args.lr, momentum=args.momentum),
                             kvstore=kv, update_on_kvstore=update_on_kvstore(args.update_on))
    trainer.sync_params()  # every worker starts from rank 0's weights

    sampler = kvcore.SplitSampler(len(x_train), num_workers, rank, seed=args.seed, drop_last=True)
    steps = len(sampler) // worker_batch
    accuracy = 0.0
    for epoch in range(args.epochs):
        epoch_start = time.perf_counter()
        sampler.set_epoch(epoch)
        order = torch.from_numpy(sampler.indices())
        loss_sum = 0.0
        model.train()
        for step in range(steps):
            batch = order[step * worker_batch:(step + 1) * worker_batch]
            model.zero_grad()
            loss = loss_fn(model(x_train[batch]), y_train[batch])
            loss.backward()
            loss_sum += loss.item()
            trainer.step(args.batch_size)  # reads each parameter's .grad
        model.eval()
        with torch.no_grad():
            accuracy = float((model(x_test).argmax(dim=1) == y_test).float().mean())
        report_epoch(rank, epoch, accuracy, loss_sum, steps * worker_batch, epoch_start)
    report_final(rank, accuracy, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
