"""The zygote: the preload imported once, forks that hold exactly what a standby holds.

Real processes (the real bootstrap in zygote mode, no agent): forks get stdin /dev/null, the
pipes the agent passed and nothing else; their exit codes and signals come back through the
zygote's reports; a request that is not well-formed is refused and the zygote serves on.
"""

from __future__ import annotations

import array
import asyncio
import json
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

from nodeagent._launch import BOOTSTRAP_PATH, StandbyLaunch
from nodeagent._zygote import MAX_MESSAGE, ForkedProcess, Zygote
from tests._helpers import free_port

ROOT = Path(__file__).resolve().parents[2]
PRELOAD = ("tests.workloads.preload_marker",)
# What a fork runs once handed off: it records what it holds, then ends as it is told to.
PROBE = """
import json, os, signal, sys, time
fds = sorted(int(f) for f in os.listdir("/proc/self/fd"))
links = {}
for fd in fds:
    try:
        links[fd] = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        links[fd] = None
seen = {
    "fds": fds,
    "links": links,
    "ppid": os.getppid(),
    "sid": os.getsid(0),
    "pid": os.getpid(),
    "mark": os.environ.get("GELASTIC_WORKER_MARK"),
    "round": os.environ.get("ROUND_VAR"),
    "sigchld_default": signal.getsignal(signal.SIGCHLD) == signal.SIG_DFL,
    "blocked": sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])),
    "preloaded": "tests.workloads.preload_marker" in sys.modules,
}
with open(os.environ["OUT"], "w") as f:
    json.dump(seen, f)
print("fork says hello", flush=True)
end = os.environ["END"]
if end == "exit3":
    sys.exit(3)
if end == "term":
    os.kill(os.getpid(), signal.SIGTERM)
time.sleep(60)
"""


def _launch(tmp: Path) -> StandbyLaunch:
    prefix = (sys.executable, BOOTSTRAP_PATH)
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("GELASTIC_")},
        "PYTHONPATH": str(ROOT),
        "PRELOAD_MARKS": str(tmp / "marks"),
    }
    return StandbyLaunch(
        prefix=prefix,
        argv=(*prefix, "--preload", PRELOAD[0]),
        env=env,
        cwd=str(tmp),
        preload=PRELOAD,
    )


def _hand_off(wfd: int, tmp: Path, name: str, end: str) -> None:
    env = {
        "PATH": os.environ.get("PATH", ""),
        "OUT": str(tmp / f"{name}.json"),
        "END": end,
        "ROUND_VAR": name,
    }
    data = json.dumps({"argv": ["--code", PROBE], "env": env}).encode()
    os.write(wfd, data)
    os.close(wfd)


async def _read_all(fd: int) -> bytes:
    loop = asyncio.get_running_loop()
    chunks = []
    while True:
        data = await loop.run_in_executor(None, os.read, fd, 65536)
        if not data:
            os.close(fd)
            return b"".join(chunks)
        chunks.append(data)


async def _wait_file(path: Path) -> dict[str, Any]:
    for _ in range(1000):
        if path.exists() and path.stat().st_size:
            return json.loads(path.read_text())
        await asyncio.sleep(0.01)
    raise AssertionError(f"{path} never written")


def test_forks_hold_exactly_their_pipes_and_report_exit_codes_and_signals(tmp_path: Path) -> None:
    async def main() -> None:
        z = Zygote.start(_launch(tmp_path))
        try:
            assert await z.wait_ready(60)
            forks: dict[str, tuple[ForkedProcess, int]] = {}
            for end in ("exit3", "kill", "term"):
                forks[end] = await z.fork()
            outputs = {}
            for end, (handle, wfd) in forks.items():
                out, err = handle.take_pipes()
                assert out is not None and err is not None
                outputs[end] = asyncio.ensure_future(_read_all(out))
                os.close(err)
                _hand_off(wfd, tmp_path, end, end)
            seen = {end: await _wait_file(tmp_path / f"{end}.json") for end in forks}
            forks["kill"][0].send_signal_group(signal.SIGKILL)
            codes = {end: await asyncio.wait_for(h.wait(), 30) for end, (h, _) in forks.items()}
            assert codes == {"exit3": 3, "kill": -signal.SIGKILL, "term": -signal.SIGTERM}
            for end, s in seen.items():
                # 0-2 and the descriptor listdir itself opened: the hand-off pipe was closed
                # after the read, the zygote's socket and everything else never came along.
                assert s["fds"] == [0, 1, 2, 3], s
                assert s["links"]["0"] == "/dev/null"
                assert s["links"]["1"].startswith("pipe:") and s["links"]["2"].startswith("pipe:")
                assert s["ppid"] == z.pid and s["sid"] == s["pid"]  # its own session
                assert s["round"] == end and s["preloaded"] is True
                assert s["sigchld_default"] is True and s["blocked"] == []
                assert b"fork says hello" in await asyncio.wait_for(outputs[end], 10)
            # The preload was imported once, by the zygote, not by any fork.
            assert (tmp_path / "marks").read_text().split() == [str(z.pid)]
        finally:
            z.kill()
            await asyncio.wait_for(z.handle.wait(), 10)
            z.close()

    asyncio.run(main())


