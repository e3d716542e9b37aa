"""`gelastic run`: a drop-in for `torchrun`, with no servers to start.

On one host (the default, and `--standalone`) it runs a coordinator (loopback, any free port,
behind a random token that only this process holds: in a 0600 file of a private 0700 temp dir)
and one node agent inside this process, on an asyncio loop in a background thread, submits the
script as a one-node job and waits for it with the Python client, like any other job. With
torchrun's multi-node flags it is one node of a job that the same line forms on every node
(`gelastic._cli_run_nodes`). Worker output is teed to this console with a `[rank]:` prefix, a
failure ends with the torchelastic-style failure report, and the exit code is torchrun's: 0 when
every rank succeeded, 1 otherwise. SIGINT, SIGTERM, SIGHUP and SIGQUIT cancel the job (one host)
or stop this node's workers (several nodes) and stop everything before the command exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from client import Client, GelasticError, Job
from client.console import strip_terminal_controls, write_scheduler_error_file
from client.model import JobState, RunResult, WorkerState, is_name
from client.security import new_token_file
from gelastic._rdzv import (
    MultiNode,
)
from gelastic._run_plan import (
    CANCEL_SLACK_S,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    PET_NAMES,
    PREFIX_TEMPLATE_ENV,
    START_TIMEOUT_S,
    RunError,
    RunPlan,
    cpu_count,
    plan_run,
    run_parser,
)

if TYPE_CHECKING:
    from coordinator.server import Coordinator
    from nodeagent.session import NodeAgent

__all__ = [
    "PET_NAMES",
    "EmbeddedCluster",
    "RunError",
    "RunPlan",
    "cpu_count",
    "main",
    "plan_run",
    "run_parser",
]

logger = logging.getLogger(__name__)


# ---- the embedded cluster -------------------------------------------------------------------


@dataclass(frozen=True)
class CoordinatorSetup:
    """The coordinator an `EmbeddedCluster` runs."""

    host: str = "127.0.0.1"
    port: int = 0
    """0 = any free port."""
    token_file: str = ""
    """The token it requires ("" with `private_token`: one made for this run alone)."""
    private_token: bool = True
    insecure: bool = False
    """Listen off loopback without a token or TLS (the launcher has said so loudly)."""
    store: str = ""
    """"" = state in memory; "etcd://..." = a replica on that etcd."""
    leader_ttl: float = 5.0
    reconnect_grace: float = 15.0
    """After a takeover, seconds a node has to come back before it counts as lost."""


class EmbeddedCluster:
    """A coordinator and one node agent on a private asyncio loop in a background thread.

    The loop thread lives until `stop()`: the agent forks workers from it, and they are set to
    die with the thread that forked them, so no worker outlives this object, or this process.
    With `coordinator=None` it runs the agent alone, dialling `target` (a node of a multi-node
    run whose coordinator another node hosts).
    """

    def __init__(
        self,
        *,
        slots: int,
        log_dir: str,
        state_dir: str,
        dashboard_port: int | None = None,
        addr: str = "127.0.0.1",
        name: str = "",
        coordinator: CoordinatorSetup | None = CoordinatorSetup(),
        target: str = "",
        token_file: str = "",
        insecure: bool = False,
        wait_connected: bool = True,
        reconnect_max: float = 5.0,
        agent_later: bool = False,
    ) -> None:
        self.slots = slots
        self.addr = addr
        self.name = name or _node_name()
        self.dashboard_port = dashboard_port
        self.dashboard_url = ""
        """Where the web dashboard serves (with `dashboard_port`), once started."""
        self.log_dir = log_dir
        self.state_dir = state_dir
        self.setup = coordinator
        self.target = target
        self.insecure = insecure
        self.wait_connected = wait_connected
        self.reconnect_max = reconnect_max
        self.agent_later = agent_later
        """`start()` starts the coordinator only; `start_agent()` the agent (a node of a
        multi-node run joins once its submit was accepted)."""
        self.address = ""
        self.token_file = token_file
        """The token the coordinator requires; with a private token, made by `start()`."""
        self._own_token = False
        self.bind_failure = ""
        """Why this node could not host the coordinator it guessed it hosts ("" = it could)."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._coordinator: Coordinator | None = None
        self._agent: NodeAgent | None = None
        self._start_task: asyncio.Task[Any] | None = None

    @property
    def agent_connected(self) -> bool:
        """Whether the agent's session with a coordinator is open now."""
        agent = self._agent
        return agent is not None and agent.connected.is_set()

    @property
    def agent_refusal(self) -> str:
        """Why the coordinator refused the agent for good ("" = it did not)."""
        agent = self._agent
        return str(agent.refusal) if agent is not None and agent.refused.is_set() else ""

    @property
    def leading(self) -> bool:
        """Whether this cluster's coordinator serves (a replica: while it is the leader)."""
        return self._coordinator is not None and bool(self._coordinator.leading)

    def start(self) -> str:
        """Start both servers; return the coordinator's address once the node has joined."""
        if self.setup is not None and self.setup.private_token:
            # Loopback is open to every user of this host: the coordinator takes only this token.
            self.token_file = str(new_token_file("gelastic-run-token-"))
            self._own_token = True
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._thread = threading.Thread(target=self._serve, name="gelastic-run", daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), loop).result(START_TIMEOUT_S)
        return self.address

    def _serve(self) -> None:
        assert self._loop is not None
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    async def _start(self) -> None:
        # Imported here: a usage error or `--help` needs neither the server nor the agent.
        from coordinator.server import Coordinator, CoordinatorConfig

        self._start_task = asyncio.current_task()
        setup = self.setup
        if setup is not None:
            self._coordinator = Coordinator(
                CoordinatorConfig(
                    host=setup.host,
                    port=setup.port,
                    heartbeat_interval=0.5,
                    lease=5.0,
                    state_dir=":memory:",
                    store=setup.store,
                    leader_ttl=setup.leader_ttl,
                    reconnect_grace=setup.reconnect_grace,
                    token_file=self.token_file,
                    insecure=setup.insecure,
                )
            )
            await self._coordinator.start()
            self.address = self._coordinator.address
            if self.dashboard_port is not None:
                self.dashboard_url = await self._coordinator.start_dashboard(self.dashboard_port)
        if not self.agent_later:
            await self._start_agent()

    def start_agent(self) -> None:
        """Start the agent (after `start()`, with `agent_later`)."""
        assert self._loop is not None
        asyncio.run_coroutine_threadsafe(self._start_agent(), self._loop).result(START_TIMEOUT_S)

    async def _start_agent(self) -> None:
        from nodeagent.session import AgentConfig, NodeAgent

        self._agent = NodeAgent(
            AgentConfig(
                coordinator=self.target or self.address,
                slots=self.slots,
                name=self.name,
                addr=self.addr,
                log_dir=self.log_dir,
                state_dir=self.state_dir,
                token_file=self.token_file,
                insecure=self.insecure,
                reconnect_max=self.reconnect_max,
            )
        )
        await self._agent.start()
        if self.wait_connected:
            await asyncio.wait_for(self._agent.connected.wait(), START_TIMEOUT_S)

    def replicas(self) -> tuple[str, ...]:
        """This node's coordinator replica and the leader it knows of ("" parts left out)."""
        coordinator = self._coordinator
        if coordinator is None or not self.address:
            return ()
        leadership = coordinator.leadership
        leader = str(leadership.leader_addr) if leadership is not None else ""
        return (self.address,) if not leader or leader == self.address else (self.address, leader)

    def follow(self, coordinators: tuple[str, ...]) -> None:
        """Let the agent go to these coordinators (its replica and the leader it names)."""
        loop, agent = self._loop, self._agent
        if loop is None or agent is None or tuple(agent.coordinators) == coordinators:
            return

        def apply() -> None:
            agent.coordinators = coordinators

        loop.call_soon_threadsafe(apply)

    async def _stop_agent(self, grace: float) -> None:
        if self._agent is not None:
            await self._agent.stop(grace)

    def stop_agent(self, grace: float) -> None:
        """Stop the workers and the agent, leaving the coordinator serving."""
        loop, thread = self._loop, self._thread
        if loop is not None and thread is not None and thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._stop_agent(grace), loop).result(grace + 30)

    async def _stop(self, grace: float, leave_first: bool = False) -> None:
        start = self._start_task
        if start is not None and not start.done():
            # Interrupted while starting: the start must end before its parts are stopped.
            start.cancel()
            with contextlib.suppress(BaseException):
                await start
        # The node leaving is expected now; the coordinator need not warn about it.
        logging.getLogger("coordinator").setLevel(logging.ERROR)
        if self._agent is not None:
            await self._agent.stop(grace, leave_first=leave_first)
        if self._coordinator is not None:
            await self._coordinator.stop(grace=0.5)
        # The server's own RPC tasks end by themselves once it has stopped; anything still
        # pending after that must not run against a closed loop.
        me = asyncio.current_task()
        pending = [t for t in asyncio.all_tasks() if t is not me]
        if pending:
            _, left = await asyncio.wait(pending, timeout=2.0)
            for t in left:
                t.cancel()
            await asyncio.gather(*left, return_exceptions=True)

    def stop(self, grace: float, *, leave_first: bool = False) -> None:
        """Stop the workers (SIGTERM, `grace`, SIGKILL), the agent, the coordinator; idempotent.

        `leave_first`: the node leaves its coordinator before its workers are stopped, so the
        job re-forms on the other nodes without spending a restart (see `NodeAgent.stop`)."""
        loop, thread = self._loop, self._thread
        self._loop = self._thread = None
        if loop is None or thread is None:
            self._remove_token()
            return
        try:
            if thread.is_alive():
                asyncio.run_coroutine_threadsafe(self._stop(grace, leave_first), loop).result(
                    grace + 30
                )
        except Exception:
            logger.exception("stopping the embedded coordinator and agent failed")
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(30)
            if not thread.is_alive():
                loop.close()
            self._remove_token()

    def _remove_token(self) -> None:
        if self.token_file and self._own_token:
            shutil.rmtree(os.path.dirname(self.token_file), ignore_errors=True)
            self.token_file = ""


