"""Site plug-ins of a node agent (`nodeagent --plugin module:object`, repeatable, and the
`gelastic.agent_plugins` entry points): hooks where a subclass of torchelastic's
SimpleElasticAgent would have overridden a method.

A plug-in is an object with any of these methods (plain functions, called in a thread):

- `before_round(info: RoundInfo)`: before this node starts its workers of a round. None or
  True lets the round start; False or a string vetoes it: each of this node's ranks of the round
  fails at once, an INFRA failure (the host is at fault) whose message names the reason.
- `after_worker_exit(info: WorkerExitInfo)`: after one worker exited; what it returns is ignored.
- `health_check()`: every `health_check_interval` seconds. None or True: healthy; False or a
  string: unhealthy, with that reason. The heartbeats say so and the coordinator quarantines the
  node, as it does for a lost GPU, until the checks pass and the quarantine ends (its time
  passes, or `gelastic nodes --clear-quarantine`).

Plug-in code must not break the agent: every call runs in a daemon thread of its own, never on
the event loop, bounded by `timeout` seconds. A hook that raises, times out or returns
anything else is logged and counts as "no objection" (fail-open: a bug in a check is not a
sick host). While MAX_RUNNING calls of a hook have not returned, the next is skipped: a hook that
hangs holds a few threads, never more, and never the agent's exit. Reasons are cut to one line of at most MAX_REASON characters.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from client.assignment import RoundAssignment
from client.node_protocol import WorkerExit
from client.plugins import MAX_PLUGINS, load_entry_points, load_plugin

__all__ = [
    "AgentPlugins",
    "RoundInfo",
    "WorkerExitInfo",
    "exit_info",
    "load_agent_plugins",
    "round_info",
]

logger = logging.getLogger(__name__)

ENTRY_POINTS = "gelastic.agent_plugins"
HOOKS = ("before_round", "after_worker_exit", "health_check")
MAX_REASON = 500
MAX_RUNNING = 4
"""Calls of one hook of one plug-in whose threads may run at once; one more is skipped."""


@dataclass(frozen=True)
class RoundInfo:
    """What `before_round` is told: this node's share of a round."""

    job_id: str
    attempt: int
    round: int
    node: str
    global_ranks: tuple[int, ...]
    """The ranks this node would run."""
    world_size: int
    gpu_uuids: tuple[str, ...] = ()
    """The GPUs given to the ranks, one each (empty on a node without GPUs)."""


@dataclass(frozen=True)
class WorkerExitInfo:
    """What `after_worker_exit` is told: one worker's exit."""

    job_id: str
    round: int
    node: str
    global_rank: int
    local_rank: int
    pid: int
    exitcode: int
    """0 for success; negative for a death by signal (-9: SIGKILL), as Popen has it."""
    signal: int = 0
    """The signal that ended it (0: none)."""


def round_info(a: RoundAssignment, node: str) -> RoundInfo:
    return RoundInfo(
        job_id=a.job_id,
        attempt=a.attempt,
        round=a.round,
        node=node,
        global_ranks=tuple(w.global_rank for w in a.workers),
        world_size=a.workers[0].world_size if a.workers else 0,
        gpu_uuids=a.gpu_uuids,
    )


def exit_info(a: RoundAssignment, node: str, ex: WorkerExit) -> WorkerExitInfo:
    return WorkerExitInfo(
        job_id=a.job_id,
        round=a.round,
        node=node,
        global_rank=ex.global_rank,
        local_rank=ex.local_rank,
        pid=ex.pid,
        exitcode=ex.exitcode,
        signal=-ex.exitcode if ex.exitcode < 0 else 0,
    )


def one_reason(value: object) -> str:
    """A hook's reason as it is shown: one line, at most MAX_REASON characters."""
    text = " ".join(str(value).split())
    return text[:MAX_REASON] + ("..." if len(text) > MAX_REASON else "")


