"""A tiny DistributedDataParallel training run, written for torchrun: it reads only the env.

Run it with `torchrun --nproc-per-node 2 examples/train_ddp.py` or under gelastic unchanged.

With `--checkpoint-dir DIR` it survives restarts: rank 0 saves the model, the optimizer and the
number of finished steps to DIR/checkpoint.pt every `--checkpoint-every` steps (written to a
temporary file in DIR, then renamed over the old one, so a reader never sees half a file), and
every rank of a new attempt loads it before its first step and goes on from there. The step is
also written to DIR/checkpoint.json (same way, after the checkpoint itself), which a watcher can
read without torch. Rank 0 prints `resumed from step N` when it started from a checkpoint.

With `--leave-on-notice` (and a checkpoint dir) it leaves cleanly when gelastic drains a node of
the job (`gelastic nodes --drain NODE --deadline 90`, or a SIGTERM to a node's agent): every rank
checks `client.preempted()` after each step and the ranks agree with one all_reduce of a flag,
so all stop at the same step; rank 0 saves the checkpoint and every rank exits 0, long before
the deadline. The job re-forms on the nodes that remain, without spending a restart, and goes on
from that step. Outside gelastic `preempted()` is always None.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

try:
    from client import preempted
except ImportError:  # not under gelastic (plain torchrun): never preempted

    def preempted() -> None:  # type: ignore[misc]
        return None


CHECKPOINT = "checkpoint.pt"
CHECKPOINT_INFO = "checkpoint.json"


def _write_atomically(directory: Path, name: str, write: Any) -> None:
    """`write(file)` into a private temporary file in `directory`, then rename it to `name`."""
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=directory)  # 0600
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, directory / name)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_checkpoint(directory: Path, model: torch.nn.Module, opt: Any, step: int) -> None:
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}
    _write_atomically(directory, CHECKPOINT, lambda f: torch.save(state, f))
    write_checkpoint_info(directory, step)


def write_checkpoint_info(directory: Path, step: int) -> None:
    info = json.dumps({"step": step}).encode()
    _write_atomically(directory, CHECKPOINT_INFO, lambda f: f.write(info))


def load_checkpoint(directory: Path, model: torch.nn.Module, opt: Any) -> int:
    """Load DIR/checkpoint.pt if there is one; return the number of steps it had finished."""
    path = directory / CHECKPOINT
    if not path.exists():
        return 0
    # weights_only: tensors and plain containers only, never arbitrary pickled objects.
    state = torch.load(path, weights_only=True)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    return int(state["step"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--checkpoint-dir", type=Path, default=None)
    parser.add_argument("--checkpoint-every", type=int, default=1)
    parser.add_argument(
        "--step-time", type=float, default=0.0, help="seconds of pretend compute per step"
    )
    parser.add_argument(
        "--leave-on-notice",
        action="store_true",
        help="on gelastic's preemption notice, checkpoint (needs --checkpoint-dir) and exit 0",
    )
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    net = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    start = 0
    if args.checkpoint_dir is not None:
        # Every rank loads before the first collective, and rank 0 saves only after one, so all
        # ranks of an attempt start from the same checkpoint.
        start = load_checkpoint(args.checkpoint_dir, net, opt)
        if rank == 0 and start:
            # The step file follows the checkpoint: a rank stopped between the two writes left it
            # one step behind, and a run resumed at its last step writes no checkpoint again.
            write_checkpoint_info(args.checkpoint_dir, start)
            # gelastic names the round; torchrun does not.
            where = (
                f", round {os.environ['GELASTIC_ROUND']}" if "GELASTIC_ROUND" in os.environ else ""
            )
            print(f"resumed from step {start} (world size {world}{where})", flush=True)
    model = DistributedDataParallel(net)
    true_w = torch.arange(8, dtype=torch.float32) / 8
    loss = torch.tensor(0.0)
    for step in range(start, args.steps):
        # The data of a step depends on the step and the rank only: a resumed run sees the same.
        gen = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(32, 8, generator=gen)
        y = x @ true_w
        loss = torch.nn.functional.mse_loss(model(x).squeeze(-1), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if args.step_time:
            time.sleep(args.step_time)
        done = step + 1
        if rank == 0 and (step % 5 == 0 or done == args.steps):
            print(f"step {step:3d}  loss {loss.item():.4f}  (world size {world})", flush=True)
        if (
            rank == 0
            and args.checkpoint_dir is not None
            and (done % args.checkpoint_every == 0 or done == args.steps)
        ):
            save_checkpoint(args.checkpoint_dir, net, opt, done)
        if args.leave_on_notice and args.checkpoint_dir is not None and done < args.steps:
            # One rank's notice is every rank's: all stop after the same step.
            notice = torch.tensor([float(preempted() is not None)])
            dist.all_reduce(notice)
            if notice.item():
                if rank == 0:
                    save_checkpoint(args.checkpoint_dir, net, opt, done)
                    print(f"preemption notice: checkpointed step {done}; leaving", flush=True)
                dist.barrier()  # rank 0's checkpoint is whole before any rank goes
                dist.destroy_process_group()
                return
    total = torch.tensor([loss.item()])
    dist.all_reduce(total)
    if rank == 0:
        print(f"mean final loss across {world} ranks: {total.item() / world:.4f}", flush=True)
    print(
        f"rank {rank}/{world} on {os.environ.get('GROUP_RANK')}:{os.environ.get('LOCAL_RANK')} done",
        flush=True,
    )
    # Every rank reaches the end before any tears its group down: one that exits first can
    # leave another's destroy_process_group() waiting on it.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
