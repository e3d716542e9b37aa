"""A small DDP job over gloo for runs of several `gelastic run` launchers (or torchrun).

Every rank trains one linear model on its shard (rank::world) of fixed data, so the final
parameters depend on the world size and the steps, never on how ranks are spread over nodes.
It writes, into $NODES_OUT: `start.<restart>.<rank>` when a rank starts (its pid, world size,
group rank), `step` (rank 0, "<restart> <world> <step>", replaced atomically each step) and
`params.<restart>.<world>.json` (rank 0, at the end). $NODES_CRASH_RANK exits 1 after step 3 of
attempt 0; $NODES_PAUSE sleeps that long after each step, so a test can act mid-training.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist

out = os.environ["NODES_OUT"]
rank = int(os.environ["RANK"])
world = int(os.environ["WORLD_SIZE"])
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
steps = int(os.environ.get("NODES_STEPS", "20"))
crash_rank = int(os.environ.get("NODES_CRASH_RANK", "-1"))
pause = float(os.environ.get("NODES_PAUSE", "0"))


def write(name: str, text: str) -> None:
    tmp = os.path.join(out, f".{name}.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, os.path.join(out, name))


write(
    f"start.{restart}.{rank}",
    json.dumps({"pid": os.getpid(), "world": world, "group": int(os.environ["GROUP_RANK"])}),
)
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
ddp = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
gen = torch.Generator().manual_seed(1234)
x = torch.randn(96, 4, generator=gen)
y = x.sum(1, keepdim=True)
xs, ys = x[rank::world], y[rank::world]
for step in range(steps):
    opt.zero_grad()
    loss = ((ddp(xs) - ys) ** 2).mean()
    loss.backward()
    opt.step()
    if rank == 0:
        write("step", f"{restart} {world} {step}")
    if rank == crash_rank and restart == 0 and step == 3:
        sys.exit(1)
    time.sleep(pause)
if rank == 0:
    params = [p.detach().flatten().tolist() for p in model.parameters()]
    write(f"params.{restart}.{world}.json", json.dumps(params))
dist.destroy_process_group()
