"""A worker group's processes: spawn them, see each one to its exit, kill and stop them.

`Supervisor` holds the group's workers and its phase. It listens on the round's c10d store port,
spawns each worker of the plan (its pid recorded for the reaper, its pipes given to the output
pumps), then starts the store host beside them, waits for each exit and reports it once through
`on_exit` (what the exit means is `Results`'), kills a worker the watchdog or the health check
condemns, and stops the rest: SIGTERM, the grace, SIGKILL. A supervision task that fails, or a
start that fails half-way, makes the group UNKNOWN: everything it started is killed at once
(`go_unknown`).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from client.assignment import RoundAssignment, WorkerRanks
from client.model import FailureCategory, ProcessFailure, signal_name
from client.redaction import redact_argv
from nodeagent import _faults
from nodeagent._group_health import HealthWatch
from nodeagent._group_output import ConsoleWriter, StreamPump, drain, open_pumps
from nodeagent._group_results import (
    EXIT_CANNOT_EXECUTE,
    EarlyFailures,
    NotStarted,
    Results,
    WorkerExit,
    spawn_failure,
)
from nodeagent._launch import StoreHostLaunch, WorkerLaunch
from nodeagent._process import ProcessHandle
from nodeagent._reaper import PidRegistry
from nodeagent._store_host import StoreHost, StoreHostError, WarmStoreHost, listen_for
from nodeagent._watchdog import FileTimerServer

__all__ = ["MAX_UNKNOWN_REASON", "GroupTasks", "Phase", "RoundStore", "Supervisor", "Worker"]

logger = logging.getLogger("nodeagent._workers")

MAX_UNKNOWN_REASON = 1000
"""Characters of an UNKNOWN group's reason kept (an exception's text is not ours to bound)."""
_STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGKILL})
_STORE_STOP_GRACE = 2.0


def _stopped_by_us(handle: Any, rc: int) -> bool:
    """Whether a death by signal `-rc` is the agent's stop: one of its stop signals, and one it
    sent (a worker SIGKILLed by someone else while the stop began is a failure, not a stop)."""
    if -rc not in _STOP_SIGNALS:
        return False
    sent = getattr(handle, "signals_sent", None)
    return sent is None or -rc in sent


class Phase(enum.Enum):
    NEW = "NEW"
    STARTING = "STARTING"
    RUNNING = "RUNNING"
    STOPPING = "STOPPING"
    CLOSED = "CLOSED"


@dataclass
class Worker:
    """One worker of the plan: its process once started, and whether its exit was reported."""

    launch: WorkerLaunch
    handle: ProcessHandle | None = None
    pumps: list[StreamPump] = field(default_factory=list)
    reported: bool = False
    exit: WorkerExit | None = None
    kill_reason: str | None = None
    """Why the agent itself killed this worker (watchdog, health); makes the exit a failure."""
    unhealthy: bool = False
    supervisor: asyncio.Task[Any] | None = None

    @property
    def pid(self) -> int:
        return self.handle.pid if self.handle is not None else 0


async def _let_end(handle: Any, bound: float) -> bool:
    """Let a worker end on its own for up to `bound` s, then kill it; whether it died."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(bound):
            await handle.wait()
            return True
    return bool(await handle.terminate(0.0))