def _node_name() -> str:
    name = socket.gethostname().split(".")[0]
    return name if is_name(name) else "localhost"


# ---- signals --------------------------------------------------------------------------------


class Interrupted(BaseException):
    """SIGINT, SIGTERM, SIGHUP or SIGQUIT arrived: cancel the job and stop."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


class _SignalGuard:
    """Turns the first stop signal into `Interrupted`; a second one during clean-up forces exit.

    Forcing exit is safe: the workers die with the loop thread that forked them.
    """

    def __init__(self) -> None:
        self.received: int | None = None
        self.cleaning = False
        """Set once clean-up has begun: a first signal then no longer interrupts it."""
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _SignalGuard:
        if threading.current_thread() is threading.main_thread():
            for sig in _HANDLED_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: types.FrameType | None) -> None:
        if self.received is None:
            self.received = signum
            if self.cleaning:
                return
            raise Interrupted(signum)
        sys.stderr.write(f"gelastic run: {signal.Signals(signum).name} again; exiting now\n")
        sys.stderr.flush()
        os._exit(EXIT_FAILED)

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)


# ---- running --------------------------------------------------------------------------------


def _say(text: str) -> None:
    sys.stderr.write(f"gelastic run: {text}\n")
    sys.stderr.flush()


def execute(plan: RunPlan) -> int:
    """Run the plan's job on an embedded cluster; return torchrun's exit code."""
    if plan.multinode is not None:
        raise RunError("a run of several nodes is run by gelastic._cli_run_nodes.main")
    os.environ.setdefault(PREFIX_TEMPLATE_ENV, plan.prefix_template)
    own_log_dir = plan.log_dir is None
    log_dir = plan.log_dir or tempfile.mkdtemp(prefix="gelastic-run-")
    state_dir = tempfile.mkdtemp(prefix="gelastic-run-state-")
    cluster = EmbeddedCluster(
        slots=plan.spec.nproc_per_node,
        log_dir=log_dir,
        state_dir=state_dir,
        dashboard_port=plan.dashboard_port,
        addr=plan.local_addr,
    )
    client: Client | None = None
    job: Job | None = None
    code = EXIT_FAILED
    keep_logs = True
    with _SignalGuard() as guard:
        try:
            address = cluster.start()
            if cluster.dashboard_url:
                _say(
                    f"dashboard: {cluster.dashboard_url} (log in with the token in "
                    f"{cluster.token_file}; it lasts as long as this run)"
                )
            client = Client(address, token_file=cluster.token_file)
            job = client.submit(plan.spec)
            result = job.wait(progress=plan.progress, out=sys.stderr)
            state = job.status().state
            code = EXIT_OK if state == JobState.SUCCEEDED else EXIT_FAILED
            keep_logs = code != EXIT_OK
            _report(plan, state, settled(job, result, plan.spec.stop_grace))
        except Interrupted as exc:
            _say(f"{signal.Signals(exc.signum).name}: cancelling the job")
            if job is not None:
                _cancel(job, plan.spec.stop_grace + CANCEL_SLACK_S)
        except (GelasticError, TimeoutError, OSError) as exc:
            _say(" ".join(str(exc).split()) or type(exc).__name__)
        finally:
            guard.cleaning = True
            if client is not None:
                client.close()
            cluster.stop(plan.spec.stop_grace)
            shutil.rmtree(state_dir, ignore_errors=True)
            if own_log_dir:
                if keep_logs:
                    _say(f"worker logs are in {log_dir}")
                else:
                    shutil.rmtree(log_dir, ignore_errors=True)
        if guard.received is not None:
            return EXIT_FAILED
    return code


SETTLE_MAX_S = 10.0
"""Longest wait for a failed round's last exits before its report is printed."""
_RUNNING = frozenset({WorkerState.INIT, WorkerState.HEALTHY, WorkerState.UNHEALTHY})


