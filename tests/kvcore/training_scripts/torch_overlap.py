"""Worker: a PyTorch model trained through kvcore.Trainer, its gradients sent from PyTorch's hooks.

argv[1]: the store (``dist_sync`` in a job with servers, ``allreduce`` without). Each worker takes
its half of a global batch; from the second step on the Trainer sends each group of gradients as
backprop produces it. After 4 steps every worker's weights must equal those of one process that
trained a twin model with torch's SGD on the whole global batch.
"""

import sys

import torch

import kvcore

kv = kvcore.create(sys.argv[1])
rank, n = kv.rank, kv.num_workers
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 300), torch.nn.Tanh(), torch.nn.Linear(300, 3))
twin = torch.nn.Sequential(torch.nn.Linear(6, 300), torch.nn.Tanh(), torch.nn.Linear(300, 3))
twin.load_state_dict(model.state_dict())
trainer = kvcore.Trainer(model, kvcore.optim.SGD(learning_rate=0.1, momentum=0.9), kvstore=kv, coalesce_bytes=4096)
reference = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
generator = torch.Generator().manual_seed(1)
for step in range(4):
    x, y = torch.randn(8, 6, generator=generator), torch.randint(0, 3, (8,), generator=generator)
    mine = slice(rank * 8 // n, (rank + 1) * 8 // n)
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(x[mine]), y[mine], reduction="sum").backward()
    trainer.step(8)
    reference.zero_grad()
    torch.nn.functional.cross_entropy(twin(x), y).backward()
    reference.step()
for (name, ours), theirs in zip(model.named_parameters(), twin.parameters()):
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5, msg=name)
assert trainer._hand_off is not None and trainer._hand_off.watched, "the gradient hooks were not installed"
print("OK", rank, flush=True)
