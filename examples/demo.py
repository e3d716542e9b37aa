"""`make demo`: a real 2 x 2 DDP job on a local cluster survives a dead worker and a dead node.

A coordinator and two node agents start on this host; `train_ddp.py` runs as 2 nodes x 2 gloo
workers (min_nodes=1, max_nodes=2) and checkpoints every step into a private directory.

- Act 1: once the checkpoint has reached 30% of the steps, the demo SIGKILLs one worker (rank 3,
  its pid taken from the job's status). The job restarts (attempt 1) and every rank resumes from
  the checkpoint, not from step 0.
- Act 2: at 60% of the steps, the demo SIGKILLs node-1's agent; its workers die with it. The job
  re-forms on node-0 alone, resumes from the checkpoint again, and finishes.

The coordinator serves its dashboard (`LocalCluster(dashboard_port=0)`); its URL is printed
first. The timeline is printed as it happens, from the job's attempts, its events and rank 0's
log (it prints `resumed from step N`), all read through the client API; then the RunResult, the
wall time of each phase and the CPU time of the demo and its cluster. The job asks for standby
workers (`preload` of torch and of the torch._dynamo that DDP's constructor imports): each
node's zygote imports them once, and every worker of every round and every standby is a fork of
it, so neither a start nor a restart imports them again.

The demo exits non-zero when the story did not happen as told: the job failed, attempt 0 did
not fail, a round did not resume from the checkpoint, or anything it started was left running.
Everything it started is stopped before it exits and its directory is removed, unless it
failed: then it says where the logs and checkpoints are.

`--steps N` (default 30, at least 10) makes the run shorter or longer; `--events` also prints the
job's raw events at the end.
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

import psutil

from client import GelasticError, Job, JobSpec, JobState, WorkerState
from client.model import AttemptSummary, ProcessFailure, RunResult
from client.stacks import format_capture
from gelastic.local import AGENT_ENV, CLUSTER_ENV, LocalCluster, poll_until

HERE = Path(__file__).resolve().parent
WAIT_S = 120.0
"""Longest the demo waits for any one thing (a checkpoint step, a resumed round, the end)."""
MAX_LOG_BYTES = 256 * 1024
"""Most of rank 0's log the demo reads to find the step a round resumed from."""
NODES = ("node-0", "node-1")
VICTIM_RANK = 3
VICTIM_NODE = "node-1"
_RESUMED = re.compile(r"resumed from step (\d{1,9}) \(world size (\d{1,6}), round (\d{1,9})\)")


class DemoFailed(RuntimeError):
    """The job did not recover the way the demo says it does."""


def _print_dashboard_url(cluster: LocalCluster) -> None:
    """Where the cluster's live dashboard is, while the demo runs (the token stays in its file)."""
    url = cluster.dashboard_url
    if url:
        print(f"dashboard: {url}  (log in with the token in {cluster.token_file})", flush=True)


class Phases:
    """Wall-clock marks of the demo's phases, and the CPU time it and its cluster used."""

    def __init__(self, t0: float) -> None:
        self.marks: list[tuple[str, float]] = [("start", t0)]

    def mark(self, what: str) -> None:
        self.marks.append((what, time.time()))

    def report(self) -> str:
        lines = ["phases (wall):"]
        for (_, a), (what, b) in zip(self.marks, self.marks[1:], strict=False):
            lines.append(f"  {b - a:5.1f} s  {what}")
        me = resource.getrusage(resource.RUSAGE_SELF)
        # Its processes once they were reaped: the coordinator and the agents, with the workers,
        # standbys and store hosts they reaped (not those of an agent that was killed).
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        own, theirs = me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime
        lines.append(
            f"CPU: {own + theirs:.1f} s ({own:.1f} s the demo, {theirs:.1f} s its cluster)"
        )
        return "\n".join(lines)


