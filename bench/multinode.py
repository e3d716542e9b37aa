"""multinode: three launchers on this host form one job of 3 x 2 torch workers, as torchrun's
own multi-agent test does, with torchrun and with `gelastic run` on the very same command line.

Every launcher runs, in a session of its own, with a fresh c10d port and rendezvous id per run:

    torchrun --nnodes 3 --nproc-per-node 2 --rdzv-backend c10d \\
        --rdzv-endpoint 127.0.0.1:PORT --rdzv-id ID --max-restarts 1 _multinode_worker.py

and for gelastic `gelastic run` in place of `torchrun`. The workers (`_multinode_worker.py`)
stamp their first line, init_process_group(gloo) and their first all_reduce, then all_reduce in
a loop as training does. Metrics, median [min - max] over `--runs`:

- `3x2 launch -> all started`, `3x2 launch -> all past init`: right before the first launcher
  is spawned -> the last of the 6 ranks' first line / past init_process_group.
- `3x2 crash -> training again`: once all 6 train (+0.5 s) rank 1 writes the crash time and
  exits 1; -> the last of the 6 ranks of the next attempt past its first all_reduce. They then
  run 5 all_reduces and exit 0; every launcher must exit 0.
- `2:3 non-host launcher killed -> re-formed`: with `--nnodes 2:3` (with `--nnodes 3` torchrun
  cannot go on with 2 nodes) and `--rdzv-conf last_call_timeout=3` (what a 2-node round waits
  for a third: torchrun's default is 30 s), once all 6 train (+0.5 s) the benchmark writes the
  kill time and SIGKILLs a launcher that does not serve the rendezvous endpoint: its process
  group and every process under it (its workers have sessions of their own), as a host that
  goes down; -> the last of the 4 ranks of the 2 survivors past their first all_reduce. Then
  the survivors must exit 0.
- `2:3 host launcher killed -> survivors exited` (torchrun; gelastic with c10d): the same kill
  of the launcher that listens on the c10d endpoint; -> the last survivor exits. Both must fail
  (exit non-zero): the rendezvous lived in the dead launcher.
- `2:3 (etcd) leader's launcher killed -> re-formed` (gelastic): `--rdzv-backend etcd
  --rdzv-endpoint 127.0.0.1:ETCDPORT` (a fresh single-member etcd per run, `bench/_etcd.py`),
  every launcher a coordinator replica; the launcher whose replica leads (each prints its
  replica's address; a client given all three finds the leader) is killed; -> the 4 ranks of
  the survivors past their first all_reduce, then the survivors must exit 0. The row
  `2:3 (etcd) launch -> all past init` comes from the same runs.
- `(preload)` rows (gelastic): the c10d crash and non-host kill runs again with
  `--preload torch --preload torch._dynamo` added (standby workers forked from a launcher that
  imported torch once); torchrun has no such flag, so the main rows keep its line unchanged.

The notes give the restart count (`TORCHELASTIC_RESTART_COUNT`) the next attempt's ranks saw,
and any process that outlived its launchers (swept by mark after every launcher had ended).

The systems alternate which goes first, run by run. Each launcher carries a marker in its
environment; at the end of every run its process group gets SIGTERM (SIGKILL after 5 s) and
anything still carrying the marker is killed. A gelastic whose `gelastic run` refuses the
multi-node command line (exit 2) gets rows without samples that say so.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import psutil

from bench._common import (
    GELASTIC,
    MARK_ENV,
    TORCH,
    TORCH_ENV,
    TORCHRUN,
    Measurement,
    RunDirs,
    Stamp,
    free_port,
    log,
    read_event,
    write_event,
)
from bench._etcd import EtcdCluster, etcd_binary
from client import Client

SCENARIO = "multinode"
WORKER = str(Path(__file__).resolve().parent / "_multinode_worker.py")
GELASTIC_CLI = str(Path(sys.executable).with_name("gelastic"))
NODES = 3
NPROC = 2
ELASTIC_NNODES = "2:3"
LAST_CALL_S = 3
"""`last_call_timeout` of the 2:3 runs, for both systems: how long a round of 2 waits for a third."""
NODE_ENV = "GELASTIC_BENCH_NODE"
"""Set on each launcher to a value of its own: finds what one launcher left, to kill a "host"."""
TIMEOUT = 180.0
"""Longest wait for any one thing (6 torch imports on 2 cores take 15-30 s)."""
EXIT_TIMEOUT = 60.0
"""Longest wait for launchers to exit once their job is done or lost."""
SETTLE_S = 0.5
STOP_GRACE_S = 5.0
WORKER_ENV = {
    **TORCH_ENV,
    "BENCH_HOLD_MAX": "240",
    # torchrun's workers would otherwise reuse the rendezvous store across restarts and fail
    # to init again (see torch_recovery); given to both systems' launchers alike.
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
}


class Refused(Exception):
    """`gelastic run` refused the multi-node command line (exit 2): it has no multi-node run."""


@dataclass(frozen=True)
class System:
    label: str
    """The row's system: GELASTIC or TORCH."""
    command: tuple[str, ...]
    """What comes before the launcher's flags."""
    backend: str = "c10d"
    extra: tuple[str, ...] = ()
    """Flags of this variant only, right before the script."""


