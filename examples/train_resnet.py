"""Data-parallel training of ResNet-20 on CIFAR-10-shaped synthetic images, gradients synchronised through kvcore.

One worker, local store:            python examples/train_resnet.py
Two workers and two servers:        pslaunch -n 2 -s 2 examples/train_resnet.py
Two workers, no servers:            pslaunch -n 2 -s 0 examples/train_resnet.py
With gradient compression:          pslaunch -n 2 -s 2 examples/train_resnet.py --compression fp16
The same model under torch DDP:     pslaunch -n 2 -s 0 examples/train_resnet.py --ddp [--ddp-hook powersgd]

The model is He et al.'s ResNet-20 for CIFAR-10 (three stages of three basic blocks, 16/32/64
channels, identity shortcuts padded with zero channels where the width doubles: "option A"; about
0.27 M parameters). The images come from ``examples/synthetic_cifar.py``: 3 x 32 x 32, 10 classes,
made from ``--data-seed`` on every worker, nothing downloaded (5,000 for training and 1,000 for
testing by default: 8 epochs take about 3 minutes on one core and reach a test accuracy of 0.99).

The training loop is a plain PyTorch one; what changes for data parallelism is what
``examples/torch_train.py`` shows: ``kvcore.SplitSampler`` gives each worker its part of every
epoch, the loss is summed over the worker's samples, and ``kvcore.Trainer`` takes the model's
parameters and, at ``trainer.step(global_batch)``, sums the gradients of every worker through the
store and applies SGD (momentum ``--momentum``, weight decay ``--wd``, the learning rate falling
linearly from ``--lr`` to 0 over the run) with their mean. ``--batch-size`` is the global batch
over all workers; ``--threads`` the torch threads of each worker (1: one core per worker).
``--compression TYPE`` encodes the gradients on their way (a ``dist_*`` or ``allreduce`` store,
docs/compression.md): ``fp16`` and ``bf16`` (pushes and pulls at half width), ``1bit_scaled``
(``--compression-block``), ``topk`` and ``randomk`` (``--compression-ratio``), all three with error
feedback, or MXNet's ``2bit`` and ``1bit`` (``--compression-threshold``; at MXNet's default
threshold 2bit learns far more slowly than without). docs/training.md gives each one's accuracy.

Batch norm: each worker normalises with the statistics of its own part of the batch, as torch DDP
does by default (no SyncBatchNorm). The BN scales and shifts are parameters, trained through the
Trainer like every weight; the running mean and variance are buffers, not parameters, so the
Trainer leaves them alone: each worker keeps its own and evaluates with them (``model.eval()``).

``--ddp`` trains the same model with ``torch.nn.parallel.DistributedDataParallel`` instead (gloo,
torchrun's variables, which ``pslaunch -s 0`` sets) and ``torch.optim.SGD``, with the same data,
split, seed and schedule: the reference ``examples/resnet_parity.py`` compares kvcore against.
``--ddp-hook`` adds one of DDP's communication hooks: ``fp16`` (``fp16_compress_hook``), ``bf16``
(``bf16_compress_hook``) or ``powersgd`` (``powerSGD_hook``, rank ``--powersgd-rank``, after
``--powersgd-start`` plain steps, with its error feedback). DDP
also copies rank 0's running statistics to the other ranks at every forward pass (its
``broadcast_buffers`` default); the kvcore path does not.

Each worker prints, per epoch, the test accuracy, the mean training loss of its samples, the
epoch's time and how many training images per second it went through (evaluation excluded):

    worker 0 epoch 3 test_accuracy 0.9711 train_loss 0.1234 time 0.41 images_per_s 812.3

and at the end ``worker 0 final test_accuracy 0.9711 wall_time 2.31``. Needs the torch extra:
``pip install 'pslaunch[torch]'`` (a CPU build of torch is enough).

Under pslaunch the kvcore loop is resumable (``kvcore.elastic.State``, scalars ``epoch`` and
``step``): with ``--checkpoint-dir`` it commits at the end of each epoch and a restarted job resumes
from the last commit; with ``--restart-scope worker`` a worker that dies is replaced in place and
redoes its steps exactly: the weights and the optimizer's state end as an uninterrupted run's (the
running batch-norm statistics, a worker's own buffers, start afresh in a replacement, as after any
restart). ``--save-weights PATH``: worker 0 writes the final parameters.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import numpy as np

import kvcore

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from synthetic_cifar import load_synthetic_cifar  # noqa: E402  (the examples directory is not a package)
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

try:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel
except ImportError:
    raise SystemExit("this example needs PyTorch: pip install 'pslaunch[torch]'") from None


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with batch norm, added to the input (the shortcut) before the last ReLU."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.stride = stride
        self.extra_channels = out_channels - in_channels

    def shortcut(self, x: torch.Tensor) -> torch.Tensor:
        """The input, subsampled and padded with zero channels where the block halves the size and
        doubles the width: option A of the paper, which adds no parameter."""
        if self.stride == 1 and self.extra_channels == 0:
            return x
        x = x[:, :, ::self.stride, ::self.stride]
        half = self.extra_channels // 2
        return F.pad(x, (0, 0, 0, 0, half, self.extra_channels - half))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet20(nn.Module):
    """ResNet-20 for 32 x 32 images: a 3x3 stem, 3 stages of 3 blocks (16, 32, 64 channels; the
    second and third halve the size), global average pooling and a linear classifier."""

    def __init__(self, num_classes: int = 10, blocks_per_stage: int = 3) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        blocks, channels = [], 16
        for stage, width in enumerate((16, 32, 64)):
            for i in range(blocks_per_stage):
                stride = 2 if stage > 0 and i == 0 else 1
                blocks.append(BasicBlock(channels, width, stride))
                channels = width
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(channels, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.blocks(self.stem(x))
        return self.fc(F.adaptive_avg_pool2d(features, 1).flatten(1))


def linear_decay(lr: float, total_steps: int) -> functools.partial:
    """The learning rate at update ``n`` (counted from 1): ``lr`` falling linearly to 0 after ``total_steps``.

    A ``functools.partial`` of ``numpy.interp`` rather than a function of this script, because the
    optimizer is pickled to the servers (``--update-on store``), which cannot import this script.
    """
    return functools.partial(np.interp, xp=[0, total_steps], fp=[lr, 0.0])


class KVCoreSync:
    """Gradients summed over the workers through a kvcore store; SGD runs in the store or here (``--update-on``)."""

    def __init__(self, model: nn.Module, args: argparse.Namespace, total_steps: int) -> None:
        self.kv = kvcore.create(args.kvstore or default_kvstore())
        self.rank, self.num_workers = self.kv.rank, self.kv.num_workers
        self.model = model  # what the forward pass calls
        compression = compression_params(args)
        optimizer = kvcore.optim.SGD(learning_rate=args.lr, momentum=optimizer_momentum(args), wd=args.wd,
                                     lr_scheduler=linear_decay(args.lr, total_steps))
        # Raises CompressionError here, before any step, for a store that cannot compress.
        self.trainer = kvcore.Trainer(model, optimizer, kvstore=self.kv, compression_params=compression,
                                      update_on_kvstore=update_on_kvstore(args.update_on))
        self.state = resumable(self.kv, epoch=0, step=0)  # where a restart resumes
        self.state.restore()  # a restarted job: the last commit; a worker replaced in place: its predecessor's place
        self.trainer.sync_params()  # every worker starts from rank 0's weights (or the restored ones)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, labels, reduction="sum")  # the Trainer divides by the global batch

    def step(self, global_batch: int) -> None:
        self.trainer.step(global_batch)  # reads each parameter's .grad

    def close(self) -> None:
        """Nothing to release: the store leaves the job when the process ends."""


class DDPSync:
    """torch DDP over gloo, for comparison: gradients averaged by DDP, ``torch.optim.SGD`` on every rank."""

    def __init__(self, model: nn.Module, args: argparse.Namespace, total_steps: int) -> None:
        dist.init_process_group("gloo")  # env://: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
        self.rank, self.num_workers = dist.get_rank(), dist.get_world_size()
        # PowerSGD over gloo: one bucket, so one chain of its collectives is in flight at a time (two
        # buckets' chains ran out of step on gloo here: "Received data size doesn't match expected size")
        buckets = {"bucket_cap_mb": 1024} if args.ddp_hook == "powersgd" else {}
        self.model = DistributedDataParallel(model, **buckets)  # broadcasts rank 0's weights
        if args.ddp_hook != "none":
            register_ddp_hook(self.model, args)
        self.optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                                         weight_decay=args.wd)
        self.learning_rate = linear_decay(args.lr, total_steps)
        self.updates = 0
        self.state = resumable(None, epoch=0, step=0)  # kept nowhere: DDP restarts from the beginning

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, labels)  # DDP averages these means over the ranks

    def step(self, global_batch: int) -> None:
        self.updates += 1  # kvcore's optimizers count from 1 too
        for group in self.optimizer.param_groups:
            group["lr"] = float(self.learning_rate(self.updates))
        self.optimizer.step()

    def close(self) -> None:
        dist.destroy_process_group()


def register_ddp_hook(model: DistributedDataParallel, args: argparse.Namespace) -> None:
    """One of torch DDP's own communication hooks, as a DDP user turns it on."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if args.ddp_hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=args.powersgd_rank,
                                            start_powerSGD_iter=args.powersgd_start, random_seed=args.seed)
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    else:
        hook = default_hooks.fp16_compress_hook if args.ddp_hook == "fp16" else default_hooks.bf16_compress_hook
        model.register_comm_hook(None, hook)


