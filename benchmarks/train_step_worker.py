"""Benchmark worker: one data-parallel training step of a model, through torch DDP or kvcore.Trainer.

The models (``--model``) and data are those of the DDP baseline the project compares with:

- ``mlp``: ``IN -> H -> H -> H -> 10`` with ReLU (IN = 1024, H = 2048: about 10.5 M parameters, 42 MB
  of float32 gradients in 8 tensors), a random batch of 32 samples per worker;
- ``resnet20``: ``examples/train_resnet.py``'s ResNet-20 (about 0.27 M parameters in 65 tensors, 3x3
  convolutions and batch norm), a random batch of 32 images of 3 x 32 x 32 per worker;

cross-entropy, SGD. Each worker runs
``--warmup`` untimed steps, then ``--steps`` timed ones (zero the gradients, forward, backward,
step), and prints ``RESULT {"ms_per_step": median, "cpu_ms_per_step": ...}`` (the CPU this process
spent per timed step, every thread).

``ddp``: ``torch.nn.parallel.DistributedDataParallel`` over gloo (torch's ``env://`` variables).
``trainer``: ``kvcore.Trainer`` over ``kvcore.create(--store)`` in a job the runner starts
(``allreduce`` without servers, or ``dist_sync`` with servers); gradients leave as backprop
produces them (the Trainer's PyTorch hooks), as DDP's buckets do; ``--no-overlap``: only after
backward, in ``step`` (what the communication costs when nothing hides it).
``floor``: one process, no communication: the step's compute alone.
``--profile FILE`` (or ``TRAIN_STEP_PROFILE``): cProfile of the timed steps (the main thread), for ``benchmarks.profile_summary``.

After the timed steps every worker checks that its weights equal worker 0's (an allgather of a
checksum for the Trainer, an all_reduce of one for DDP): data parallelism that drifts fails.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import resource
import statistics
import sys
import time

import torch
from torch import nn

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def model_of(inp: int, hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(inp, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10))


def model_and_batch(args: argparse.Namespace) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The model ``--model`` names, and a random batch of ``--batch`` samples for it."""
    if args.model == "resnet20":
        sys.path.insert(0, EXAMPLES)  # the examples directory is not a package
        from train_resnet import ResNet20

        return ResNet20(), torch.randn(args.batch, 3, 32, 32), torch.randint(0, 10, (args.batch,))
    return model_of(args.inp, args.hidden), torch.randn(args.batch, args.inp), torch.randint(0, 10, (args.batch,))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["ddp", "trainer", "floor"])
    parser.add_argument("--model", choices=["mlp", "resnet20"], default="mlp")
    parser.add_argument("--store", default="allreduce")
    parser.add_argument("--no-overlap", action="store_true", help="the Trainer sends gradients after backward only")
    parser.add_argument("--profile", default=os.environ.get("TRAIN_STEP_PROFILE"),
                        help="write a cProfile of the timed steps here (default: $TRAIN_STEP_PROFILE)")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inp", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=32, help="samples per worker")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if args.mode == "floor":
        rank, world = 0, 1
    elif args.mode == "ddp":
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        import kvcore

        kv = kvcore.create(args.store)
        rank, world = kv.rank, kv.num_workers
    torch.manual_seed(rank)  # different initial weights: the first step must make them equal
    model, x, y = model_and_batch(args)
    loss_fn = nn.CrossEntropyLoss()
    if args.mode == "floor":
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def step() -> None:
            opt.zero_grad(set_to_none=False)
            loss_fn(model(x), y).backward()
            opt.step()
    elif args.mode == "ddp":
        net = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(net.parameters(), lr=0.01)

        def step() -> None:
            opt.zero_grad(set_to_none=False)
            loss_fn(net(x), y).backward()
            opt.step()
    else:
        trainer = kvcore.Trainer(model, kvcore.optim.SGD(learning_rate=0.01), kvstore=kv, overlap=not args.no_overlap)

        def step() -> None:
            model.zero_grad(set_to_none=False)
            loss_fn(model(x), y).backward()
            trainer.step(world)  # the loss is a mean per worker: the step applies the mean over workers

    times = []
    profile = cProfile.Profile() if args.profile else None
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            before = resource.getrusage(resource.RUSAGE_SELF)
            if profile is not None:
                profile.enable()
        start = time.perf_counter()
        step()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    after = resource.getrusage(resource.RUSAGE_SELF)
    if profile is not None:
        profile.disable()
        profile.dump_stats(args.profile)
    cpu_ms = ((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)) / len(times) * 1e3
    checksum = torch.tensor([float(sum(p.detach().double().sum() for p in model.parameters()))], dtype=torch.float64)
    if args.mode == "floor":
        same = True
    elif args.mode == "ddp":
        first = checksum.clone()
        dist.broadcast(first, 0)
        same = bool(first == checksum)
        # both ranks leave together: gloo aborts a process whose peer closed the connection while its
        # own teardown still used it ("terminate called without an active exception", seen under load)
        dist.barrier()
        dist.destroy_process_group()
    else:
        rows = kvcore.collectives.allgather(checksum.numpy())  # also between the workers of a job with servers
        same = bool((rows == rows[0]).all())
    if not same:
        print(f"worker {rank}: weights differ from worker 0's after {len(times)} steps", file=sys.stderr)
        return 1
    params = sum(p.numel() for p in model.parameters())
    print("RESULT " + json.dumps({"rank": rank, "workers": world, "params": params,
                                  "ms_per_step": statistics.median(times) * 1e3, "cpu_ms_per_step": cpu_ms}), flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    if "ddp" in sys.argv[1:2]:
        # torch's static destructors can still abort a DDP process after its result is out, even after
        # a barrier and destroy_process_group ("terminate called without an active exception": a
        # joinable C++ thread destroyed at exit, seen under load): the result is written, so end now
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