PRELOAD = ("--preload", "torch", "--preload", "torch._dynamo")
"""gelastic's standbys: each launcher imports these once and forks its workers from there."""
TORCHRUN_SYSTEM = System(TORCH, (TORCHRUN,))
GELASTIC_SYSTEM = System(GELASTIC, (GELASTIC_CLI, "run"))
GELASTIC_PRELOAD = System(GELASTIC, (GELASTIC_CLI, "run"), extra=PRELOAD)
GELASTIC_ETCD = System(GELASTIC, (GELASTIC_CLI, "run"), "etcd")


# ---- stamps ------------------------------------------------------------------------------------


def _read(run_dir: Path, phase: str) -> list[tuple[Stamp, int]]:
    """(stamp, world size) of every `phase` stamp, oldest first."""
    out = []
    for p in run_dir.glob(f"{phase}-*.json"):
        d = json.loads(p.read_text())
        out.append((Stamp(d["t"], d["rank"], d["restart"], d["pid"], d["later"]), d["world"]))
    return sorted(out, key=lambda s: s[0].t)


def _wait_stamps(
    run_dir: Path,
    phase: str,
    count: int,
    later: bool,
    alive: Callable[[], bool],
    world: int | None = None,
) -> list[tuple[Stamp, int]] | None:
    """`count` stamps of `phase` (of later attempts only, with `later`; of a world of `world`
    only, when given); None after TIMEOUT or once `alive()` is false without them."""
    deadline = time.monotonic() + TIMEOUT
    while True:
        stamps = [
            s
            for s in _read(run_dir, phase)
            if s[0].later == later and (world is None or s[1] == world)
        ]
        if len(stamps) >= count:
            return stamps
        if time.monotonic() >= deadline or not alive():
            return None
        time.sleep(0.02)


def _check_world(stamps: list[tuple[Stamp, int]], count: int, what: str) -> float:
    """The last stamp's time, once the stamps are exactly one per rank of a world of `count`."""
    ranks = sorted(s.rank for s, _ in stamps)
    worlds = {w for _, w in stamps}
    if ranks != list(range(count)) or worlds != {count}:
        raise RuntimeError(
            f"{what}: expected ranks 0-{count - 1} of a world of {count}, got ranks {ranks} "
            f"of worlds {sorted(worlds)}"
        )
    return max(s.t for s, _ in stamps)


# ---- launchers -----------------------------------------------------------------------------------