class RoundStore:
    """The round's c10d store host on this node, when this node serves one: its port listened on
    before the workers start, the host started just after them (off their path: the listening
    socket queues every rank that connects before the host serves it), stopped only after
    them (none of them may lose the store while it still runs)."""

    def __init__(
        self,
        *,
        ctx: Callable[[WorkerLaunch | None], str],
        node_name: str,
        registry: PidRegistry | None,
        warm_store: Callable[[StoreHostLaunch], WarmStoreHost | None] | None,
        own: Callable[[Coroutine[Any, Any, Any], str], object],
        active: Callable[[], bool],
        on_failed: Callable[[str], None],
    ) -> None:
        self._ctx = ctx
        self._node_name = node_name
        self._registry = registry
        self._warm_store = warm_store
        self._own = own
        self._active = active
        """Whether the round still runs (a stop begun: its host is not started)."""
        self._on_failed = on_failed
        """The host cannot start while the workers run: they would wait for it in vain."""
        self._launch: StoreHostLaunch | None = None
        self._sock: socket.socket | None = None
        self._starting: asyncio.Handle | None = None
        self._host: StoreHost | None = None
        self._stopping: asyncio.Future[bool] | None = None

    async def listen(
        self, plan: Sequence[WorkerLaunch], launch: StoreHostLaunch | None
    ) -> NotStarted | None:
        """Listen on the store's port, before the workers of `plan`; why not, if it cannot.

        Workers told to use the agent's store would wait for one that never comes, so a port
        that cannot be listened on fails the round's workers before they start.
        """
        if launch is None or not plan:
            return None
        try:
            self._sock = await listen_for(launch)
        except StoreHostError as e:
            logger.error("%s %s", self._ctx(None), e)
            return EXIT_CANNOT_EXECUTE, f"cannot start worker: {e}", FailureCategory.PLATFORM
        self._launch = launch
        return None

    def start(self) -> None:
        """Start the host on the port listened on, once the workers are spawned: on the loop's
        next turn, so neither the workers nor the report of their start wait for it."""
        if self._sock is not None and self._starting is None:
            self._starting = asyncio.get_running_loop().call_soon(self._start)

    def _start(self) -> None:
        self._starting = None
        sock, self._sock = self._sock, None
        if sock is None or self._launch is None:
            return
        if not self._active():
            sock.close()
            return
        launch, ctx = self._launch, self._ctx(None)
        try:
            warm = self._warm_store(launch) if self._warm_store is not None else None
            self._host = StoreHost.start(
                launch, ctx=ctx, registry=self._registry, warm=warm, sock=sock
            )
        except Exception as e:
            sock.close()  # the host did not take it
            self._on_failed(f"the c10d store host cannot start: {type(e).__name__}: {e}")
            return
        self._own(self._host.watch(), f"store-host-{self._host.pid}")

    def _let_go(self) -> None:
        """A host not started yet will not be: its start and its port go."""
        if self._starting is not None:
            self._starting.cancel()
            self._starting = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def stop(self) -> None:
        """Begin the host's stop (once the workers are gone), without waiting for its teardown:
        it serves no one now, and a torch interpreter takes a while to end."""
        self._let_go()
        if self._host is not None and self._stopping is None:
            self._stopping = asyncio.ensure_future(self._host.stop(_STORE_STOP_GRACE))

    async def stopped(self) -> None:
        """Wait for the stop begun, if one was."""
        if self._stopping is not None:
            await asyncio.shield(self._stopping)

    def close(self) -> None:
        self._let_go()
        if self._host is not None:
            self._host.close()