class AgentPlugins:
    """The agent's plug-ins and the bounded calling of their hooks."""

    def __init__(self, plugins: Sequence[tuple[str, Any]], *, timeout: float = 10.0) -> None:
        if not 0 < timeout <= 3600:
            raise ValueError(f"plugin_timeout: must be in (0, 3600] s, got {timeout}")
        self.names = [name for name, _ in plugins]
        self._hooks: dict[str, list[tuple[str, Any]]] = {
            hook: [(n, getattr(p, hook)) for n, p in plugins if callable(getattr(p, hook, None))]
            for hook in HOOKS
        }
        self.timeout = timeout
        self._running: dict[tuple[str, str], set[asyncio.Future[Any]]] = {}
        """The calls of each (plug-in, hook) whose thread has not returned."""
        self.health_problem = ""
        """What the latest health check found wrong ("" = nothing): each heartbeat says it."""
        self.errors = 0
        """Calls that raised, timed out or were skipped (a previous call still running)."""

    def has(self, hook: str) -> bool:
        return bool(self._hooks[hook])

    async def before_round(self, info: RoundInfo) -> str:
        """Why a plug-in vetoes the round ("" = none does)."""
        for name, hook in self._hooks["before_round"]:
            ok, value = await self._call(name, "before_round", hook, info)
            if ok and (value is False or isinstance(value, str)):
                reason = one_reason(value) if isinstance(value, str) and value.strip() else "vetoed"
                return f"plug-in {name}: {reason}"
            if ok and value not in (None, True):
                self._bad_value(name, "before_round", value)
        return ""

    async def after_worker_exit(self, info: WorkerExitInfo) -> None:
        for name, hook in self._hooks["after_worker_exit"]:
            await self._call(name, "after_worker_exit", hook, info)

    async def health_check(self) -> str:
        """Why the node is unhealthy ("" = healthy, or no plug-in checks)."""
        problems = []
        for name, hook in self._hooks["health_check"]:
            ok, value = await self._call(name, "health_check", hook)
            if ok and (value is False or isinstance(value, str)):
                reason = one_reason(value) if isinstance(value, str) and value.strip() else "failed"
                problems.append(f"plug-in {name}: {reason}")
            elif ok and value not in (None, True):
                self._bad_value(name, "health_check", value)
        return one_reason("; ".join(problems))

    async def watch_health(self, interval: float) -> None:
        """Check the node's health every `interval` s, into `health_problem`, until cancelled."""
        while True:
            problem = await self.health_check()
            if problem != self.health_problem:
                logger.log(
                    logging.ERROR if problem else logging.INFO, "health: %s", problem or "ok"
                )
            self.health_problem = problem
            await asyncio.sleep(interval)

    async def _call(self, name: str, hook: str, fn: Any, *args: object) -> tuple[bool, object]:
        """(it returned, what) for one call of `fn` in a thread, bounded by the timeout."""
        running = self._running.setdefault((name, hook), set())
        if len(running) >= MAX_RUNNING:
            self.errors += 1
            logger.warning(
                "plug-in %s: %d calls of %s still run; skipped", name, len(running), hook
            )
            return False, None
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        # Read once settled, even after a timeout: no "exception never retrieved" later.
        future.add_done_callback(lambda f: f.cancelled() or f.exception())
        running.add(future)
        future.add_done_callback(running.discard)

        def run() -> None:
            err: Exception | None = None
            try:
                value = fn(*args)
            except BaseException as exc:  # even SystemExit: it is the hook's, not the agent's
                err = exc if isinstance(exc, Exception) else RuntimeError(repr(exc))
                value = None
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits
                loop.call_soon_threadsafe(_settle, future, value, err)

        # A daemon thread: one that never returns neither holds the agent's exit nor a pool.
        threading.Thread(target=run, name=f"plugin {name} {hook}", daemon=True).start()
        try:
            value = await asyncio.wait_for(asyncio.shield(future), self.timeout)
        except TimeoutError:
            self.errors += 1
            logger.warning("plug-in %s: %s took over %g s; ignored", name, hook, self.timeout)
            return False, None
        except Exception:
            self.errors += 1
            logger.exception("plug-in %s: %s raised; ignored", name, hook)
            return False, None
        return True, value

    def _bad_value(self, name: str, hook: str, value: object) -> None:
        self.errors += 1
        logger.warning(
            "plug-in %s: %s returned a %s (None, True, False or a reason expected); ignored",
            name,
            hook,
            type(value).__name__,
        )


def _settle(future: asyncio.Future[Any], value: object, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(value)


def load_agent_plugins(refs: Sequence[str], *, timeout: float) -> AgentPlugins:
    """The plug-ins named (`module:object`) and those of the entry points. ValueError names a
    bad one, or one without any hook."""
    plugins = [(ref, load_plugin(ref)) for ref in refs[:MAX_PLUGINS]]
    plugins += load_entry_points(ENTRY_POINTS, limit=MAX_PLUGINS - len(plugins))
    for name, p in plugins:
        if not any(callable(getattr(p, hook, None)) for hook in HOOKS):
            raise ValueError(f"plug-in {name}: has none of the hooks {', '.join(HOOKS)}")
    return AgentPlugins(plugins, timeout=timeout)