class Launchers:
    """`NODES` launchers of one system on 127.0.0.1 sharing one rendezvous: one job.

    Each starts in its own session with this group's marker (`MARK_ENV`) and its own
    (`NODE_ENV`) in its environment, which its workers inherit. `kill_node` SIGKILLs one
    launcher's group and everything under it or carrying its mark; `stop` ends the rest.
    """

    def __init__(
        self,
        system: System,
        *,
        nnodes: str,
        endpoint: str,
        env: dict[str, str],
        log_dir: Path,
        rdzv_conf: str = "",
    ) -> None:
        self.system = system
        self.mark = uuid.uuid4().hex
        self.endpoint = endpoint
        self.argv = [
            *system.command,
            "--nnodes", nnodes,
            "--nproc-per-node", str(NPROC),
            "--rdzv-backend", system.backend,
            "--rdzv-endpoint", endpoint,
            "--rdzv-id", f"bench-{self.mark[:12]}",
            "--max-restarts", "1",
            *(["--rdzv-conf", rdzv_conf] if rdzv_conf else []),
            *system.extra,
            WORKER,
        ]  # fmt: skip
        self.env = {**os.environ, **env, MARK_ENV: self.mark}
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen[bytes]] = []
        self.exit_times: dict[int, float] = {}
        self.left_behind: list[int] = []
        """Pids `stop` had to sweep by mark although every launcher had already ended."""
        self.formed_short = False
        """The first attempt formed without every node first (see `_wait_first`)."""
        self._logs: list[IO[bytes]] = []

    def start(self) -> float:
        """Spawn every launcher at once; the wall time right before the first is spawned."""
        t0 = time.time()
        for i in range(NODES):
            log_file = open(self.log_dir / f"launcher-{i}.log", "wb")  # noqa: SIM115 - closed in stop
            self._logs.append(log_file)
            # Its temporary files (a failed or killed launcher keeps its worker logs) go with
            # the run's directory.
            tmp = self.log_dir / f"t{i}"
            tmp.mkdir(exist_ok=True)
            self.procs.append(
                subprocess.Popen(
                    self.argv,
                    env={**self.env, NODE_ENV: f"{self.mark}-{i}", "TMPDIR": str(tmp)},
                    stdin=subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        return t0

    def poll(self) -> None:
        for i, p in enumerate(self.procs):
            if i not in self.exit_times and p.poll() is not None:
                self.exit_times[i] = time.time()

    def running(self, among: list[int] | None = None) -> list[int]:
        self.poll()
        return [i for i in among or range(len(self.procs)) if i not in self.exit_times]

    def check_refused(self) -> None:
        """Raise Refused when a gelastic launcher exited 2 (a command line it cannot run)."""
        self.poll()
        if self.system.label != GELASTIC:
            return
        for i, p in enumerate(self.procs):
            if p.returncode == 2:
                text = (self.log_dir / f"launcher-{i}.log").read_text(errors="replace").strip()
                raise Refused(text.splitlines()[-1][:120] if text else "exit 2")

    def wait_exit(self, among: list[int], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self.running(among):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True

    def codes(self, among: list[int] | None = None) -> list[int | None]:
        return [self.procs[i].poll() for i in among or range(len(self.procs))]

    def log_text(self, i: int) -> str:
        self._logs[i].flush()
        return (self.log_dir / f"launcher-{i}.log").read_text(errors="replace")

    def gelastic_host(self) -> int:
        """The gelastic launcher that says it hosts the rendezvous; it must be the only one and
        the one listening on the endpoint."""
        said = [i for i in range(NODES) if "hosts the rendezvous" in self.log_text(i)]
        served = self.host()
        if said != [served]:
            raise RuntimeError(
                f"launchers {said} say they host the rendezvous, launcher {served} listens on "
                f"{self.endpoint} ({self.log_dir})"
            )
        return served

    def etcd_leader(self) -> int:
        """The gelastic launcher whose coordinator replica leads: every launcher prints its
        replica's address; a client given all three finds the leader."""
        replicas: dict[str, int] = {}
        for i in range(NODES):
            for line in self.log_text(i).splitlines():
                if "runs a coordinator replica at " in line:
                    replicas[line.split("replica at ", 1)[1].split()[0]] = i
        if len(replicas) != NODES:
            raise RuntimeError(f"expected {NODES} replica addresses, got {replicas}")
        with Client(",".join(replicas), timeout=10.0) as client:
            client.list_nodes()
            return replicas[client.address]

    def host(self, timeout: float = 10.0) -> int:
        """The launcher listening on the c10d endpoint's port (itself or a process under it)."""
        port = int(self.endpoint.rsplit(":", 1)[1])
        deadline = time.monotonic() + timeout
        while True:
            for i, p in enumerate(self.procs):
                with contextlib.suppress(psutil.Error):
                    root = psutil.Process(p.pid)
                    for proc in [root, *root.children(recursive=True)]:
                        with contextlib.suppress(psutil.Error):
                            for c in proc.net_connections("tcp"):
                                if c.status == psutil.CONN_LISTEN and c.laddr.port == port:
                                    return i
            if time.monotonic() >= deadline:
                raise RuntimeError(f"no launcher listens on {self.endpoint}")
            time.sleep(0.05)

    def _marked(self, key: str, value: str) -> list[psutil.Process]:
        found = []
        for proc in psutil.process_iter(["pid"]):
            with contextlib.suppress(psutil.Error):
                if proc.environ().get(key) == value and proc.status() != psutil.STATUS_ZOMBIE:
                    found.append(proc)
        return found

    def kill_node(self, i: int) -> None:
        """SIGKILL launcher `i`'s process group and every process under it or with its mark,
        as a host that goes down."""
        p = self.procs[i]
        under: list[psutil.Process] = []
        with contextlib.suppress(psutil.Error):
            under = psutil.Process(p.pid).children(recursive=True)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        for proc in under + self._marked(NODE_ENV, f"{self.mark}-{i}"):
            with contextlib.suppress(psutil.Error):
                proc.kill()
        p.wait(timeout=30)
        self.poll()

    def stop(self) -> list[int]:
        """SIGTERM every launcher's group, SIGKILL after the grace, then kill whatever still
        carries the mark; bounded. Returns the pids that had to be swept by mark (also kept in
        `left_behind` when every launcher had ended before)."""
        ended = not self.running()
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
        swept = []
        for _ in range(50):
            left = self._marked(MARK_ENV, self.mark)
            if not left:
                break
            for proc in left:
                swept.append(proc.pid)
                with contextlib.suppress(psutil.Error):
                    proc.kill()
            time.sleep(0.2)
        else:
            log(f"  warning: processes of {self.system.label} left behind: {left}")
        for f in self._logs:
            f.close()
        self._logs.clear()
        if ended and swept:
            self.left_behind = sorted(set(swept))
            log(
                f"  {self.system.label}: {len(self.left_behind)} process(es) outlived their "
                f"launchers ({self.log_dir})"
            )
        return sorted(set(swept))


@contextlib.contextmanager
def _launchers(system: System, run_dir: Path, mode: str, nnodes: str) -> Iterator[Launchers]:
    """The launchers of one run (a fresh port, or a fresh etcd, and rendezvous id), stopped at
    the end whatever happened."""
    etcd: EtcdCluster | None = None
    conf = f"last_call_timeout={LAST_CALL_S}" if nnodes != str(NODES) else ""
    try:
        if system.backend == "etcd":
            etcd = EtcdCluster(1).start()
            endpoint = etcd.endpoints[0]
        else:
            endpoint = f"127.0.0.1:{free_port()}"
        env = {"BENCH_DIR": str(run_dir), "BENCH_MODE": mode, "BENCH_CRASH_RANK": "1"}
        group = Launchers(
            system,
            nnodes=nnodes,
            endpoint=endpoint,
            env={**env, **WORKER_ENV},
            log_dir=run_dir,
            rdzv_conf=conf,
        )
        try:
            yield group
        finally:
            group.stop()
    finally:
        if etcd is not None:
            etcd.stop()


def _first(run_dir: Path, phase: str) -> list[tuple[Stamp, int]]:
    """The `phase` stamps of the first attempt's world of every node."""
    return [s for s in _read(run_dir, phase) if not s[0].later and s[1] == NODES * NPROC]


def _wait_first(group: Launchers, run_dir: Path) -> list[tuple[Stamp, int]]:
    """Every rank of the first attempt past its first all_reduce in a world of all the nodes,
    or an error saying why not. With `--nnodes 2:3` a third launcher that comes after the last
    call finds a round of 2 running, which then re-forms with it (both systems do): the ranks
    of that world of 4 are left out, and `group.formed_short` says it happened."""
    count = NODES * NPROC
    stamps = _wait_stamps(run_dir, "step", count, False, lambda: bool(group.running()), world=count)
    group.formed_short = any(not s.later and w != count for s, w in _read(run_dir, "start"))
    group.check_refused()
    if stamps is None:
        raise RuntimeError(
            f"{group.system.label}: the 6 ranks never trained (launcher exit codes "
            f"{group.codes()}; logs in {run_dir})"
        )
    _check_world(stamps, NODES * NPROC, "first attempt")
    return stamps


# ---- the runs ------------------------------------------------------------------------------------


@dataclass
class CrashRun:
    started: float
    past_init: float
    training_again: float | None
    restarts: list[int]
    """TORCHELASTIC_RESTART_COUNT as the next attempt's ranks saw it."""
    group: Launchers
    """Read `left_behind` once the run is over."""


def _restarts(stamps: list[tuple[Stamp, int]] | None) -> list[int]:
    return sorted({s.restart for s, _ in stamps or []})


def _crash_run(system: System, run_dir: Path) -> CrashRun:
    count = NODES * NPROC
    with _launchers(system, run_dir, "crash", str(NODES)) as group:
        t0 = group.start()
        _wait_first(group, run_dir)
        started = _check_world(_first(run_dir, "start"), count, "first starts") - t0
        past_init = _check_world(_first(run_dir, "init"), count, "first inits") - t0
        again = _wait_stamps(run_dir, "step", count, True, lambda: bool(group.running()))
        crash = read_event(run_dir)
        if again is None or crash is None:
            if system.label == GELASTIC:
                raise RuntimeError(f"gelastic did not train again after the crash ({run_dir})")
            return CrashRun(started, past_init, None, _restarts(again), group)
        training_again = _check_world(again, count, "attempt after the crash") - crash
        if not group.wait_exit(list(range(NODES)), EXIT_TIMEOUT) or group.codes() != [0] * NODES:
            raise RuntimeError(
                f"{system.label}: after the restart every launcher should exit 0, got "
                f"{group.codes()} ({run_dir})"
            )
    return CrashRun(started, past_init, training_again, _restarts(again), group)


@dataclass
class KillRun:
    value: float | None
    """kill -> re-formed, or kill -> survivors exited; None when it did not happen in time."""
    codes: list[int | None]
    """The survivors' exit codes."""
    past_init: float
    """launch -> all 6 past init (the etcd variant reports it)."""
    restarts: list[int]
    """TORCHELASTIC_RESTART_COUNT as the re-formed ranks saw it."""
    group: Launchers
    victim: int
    """The launcher killed (index in start order)."""


def _kill_run(system: System, run_dir: Path, *, host: bool) -> KillRun:
    """Kill the host launcher (`host`) or another one once all 6 ranks train; time the re-form,
    or with c10d and `host`, the survivors' exit."""
    with _launchers(system, run_dir, "hold", ELASTIC_NNODES) as group:
        t0 = group.start()
        _wait_first(group, run_dir)
        past_init = _check_world(_first(run_dir, "init"), NODES * NPROC, "first inits") - t0
        if system.backend == "etcd":
            victim = group.etcd_leader()  # every launcher is a replica: kill the leader's
        else:
            served = group.gelastic_host() if system.label == GELASTIC else group.host()
            victim = served if host else max(i for i in range(NODES) if i != served)
        survivors = [i for i in range(NODES) if i != victim]
        time.sleep(SETTLE_S)
        t_kill = write_event(run_dir)
        group.kill_node(victim)
        if host and system.backend == "c10d":
            if not group.wait_exit(survivors, EXIT_TIMEOUT):
                return KillRun(None, group.codes(survivors), past_init, [], group, victim)
            codes = group.codes(survivors)
            if 0 in codes:
                raise RuntimeError(
                    f"{system.label}: a survivor of the store host's death exited 0: {codes}"
                )
            t_exit = max(group.exit_times[i] for i in survivors)
            return KillRun(t_exit - t_kill, codes, past_init, [], group, victim)
        count = (NODES - 1) * NPROC
        again = _wait_stamps(run_dir, "step", count, True, lambda: bool(group.running(survivors)))
        if again is None:
            if system.label == GELASTIC:
                raise RuntimeError(f"gelastic did not re-form after the kill ({run_dir})")
            return KillRun(None, group.codes(survivors), past_init, [], group, victim)
        value = _check_world(again, count, "attempt after the kill") - t_kill
        if not group.wait_exit(survivors, EXIT_TIMEOUT) or group.codes(survivors) != [0, 0]:
            raise RuntimeError(
                f"{system.label}: after re-forming the survivors should exit 0, got "
                f"{group.codes(survivors)} ({run_dir})"
            )
        return KillRun(value, group.codes(survivors), past_init, _restarts(again), group, victim)


# ---- the scenario --------------------------------------------------------------------------------


def _fmt(v: float | None) -> str:
    return "timed out" if v is None else f"{v:.3f} s"


def _seen(values: set[str]) -> str:
    return ", ".join(sorted(values)) or "none"


class _Rows:
    def __init__(self) -> None:
        def m(metric: str, system: str) -> Measurement:
            return Measurement(SCENARIO, metric, system)

        size = f"{NODES}x{NPROC}"
        el = ELASTIC_NNODES
        self.started = {s: m(f"{size} launch -> all started", s) for s in (GELASTIC, TORCH)}
        self.init = {s: m(f"{size} launch -> all past init", s) for s in (GELASTIC, TORCH)}
        self.crash = {s: m(f"{size} crash -> training again", s) for s in (GELASTIC, TORCH)}
        self.nonhost = {
            s: m(f"{el} non-host launcher killed -> re-formed", s) for s in (GELASTIC, TORCH)
        }
        self.host = {
            s: m(f"{el} host launcher killed -> survivors exited", s) for s in (GELASTIC, TORCH)
        }
        self.etcd_leader = m(f"{el} (etcd) leader's launcher killed -> re-formed", GELASTIC)
        self.etcd_init = m(f"{el} (etcd) launch -> all past init", GELASTIC)
        self.pre_init = m(f"{size} (preload) launch -> all past init", GELASTIC)
        self.pre_crash = m(f"{size} (preload) crash -> training again", GELASTIC)
        self.pre_nonhost = m(f"{el} (preload) non-host launcher killed -> re-formed", GELASTIC)
        systems = (GELASTIC, TORCH, "preload", "etcd")
        self.host_codes: dict[str, set[str]] = {GELASTIC: set(), TORCH: set()}
        self.crash_restarts: dict[str, set[str]] = {s: set() for s in systems}
        self.kill_restarts: dict[str, set[str]] = {s: set() for s in systems}
        self.leaders: list[int] = []
        self.left: dict[str, list[str]] = {s: [] for s in systems}
        """Runs (and how many processes) that left processes behind their ended launchers."""
        self.short: dict[str, list[str]] = {s: [] for s in systems}
        """Runs whose first attempt formed with 2 nodes before the third came (2:3 only)."""

    def gelastic_rows(self) -> list[Measurement]:
        return [
            self.started[GELASTIC],
            self.init[GELASTIC],
            self.crash[GELASTIC],
            self.nonhost[GELASTIC],
            self.host[GELASTIC],
            self.etcd_leader,
            self.etcd_init,
            self.pre_init,
            self.pre_crash,
            self.pre_nonhost,
        ]

    def all(self) -> list[Measurement]:
        out: list[Measurement] = []
        for pair in (self.started, self.init, self.crash, self.nonhost, self.host):
            out += [pair[GELASTIC], pair[TORCH]]
        return [
            *out,
            self.etcd_leader,
            self.etcd_init,
            self.pre_init,
            self.pre_crash,
            self.pre_nonhost,
        ]

    def record(self, key: str, what: str, group: Launchers) -> None:
        """What the ended run `what` of `key` left behind, and whether it formed short."""
        if group.left_behind:
            self.left[key].append(f"{what}: {len(group.left_behind)}")
        if group.formed_short:
            self.short[key].append(what)

    def finish(self, etcd: bool, refused: str | None) -> None:
        """The notes, once every run is in."""
        for s in (GELASTIC, TORCH):
            self.host[s].note = f"survivors' exit codes {_seen(self.host_codes[s])}"
        for s, row in ((GELASTIC, self.crash[GELASTIC]), (TORCH, self.crash[TORCH])):
            row.note = f"restart count of the next attempt {_seen(self.crash_restarts[s])}"
        conf = f"--nnodes {ELASTIC_NNODES} --rdzv-conf last_call_timeout={LAST_CALL_S}"
        for s, row in ((GELASTIC, self.nonhost[GELASTIC]), (TORCH, self.nonhost[TORCH])):
            row.note = f"{conf}; restart count after {_seen(self.kill_restarts[s])}"
        self.pre_nonhost.note = f"restart count after {_seen(self.kill_restarts['preload'])}"
        self.pre_crash.note = (
            f"restart count of the next attempt {_seen(self.crash_restarts['preload'])}"
        )
        for pre, cold in (
            (self.pre_init, self.init[TORCH]),
            (self.pre_crash, self.crash[TORCH]),
            (self.pre_nonhost, self.nonhost[TORCH]),
        ):
            if pre.median and cold.median is not None:
                ratio = f"torchrun / this: {cold.median / pre.median:.1f}x"
                pre.note = f"{ratio}; {pre.note}" if pre.note else ratio
        if etcd:
            self.etcd_leader.note = (
                f"leader was launcher {self.leaders} (0 = started first); restart count after "
                f"{_seen(self.kill_restarts['etcd'])}"
            )
        else:
            self.etcd_leader.note = self.etcd_init.note = "n/a: etcd is not installed"
        for key, row in (
            (GELASTIC, self.started[GELASTIC]),
            (TORCH, self.started[TORCH]),
            ("preload", self.pre_init),
            ("etcd", self.etcd_init),
        ):
            if self.left[key]:
                extra = f"processes outlived their launchers: {'; '.join(self.left[key])}"
                row.note = f"{row.note}; {extra}" if row.note else extra
            if self.short[key]:
                extra = (
                    "formed with 2 nodes before the third came (then re-formed with it): "
                    + "; ".join(self.short[key])
                )
                row.note = f"{row.note}; {extra}" if row.note else extra
        if refused is not None:
            for m in self.gelastic_rows():
                m.note = f"n/a: gelastic run refused the multi-node command line: {refused}"


def _system_run(system: System, rows: _Rows, dirs: RunDirs, tag: str, etcd: bool) -> None:
    s = system.label
    c = _crash_run(system, dirs.new(f"{s}-crash"))
    rows.started[s].add(c.started)
    rows.init[s].add(c.past_init)
    rows.crash[s].add(c.training_again)
    rows.crash_restarts[s].add(str(c.restarts))
    rows.record(s, f"crash run {tag}", c.group)
    k = _kill_run(system, dirs.new(f"{s}-nonhost"), host=False)
    rows.nonhost[s].add(k.value)
    rows.kill_restarts[s].add(str(k.restarts))
    rows.record(s, f"non-host kill {tag}", k.group)
    h = _kill_run(system, dirs.new(f"{s}-host"), host=True)
    rows.host[s].add(h.value)
    rows.host_codes[s].add(str(h.codes))
    rows.record(s, f"host kill {tag}", h.group)
    msg = (
        f"started {_fmt(c.started)}, past init {_fmt(c.past_init)}, crash -> training again "
        f"{_fmt(c.training_again)}; non-host kill -> re-formed {_fmt(k.value)}; host kill -> "
        f"survivors exited {_fmt(h.value)} {h.codes}"
    )
    if system.label == GELASTIC:
        pc = _crash_run(GELASTIC_PRELOAD, dirs.new("gelastic-preload-crash"))
        rows.pre_init.add(pc.past_init)
        rows.pre_crash.add(pc.training_again)
        rows.crash_restarts["preload"].add(str(pc.restarts))
        rows.record("preload", f"crash run {tag}", pc.group)
        pk = _kill_run(GELASTIC_PRELOAD, dirs.new("gelastic-preload-nonhost"), host=False)
        rows.pre_nonhost.add(pk.value)
        rows.kill_restarts["preload"].add(str(pk.restarts))
        rows.record("preload", f"non-host kill {tag}", pk.group)
        msg += (
            f"; preload: past init {_fmt(pc.past_init)}, crash -> training again "
            f"{_fmt(pc.training_again)}, non-host kill -> re-formed {_fmt(pk.value)}"
        )
    if system.label == GELASTIC and etcd:
        e = _kill_run(GELASTIC_ETCD, dirs.new("gelastic-etcd-leader"), host=True)
        rows.etcd_leader.add(e.value)
        rows.etcd_init.add(e.past_init)
        rows.kill_restarts["etcd"].add(str(e.restarts))
        rows.leaders.append(e.victim)
        rows.record("etcd", f"leader kill {tag}", e.group)
        msg += f"; etcd: leader (launcher {e.victim}) kill -> re-formed {_fmt(e.value)}"
    log(f"  {SCENARIO} {tag} {s}: {msg}")


def run(runs: int, quick: bool) -> list[Measurement]:
    rows = _Rows()
    etcd = etcd_binary() is not None
    refused: str | None = None
    with RunDirs(SCENARIO) as dirs:
        for i in range(runs):
            order = (GELASTIC_SYSTEM, TORCHRUN_SYSTEM)
            if i % 2:
                order = order[::-1]
            for system in order:
                if system.label == GELASTIC and refused is not None:
                    continue
                try:
                    _system_run(system, rows, dirs, f"run {i + 1}/{runs}", etcd)
                except Refused as exc:
                    refused = str(exc)
                    log(f"  {SCENARIO}: gelastic run refused the multi-node command line: {exc}")
                time.sleep(0.2)
    rows.finish(etcd, refused)
    return rows.all()
