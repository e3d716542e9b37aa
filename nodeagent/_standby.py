"""Warm standby workers: interpreters of a job that already started (and imported its preload
modules, if it names any).

A job whose spec names `preload` modules gets, on each agent that runs it, one zygote
(`nodeagent._zygote`): the bootstrap in zygote mode under the job's interpreter, flags, cwd and
env, without any per-round variable (RANK, MASTER_ADDR, TORCHELASTIC_RESTART_COUNT, ...). It
imports the modules once and forks standbys on request; a round's start waits for its imports
(`prepare`, at most `READY_WAIT_S`) and has it fork the round's workers, so they are forks too
and the node pays the import once per job, not once per worker. Every fork's answer is awaited
(a fill's in a task of the pool's), never waited for on the event loop: the zygote runs the
job's code, which may delay a fork as long as it likes, and the agent's heartbeats go on. A zygote that cannot start, is not ready in time, or
whose preload failed to import leaves the round to start cold, as without `preload`.

Each standby (up to `nproc_per_node`, when they can serve a later round: `can_serve`) blocks
reading its hand-off from a pipe whose write end only the agent holds (inherited, never a path).
When a later round of the job starts on this node, `StandbyPool.spawner` hands a standby the
worker's bootstrap argv and full env (JSON, bounded); the standby takes that env and runs the
entrypoint exactly as a cold worker would. It is the same process from then on: the
`ProcessHandle` the group supervises, with the stdout/stderr pipes the group pumps into the
rank's logs (what the standby printed while it waited lands there first). Without a zygote
(it could not be started) standbys are spawned as interpreters of their own (``--standby FD``).

A python job without `preload` has no zygote (its first round's workers start cold, as
always) but gets such standbys while its restart budget lasts (`can_serve`), so a failure
restart skips the interpreter start of each worker (about 30 ms of CPU each, which is most of
a restart when several workers start on a few cores). The price is one idle interpreter per
local worker (about 12 MB resident, 6 MB of it its own, here) and their start beside the round's workers.

Standbys and zygotes run like workers: their own session, the parent-death signal (a fork's on
its zygote, the zygote's on the agent), and worker marks, so the sentinel kills them with the
agent, SIGKILL included. The pool kills a job's standbys when the job is done on this node
(`discard`), when the agent stops (`close`), and when no round of the job came for `IDLE_S`
seconds; their zygote goes with them once its last fork (a worker, maybe) has exited, since its
forks die with it.

A job that succeeded here and asked for it (`JobSpec.standby_linger`) leaves its standbys, its
zygote and warm store host lingering (`release`), keyed by their launch: interpreter, argv, cwd,
the whole job env and the preload list. The first round of a later job whose launch is equal in
every one of those (`adopt`) takes them over, so a sweep of one spec pays the import once per
node. At most `MAX_LINGERING` launches linger per agent (the oldest goes first), each at most
its linger; the agent's death, its stop, and a job of another spec never see them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from client.assignment import RoundAssignment
from nodeagent._agent_logs import log_task_failure
from nodeagent._launch import StandbyLaunch, StoreHostLaunch, WorkerLaunch
from nodeagent._process import ProcessHandle, RealProcess, spawn

if TYPE_CHECKING:
    from nodeagent._store_host import WarmStoreHost
    from nodeagent._zygote import Zygote

__all__ = [
    "IDLE_S",
    "MAX_HANDOFF_BYTES",
    "READY_WAIT_S",
    "StandbyPool",
    "can_serve",
    "encode_handoff",
]

logger = logging.getLogger(__name__)

MAX_HANDOFF_BYTES = 4 * 1024 * 1024
"""Largest hand-off (kept in step with nodeagent._bootstrap)."""
IDLE_S = 120.0
"""A job's standbys are killed when no round of the job has held this node for this long."""
MAX_LINGERING = 2
"""Most launches whose standbys linger on one agent after their job (`release`)."""
READY_WAIT_S = 60.0
"""How long a round's start waits for its job's zygote to finish importing (`prepare`)."""
_OWN_ENV = ("GELASTIC_AGENT_PID", "GELASTIC_WORKER_MARK")