def settled(job: Job, result: RunResult, stop_grace: float) -> RunResult:
    """A FAILED result once the failed round's workers have all ended, at most
    min(stop_grace + 2, SETTLE_MAX_S) s from now.

    A job with no restart left is FAILED the moment its first failure is known; exits that come
    after it (a rank that died without an error file, whose report was a few milliseconds late)
    still complete the result and may move its root cause earlier. The report waits for them.
    """
    if result.state != WorkerState.FAILED:
        return result
    deadline = time.monotonic() + min(stop_grace + 2.0, SETTLE_MAX_S)
    while time.monotonic() < deadline:
        try:
            if not any(w.state in _RUNNING for w in job.status().workers):
                break
        except GelasticError:
            return result
        time.sleep(0.05)
    try:
        return job.poll() or result
    except GelasticError:
        return result


def _cancel(job: Job, timeout: float) -> None:
    try:
        job.cancel()
        job.wait(timeout)
    except (GelasticError, TimeoutError) as exc:
        _say(f"the job did not end cleanly ({' '.join(str(exc).split())}); stopping the workers")


def _report(
    plan: RunPlan, state: JobState, result: RunResult, *, local_error_files: bool = True
) -> None:
    if state == JobState.SUCCEEDED:
        return
    # With every worker on this host, the root cause's own error file is copied as it is.
    write_scheduler_error_file(result, plan.report_name, local_error_files=local_error_files)
    if result.failures:
        table = result.format_failures(plan.report_name).rstrip("\n") + "\n"
        # The table quotes the workers (tracebacks, stderr): on a terminal none of it runs.
        sys.stderr.write(strip_terminal_controls(table) if sys.stderr.isatty() else table)
    else:
        reason = " ".join(result.reason.split())
        _say(
            f"{plan.report_name} {state.value}: "
            + (strip_terminal_controls(reason) if sys.stderr.isatty() else reason)
        )
    sys.stderr.flush()


def main(
    argv: Sequence[str], *, run_node: Callable[[RunPlan, MultiNode], int] | None = None
) -> int:
    """`gelastic run`; `run_node` runs this node's part of a run of several nodes."""
    args = run_parser().parse_args(list(argv))
    try:
        plan = plan_run(args)
    except RunError as exc:
        _say(str(exc))
        return EXIT_USAGE
    for note in plan.notes:
        _say(note)
    logging.basicConfig(
        level=plan.log_level,
        format="gelastic run: %(levelname)s %(name)s: %(message)s",
    )
    try:
        if plan.multinode is not None:
            if run_node is None:
                _say("this command runs on one host only")
                return EXIT_USAGE
            return run_node(plan, plan.multinode)
        return execute(plan)
    except Interrupted:
        # The signal arrived as the run was ending; everything has been stopped already.
        return EXIT_FAILED
