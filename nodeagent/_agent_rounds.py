"""The worker groups of the rounds a node agent holds: started, stopped, released.

`RoundControl` carries out what the agent accepted: it runs one `WorkerGroup` per held round
(`run`), reports each start, failure notice, exit and UNKNOWN through `send` the moment it
happens, and keeps them in the round's `Held` record, which every new session re-reports. It
stops a round when told (`stop`, reported once its workers are gone), lets it go once the
exit barrier is passed (`release`), and stops them all when the agent stops (`stop_all`). The
job's standbys (`nodeagent._standby`) follow its rounds. What to accept and what to tell the
coordinator is decided in `nodeagent._agent_core`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from client.assignment import RoundAssignment
from client.model import MAX_STANDBY_LINGER_S, FailureCategory, ProcessFailure
from client.node_codec import MAX_TORCH_METRICS
from client.node_protocol import (
    GroupStopped,
    GroupUnknown,
    NodeMsg,
    Release,
    Stop,
    TorchMetric,
    WorkerExited,
    WorkerFailing,
)
from nodeagent._agent_core import HeldRound, Refusal, preempt_notice
from nodeagent._agent_logs import log_task_failure
from nodeagent._launch import METRICS_CHANNEL_ENV
from nodeagent._metric_channel import MetricChannel
from nodeagent._plugins import AgentPlugins, exit_info, round_info

if TYPE_CHECKING:
    from nodeagent._reaper import PidRegistry
    from nodeagent._standby import StandbyPool
    from nodeagent._workers import WorkerExit, WorkerGroup

__all__ = ["Held", "RoundControl"]

logger = logging.getLogger(__name__)

START_WAIT_S = 30.0
"""How long a stop waits for a start still under way to finish spawning."""


@dataclass
class Held(HeldRound):
    """A held round and the worker group that runs it."""

    group: WorkerGroup | None = None
    stopping: asyncio.Task[None] | None = None
    started: asyncio.Event = field(default_factory=asyncio.Event)


class RoundControl:
    """The held rounds of one agent, by (job id, round), and their worker groups."""

    def __init__(
        self,
        node: str,
        *,
        dirs: Callable[[], tuple[Path, Path]],
        registry: PidRegistry,
        standbys: StandbyPool,
        send: Callable[[NodeMsg], None],
        spawn: Callable[[Coroutine[Any, Any, None], str], None],
        started: Callable[[Held], None],
        closing: Callable[[], bool],
        plugins: AgentPlugins | None = None,
    ) -> None:
        self.node = node
        self._dirs = dirs
        """The log root and the state dir (they are settled when the agent starts)."""
        self._registry = registry
        self._standbys = standbys
        self._send = send
        self._spawn = spawn
        self._started = started
        """Called once a round's workers are up, before that is reported (standbys warm up)."""
        self._closing = closing
        self._plugins = plugins
        """Site hooks: `before_round` may veto a round, `after_worker_exit` hears each exit."""
        self.held: dict[tuple[str, int], Held] = {}
        self._ending: set[WorkerGroup] = set()
        """Groups of rounds no longer held whose close (the store host's end, the log pumps)
        is under way: `stop_all` waits for them."""
        self.metrics: MetricChannel | None = None
        """Where the workers of a job with torch_metrics send them (None: not open)."""

    def run(self, a: RoundAssignment) -> None:
        held = Held(a)
        self.held[(a.job_id, a.round)] = held
        self._spawn(self._start_group(held), f"start-{a.job_id}-{a.round}")

    async def _start_group(self, held: Held) -> None:
        try:
            if await self._vetoed(held):
                return
            await self._start_workers(held)
        except Exception as exc:
            # Whatever failed, the round's workers must not run unsupervised nor unreported.
            a = held.assignment
            logger.exception("job %s round %d: the start failed", a.job_id, a.round)
            reason = f"the start failed: {type(exc).__name__}: {exc}"
            if held.group is not None:
                held.group.go_unknown(reason)
            if not held.unknown:  # no group, or one already closed: say it here
                held.unknown = reason
                self._send(GroupUnknown(a.job_id, a.round, reason))
            held.started.set()

    async def _vetoed(self, held: Held) -> bool:
        """Whether a plug-in's `before_round` vetoes the round: then each of its ranks here
        exits at once with an INFRA failure naming the reason (no worker starts)."""
        plugins, a = self._plugins, held.assignment
        if plugins is None or not plugins.has("before_round"):
            return False
        why = await plugins.before_round(round_info(a, self.node))
        if not why or self.held.get((a.job_id, a.round)) is not held:
            return bool(why)
        refusal = Refusal(f"before_round {why}", FailureCategory.INFRA)
        logger.error("%s", refusal.message(self.node, a.round))
        for exited in refusal.exits(a, self.node, time.time()):
            held.exits.append(exited.exit)
            self._send(exited)
        held.started.set()
        return True

    async def _start_workers(self, held: Held) -> None:
        a = held.assignment
        key = (a.job_id, a.round)
        plugins = self._plugins

        def on_exit(ex: WorkerExit) -> None:
            held.exits.append(ex)
            self._send(WorkerExited(a.job_id, a.round, ex))
            if plugins is not None and plugins.has("after_worker_exit"):
                info = exit_info(a, self.node, ex)
                self._spawn(plugins.after_worker_exit(info), f"after-exit-{a.job_id}-{a.round}")

        def on_failing(failure: ProcessFailure) -> None:
            held.failing[failure.local_rank] = failure
            self._send(WorkerFailing(a.job_id, a.round, failure))

        def on_unknown(reason: str) -> None:
            # The group killed its workers before this; the report may be lost with the
            # session, so it is kept and replayed on the next.
            held.unknown = reason
            logger.error(
                "job %s attempt %d round %d: worker group UNKNOWN: %s",
                a.job_id,
                a.attempt,
                a.round,
                reason,
            )
            self._send(GroupUnknown(a.job_id, a.round, reason))

        # Imported at the first round: the supervision stack (health, watchdog, inotify, error
        # files) is about 1 MB of heap an idle agent does without.
        from nodeagent._workers import WorkerGroup

        log_root, state_dir = self._dirs()
        group = WorkerGroup(
            a,
            on_unknown=on_unknown,
            node_name=self.node,
            log_root=log_root,
            on_exit=on_exit,
            on_failing=on_failing,
            run_dir=state_dir,
            pid_registry=self._registry,
            spawner=self._standbys.spawner(a.job_id),
            warm_store=lambda _launch: self._standbys.take_store(a.job_id),
            before_spawn=lambda: self._prepare_zygote(a.job_id, group, len(a.workers)),
            agent_env={**os.environ, METRICS_CHANNEL_ENV: self.metrics.path}
            if self.metrics
            else None,
        )
        held.group = group
        launch = group.standby_launch()
        if launch is not None:
            # The job's first round here: standbys a finished job of the same spec left (a sweep).
            self._standbys.adopt(a.job_id, launch)
        try:
            pids = await group.start()
        finally:
            held.started.set()
        held.pids = dict(pids)
        if self.held.get(key) is not held or held.unknown:
            return
        self._started(held)
        self._send(held.workers_started())
        logger.info(
            "job %s attempt %d round %d: started ranks %s",
            a.job_id,
            a.attempt,
            a.round,
            {held.global_rank(lr): pid for lr, pid in pids.items()},
        )

    async def _prepare_zygote(self, job_id: str, group: WorkerGroup, workers: int) -> None:
        """Before a round's workers start: its job's zygote (preload only), started if need be
        and waited for, and its forks for the `workers`, so the workers are forks of it (see
        nodeagent._standby). Awaited: the session's heartbeats go on meanwhile."""
        launch = group.standby_launch()
        if launch is not None and launch.preload and not self._closing():
            await self._standbys.prepare(job_id, launch, workers)

    def open_metrics(self, path: Path) -> None:
        """Serve the torch metrics channel at `path` (a FIFO, 0600) on the running loop; when it
        cannot be made, a job with torch_metrics runs here without it (a warning says why)."""
        channel = MetricChannel(str(path), self._takes_metrics)
        try:
            fd = channel.open()
        except OSError as exc:  # the agent runs on; such jobs report no torch metrics here
            logger.warning("no torch metrics channel at %s: %s", path, exc)
            return
        asyncio.get_running_loop().add_reader(fd, channel.read)
        self.metrics = channel

    def _takes_metrics(self, job_id: str) -> bool:
        return any(k[0] == job_id and h.assignment.spec.torch_metrics for k, h in self.held.items())

    def take_metrics(self) -> tuple[TorchMetric, ...]:
        """The torch metrics changed since the last heartbeat (at most MAX_TORCH_METRICS)."""
        if self.metrics is None:
            return ()
        return tuple(TorchMetric(*m) for m in self.metrics.take(MAX_TORCH_METRICS))

    def close_metrics(self) -> None:
        if self.metrics is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: no reader to remove
                asyncio.get_running_loop().remove_reader(self.metrics.fd)
            self.metrics.close()
            self.metrics = None

    def stop(self, m: Stop) -> None:
        held = self.held.get((m.job_id, m.round))
        if held is None:
            self._send(GroupStopped(m.job_id, m.round))
            return
        logger.info("job %s round %d: stopping (%s)", m.job_id, m.round, m.reason)
        # Every stop, a restart's and a re-form's too, gives the workers the job's grace: a
        # SIGTERM handler that saves a checkpoint finishes it. Workers that exit on SIGTERM (a
        # torch rank blocked in a collective does within tens of ms) cost the next round nothing.
        if not m.replaced or m.drain_node == self.node:
            # No next round of the job comes here (a drained node gets none).
            self._standbys.discard(m.job_id)
        notice: tuple[float, bytes] | None = None
        if m.notice:
            # A drain: the workers are told now, whatever comes after.
            notice = (m.term_after, preempt_notice(m, time.time()))
            logger.info(
                "job %s round %d: preemption notice (node %s drains); SIGTERM in %.3g s, "
                "SIGKILL %.3g s later",
                m.job_id,
                m.round,
                m.drain_node,
                m.term_after,
                m.grace,
            )
        if held.stopping is None:
            held.stopping = asyncio.get_running_loop().create_task(
                self._stop_and_report(held, m.grace, replaced=m.replaced, notice=notice),
                name=f"stop-{m.job_id}-{m.round}",
            )
            held.stopping.add_done_callback(log_task_failure)

    async def _stop_and_report(
        self,
        held: Held,
        grace: float,
        *,
        replaced: bool = False,
        notice: tuple[float, bytes] | None = None,
    ) -> None:
        # Reported once the workers are gone; the group's close (the store host's teardown, the
        # log pumps) runs after, off the path of the round that replaces it.
        unkillable = await self.stop_group(held, grace, close=False, notice=notice)
        a = held.assignment
        if replaced and not any(k[0] == a.job_id and h is not held for k, h in self.held.items()):
            self._standbys.idle(a.job_id)
        self._send(GroupStopped(a.job_id, a.round, tuple(unkillable)))
        self.held.pop((a.job_id, a.round), None)
        if held.group is not None:
            await self._close(held.group)

    async def stop_group(
        self,
        held: Held,
        grace: float,
        *,
        close: bool = True,
        notice: tuple[float, bytes] | None = None,
    ) -> list[int]:
        """Stop the round's workers (`notice`: a drain's, (SIGTERM after, the notice))."""
        # A start still under way must finish spawning before it can be stopped as a unit.
        if held.group is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(held.started.wait(), START_WAIT_S)
        unkillable: list[int] = []
        if held.group is not None and notice is not None:
            unkillable = await held.group.stop_after_notice(grace, *notice)
        elif held.group is not None:
            unkillable = await held.group.stop(grace)
            if close:
                await held.group.close()
        held.stopped = True
        return unkillable

    async def stop_all(self, grace_of: Callable[[Held], float]) -> None:
        """Stop every held round's workers, each with its grace (the agent stops)."""
        held = list(self.held.values())
        await asyncio.gather(
            *(self.stop_group(h, grace_of(h)) for h in held), return_exceptions=True
        )
        # Rounds that ended before: their close has no workers left to wait for.
        await asyncio.gather(*(g.close() for g in list(self._ending)), return_exceptions=True)

    async def _close(self, group: WorkerGroup) -> None:
        self._ending.add(group)
        try:
            await group.close()
        finally:
            self._ending.discard(group)

    def idle(self) -> bool:
        """No worker of a held round runs, and no stop is under way (a drain is done here)."""
        return all(
            h.started.is_set()
            and (h.group is None or h.group.running == 0)
            and (h.stopping is None or h.stopping.done())
            for h in self.held.values()
        )

    def release(self, m: Release) -> None:
        held = self.held.pop((m.job_id, m.round), None)
        # Released by the exit barrier: the job succeeded and is done here. Its standbys go, or
        # linger for the next job of the same spec when it asked for that.
        linger = held.assignment.spec.standby_linger if held is not None else 0.0
        self._standbys.release(m.job_id, min(linger, MAX_STANDBY_LINGER_S))
        if held is not None and held.group is not None:
            self._spawn(self._close(held.group), "close-group")