class GroupTasks:
    """The tasks of one group's supervision: named for the group, cancelled at its close. One
    that fails leaves what it watched unwatched: `on_failed(why)` (the group goes UNKNOWN)."""

    def __init__(
        self,
        label: str,
        ctx: Callable[[WorkerLaunch | None], str],
        on_failed: Callable[[str], None],
    ) -> None:
        self._label = label
        self._ctx = ctx
        self._on_failed = on_failed
        self._tasks: set[asyncio.Task[Any]] = set()

    def own(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """Run `coro` as the task `name` of the group."""
        task = asyncio.ensure_future(coro)
        task.set_name(f"{name} {self._label}")
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        exc = None if task.cancelled() else task.exception()
        if exc is not None:
            logger.error("%s task %s failed", self._ctx(None), task.get_name(), exc_info=exc)
            # A task of the group's supervision is gone: what it watched is unwatched now.
            what = task.get_name().split(" ", 1)[0]
            self._on_failed(f"{what} failed: {type(exc).__name__}: {exc}")

    async def cancel(self) -> None:
        """Cancel every task still running, and wait for them to end."""
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


class Supervisor:
    """The processes of one group's workers; see the module docstring."""

    def __init__(
        self,
        assignment: RoundAssignment,
        *,
        results: Results,
        health: HealthWatch,
        ctx: Callable[[WorkerLaunch | None], str],
        on_exit: Callable[[WorkerExit], None],
        on_unknown: Callable[[str], None] | None,
        on_failing: Callable[[ProcessFailure], None] | None,
        console: ConsoleWriter | None,
        registry: PidRegistry | None,
        spawner: Callable[[WorkerLaunch], ProcessHandle],
        warm_store: Callable[[StoreHostLaunch], WarmStoreHost | None] | None,
        before_spawn: Callable[[], Awaitable[object]] | None,
        drain_timeout: float,
    ) -> None:
        self.assignment = assignment
        self._results = results
        self._health = health
        self._ctx = ctx
        self._on_exit = on_exit
        self._on_unknown = on_unknown
        self._console = console
        self._registry = registry
        self._spawner = spawner
        self._before_spawn = before_spawn
        """Awaited once the store host is started, before the workers are (the job's zygote)."""
        self._drain_timeout = drain_timeout
        self.phase = Phase.NEW
        self.workers: list[Worker] = []
        self.unknown: str | None = None
        """Why the group is UNKNOWN (None: it is not)."""
        self.setup_failed = False
        self.watchdog: FileTimerServer | None = None
        self._tasks = GroupTasks(f"{assignment.job_id}/{assignment.round}", ctx, self.go_unknown)
        self.own = self._tasks.own
        self.early = EarlyFailures(
            results,
            on_failing,
            running_pid=self._running_pid,
            own=self.own,
            go_unknown=self.go_unknown,
            ctx=ctx,
        )
        self._by_pid: dict[int, Worker] = {}
        self._by_rank: dict[int, Worker] = {}
        self._store = RoundStore(
            ctx=ctx,
            node_name=results.node_name,
            registry=registry,
            warm_store=warm_store,
            own=self.own,
            active=lambda: self.phase in (Phase.STARTING, Phase.RUNNING),
            on_failed=self.go_unknown,
        )
        self._stop_task: asyncio.Task[list[int]] | None = None
        self._close_task: asyncio.Task[None] | None = None

    @property
    def pids(self) -> dict[int, int]:
        """{local_rank: pid} of every worker that was started."""
        return {w.launch.local_rank: w.pid for w in self.workers if w.handle is not None}

    def _running_pid(self, launch: WorkerLaunch) -> int | None:
        w = self._by_rank.get(launch.local_rank)
        return w.pid if w is not None and w.handle is not None and not w.reported else None

    # -- UNKNOWN -----------------------------------------------------------------------------

    def go_unknown(self, reason: str) -> None:
        """The group can no longer be supervised: it is UNKNOWN. Every worker it started is
        killed now (its process group), the rest of the stop follows, then `on_unknown` says why:
        the agent never runs workers it cannot supervise. Once only."""
        if self.unknown is not None or self.phase is Phase.CLOSED:
            return
        reason = " ".join(reason.split())[:MAX_UNKNOWN_REASON]
        self.unknown = reason
        logger.error("%s worker group UNKNOWN: %s; killing its workers", self._ctx(None), reason)
        self.phase = Phase.STOPPING  # their exits are the agent's stop, not failures
        for w in self.workers:
            if w.handle is not None and not w.reported:
                try:
                    w.handle.send_signal_group(signal.SIGKILL)
                except Exception:
                    logger.exception("%s cannot kill pid %d", self._ctx(w.launch), w.pid)
        if self._stop_task is None:
            self._stop_task = asyncio.ensure_future(self._stop(0.0))
            self._stop_task.add_done_callback(self._stop_done)
        if self._on_unknown is not None:
            try:
                self._on_unknown(reason)
            except Exception:
                logger.exception("%s on_unknown callback failed", self._ctx(None))

    def _stop_done(self, task: asyncio.Task[list[int]]) -> None:
        if not task.cancelled() and task.exception() is not None:
            logger.error("%s stop failed", self._ctx(None), exc_info=task.exception())

    # -- start -------------------------------------------------------------------------------

    def fail_setup(self, message: str, category: FailureCategory) -> None:
        """The round could not be prepared: every worker assigned fails without starting."""
        logger.error("%s %s", self._ctx(None), message)
        self.workers = []
        self.setup_failed = True
        for ranks in self.assignment.workers:
            self.own(self._report_setup_failure(ranks, message, category), "report-not-started")
        self.phase = Phase.RUNNING

    async def spawn(
        self, plan: Sequence[WorkerLaunch], store_launch: StoreHostLaunch | None
    ) -> dict[int, int]:
        """Listen on the store's port, start every worker of `plan`, then the store host;
        {local_rank: pid} of the workers started.

        A worker that cannot start fails (on_exit, once this returned); any other error makes
        the group UNKNOWN. {} when a stop came in meanwhile.
        """
        self.workers = [Worker(launch) for launch in plan]
        self._by_rank = {w.launch.local_rank: w for w in self.workers}
        self.early.start(plan)
        loop = asyncio.get_running_loop()
        not_started: list[tuple[Worker, NotStarted]] = []
        try:
            store_error = await self._store.listen(plan, store_launch)
            if self._before_spawn is not None and store_error is None:
                # A stop that comes in meanwhile finds no worker yet.
                await self._before_spawn()
                if self.phase is not Phase.STARTING:
                    return {}
            for w in self.workers:
                why = store_error or self._spawn_one(w, loop)
                if why is not None:
                    not_started.append((w, why))
        except Exception as e:
            # Half-way: what started must not run unsupervised, nor what is left start later.
            n = sum(1 for w in self.workers if w.handle is not None)
            self.go_unknown(
                f"the start failed after {n} of {len(self.workers)} worker(s): "
                f"{type(e).__name__}: {e}"
            )
            return self.pids
        # From here on nothing awaits, so on_exit runs only after start() has returned.
        for w, why in not_started:
            self.own(self._report_later(w, why), "report-not-started")
        self.phase = Phase.RUNNING
        if any(w.handle is not None for w in self.workers):
            self._store.start()
            self.own(self._health.run(self._live, self._judged, self._condemn), "health")
        return self.pids

    def _spawn_one(self, w: Worker, loop: asyncio.AbstractEventLoop) -> NotStarted | None:
        """Start one worker and its supervision; why it could not start, if it could not."""
        try:
            handle = self._spawner(w.launch)
        except OSError as e:
            return spawn_failure(w.launch, e, self._results.node_name)
        except Exception as e:  # e.g. SubprocessError from the child setup
            message = f"cannot start worker: {type(e).__name__}: {e}"
            return EXIT_CANNOT_EXECUTE, message, FailureCategory.PLATFORM
        w.handle = handle
        self._by_pid[handle.pid] = w
        if self._registry is not None:
            self._registry.add(
                handle.pid, job_id=self.assignment.job_id, global_rank=w.launch.global_rank
            )
        w.pumps = open_pumps(
            loop,
            handle.take_pipes(),
            w.launch,
            job_id=self.assignment.job_id,
            console=self._console,
        )
        logger.info(
            "%s started pid %d: %s",
            self._ctx(w.launch),
            handle.pid,
            " ".join(redact_argv(w.launch.argv)),  # an option's secret stays out of the log
        )
        w.supervisor = self.own(self._supervise(w), f"supervise-{handle.pid}")
        _faults.started(sum(1 for x in self.workers if x.handle is not None))
        return None

    # -- exits -------------------------------------------------------------------------------

    def _emit(self, w: Worker, ex: WorkerExit) -> None:
        if w.reported:
            return
        w.reported = True
        w.exit = ex
        if w.handle is not None:
            if self.watchdog is not None:
                self.watchdog.forget_pid(w.handle.pid)
            if self._registry is not None:
                self._registry.remove(w.handle.pid)
            self._health.forget(w.handle.pid)
        if ex.failure is not None:
            logger.warning(
                "%s exited with %d: %s", self._ctx(w.launch), ex.exitcode, ex.failure.message
            )
        else:
            logger.info(
                "%s exited with %d%s",
                self._ctx(w.launch),
                ex.exitcode,
                " (stopped by the agent)" if ex.stopped_by_agent else "",
            )
        try:
            self._on_exit(ex)
        except Exception as e:
            logger.exception("%s on_exit callback failed", self._ctx(w.launch))
            self.go_unknown(
                f"the exit of rank {w.launch.global_rank} could not be reported: "
                f"{type(e).__name__}: {e}"
            )

    async def _report_setup_failure(
        self, ranks: WorkerRanks, message: str, category: FailureCategory
    ) -> None:
        try:
            self._on_exit(self._results.setup_failed(ranks, message, category))
        except Exception:
            logger.exception("%s on_exit callback failed", self._ctx(None))

    async def _report_later(self, w: Worker, why: NotStarted) -> None:
        logger.error("%s %s", self._ctx(w.launch), why[1])
        self._emit(w, self._results.not_started(w.launch, why))

    async def _supervise(self, w: Worker) -> None:
        assert w.handle is not None
        _faults.observe()
        rc = await w.handle.wait()
        observed = time.time()
        # Whether the agent was stopping when the exit was seen, not when it is reported.
        stopping = self.phase is not Phase.RUNNING
        try:
            await drain(w.pumps, self._drain_timeout)
            if w.reported:
                return
            early = self.early.recorded(w.launch)
            # During a stop, only a death by the agent's own signals (or a clean exit) is "stopped
            # on purpose". A worker that fails by itself meanwhile, e.g. on the collective its
            # crashed peer broke, is a real (collateral) failure and must be reported as one.
            # A worker that recorded its failure is a failure however it ends (the stop that its
            # own early report caused usually cuts its teardown short).
            stopped = (
                stopping
                and w.kill_reason is None
                and (rc == 0 or _stopped_by_us(w.handle, rc))
                and early is None
            )
            failure: ProcessFailure | None = None
            value: bytes | None = None
            if not stopped:
                failure, value = await self._results.outcome(
                    w.launch, w.pid, rc, observed, kill_reason=w.kill_reason, early=early
                )
        except Exception as e:
            logger.exception("%s cannot report the exit of pid %d", self._ctx(w.launch), w.pid)
            stopped, value = False, None
            failure = self._results.unobserved(w.launch, w.pid, rc, observed, e)
        self._emit(
            w,
            WorkerExit(
                local_rank=w.launch.local_rank,
                global_rank=w.launch.global_rank,
                pid=w.pid,
                exitcode=rc,
                stopped_by_agent=stopped,
                failure=failure,
                return_value=value,
                timestamp=observed,
            ),
        )

    # -- watchdog and health -----------------------------------------------------------------

    def is_worker_pid(self, pid: int) -> bool:
        w = self._by_pid.get(pid)
        return w is not None and not w.reported

    def on_timer_expired(self, pid: int, scope_id: str, sig: int, expiration: float) -> None:
        w = self._by_pid.get(pid)
        if w is None or w.kill_reason is not None:
            return
        when = datetime.fromtimestamp(expiration).isoformat(sep=" ", timespec="milliseconds")
        w.kill_reason = (
            f"watchdog timer '{scope_id}' expired at {when}; killed PID {pid} with "
            f"{signal_name(sig)}"
        )

    def _live(self) -> dict[int, WorkerLaunch] | None:
        """{pid: launch} of the workers that run, for the health check (None: it is over)."""
        if self.phase is not Phase.RUNNING:
            return None
        return {
            w.handle.pid: w.launch
            for w in self.workers
            if w.handle is not None and not w.reported and w.handle.is_alive()
        }

    def _judged(self, pid: int) -> bool:
        w = self._by_pid.get(pid)
        return w is not None and not w.reported and self.phase is Phase.RUNNING

    def _condemn(self, pid: int, why: str) -> None:
        """The health check found the worker `pid` unhealthy: kill it (once)."""
        w = self._by_pid[pid]
        if w.kill_reason is not None:
            return
        w.unhealthy = True
        w.kill_reason = f"{why}; killed PID {pid} with SIGKILL"
        self.own(self._kill_unhealthy(w), f"kill-unhealthy-{pid}")

    async def _kill_unhealthy(self, w: Worker) -> None:
        assert w.handle is not None and w.kill_reason is not None
        logger.error("%s %s", self._ctx(w.launch), w.kill_reason)
        if await w.handle.terminate(0.0):
            return  # _supervise reports it
        self._emit(w, await self._results.unkillable(w.launch, w.pid, w.kill_reason))

    # -- stop --------------------------------------------------------------------------------

    async def stop(self, grace: float) -> list[int]:
        """Stop every remaining worker (SIGTERM, `grace` s, SIGKILL); idempotent.

        Returns the pids that would not die (uninterruptible sleep); their exit is never reported.
        """
        if self._stop_task is None:
            self._stop_task = asyncio.ensure_future(self._stop(grace))
        return list(await asyncio.shield(self._stop_task))

    async def _stop(self, grace: float) -> list[int]:
        if self.phase in (Phase.NEW, Phase.STARTING, Phase.RUNNING):
            self.phase = Phase.STOPPING
        live = [w for w in self.workers if w.handle is not None and not w.reported]
        if live:
            logger.info("%s stopping %d worker(s), grace %.1f s", self._ctx(None), len(live), grace)
        # A worker that already recorded its failure is ending on its own: it is not signalled,
        # so its exit code is its own (the root cause's), for up to the job's stop_grace.
        own_end = max(grace, self.assignment.spec.stop_grace)
        results = await asyncio.gather(
            *(
                _let_end(w.handle, own_end)
                if self.early.recorded(w.launch) is not None and grace > 0
                else w.handle.terminate(grace)
                for w in live
                if w.handle
            )
        )
        unkillable = [w.pid for w, ok in zip(live, results, strict=True) if not ok]
        # Let the exits of the workers that died be reported before returning.
        reporting = [
            w.supervisor
            for w in live
            if w.supervisor is not None and not w.supervisor.done() and w.pid not in unkillable
        ]
        if reporting:
            await asyncio.wait(reporting, timeout=self._drain_timeout + 5.0)
        # Only after the workers. The group counts as stopped without waiting for the host's
        # own teardown: `close` waits for it.
        self._store.stop()
        if self.watchdog is not None:
            self.watchdog.close()
        return unkillable

    async def close(self, grace: float) -> None:
        """Stop what still runs (SIGKILL after `grace`), cancel every task, close what is open.

        Once: a later call waits for the first. A caller that is cancelled does not cancel the
        close, which still ends the store host and every worker (an agent that stops while a
        finished round closes waits for that close, it does not cut it short)."""
        if self._close_task is None:
            self._close_task = asyncio.ensure_future(self._close(grace))
        await asyncio.shield(self._close_task)

    async def _close(self, grace: float) -> None:
        if self.phase is Phase.CLOSED:
            return
        await self.stop(grace)
        await self._store.stopped()
        self.phase = Phase.CLOSED
        await self.early.close()
        await self._tasks.cancel()
        for w in self.workers:
            for p in w.pumps:
                p.finish()
            close = getattr(w.handle, "close", None)
            if close is not None:
                close()
        self._store.close()
        if self.watchdog is not None:
            self.watchdog.close()
