"""A torchrun-style worker: gloo all_reduce of the ranks; writes what it saw to $OUT_DIR."""

import json
import os
import sys

import torch
import torch.distributed as dist

ENV_KEYS = [
    "RANK",
    "LOCAL_RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_NAME",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_ERROR_FILE",
]

dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.tensor([float(rank)])
dist.all_reduce(t)
out = {"sum": t.item(), "pid": os.getpid(), "env": {k: os.environ.get(k) for k in ENV_KEYS}}
path = os.path.join(os.environ["OUT_DIR"], f"rank{rank}.json")
with open(path + ".tmp", "w") as f:
    json.dump(out, f)
os.replace(path + ".tmp", path)
dist.destroy_process_group()
if os.environ.get("EXIT_RANK") == str(rank):
    print(f"rank {rank} exiting with 3 on purpose", file=sys.stderr, flush=True)
    sys.exit(3)