def test_a_request_that_is_not_well_formed_is_refused_and_the_zygote_serves_on(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        z = Zygote.start(_launch(tmp_path))
        try:
            assert await z.wait_ready(60)
            sock = z._sock
            r, w = os.pipe()

            async def ask(rid: int, data: bytes, fds: list[int]) -> dict[str, Any]:
                answer = z._expect(rid)
                anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
                sock.sendmsg([data], anc)
                return await z._await_reply(rid, answer)

            three = [w, w, r]
            assert (await ask(-1, b"not json", three))["op"] == "refused"
            assert (await ask(-1, b"x" * (MAX_MESSAGE + 10), three))["op"] == "refused"
            fork7 = json.dumps({"op": "fork", "id": 7}).encode()
            assert (await ask(7, fork7, [w, r]))["op"] == "refused"
            exec8 = json.dumps({"op": "exec", "id": 8}).encode()
            assert (await ask(8, exec8, three))["op"] == "refused"
            bad_mark = {"op": "fork", "id": 9, "mark": "a b/../c"}
            assert (await ask(9, json.dumps(bad_mark).encode(), three))["op"] == "refused"
            not_an_id = json.dumps({"op": "fork", "id": True}).encode()
            assert (await ask(-1, not_an_id, three))["op"] == "refused"
            os.close(r)
            os.close(w)
            assert z.alive()
            handle, wfd = await z.fork()  # still serving
            for fd in handle.take_pipes():
                assert fd is not None
                os.close(fd)
            os.close(wfd)  # EOF without a hand-off: the standby exits 0
            assert await asyncio.wait_for(handle.wait(), 30) == 0
        finally:
            z.kill()
            await asyncio.wait_for(z.handle.wait(), 10)
            z.close()

    asyncio.run(main())


def test_the_forks_of_a_zygote_that_dies_die_too_and_show_as_sigkill(tmp_path: Path) -> None:
    async def main() -> None:
        z = Zygote.start(_launch(tmp_path))
        assert await z.wait_ready(60)
        handle, wfd = await z.fork()
        for fd in handle.take_pipes():
            assert fd is not None
            os.close(fd)
        os.kill(z.pid, signal.SIGKILL)  # not through the handle: as if the OOM killer did it
        assert await asyncio.wait_for(handle.wait(), 30) == -signal.SIGKILL
        assert not os.path.exists(f"/proc/{handle.pid}/stat") or _zombie(handle.pid)
        os.close(wfd)
        await asyncio.wait_for(z.handle.wait(), 10)
        z.close()

    asyncio.run(main())


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX"
    except (OSError, IndexError):
        return True


def test_a_warm_store_host_forked_from_the_zygote_serves_the_round_it_is_handed(
    tmp_path: Path,
) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from nodeagent._launch import STORE_HOST_PATH, StoreHostLaunch
    from nodeagent._store_host import StoreHost, WarmStoreHost

    port = free_port()
    zygote_launch = _launch(tmp_path)
    env = {**zygote_launch.env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    launch = StoreHostLaunch(
        argv=(sys.executable, STORE_HOST_PATH),
        env=env,
        cwd=str(tmp_path),
        log_path=tmp_path / "store.log",
        addr="127.0.0.1",
        port=port,
    )

    async def main() -> None:
        z = Zygote.start(zygote_launch)
        try:
            assert await z.wait_ready(60)
            warm = await WarmStoreHost.forked(launch, z.fork_store)
            assert Path(f"/proc/{warm.process.pid}/stat").read_text().split()[3] == str(z.pid)
            host = StoreHost.start(launch, ctx="[t]", warm=warm)
            assert host.pid == warm.process.pid
            watch = asyncio.ensure_future(host.watch())

            def use() -> bytes:
                client = dist.TCPStore(
                    "127.0.0.1", port, None, False, timeout=timedelta(seconds=30)
                )
                client.set("k", "v")
                return bytes(client.get("k"))

            assert await asyncio.to_thread(use) == b"v"
            for _ in range(500):  # its "ready" line may still be on its way to the loop
                if host.state == "ready":
                    break
                await asyncio.sleep(0.01)
            assert host.state == "ready"
            assert await host.stop(2.0)
            assert await watch in (0, -signal.SIGTERM, -signal.SIGKILL)
            host.close()
        finally:
            z.kill()
            await asyncio.wait_for(z.handle.wait(), 10)
            z.close()

    asyncio.run(main())


class _FakeZygoteProcess:
    """The agent's handle on a zygote process that a test plays itself."""

    pid = 4242

    def __init__(self) -> None:
        self.signals: list[int] = []
        self.exited = asyncio.get_running_loop().create_future()

    def take_pipes(self) -> tuple[int | None, int | None]:
        return (None, None)

    def is_alive(self) -> bool:
        return not self.signals

    async def wait(self) -> int:
        return int(await self.exited)

    def send_signal_group(self, sig: int) -> None:
        self.signals.append(sig)


def test_a_zygote_that_reports_an_exit_code_or_pid_out_of_range_is_killed() -> None:
    """What a zygote (the job's interpreter, running its imports) says is bounded like any
    input: an exit code that is no exit code or signal, or a pid no process can have, is a
    broken protocol, and the zygote is killed rather than believed."""

    async def main(message: dict[str, Any]) -> tuple[list[int], bool]:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        handle = _FakeZygoteProcess()
        z = Zygote(handle, ours, ("json",))  # type: ignore[arg-type]
        try:
            theirs.send(json.dumps({"op": "ready", "failed": []}).encode())
            theirs.send(json.dumps(message).encode())
            for _ in range(200):
                if handle.signals:
                    break
                await asyncio.sleep(0.01)
            return list(handle.signals), z.alive()
        finally:
            z.close()
            theirs.close()

    for bad in (
        {"op": "exit", "pid": 77, "code": 1 << 40},
        {"op": "exit", "pid": 77, "code": -65},
        {"op": "exit", "pid": 1 << 40, "code": 0},
        {"op": "exit", "pid": True, "code": 0},
    ):
        signals, alive = asyncio.run(main(bad))
        assert signals == [signal.SIGKILL] and not alive, bad
    # A well-formed exit of a pid it never forked is ignored, and the zygote serves on.
    signals, alive = asyncio.run(main({"op": "exit", "pid": 77, "code": -9}))
    assert signals == [] and alive


def test_a_fork_whose_exit_is_read_with_its_answer_still_reports_its_code() -> None:
    """A fork that dies at once: the zygote's `forked` answer and its `exit` report arrive
    together, before the awaiting request has resumed and made the fork's handle; the exit
    must still reach that handle, not be dropped as the exit of a pid never forked."""

    async def main() -> int:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        handle = _FakeZygoteProcess()
        z = Zygote(handle, ours, ("json",))  # type: ignore[arg-type]
        try:
            theirs.send(json.dumps({"op": "ready", "failed": []}).encode())
            assert await z.wait_ready(5)
            fork = asyncio.ensure_future(z.fork())
            for _ in range(500):  # the request is sent once the task has run
                await asyncio.sleep(0.01)
                if z._waiting:
                    break
            data, ancillary, _, _ = theirs.recvmsg(MAX_MESSAGE, socket.CMSG_SPACE(16))
            for _level, _kind, payload in ancillary:
                for fd in array.array("i", payload[: len(payload) - len(payload) % 4]):
                    os.close(fd)
            rid = json.loads(data)["id"]
            # A pid that is no process's now: the fork was reaped before its answer was read.
            gone = os.fork()
            if gone == 0:
                os._exit(0)
            os.waitpid(gone, 0)
            theirs.send(json.dumps({"op": "forked", "id": rid, "pid": gone}).encode())
            theirs.send(json.dumps({"op": "exit", "pid": gone, "code": 3}).encode())
            forked, hand_w = await asyncio.wait_for(fork, 5)
            os.close(hand_w)
            return await asyncio.wait_for(forked.wait(), 5)
        finally:
            z.close()
            theirs.close()

    assert asyncio.run(main()) == 3