def parse_args(argv=None) -> argparse.Namespace:
    parser = training_parser(__doc__.split("\n\n")[0], hidden_layer=False)
    parser.set_defaults(epochs=8, batch_size=64, lr=0.05)
    parser.add_argument("--wd", type=float, default=5e-4, help="weight decay")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads per worker (0: torch's default, which follows OMP_NUM_THREADS)")
    parser.add_argument("--train-size", type=int, default=5000, help="training images (a multiple of 10)")
    parser.add_argument("--test-size", type=int, default=1000, help="test images (a multiple of 10)")
    parser.add_argument("--data-seed", type=int, default=0,
                        help="seed of the synthetic images; --seed changes the weights and shuffles only")
    parser.add_argument("--ddp", action="store_true",
                        help="torch DistributedDataParallel instead of kvcore (run under pslaunch -s 0 or torchrun)")
    parser.add_argument("--ddp-hook", choices=["none", "fp16", "bf16", "powersgd"], default="none",
                        help="a DDP communication hook (with --ddp)")
    parser.add_argument("--powersgd-rank", type=int, default=2, help="PowerSGD's matrix approximation rank")
    parser.add_argument("--powersgd-start", type=int, default=10,
                        help="steps of plain allreduce before PowerSGD starts (its start_powerSGD_iter)")
    return parser.parse_args(argv)


def evaluate(model: nn.Module, x_test: torch.Tensor, y_test: torch.Tensor, batch: int = 500) -> float:
    """Accuracy on the test set, batch norm using this worker's running statistics."""
    model.eval()
    correct = 0
    with torch.no_grad():
        for start in range(0, len(x_test), batch):
            logits = model(x_test[start:start + batch])
            correct += int((logits.argmax(dim=1) == y_test[start:start + batch]).sum())
    return correct / len(x_test)


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if args.ddp and args.compression != "none":
        print("--compression applies to kvcore's stores, not to --ddp (DDP's own: --ddp-hook)", file=sys.stderr)
        return 2
    if args.ddp_hook != "none" and not args.ddp:
        print("--ddp-hook applies to --ddp; kvcore's stores compress with --compression", file=sys.stderr)
        return 2
    if args.ddp and "WORLD_SIZE" not in os.environ:
        print("--ddp needs torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): "
              "run it under pslaunch -s 0 or torchrun", file=sys.stderr)
        return 2
    try:
        x_train, y_train, x_test, y_test = (torch.from_numpy(a) for a in load_synthetic_cifar(
            args.data_seed, args.train_size, args.test_size))
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2

    torch.manual_seed(args.seed)  # the same initial weights on every worker (and rank 0's win anyway)
    model = ResNet20()
    # The schedule counts global batches, so it is the same whatever the number of workers.
    total_steps = args.epochs * (args.train_size // args.batch_size)
    try:
        sync = (DDPSync if args.ddp else KVCoreSync)(model, args, total_steps)
    except kvcore.CompressionError as exc:
        print(f"--compression {args.compression}: {exc}", file=sys.stderr)
        return 2
    rank, num_workers = sync.rank, sync.num_workers
    if args.batch_size % num_workers:
        print(f"worker {rank}: --batch-size {args.batch_size} must be a multiple of {num_workers} workers",
              file=sys.stderr)
        return 2
    worker_batch = args.batch_size // num_workers

    # Same seed on every worker: one permutation per epoch, each worker takes its strided part.
    sampler = kvcore.SplitSampler(len(x_train), num_workers, rank, seed=args.seed, drop_last=True)
    steps = len(sampler) // worker_batch  # equal on every worker: a synchronous step needs every worker
    accuracy = 0.0
    state = sync.state
    for epoch in range(state.epoch, args.epochs):
        epoch_start = time.perf_counter()
        sampler.set_epoch(epoch)
        order = torch.from_numpy(sampler.indices())
        loss_sum = 0.0
        model.train()
        first = state.step  # 0, but in the epoch a restart resumes in
        for step in range(first, steps):
            batch = order[step * worker_batch:(step + 1) * worker_batch]
            model.zero_grad()
            logits = sync.model(x_train[batch])
            loss = sync.loss(logits, y_train[batch])
            loss.backward()
            # Summed over this worker's samples whichever way it synchronises (DDP's loss is a mean).
            loss_sum += float(F.cross_entropy(logits.detach(), y_train[batch], reduction="sum"))
            sync.step(args.batch_size)
            state.step = step + 1  # marks the place (no round trip): sent with the next push
        train_seconds = time.perf_counter() - epoch_start
        accuracy = evaluate(model, x_test, y_test)
        report_epoch(rank, epoch, accuracy, loss_sum, (steps - first) * worker_batch, epoch_start, train_seconds)
        state.epoch, state.step = epoch + 1, 0
        commit_if_kept(state)
    report_final(rank, accuracy, started)
    save_weights(args.save_weights, rank, {n: p.detach().numpy().copy() for n, p in model.named_parameters()})
    sync.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