def encode_handoff(launch: WorkerLaunch, prefix: tuple[str, ...]) -> bytes:
    """The hand-off of one worker to a standby started with `prefix`; ValueError if too big."""
    env = {k: v for k, v in launch.env.items() if k not in _OWN_ENV}
    data = json.dumps({"argv": list(launch.argv[len(prefix) :]), "env": env}).encode("utf-8")
    if len(data) > MAX_HANDOFF_BYTES:
        raise ValueError(f"the hand-off is {len(data)} bytes, over {MAX_HANDOFF_BYTES}")
    return data


def can_serve(a: RoundAssignment) -> bool:
    """Whether standbys warmed during round `a` can serve a later round on this node.

    A job without `preload` gets them only while its restart budget lasts: a failure restart
    is what its user asked to be ready for, and all a standby saves it is the interpreter's
    start, so jobs that cannot restart (the default, `max_restarts=0`) pay no idle interpreter
    per worker for the rare re-form after a lost node.

    A restart after a failure comes only while the job's budget lasts (`attempt <
    max_restarts`); the loss of another node re-forms the job, fixed-size ones too, on the
    survivors without spending it, so a round of several nodes always may; a job with a
    `standby_linger` hands them to the next job of its spec. A round of this node alone at its
    last attempt has none of these: only a node joining would re-form it, and that round starts
    cold rather than every such job paying for interpreters that almost never serve.
    """
    spec = a.spec
    if not spec.preload:
        return a.attempt < spec.max_restarts
    return a.attempt < spec.max_restarts or a.group_world_size > 1 or spec.standby_linger > 0


async def _fork(zygote: Zygote) -> tuple[ProcessHandle, int]:
    """A standby forked from `zygote` (the pools' `_forker`, which tests may swap)."""
    return await zygote.fork()


def _key(launch: StandbyLaunch) -> tuple[object, ...]:
    """What two jobs' standbys must share for one to serve the other: all of the launch."""
    env = tuple(sorted(launch.env.items()))
    return (launch.prefix, launch.argv, launch.cwd, env, launch.preload)


@dataclass
class _Standby:
    handle: ProcessHandle
    wfd: int | None


@dataclass
class _JobPool:
    launch: StandbyLaunch
    want: int
    idle: list[_Standby] = field(default_factory=list)
    timer: asyncio.TimerHandle | None = None
    store: WarmStoreHost | None = None
    """A warm c10d store host, on the node that served the round's store."""
    zygote: Zygote | None = None
    """Forks the standbys (and a round's workers) of this launch; None: not started, or it
    could not be (then standbys are spawned, each importing for itself)."""
    refill: bool = False
    """A fill waits for the zygote's imports: it forks the standbys once they are done."""
    waited_out: bool = False
    """A round's start waited `READY_WAIT_S` for this zygote in vain: later ones do not wait."""
    forking: asyncio.Task[None] | None = None
    """Forks standbys from the zygote until `want` wait (a fill's, in the background)."""
    store_forking: asyncio.Task[None] | None = None
    """Forks a warm store host from the zygote (a fill's, in the background)."""
    forks: asyncio.Lock = field(default_factory=asyncio.Lock)
    """Held while forks of this pool are asked for: one at a time, each counted before."""
    gone: bool = False
    """Discarded or killed: what a fork on its way brings is let go."""