def checkpoint_step(ckpt_dir: Path) -> int:
    """The step of the last checkpoint train_ddp.py wrote (0 before the first)."""
    try:
        with open(ckpt_dir / "checkpoint.json", "rb") as f:
            doc = json.loads(f.read(4096))
    except (OSError, ValueError):
        return 0
    step = doc.get("step") if isinstance(doc, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else 0


def _one_line(text: str, limit: int = 100) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


_ERROR_TYPE = re.compile(r"([A-Za-z_][\w.]{0,60}):.*", re.DOTALL)


def _how(f: ProcessFailure) -> str:
    """`SIGKILL` for a plain death by signal, else the error it recorded, else its exit code."""
    m = _ERROR_TYPE.fullmatch(f.message)
    if m and not f.message.startswith("Signal "):
        return m.group(1)
    return f.signal or f"exit code {f.exitcode}"


class Timeline:
    """The story so far, one line per thing that happened, each printed once, as it is known.

    Rounds come from the job's events (when each formed) and attempts (how each ended, with its
    failures); where a round resumed comes from rank 0's log; what the demo did, from itself.
    """

    def __init__(self, job: Job, t0: float) -> None:
        self.job = job
        self.t0 = t0
        self.resumed: dict[int, tuple[int, int]] = {}
        """Round -> (step it resumed from, world size)."""
        self.final_step = 0
        self.killed: dict[int, int] = {}
        """Round -> the rank the demo SIGKILLed in it."""
        self._printed: set[tuple[int, str]] = set()

    def say(self, who: str, text: str, when: float | None = None) -> None:
        at = (time.time() if when is None else when) - self.t0
        print(f"  {max(0.0, at):5.1f} s  {who:10s} {text}", flush=True)

    def update(self) -> None:
        """Print what the coordinator now knows and was not printed yet, oldest first."""
        attempts = {a.round: a for a in self.job.attempts()}
        formed = {e.round: e for e in self.job.events() if e.kind == "round_formed"}
        status = self.job.status()
        for round_ in sorted(set(formed) | set(attempts)):
            a = attempts.get(round_)
            attempt = a.attempt if a is not None else status.attempt
            nodes = a.nodes if a is not None else tuple(m.node for m in status.members)
            e = formed.get(round_)
            if round_ in self.resumed:  # printed as soon as rank 0 said so
                self._once(round_, "start", None, attempt, self._start(nodes, round_))
            elif round_ == min(formed, default=round_):
                when = e.timestamp if e is not None else None
                self._once(round_, "start", when, attempt, self._start(nodes, round_))
            if a is not None and a.ended_at:
                self._once(round_, "end", a.ended_at, attempt, self._end(a))

    def _once(self, round_: int, what: str, when: float | None, attempt: int, text: str) -> None:
        if (round_, what) not in self._printed:
            self._printed.add((round_, what))
            self.say(f"attempt {attempt}", text, when)

    def _start(self, nodes: Sequence[str], round_: int) -> str:
        where = ", ".join(nodes)
        if round_ in self.resumed:
            step, world = self.resumed[round_]
            return f"resumed from step {step} on {where} (world size {world})"
        return f"started on {where} (world size {2 * len(nodes)})"

    def _end(self, a: AttemptSummary) -> str:
        later = [r for r in self.resumed if r > a.round]
        step = self.resumed[min(later)][0] if later else self.final_step
        at = f" at step {step}" if step else ""
        if "lost" in a.end_reason:
            # "node node-1 lost (why); re-forming with the remaining nodes": the next line says so.
            # Its workers went with its agent: the loss is the story, not their exit codes.
            text = f"stopped{at}: {_one_line(a.end_reason.split(';')[0])}"
            if a.failures:
                ranks = ", ".join(str(f.global_rank) for f in a.failures)
                text += f"; its ranks {ranks} went with it"
            return text
        if a.failures:
            text = f"failed{at}: {describe_failures(a.failures)}"
            victim = self.killed.get(a.round)
            if victim is not None and all(f.global_rank != victim for f in a.failures):
                text += f" (rank {victim}, which the demo killed, is not listed)"
            return text
        return f"finished{at}: {_one_line(a.end_reason)}"


def describe_failures(failures: Sequence[ProcessFailure]) -> str:
    """`rank 3 on node-1 (SIGKILL); also ranks 0, 2 (exit code 1)`: a signal death first (the
    kill that started it), else the root cause the coordinator named; it is named if another."""
    ordered = sorted(failures, key=lambda f: (_how(f) != f.signal, not f.root_cause, f.global_rank))
    head, rest = ordered[0], ordered[1:]
    text = f"rank {head.global_rank} on {head.node} ({_how(head)})"
    if rest:
        ranks = ", ".join(str(f.global_rank) for f in sorted(rest, key=lambda f: f.global_rank))
        hows = sorted({_how(f) for f in rest})
        text += f"; also rank{'s' if len(rest) > 1 else ''} {ranks} ({', '.join(hows)})"
    root = [f for f in failures if f.root_cause]
    if root and root[0] is not head:
        text += f"; root cause as reported: rank {root[0].global_rank}"
    return text


def _wait(job: Job, pred: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    """Wait for `pred`; fail at once if the job ended first.

    `pred` is looked at every 20 ms (a step of the demo's training takes 50 ms, and an act must
    strike with steps still to go); the job's state, an RPC, every 200 ms.
    """
    asked = [time.monotonic()]

    def check() -> bool:
        if pred():
            return True
        if time.monotonic() - asked[0] < 0.2:
            return False
        asked[0] = time.monotonic()
        state = job.status().state
        if state.is_terminal():
            raise DemoFailed(f"the job ended ({state.value}) while waiting for {what}")
        return False

    try:
        poll_until(check, timeout, interval=0.02, what=what)
    except TimeoutError as e:
        raise DemoFailed(f"{e}\n{_where_each_rank_is(job)}") from None


def _where_each_rank_is(job: Job) -> str:
    """Every running rank's stack, grouped: what a wait that ran out has to say."""
    try:
        return "where each rank is:\n" + format_capture(job.stacks(wait=10))
    except GelasticError as e:
        return f"no stacks of the ranks: {e}"


def resumed_from(job: Job, attempt: int, round_: int) -> tuple[int, int] | None:
    """(step, world size) that rank 0 printed when round `round_` resumed, from its log."""
    data = bytearray()
    try:
        for chunk in job.logs(rank=0, stream="stdout", attempt=attempt):
            data += chunk[: MAX_LOG_BYTES - len(data)]
            if len(data) >= MAX_LOG_BYTES:
                break
    except GelasticError:
        return None  # the round is still starting: its log is not there yet
    for line in data.decode(errors="replace").splitlines():
        m = _RESUMED.fullmatch(line.strip())
        if m and int(m.group(3)) == round_:
            return int(m.group(1)), int(m.group(2))
    return None


def wait_resumed(job: Job, timeline: Timeline, after_round: int, nodes: Sequence[str]) -> int:
    """Wait for a round after `after_round` to run on `nodes` and resume; return its step."""
    found: list[tuple[int, int, int]] = []

    def resumed() -> bool:
        status = job.status()
        if status.round <= after_round or status.state != JobState.RUNNING:
            return False
        members = sorted(m.node for m in status.members)
        if members != sorted(nodes):
            raise DemoFailed(f"round {status.round} formed on {members}, not on {list(nodes)}")
        got = resumed_from(job, status.attempt, status.round)
        if got is not None:
            found.append((status.round, *got))
        return got is not None

    _wait(job, resumed, f"a round after round {after_round} to resume from the checkpoint")
    round_, step, world = found[-1]
    timeline.resumed[round_] = (step, world)
    timeline.update()
    return step


def kill_worker(cluster: LocalCluster, job: Job, rank: int) -> tuple[int, str, int]:
    """SIGKILL the worker of `rank`, found through the job's status: (pid, node, round)."""
    status = job.status()
    workers = [w for w in status.workers if w.global_rank == rank and w.pid > 0]
    if not workers:
        raise DemoFailed(f"rank {rank} has no pid in the job's status")
    w = workers[0]
    proc = psutil.Process(w.pid)
    env = proc.environ()
    # Only a worker of this cluster, on the node the status names, is the demo's to kill.
    if env.get(CLUSTER_ENV) != cluster.cluster_id or env.get(AGENT_ENV) != w.node:
        raise DemoFailed(f"pid {w.pid} of rank {rank} is not this cluster's worker on {w.node}")
    proc.send_signal(signal.SIGKILL)
    return w.pid, w.node, status.round


def run(
    args: argparse.Namespace, cluster: LocalCluster, ckpt_dir: Path, t0: float, phases: Phases
) -> RunResult:
    steps = args.steps
    act1, act2 = steps * 3 // 10, steps * 6 // 10
    spec = JobSpec(
        entrypoint=[sys.executable, str(HERE / "train_ddp.py")],
        args=["--steps", str(steps), "--checkpoint-dir", str(ckpt_dir), "--step-time", "0.05"],
        nproc_per_node=2,
        min_nodes=1,
        max_nodes=2,
        # One restart, for act 1: act 2 re-forms without spending it. The round after act 2 (node-0
        # alone, no restart left) then warms no standbys: none could serve.
        max_restarts=1,
        # Every free node joins at once (both are free whenever a round forms, until node-1
        # dies); a worker left to finish recording a failure gets 2 s.
        last_call_timeout=0,
        stop_grace=2,
        name="demo-ddp",
        env={"OMP_NUM_THREADS": "1"},  # as torchrun sets it: 4 workers share 2 cores here
        # DistributedDataParallel imports torch._dynamo: a standby has both ready.
        preload=("torch", "torch._dynamo"),
    )
    job = cluster.client.submit(spec)
    print(
        f"submitted {job.job_id}: {Path(spec.command[1]).name} on 1-2 nodes x 2 workers,"
        f" {steps} steps, checkpoint every step, standby workers with torch imported",
        flush=True,
    )
    timeline = Timeline(job, t0)
    print("\ntimeline (seconds since the demo started):", flush=True)
    timeline.say("demo", "submitted the job", time.time())

    _wait(job, lambda: checkpoint_step(ckpt_dir) >= act1, f"the checkpoint of step {act1}")
    phases.mark(f"submit to the checkpoint of step {act1} (4 workers forked, 1 import per node)")
    timeline.update()
    at = checkpoint_step(ckpt_dir)
    pid, node, round1 = kill_worker(cluster, job, VICTIM_RANK)
    timeline.killed[round1] = VICTIM_RANK
    timeline.say(
        "act 1", f"checkpoint at step {at}: SIGKILL rank {VICTIM_RANK} (pid {pid}) on {node}"
    )
    step1 = wait_resumed(job, timeline, round1, NODES)
    phases.mark("act 1: kill to resumed (attempt 1 on standbys)")
    if step1 < at or step1 == 0:
        raise DemoFailed(f"the restart resumed from step {step1}, not from step {at} or later")

    # After a step of attempt 1 at least: a short run can resume at or past act 2's step.
    act2 = max(act2, step1 + 1)
    _wait(job, lambda: checkpoint_step(ckpt_dir) >= act2, f"the checkpoint of step {act2}")
    phases.mark(f"training to the checkpoint of step {act2}")
    round2 = job.status().round
    at = checkpoint_step(ckpt_dir)
    agent_pid = cluster.kill_agent(VICTIM_NODE, signal.SIGKILL)
    timeline.say(
        "act 2", f"checkpoint at step {at}: SIGKILL node agent {VICTIM_NODE} (pid {agent_pid})"
    )
    step2 = wait_resumed(job, timeline, round2, [n for n in NODES if n != VICTIM_NODE])
    phases.mark("act 2: kill to resumed (node-0 alone, on standbys)")
    if step2 < at:
        raise DemoFailed(f"the re-formed round resumed from step {step2}, not from {at} or later")

    try:
        result = job.wait(timeout=WAIT_S)
    except TimeoutError as e:
        raise DemoFailed(f"{e}\n{_where_each_rank_is(job)}") from None
    phases.mark(f"training to step {steps} and the exit barrier")
    timeline.final_step = checkpoint_step(ckpt_dir)
    timeline.update()
    if args.events:
        print("\nevents:")
        for e in job.events():
            print(f"  {e.timestamp - t0:5.1f} s  {e.kind:16s} {_one_line(e.reason, 160)}")
    check(result, steps, timeline.final_step, round1, round2)
    return result


def check(result: RunResult, steps: int, final_step: int, round1: int, round2: int) -> None:
    """Fail unless the job ended the way the timeline told it."""
    if result.state != WorkerState.SUCCEEDED:
        raise DemoFailed(f"the job did not succeed:\n{result.format_failures()}")
    if final_step != steps:
        raise DemoFailed(f"the last checkpoint is of step {final_step}, not of step {steps}")
    by_round = {a.round: a for a in result.attempts}
    killed = by_round.get(round1)
    if killed is None or killed.attempt != 0:
        raise DemoFailed(f"round {round1}, where rank {VICTIM_RANK} was killed, is not attempt 0")
    if not killed.failures:
        raise DemoFailed(f"attempt 0 ended without a failure: {killed.end_reason}")
    lost = by_round.get(round2)
    if lost is None or f"node {VICTIM_NODE} lost" not in lost.end_reason:
        raise DemoFailed(f"round {round2} did not end by the loss of {VICTIM_NODE}")
    if result.attempts[-1].nodes != ("node-0",):
        raise DemoFailed(f"the last round ran on {result.attempts[-1].nodes}, not on node-0")


def summary(result: RunResult) -> str:
    last = result.attempts[-1] if result.attempts else None
    where = f", last on {', '.join(last.nodes)}" if last else ""
    return (
        f"RunResult: state={result.state.value}"
        f" attempts={len({a.attempt for a in result.attempts})}"
        f" rounds={len(result.attempts)}{where} failures={len(result.failures)}"
        f" ({_one_line(result.reason)})"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="training steps (at least 10)")
    parser.add_argument("--events", action="store_true", help="print the job's events at the end")
    args = parser.parse_args(argv)
    if args.steps < 10:
        parser.error("--steps must be at least 10")
    t0 = time.time()
    root = Path(tempfile.mkdtemp(prefix="gelastic-demo-"))  # 0700: logs, state, checkpoints
    ckpt_dir = root / "checkpoints"
    ckpt_dir.mkdir(mode=0o700)
    result: RunResult | None = None
    failed = ""
    print("starting a local cluster: 1 coordinator + 2 node agents on 127.0.0.1 ...", flush=True)
    cluster = LocalCluster(nodes=len(NODES), slots=2, workdir=root / "cluster", dashboard_port=0)
    phases = Phases(t0)
    try:
        with cluster:
            phases.mark("cluster start (coordinator, 2 agents)")
            _print_dashboard_url(cluster)
            for node in cluster.client.list_nodes():
                print(f"  node joined: {node.name} ({node.addr}, {node.slots} slots)", flush=True)
            result = run(args, cluster, ckpt_dir, t0, phases)
    except (DemoFailed, TimeoutError) as exc:
        failed = str(exc)
    except Exception:
        failed = traceback.format_exc()
    # What the stop had to SIGKILL outlived a graceful stop: that is what was left behind.
    left = [str(k) for k in cluster.killed] + [str(p.pid) for p in cluster.leftovers()]
    phases.mark("cluster stop")
    print()
    if result is not None:
        print(summary(result))
    if failed:
        print(f"DEMO FAILED: {failed}")
        print(f"logs and checkpoints kept in {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)
    print(phases.report())
    print(f"cluster stopped; processes left behind: {len(left)}  ({time.time() - t0:.1f} s)")
    for what in left:
        print(f"  left behind: {what}")
    return 1 if failed or left else 0


if __name__ == "__main__":
    sys.exit(main())
