"""Data-parallel training of a small MLP on scikit-learn's bundled digits through a kvcore KVStore.

One worker, local store:           python examples/train_mlp.py
Two workers and two servers:       pslaunch -n 2 -s 2 examples/train_mlp.py
Two simulated devices per worker:  python examples/train_mlp.py --devices cpu,cpu
Gradient compression:              pslaunch -n 2 -s 2 examples/train_mlp.py --compression topk

The training set is split across workers by rank (``SplitSampler``); each worker splits its share of a
batch across its devices (``split_and_load``); the ``Trainer`` sums the gradients of every device and
worker through the store and applies SGD. ``--batch-size`` is the *global* batch: each of ``n`` workers
takes ``batch / n`` samples per step and the step uses the mean over all of them, so ``n`` workers
follow the same trajectory as one. Every worker prints one line per epoch:

    worker 0 epoch 3 test_accuracy 0.9711 train_loss 0.1234 time 0.41 images_per_s 2456.1

(``images_per_s``: this worker's training samples per second, testing left out) and at the end
``worker 0 final test_accuracy 0.9711 wall_time 2.31``.

Under pslaunch the loop is resumable (``kvcore.elastic.State``, scalars ``epoch`` and ``step``): with
``--checkpoint-dir`` it commits at the end of each epoch and a restarted job resumes from the last
commit; with ``--restart-scope worker`` a worker that dies is replaced in place and redoes its steps
exactly (docs/failures.md). ``--save-weights PATH``: worker 0 writes the final weights.

In an elastic job (``pslaunch -n 2:4``, docs/failures.md "Elastic jobs") each worker keeps its batch
(``--batch-size`` over the workers at the start), the epochs are split over each step's members
(``SplitSampler.elastic_batches``, scalars ``epoch`` and ``seen``) and each step is the mean over its
members: workers that leave or join change neither which samples an epoch sees nor the mean.

The store is ``--kvstore`` when given, else ``dist_sync`` when the process was started by a launcher
(``DMLC_PS_ROOT_URI`` is set: there is a scheduler to join), else ``local``. Needs the examples extra
(``pip install 'pslaunch[examples]'``) for scikit-learn.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import kvcore
from kvcore import arrays

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mlp  # noqa: E402  (the examples directory is not a package)
from digits import load_digits_split  # noqa: E402
from training_cli import (  # noqa: E402
    commit_if_kept,
    compression_params,
    default_kvstore,
    optimizer_momentum,
    report_epoch,
    report_final,
    resumable,
    save_weights,
    training_parser,
    update_on_kvstore,
)


def parse_args(argv=None) -> argparse.Namespace:
    parser = training_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--devices", default="cpu", help="this worker's devices, e.g. cpu, cpu,cpu or gpu:0,gpu:1")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    try:
        devices = [kvcore.Device.parse(d) for d in args.devices.split(",") if d.strip()]
    except ValueError as exc:
        print(f"--devices {args.devices!r}: {exc}", file=sys.stderr)
        return 2
    missing = [str(d) for d in devices if d.is_gpu and d.index >= kvcore.num_gpus()]
    if missing or not devices:
        print(f"--devices {args.devices!r}: {', '.join(missing) or 'no device'} not available "
              f"({kvcore.num_gpus()} usable GPU(s); install the gpu extra for CuPy)", file=sys.stderr)
        return 2
    kv = kvcore.create(args.kvstore or default_kvstore())
    rank, num_workers = kv.rank, kv.num_workers
    if kv.elastic:  # each worker keeps its batch: the global one at the start over its workers then
        args.batch_size = max(1, args.batch_size // (num_workers * len(devices))) * num_workers * len(devices)
    if args.batch_size % (num_workers * len(devices)):
        print(f"worker {rank}: --batch-size {args.batch_size} must be a multiple of {num_workers} workers "
              f"x {len(devices)} devices", file=sys.stderr)
        return 2
    worker_batch = args.batch_size // num_workers

    x_train, y_train, x_test, y_test = load_digits_split(args.seed)
    host_params = mlp.init_params([x_train.shape[1], args.hidden, 10], seed=args.seed)
    # One replica of every parameter per device; the Trainer keeps them equal.
    replicas = {name: [arrays.to_device(value, d, copy=True) for d in devices] for name, value in host_params.items()}
    optimizer = kvcore.optim.SGD(learning_rate=args.lr, momentum=optimizer_momentum(args))
    try:  # a store that cannot compress, or parameters it refuses, fail here, before any step
        trainer = kvcore.Trainer(replicas, optimizer, kvstore=kv, update_on_kvstore=update_on_kvstore(args.update_on),
                                 compression=compression_params(args))
    except kvcore.CompressionError as exc:
        print(f"--compression {args.compression}: {exc}", file=sys.stderr)
        return 2
    # where a restart resumes (an elastic job's place in an epoch: the samples its members took, seen)
    state = resumable(kv, epoch=0, step=0, **({"seen": 0} if kv.elastic else {}))
    state.restore()  # a restarted job: the last commit; a worker replaced in place: its predecessor's place
    trainer.sync_params()
    if kv.elastic:  # workers come and go: each step's members split the epoch (docs/failures.md)
        return train_elastic(args, kv, trainer, state, replicas, devices, worker_batch, started,
                             (x_train, y_train, x_test, y_test))

    # Same seed on every worker: one permutation per epoch, each worker takes its strided part.
    sampler = kvcore.SplitSampler(len(x_train), num_workers, rank, seed=args.seed, drop_last=True)
    steps = len(sampler) // worker_batch  # equal on every worker: dist_sync needs every worker's push
    x_test_dev = arrays.to_device(x_test, devices[0])
    y_test_dev = arrays.to_device(y_test, devices[0])
    accuracy = 0.0
    for epoch in range(state.epoch, args.epochs):
        epoch_start = time.perf_counter()
        sampler.set_epoch(epoch)
        order = sampler.indices()
        loss_sum = 0.0
        first = state.step  # 0, but in the epoch a restart resumes in
        for step in range(first, steps):
            batch = order[step * worker_batch:(step + 1) * worker_batch]
            xs = kvcore.split_and_load(x_train[batch], devices)
            ys = kvcore.split_and_load(y_train[batch], devices)
            grads = {name: [] for name in replicas}
            for i, (x, y) in enumerate(zip(xs, ys)):
                with arrays.device_context(devices[i]):  # CuPy runs kernels on the current GPU
                    loss, device_grads = mlp.loss_and_grads({n: r[i] for n, r in replicas.items()}, x, y)
                loss_sum += loss
                for name, g in device_grads.items():
                    grads[name].append(g)
            trainer.step(args.batch_size, grads)
            state.step = step + 1  # marks the place (no round trip): sent with the next push
        train_seconds = time.perf_counter() - epoch_start
        with arrays.device_context(devices[0]):
            accuracy = mlp.accuracy({n: r[0] for n, r in replicas.items()}, x_test_dev, y_test_dev)
        report_epoch(rank, epoch, accuracy, loss_sum, (steps - first) * worker_batch, epoch_start, train_seconds)
        state.epoch, state.step = epoch + 1, 0
        commit_if_kept(state)
    report_final(rank, accuracy, started)
    save_weights(args.save_weights, rank, {n: arrays.asnumpy(r[0]) for n, r in replicas.items()})
    return 0


def train_elastic(args, kv, trainer, state, replicas, devices, worker_batch: int, started: float, data) -> int:
    """The loop of an elastic job: each step takes this worker's share of the step's batch, which the
    step's members split (``elastic_batches``), and steps with the mean over them."""
    x_train, y_train, x_test, y_test = data
    sampler = kvcore.SplitSampler(len(x_train), seed=args.seed, drop_last=True)
    x_test_dev = arrays.to_device(x_test, devices[0])
    y_test_dev = arrays.to_device(y_test, devices[0])
    accuracy, loss_sum, samples, epoch, epoch_start = 0.0, 0.0, 0, state.epoch, time.perf_counter()
    for batch in sampler.elastic_batches(kv, state, worker_batch):
        if state.epoch != epoch:  # the members took the whole epoch: report, and commit where kept
            with arrays.device_context(devices[0]):
                accuracy = mlp.accuracy({n: r[0] for n, r in replicas.items()}, x_test_dev, y_test_dev)
            report_epoch(kv.rank, epoch, accuracy, loss_sum, samples, epoch_start)
            commit_if_kept(state)
            loss_sum, samples, epoch, epoch_start = 0.0, 0, state.epoch, time.perf_counter()
        if state.epoch >= args.epochs:
            break
        xs = kvcore.split_and_load(x_train[batch], devices)
        ys = kvcore.split_and_load(y_train[batch], devices)
        grads = {name: [] for name in replicas}
        for i, (x, y) in enumerate(zip(xs, ys)):
            with arrays.device_context(devices[i]):
                loss, device_grads = mlp.loss_and_grads({n: r[i] for n, r in replicas.items()}, x, y)
            loss_sum += loss
            for name, g in device_grads.items():
                grads[name].append(g)
        trainer.step(worker_batch * kv.num_workers, grads)  # the mean over this step's members
        samples += len(batch)
        state.step = state.step + 1
    report_final(kv.rank, accuracy, started)
    save_weights(args.save_weights, kv.rank, {n: arrays.asnumpy(r[0]) for n, r in replicas.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