class _Pools:
    """The pools of every job on this agent and their teardown: a job's standbys discarded,
    lingering for a job of the same spec, or killed when the agent stops."""

    def __init__(self, *, spawner: Callable[..., RealProcess] = spawn) -> None:
        self._spawner = spawner
        self._jobs: dict[str, _JobPool] = {}
        self._lingering: dict[tuple[object, ...], _JobPool] = {}
        self._dying: list[ProcessHandle] = []
        """Killed standbys and store hosts not yet reaped: `close` waits for them too, so the agent
        never ends while one of its interpreters is still tearing down."""
        """Pools of finished jobs, by launch, oldest first (insertion order)."""
        self._retiring: list[Zygote] = []
        """Zygotes of pools that are gone, kept until their last fork (a worker) has exited."""
        self._forker: Callable[[Zygote], Awaitable[tuple[ProcessHandle, int]]] = _fork
        self._tasks: set[asyncio.Task[None]] = set()
        """The pools' forks in the background; cancelled by `close`."""

    def count(self, job_id: str) -> int:
        """Live standbys of `job_id` waiting for a round."""
        pool = self._jobs.get(job_id)
        return 0 if pool is None else sum(1 for s in pool.idle if s.handle.is_alive())

    def pids(self, job_id: str) -> list[int]:
        pool = self._jobs.get(job_id)
        return [] if pool is None else [s.handle.pid for s in pool.idle]

    def _retire(self, pool: _JobPool) -> None:
        zygote, pool.zygote = pool.zygote, None
        if zygote is None:
            return
        zygote.retire()  # killed once its last fork (a live worker, maybe) has exited
        self._retiring = [z for z in self._retiring if z.handle.is_alive()]
        self._retiring.append(zygote)
        self._dying_add(zygote.handle)

    def _prune(self, pool: _JobPool) -> None:
        alive = []
        for s in pool.idle:
            if s.handle.is_alive():
                alive.append(s)
            else:
                self._let_go(s)
        pool.idle = alive

    def idle(self, job_id: str) -> None:
        """No round of `job_id` holds this node now: kill its standbys after `IDLE_S`."""
        pool = self._jobs.get(job_id)
        if pool is None or pool.timer is not None:
            return
        loop = asyncio.get_running_loop()
        pool.timer = loop.call_later(IDLE_S, self.discard, job_id)

    def _cancel_timer(self, pool: _JobPool) -> None:
        if pool.timer is not None:
            pool.timer.cancel()
            pool.timer = None

    def _let_go(self, s: _Standby) -> None:
        if s.wfd is not None:
            os.close(s.wfd)  # EOF: a standby that is still waiting exits 0 by itself
            s.wfd = None
        s.handle.send_signal_group(signal.SIGKILL)  # it has run nothing of the user's round
        self._dying_add(s.handle)
        for fd in s.handle.take_pipes():
            if fd is not None:
                os.close(fd)

    def release(self, job_id: str, linger: float) -> None:
        """`job_id` succeeded here: keep its standbys `linger` seconds for an equal launch."""
        pool = self._jobs.get(job_id)
        if pool is None or linger <= 0:
            self.discard(job_id)
            return
        self._prune(pool)
        if not pool.idle and pool.store is None and pool.zygote is None:
            self.discard(job_id)
            return
        del self._jobs[job_id]
        self._cancel_timer(pool)
        key = _key(pool.launch)
        old = self._lingering.pop(key, None)
        if old is not None:
            self._kill(old, "replaced by a newer job of the same spec")
        while len(self._lingering) >= MAX_LINGERING:
            oldest = next(iter(self._lingering))
            self._kill(self._lingering.pop(oldest), "too many lingering specs")
        self._lingering[key] = pool
        pool.timer = asyncio.get_running_loop().call_later(linger, self._expire, key)
        logger.info(
            "job %s: %d standby worker(s) linger %g s for the next job of its spec",
            job_id,
            len(pool.idle),
            linger,
        )

    def adopt(self, job_id: str, launch: StandbyLaunch) -> bool:
        """Give `job_id` the lingering standbys of an equal launch; whether there were any."""
        if job_id in self._jobs:
            return False
        pool = self._lingering.pop(_key(launch), None)
        if pool is None:
            return False
        self._cancel_timer(pool)
        pool.launch = launch
        self._jobs[job_id] = pool
        logger.info("job %s: took over %d lingering standby worker(s)", job_id, len(pool.idle))
        return True

    def lingering(self) -> int:
        """Standbys left by finished jobs, alive or not yet reaped."""
        return sum(len(p.idle) for p in self._lingering.values())

    def _expire(self, key: tuple[object, ...]) -> None:
        pool = self._lingering.pop(key, None)
        if pool is not None:
            pool.timer = None
            self._kill(pool, "no job of the same spec came in time")

    def _kill(self, pool: _JobPool, why: str) -> None:
        self._cancel_timer(pool)
        self._gone(pool)
        n = len(pool.idle)
        for s in pool.idle:
            self._let_go(s)
        pool.idle = []
        self._retire(pool)
        if pool.store is not None:
            self._dying_add(pool.store.process)
            pool.store.discard()
            pool.store = None
        if n:
            logger.info("killed %d lingering standby worker(s): %s", n, why)

    def discard(self, job_id: str) -> None:
        """Kill every standby of `job_id` (the job is done on this node)."""
        pool = self._jobs.pop(job_id, None)
        if pool is None:
            return
        self._cancel_timer(pool)
        self._gone(pool)
        for s in pool.idle:
            self._let_go(s)
        self._retire(pool)
        if pool.store is not None:
            self._dying_add(pool.store.process)
            pool.store.discard()
            pool.store = None
        if pool.idle:
            logger.info("job %s: killed %d standby worker(s)", job_id, len(pool.idle))
        pool.idle = []

    def _gone(self, pool: _JobPool) -> None:
        """No more forks for `pool`: those asked for are given up (each exits on its own)."""
        pool.gone = True
        for task in (pool.forking, pool.store_forking):
            if task is not None:
                task.cancel()

    def _own(self, work: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(log_task_failure)
        return task

    def _dying_add(self, handle: ProcessHandle) -> None:
        self._dying = [h for h in self._dying if h.is_alive()]
        self._dying.append(handle)

    async def close(self) -> None:
        """Kill every standby and wait (bounded) until they are gone, killed ones included."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for job_id in list(self._jobs):
            self.discard(job_id)
        while self._lingering:
            self._kill(self._lingering.popitem()[1], "the agent stops")
        for zygote in self._retiring:
            zygote.kill()  # the agent stops: a worker still forked from it goes too
        handles = [h for h in self._dying if h.is_alive()]
        self._dying = []
        if handles:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    asyncio.gather(*(h.wait() for h in handles), return_exceptions=True), 5.0
                )
        for zygote in self._retiring:
            zygote.close()
        self._retiring = []


class StandbyPool(_Pools):
    """The standbys of every job on this agent. Call from the event-loop thread."""

    def fill(self, job_id: str, launch: StandbyLaunch, want: int) -> None:
        """Start standbys of `job_id` until `want` wait (a new spec replaces the old ones)."""
        pool = self._jobs.get(job_id)
        if pool is not None and pool.launch != launch:
            self.discard(job_id)
            pool = None
        if pool is None:
            pool = self._jobs[job_id] = _JobPool(launch, want)
        pool.want = want
        self._cancel_timer(pool)
        self._prune(pool)
        zygote = self._zygote(pool)
        if zygote is not None and not zygote.is_ready():
            if not pool.refill:  # the forks come once the imports are done
                pool.refill = True
                zygote.ready.add_done_callback(lambda _: self._refill(job_id, zygote))
            return
        if zygote is not None:
            # Its answers are awaited: forks never hold up the agent's event loop.
            if pool.forking is None or pool.forking.done():
                pool.forking = self._own(
                    self._fork_until(pool, lambda: pool.want), f"fork-standbys-{job_id}"
                )
            return
        while len(pool.idle) < pool.want:
            standby = self._start(pool.launch)
            if standby is None:
                return
            pool.idle.append(standby)

    def _refill(self, job_id: str, zygote: Zygote) -> None:
        pool = self._jobs.get(job_id)
        if pool is None or pool.zygote is not zygote:
            return
        pool.refill = False
        if zygote.is_ready():
            self.fill(job_id, pool.launch, pool.want)

    def _zygote(self, pool: _JobPool) -> Zygote | None:
        """The pool's zygote, started (again) when there is none alive; None if it cannot be."""
        if pool.zygote is not None and pool.zygote.alive():
            return pool.zygote
        self._retire(pool)
        if not pool.launch.preload:
            return None  # nothing to import once for all: standbys start on their own
        # Imported with the first preload job: an agent that never runs one does without it.
        from nodeagent._zygote import Zygote

        try:
            pool.zygote = Zygote.start(pool.launch, spawner=self._spawner)
        except Exception:
            logger.exception("cannot start a zygote; standbys and workers start on their own")
            return None
        pool.refill = False
        pool.waited_out = False
        return pool.zygote

    async def _fork_until(self, pool: _JobPool, want: Callable[[], int]) -> None:
        """Fork standbys from the pool's zygote until `want()` wait (while it can fork)."""
        async with pool.forks:
            while not pool.gone:
                self._prune(pool)
                zygote = pool.zygote
                if len(pool.idle) >= want() or zygote is None or not zygote.is_ready():
                    return
                standby = await self._fork(zygote)
                if standby is None:
                    return
                if pool.gone:
                    self._let_go(standby)
                    return
                pool.idle.append(standby)

    async def _fork(self, zygote: Zygote) -> _Standby | None:
        try:
            handle, wfd = await self._forker(zygote)
        except OSError as e:
            logger.warning(
                "zygote pid %d cannot fork a standby (%s); workers start cold", zygote.pid, e
            )
            return None
        logger.info("forked standby pid %d from zygote pid %d", handle.pid, zygote.pid)
        return _Standby(handle, wfd)

    async def prepare(self, job_id: str, launch: StandbyLaunch, workers: int = 0) -> bool:
        """Before a round of `job_id` starts here: its zygote, started if need be and waited for
        (at most `READY_WAIT_S`), and forks of it for the round's `workers` (those that wait
        already count); whether the round's workers can be forked from it."""
        pool = self._jobs.get(job_id)
        if pool is not None and pool.launch != launch:
            self.discard(job_id)
            pool = None
        if pool is None:
            pool = self._jobs[job_id] = _JobPool(launch, 0)
        self._cancel_timer(pool)
        zygote = self._zygote(pool)
        if zygote is None or (pool.waited_out and not zygote.is_ready()):
            return False
        if not await zygote.wait_ready(READY_WAIT_S):
            # An import that hangs must not hold every round: the next ones start cold at once.
            logger.warning(
                "zygote pid %d is not ready after %g s; workers start cold",
                zygote.pid,
                READY_WAIT_S,
            )
            pool.waited_out = True
            return False
        if zygote.ready.result():
            return False  # a preload that failed to import: cold, as without
        await self._fork_until(pool, lambda: workers)
        return True

    async def warm(self, job_id: str) -> int:
        """Wait (at most `READY_WAIT_S`) until the standbys a `fill` asked for are there."""
        pool = self._jobs.get(job_id)
        if pool is None:
            return 0
        if pool.zygote is not None:
            await pool.zygote.wait_ready(READY_WAIT_S)
            self._refill(job_id, pool.zygote)
        if pool.forking is not None:
            await asyncio.wait([pool.forking], timeout=READY_WAIT_S)
        return self.count(job_id)

    def fill_store(self, job_id: str, launch: StoreHostLaunch) -> None:
        """Start a warm store host of `job_id` (after `fill`) unless one waits already."""
        pool = self._jobs.get(job_id)
        if pool is None or (pool.store is not None and pool.store.alive()):
            return
        if pool.store is not None:
            self._dying_add(pool.store.process)
            pool.store.discard()
        pool.store = None
        if pool.store_forking is not None and not pool.store_forking.done():
            return
        zygote = pool.zygote
        if zygote is not None and zygote.is_ready() and not zygote.ready.result():
            # Forked from the job's zygote, with its imports (torch): no import of its own.
            pool.store_forking = self._own(
                self._fork_store(pool, launch, zygote), f"fork-store-{job_id}"
            )
            return
        self._start_store(pool, launch)

    async def _fork_store(self, pool: _JobPool, launch: StoreHostLaunch, zygote: Zygote) -> None:
        from nodeagent._store_host import WarmStoreHost  # with the first warm store host

        try:
            store = await WarmStoreHost.forked(launch, zygote.fork_store)
        except OSError as e:
            logger.warning("zygote pid %d cannot fork a warm store host: %s", zygote.pid, e)
            if not pool.gone:
                self._start_store(pool, launch)
            return
        if pool.gone or pool.store is not None:
            self._dying_add(store.process)
            store.discard()
            return
        pool.store = store
        logger.info(
            "forked warm c10d store host pid %d from zygote pid %d", store.process.pid, zygote.pid
        )

    def _start_store(self, pool: _JobPool, launch: StoreHostLaunch) -> None:
        from nodeagent._store_host import WarmStoreHost  # with the first warm store host

        try:
            pool.store = WarmStoreHost.start(launch)
        except Exception:
            pool.store = None
            logger.exception("cannot start a warm c10d store host; the next one starts cold")
            return
        logger.info("started warm c10d store host pid %d", pool.store.process.pid)

    def take_store(self, job_id: str) -> WarmStoreHost | None:
        """The warm store host of `job_id`, now the caller's (None: start one cold)."""
        pool = self._jobs.get(job_id)
        if pool is None or pool.store is None:
            return None
        store, pool.store = pool.store, None
        return store

    def _start(self, launch: StandbyLaunch) -> _Standby | None:
        rfd, wfd = os.pipe2(os.O_CLOEXEC)
        try:
            standby = StandbyLaunch(
                prefix=launch.prefix,
                argv=(*launch.prefix, "--standby", str(rfd), *launch.argv[len(launch.prefix) :]),
                env=launch.env,
                cwd=launch.cwd,
                preload=launch.preload,
            )
            handle = self._spawner(standby, pass_fds=(rfd,))
        except Exception:
            os.close(wfd)
            logger.exception("cannot start a standby worker; workers start cold")
            return None
        finally:
            os.close(rfd)
        logger.info(
            "started standby pid %d preloading %s",
            handle.pid,
            ",".join(launch.preload) or "nothing",
        )
        return _Standby(handle, wfd)

    def take(self, job_id: str, launch: WorkerLaunch) -> ProcessHandle | None:
        """A standby of `job_id` now running `launch`, or None (then start it cold)."""
        pool = self._jobs.get(job_id)
        if pool is None or launch.cwd != pool.launch.cwd:
            return None
        prefix = pool.launch.prefix
        if tuple(launch.argv[: len(prefix)]) != prefix:
            return None
        try:
            data = encode_handoff(launch, prefix)
        except ValueError:
            logger.warning("hand-off too big; rank %d starts cold", launch.global_rank)
            return None
        # The round's forks were made by `prepare`; none is made here, where nothing awaits.
        while pool.idle:
            s = pool.idle.pop(0)
            if self._hand(s, data):
                return s.handle
        return None

    def _hand(self, s: _Standby, data: bytes) -> bool:
        if not s.handle.is_alive() or s.wfd is None:
            self._let_go(s)
            return False
        try:
            # The standby blocks reading: a hand-off above the pipe's buffer drains as it is
            # written, and a standby that died meanwhile answers EPIPE.
            os.write(s.wfd, data)
        except OSError as e:
            logger.warning("standby pid %d cannot take its hand-off: %s", s.handle.pid, e)
            self._let_go(s)
            return False
        os.close(s.wfd)
        s.wfd = None
        return True

    def spawner(self, job_id: str) -> Callable[[WorkerLaunch], ProcessHandle]:
        """A `WorkerGroup` spawner: a standby when one fits, else a cold worker."""

        def start(launch: WorkerLaunch) -> ProcessHandle:
            handle = self.take(job_id, launch)
            return handle if handle is not None else spawn(launch)

        return start
