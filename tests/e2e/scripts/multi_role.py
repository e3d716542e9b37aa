"""A worker of a multi-role job: gloo all_reduce across every role's ranks; writes its env and
the sum to $OUT_DIR/a<restart count>-rank<RANK>.json. In attempt 0 the rank with ROLE_RANK 0 of
role $FAIL_ROLE exits 3 once every rank of the world has written its file."""

import json
import os
import sys
import time

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
    "PART",
]

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.tensor([float(rank)])
dist.all_reduce(t)
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
out_dir = os.environ["OUT_DIR"]
out = {
    "sum": t.item(),
    "pid": os.getpid(),
    "argv": sys.argv[1:],
    "env": {k: os.environ.get(k) for k in ENV_KEYS},
}
path = os.path.join(out_dir, f"a{attempt}-rank{rank}.json")
with open(path + ".tmp", "w") as f:
    json.dump(out, f)
os.replace(path + ".tmp", path)
fail = (
    attempt == "0"
    and os.environ.get("ROLE_NAME") == os.environ.get("FAIL_ROLE")
    and os.environ.get("ROLE_RANK") == "0"
)
if fail:
    # Fail only once every rank has reported, so attempt 0 is complete in $OUT_DIR.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if all(os.path.exists(os.path.join(out_dir, f"a0-rank{r}.json")) for r in range(world)):
            break
        time.sleep(0.05)
    print(f"rank {rank} ({os.environ['ROLE_NAME']}) exiting with 3 on purpose", file=sys.stderr)
    sys.exit(3)
dist.destroy_process_group()
