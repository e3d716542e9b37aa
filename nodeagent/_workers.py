"""The workers of one job round on this node: start them, watch them, report each exit, stop them.

`WorkerGroup` carries out a `RoundAssignment`: it prepares the log directories, spawns every
local worker from the launch plan, copies their stdout/stderr into the log files (and, per the
redirect/tee masks, onto the agent's console), serves the FileTimer watchdog, samples health,
and calls `on_exit` with a `WorkerExit` the moment each worker is gone. It makes no decisions
about the job: what to do after a failure is the coordinator's call, relayed by the session.

The group is a composition; each concern has a module of its own:

- `nodeagent._group_supervisor`: the processes (spawn, signals, stop and kill with a grace, each
  exit reported once, UNKNOWN when supervision is lost);
- `nodeagent._group_output`: the round's directories and files, and the workers' streams;
- `nodeagent._group_results`: what an exit means (its failure or its return value), and the
  failures reported from the error files before the exit;
- `nodeagent._group_health`: the workers' health samples and the judge of stuck ones.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import tempfile
import uuid
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path

from client.assignment import RoundAssignment
from client.model import FailureCategory, ProcessFailure, WorkerState
from nodeagent._group_health import HealthWatch, WorkerHealth
from nodeagent._group_output import (
    ConsoleWriter,
    agent_console,
    prepare_round_dir,
    prepare_worker_dirs,
    write_notice,
)
from nodeagent._group_results import Results, WorkerExit
from nodeagent._group_supervisor import MAX_UNKNOWN_REASON, Phase, Supervisor, Worker
from nodeagent._inotify import ErrorFileWatch
from nodeagent._launch import (
    StandbyLaunch,
    StoreHostLaunch,
    WorkerLaunch,
    build_launch_plan,
    build_standby_launch,
    build_store_host_launch,
    entrypoint_name,
    preempt_file,
    watchdog_request,
)
from nodeagent._process import ProcessHandle, spawn
from nodeagent._reaper import PidRegistry
from nodeagent._store_host import WarmStoreHost
from nodeagent._watchdog import FileTimerServer, TimerFileError, validate_timer_file

__all__ = ["ConsoleWriter", "WorkerExit", "WorkerGroup", "WorkerHealth", "agent_console"]

logger = logging.getLogger(__name__)

_SetupError = tuple[str, FailureCategory]
"""Why the round could not be prepared, and whose fault that is."""


class WorkerGroup:
    """The local workers of one job round (torchelastic's WorkerGroup on one node).

    `on_exit` is called once per worker, on the event loop, never before `start()` returned.
    Use `async with` or call `close()`: workers must never outlive the group.
    """

    def __init__(
        self,
        assignment: RoundAssignment,
        *,
        node_name: str,
        log_root: Path,
        on_exit: Callable[[WorkerExit], None],
        console: ConsoleWriter | None = agent_console,
        agent_env: Mapping[str, str] | None = None,
        run_dir: Path | None = None,
        pid_registry: PidRegistry | None = None,
        spawner: Callable[[WorkerLaunch], ProcessHandle] = spawn,
        python: str = sys.executable,
        agent_cwd: str | None = None,
        drain_timeout: float = 2.0,
        health_interval: float | None = None,
        on_failing: Callable[[ProcessFailure], None] | None = None,
        warm_store: Callable[[StoreHostLaunch], WarmStoreHost | None] | None = None,
        on_unknown: Callable[[str], None] | None = None,
        before_spawn: Callable[[], Awaitable[object]] | None = None,
    ) -> None:
        self.assignment = assignment
        self.spec = assignment.spec
        self.node_name = node_name
        self.log_root = Path(log_root)
        self._agent_env = dict(os.environ if agent_env is None else agent_env)
        self._run_dir = Path(run_dir) if run_dir is not None else Path(tempfile.gettempdir())
        self._python = python
        self._agent_cwd = agent_cwd
        self._health = HealthWatch(self.spec.unhealthy_timeout, health_interval)
        self._sup = Supervisor(
            assignment,
            results=Results(assignment, node_name),
            health=self._health,
            ctx=self._ctx,
            on_exit=on_exit,
            on_unknown=on_unknown,
            on_failing=on_failing,
            console=console,
            registry=pid_registry,
            spawner=spawner,
            warm_store=warm_store,
            before_spawn=before_spawn,
            drain_timeout=drain_timeout,
        )
        self._store_launch: StoreHostLaunch | None = None
        self.log_dir: Path | None = None
        self.plan: list[WorkerLaunch] = []

    # -- properties --------------------------------------------------------------------------

    @property
    def pids(self) -> dict[int, int]:
        """{local_rank: pid} of every worker that was started."""
        return self._sup.pids

    @property
    def stack_workers(self) -> list[Worker]:
        """Every worker of the plan, started or not, to read the stacks of (nodeagent._stacks)."""
        return list(self._workers)

    @property
    def running(self) -> int:
        """Workers started and not yet reported as exited."""
        return sum(1 for w in self._workers if w.handle is not None and not w.reported)

    @property
    def closed(self) -> bool:
        """`close` ran to its end: every worker and the store host are gone, the pumps done."""
        return self._sup.phase is Phase.CLOSED

    @property
    def exits(self) -> dict[int, WorkerExit]:
        """{local_rank: WorkerExit} reported so far."""
        return {w.launch.local_rank: w.exit for w in self._workers if w.exit is not None}

    @property
    def state(self) -> WorkerState:
        """The group's torchelastic state, derived from its workers."""
        sup = self._sup
        if sup.unknown is not None:
            return WorkerState.UNKNOWN
        if sup.phase in (Phase.NEW, Phase.STARTING):
            return WorkerState.INIT
        if sup.phase in (Phase.STOPPING, Phase.CLOSED):
            return WorkerState.STOPPED
        exits = [w.exit for w in self._workers if w.exit is not None]
        if sup.setup_failed or any(e.failure is not None for e in exits):
            return WorkerState.FAILED
        if self._workers and len(exits) == len(self._workers):
            return WorkerState.SUCCEEDED
        if any(w.unhealthy and not w.reported for w in self._workers):
            return WorkerState.UNHEALTHY
        return WorkerState.HEALTHY

    @property
    def unknown_reason(self) -> str | None:
        """Why the group is UNKNOWN (None: it is not)."""
        return self._sup.unknown

    @property
    def state_reason(self) -> str:
        """Why the group is UNKNOWN or UNHEALTHY ("" otherwise)."""
        state = self.state
        if state is WorkerState.UNKNOWN:
            return self._sup.unknown or ""
        if state is WorkerState.UNHEALTHY:
            for w in self._workers:
                if w.unhealthy and not w.reported and w.kill_reason:
                    return w.kill_reason[:MAX_UNKNOWN_REASON]
        return ""

    @property
    def timer_file(self) -> Path | None:
        watchdog = self._sup.watchdog
        return watchdog.path if watchdog is not None else None

    def samples(self) -> list[WorkerHealth]:
        """The latest health sample of each running worker, in local-rank order."""
        return self._health.latest(w.launch for w in self._workers if not w.reported)

    @property
    def store_launch(self) -> StoreHostLaunch | None:
        """The round's c10d store host launch on this node (None: this node serves none)."""
        return self._store_launch

    def standby_launch(self) -> StandbyLaunch | None:
        """How a standby of this group's job starts on this node (None: the job has none)."""
        return build_standby_launch(
            self.spec, agent_env=self._agent_env, python=self._python, agent_cwd=self._agent_cwd
        )

    @property
    def _workers(self) -> list[Worker]:
        """The workers of the plan (the supervisor's), in local-rank order."""
        return self._sup.workers

    @property
    def _error_watch(self) -> ErrorFileWatch | None:
        """The watch on the workers' error files (None: nothing is watched)."""
        return self._sup.early.watch

    def _ctx(self, launch: WorkerLaunch | None = None) -> str:
        a = self.assignment
        rank = f" rank {launch.global_rank} (local {launch.local_rank})" if launch else ""
        return (
            f"[job {a.job_id} ({entrypoint_name(a.spec)}) attempt {a.attempt} round {a.round} "
            f"node {self.node_name}{rank}]"
        )

    # -- start -------------------------------------------------------------------------------

    async def start(self) -> dict[int, int]:
        """Start every worker; returns {local_rank: pid} of those that started.

        Never raises for a worker that cannot start: that worker's failure goes to `on_exit`.
        Any other error half-way makes the group UNKNOWN: what started is killed (`go_unknown`).
        """
        sup = self._sup
        if sup.phase is not Phase.NEW:
            return self.pids
        sup.phase = Phase.STARTING
        timer_file, error = await self._prepare()
        if error is None and timer_file is not None:
            error = self._serve_watchdog(timer_file)
        if sup.phase is not Phase.STARTING:  # stop() or close() came in meanwhile
            return {}
        if error is not None:
            sup.fail_setup(*error)
            return {}
        return await sup.spawn(self.plan, self._store_launch)

    async def _prepare(self) -> tuple[str | None, _SetupError | None]:
        """Make the round's directories and plan its launches: (the timer file, why not)."""
        timer_file: str | None = None
        try:
            wanted, given = watchdog_request(self.spec, self._agent_env)
            if wanted:
                timer_file = given or str(self._run_dir / f"gelastic_timer_{uuid.uuid4().hex}")
                if given:
                    validate_timer_file(given)
            # One trip to a thread for the files: the plan between them is quick and pure.
            await asyncio.to_thread(self._plan, timer_file)
        except TimerFileError as e:
            return timer_file, (str(e), FailureCategory.INPUT)
        except OSError as e:
            message = f"cannot prepare the log directory under {self.log_root}: {e}"
            return timer_file, (message, FailureCategory.PLATFORM)
        except Exception as e:  # a bad spec that slipped through validation
            message = f"cannot build the launch plan: {type(e).__name__}: {e}"
            return timer_file, (message, FailureCategory.INPUT)
        return timer_file, None

    def _plan(self, timer_file: str | None) -> None:
        """Make the round's directory, plan its launches, make the workers' directories.
        Blocking (a thread's)."""
        self.log_dir = prepare_round_dir(self.log_root, self.assignment)
        self.plan = build_launch_plan(
            self.assignment,
            log_root=self.log_root,
            node_name=self.node_name,
            agent_env=self._agent_env,
            python=self._python,
            timer_file=timer_file,
            log_dir=self.log_dir,
            agent_cwd=self._agent_cwd,
        )
        self._store_launch = build_store_host_launch(
            self.assignment,
            log_dir=self.log_dir,
            node_name=self.node_name,
            agent_env=self._agent_env,
            python=self._python,
            agent_cwd=self._agent_cwd,
        )
        prepare_worker_dirs(self.plan)

    def _serve_watchdog(self, timer_file: str) -> _SetupError | None:
        """Serve the FileTimer watchdog at `timer_file`; why it cannot be served, if so."""
        sup = self._sup
        watchdog = FileTimerServer(
            timer_file, allowed_pids=sup.is_worker_pid, on_expired=sup.on_timer_expired
        )
        try:
            watchdog.start()
        except TimerFileError as e:
            watchdog.close()
            return str(e), FailureCategory.INPUT
        except OSError as e:
            watchdog.close()
            return (
                f"cannot serve the watchdog timer file {timer_file}: {e}",
                FailureCategory.PLATFORM,
            )
        sup.watchdog = watchdog
        return None

    # -- UNKNOWN, stop, close ----------------------------------------------------------------

    def go_unknown(self, reason: str) -> None:
        """The group can no longer be supervised: it is UNKNOWN. Every worker it started is
        killed now (its process group), the rest of the stop follows, then `on_unknown` says why:
        the agent never runs workers it cannot supervise. Once only."""
        self._sup.go_unknown(reason)

    async def stop(self, grace: float | None = None) -> list[int]:
        """Stop every remaining worker (SIGTERM, `grace` s, SIGKILL); idempotent.

        Returns the pids that would not die (uninterruptible sleep); their exit is never
        reported. `grace` defaults to the spec's stop_grace.
        """
        return await self._sup.stop(self.spec.stop_grace if grace is None else grace)

    async def stop_after_notice(self, grace: float, term_after: float, notice: bytes) -> list[int]:
        """A drain's stop: the preemption notice now (the file the workers' GELASTIC_PREEMPT_FILE
        names), SIGTERM `term_after` seconds later unless every worker left by then, SIGKILL
        `grace` after that. A worker that exits 0 meanwhile was stopped, not done."""
        sup = self._sup
        if sup.phase in (Phase.NEW, Phase.STARTING, Phase.RUNNING):
            sup.phase = Phase.STOPPING
        if self.log_dir is not None:
            path = preempt_file(self.log_dir, self.node_name)
            try:
                await asyncio.to_thread(write_notice, path, notice)
            except OSError as exc:
                logger.warning(
                    "%s cannot write the preemption notice %s: %s", self._ctx(), path, exc
                )
        leaving = [
            w.supervisor
            for w in self._workers
            if w.supervisor is not None and not w.supervisor.done() and not w.reported
        ]
        if leaving and term_after > 0:
            await asyncio.wait(leaving, timeout=term_after)
        return await self.stop(grace)

    async def close(self, grace: float = 0.0) -> None:
        """Stop what still runs (SIGKILL after `grace`), cancel every task, remove the FIFO."""
        await self._sup.close(grace)

    async def __aenter__(self) -> WorkerGroup:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
