"""A plain torch DDP script, unchanged from how it runs under torchrun: env:// rendezvous (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT), gloo, one allreduce and one DDP step; it imports nothing of
pslaunch. Prints `OK rank world local_rank local_world` once the results are checked."""

import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

dist.init_process_group("gloo")  # env:// from what the launcher set
rank, world = dist.get_rank(), dist.get_world_size()
assert (rank, world) == (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))

total = torch.tensor([float(rank + 1)])
dist.all_reduce(total)
assert total.item() == world * (world + 1) / 2, total

torch.manual_seed(0)  # the same initial weights everywhere; DDP broadcasts rank 0's anyway
model = DistributedDataParallel(torch.nn.Linear(4, 1, bias=False))
loss = model(torch.full((2, 4), float(rank + 1))).sum()
loss.backward()  # DDP averages the gradients of every rank
expected = sum(2.0 * (r + 1) for r in range(world)) / world
assert torch.allclose(model.module.weight.grad, torch.full((1, 4), expected)), model.module.weight.grad

del model, loss  # DDP's reducer holds the group: gone before it
dist.barrier()  # no rank tears gloo down while its peer still talks to it (an abort at exit otherwise)
dist.destroy_process_group()
print("OK", rank, world, os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"], flush=True)
# torch's static destructors can still abort a gloo process at exit ("terminate called without an
# active exception", a joinable C++ thread destroyed; seen under load after all of the above): the
# script's work is done and checked, so it ends here
os._exit(0)
