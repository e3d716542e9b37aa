"""Idle connections to the coordinator's gRPC and metrics ports neither take it down nor stay.

Before the fix the gRPC port took every connection it was offered and left one that never
spoke HTTP/2 open for two minutes (grpc's handshake timeout): 300 idle TCP connections used up a
coordinator's 256 descriptors, ListNodes timed out, and the metrics endpoint, out of
descriptors, logged a failed accept in a loop. Now the gRPC port closes a connection that has
not sent its HTTP/2 settings within the handshake timeout and one with no call open after the
idle timeout, and holds at most a cap of them (closing the next at its accept), the cap taken
from the open-files limit; the metrics endpoint makes room at its cap by closing the connection
that has waited longest, and pauses its accepts while out of descriptors.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest

from client import Client
from client import _replica_channels as replica_channels
from coordinator.server import Coordinator, CoordinatorConfig
from protos.gelastic.v1 import gelastic_pb2 as pb
from protos.gelastic.v1 import gelastic_pb2_grpc as pb_grpc
from tests._helpers import free_port, wait_for
from tests.service._fakes import FakeNode

REPO = Path(__file__).resolve().parents[2]
HARD = 256
"""The coordinator's hard limit on open files in the flood test (its soft one starts lower)."""
FLOOD = 300
"""Idle connections opened to each port."""
ANSWER_S = 30.0
"""How long ListNodes and a scrape may take during the flood: more than the handshake
timeout (what frees the cap), far less than grpc's own two minutes."""
CLOSE_S = 40.0
LOG_BYTES = 64 * 1024

# Opens N connections to each PORT (`PORT:N ...`), says how many connected to each (a JSON
# object), then on a line from stdin waits (at most WAIT s) until the server closed every one
# of the first PORT and says how many it closed of each.
FLOODER = r"""
import json, resource, select, socket, sys, time
wait = float(sys.argv[1])
targets = [(int(p), int(n)) for p, n in (a.split(":") for a in sys.argv[2:])]
awaited = {int(sys.argv[2].split(":")[0])}
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
socks = {}
for port, n in targets:
    for _ in range(n):
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", port))
        socks[s.fileno()] = (port, s)
poll = select.poll()
for fd in socks:
    poll.register(fd, select.POLLOUT)
pending, connected = dict(socks), {}
deadline = time.monotonic() + 20
while pending and time.monotonic() < deadline:
    for fd, _ in poll.poll(500):
        item = pending.pop(fd, None)
        if item is None:
            continue
        poll.unregister(fd)
        if item[1].getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
            connected[fd] = item
def count(items):
    out = {str(p): 0 for p, _ in targets}
    for port, _ in items:
        out[str(port)] += 1
    return out
print(json.dumps(count(connected.values())), flush=True)
sys.stdin.readline()
poll = select.poll()
for fd in connected:
    poll.register(fd, select.POLLIN)
open_ = dict(connected)
deadline = time.monotonic() + wait
while any(port in awaited for port, _ in open_.values()) and time.monotonic() < deadline:
    for fd, _ in poll.poll(500):
        item = open_.get(fd)
        if item is None:
            continue
        try:
            data = item[1].recv(4096)
        except OSError:
            data = b""
        if not data:
            del open_[fd]
            poll.unregister(fd)
print(json.dumps(count(v for k, v in connected.items() if k not in open_)), flush=True)
"""


def _counts(proc: subprocess.Popen[str]) -> dict[int, int]:
    assert proc.stdout is not None
    return {int(k): v for k, v in json.loads(proc.stdout.readline()).items()}


def _sockets(pid: int) -> int:
    """Sockets the process holds."""
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile
            n += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
    return n


@contextmanager
def _serve(tmp_path: Path, metrics_port: int) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """`coordinator serve` with a soft open-files limit of 64 and a hard one of HARD."""
    port_file = tmp_path / "port"
    start = (
        "import os, resource, sys; "
        f"resource.setrlimit(resource.RLIMIT_NOFILE, (64, {HARD})); "
        "os.execv(sys.executable, [sys.executable, '-m', 'coordinator.cli', *sys.argv[1:]])"
    )
    log = (tmp_path / "log").open("w")
    proc = subprocess.Popen(
        [
            *(sys.executable, "-c", start, "serve", "--port", "0", "--state-dir", ":memory:"),
            *("--port-file", str(port_file), "--metrics-port", str(metrics_port)),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        deadline = time.monotonic() + ANSWER_S
        while not port_file.exists():
            assert proc.poll() is None, (tmp_path / "log").read_text()
            assert time.monotonic() < deadline, "the coordinator did not start in time"
            time.sleep(0.05)  # a poll interval: the loop is bounded by the deadline
        yield proc, f"127.0.0.1:{port_file.read_text().strip()}"
    finally:
        proc.terminate()
        try:
            proc.wait(ANSWER_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(ANSWER_S)
        log.close()


def _list_nodes(address: str) -> float:
    """Seconds ListNodes took, waiting for a connection as long as ANSWER_S allows."""
    started = time.monotonic()
    with grpc.insecure_channel(address) as channel:
        pb_grpc.CoordinatorStub(channel).ListNodes(
            pb.ListNodesRequest(), timeout=ANSWER_S, wait_for_ready=True
        )
    return time.monotonic() - started


def _scrape(port: int) -> float:
    """Seconds until a scrape answered (a refused or cut one is tried again), within ANSWER_S."""
    started = time.monotonic()
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
                assert resp.status == 200 and b"gelastic_" in resp.read()
                return time.monotonic() - started
        except OSError:
            assert time.monotonic() - started < ANSWER_S, "no scrape answered in time"
            time.sleep(0.2)  # a retry interval: the loop is bounded by ANSWER_S


def test_an_idle_flood_of_both_ports_leaves_the_coordinator_serving(tmp_path: Path) -> None:
    metrics_port = free_port()
    with _serve(tmp_path, metrics_port) as (coordinator, address):
        assert resource.prlimit(coordinator.pid, resource.RLIMIT_NOFILE) == (HARD, HARD)
        before = (tmp_path / "log").stat().st_size
        held = _sockets(coordinator.pid)
        grpc_port = int(address.rpartition(":")[2])
        flooder = subprocess.Popen(
            [
                *(sys.executable, "-c", FLOODER, str(CLOSE_S)),
                *(f"{grpc_port}:{FLOOD}", f"{metrics_port}:{FLOOD}"),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            connected = _counts(flooder)
            assert sum(connected.values()) > HARD  # more than the coordinator could ever hold
            assert _list_nodes(address) < ANSWER_S
            assert _scrape(metrics_port) < ANSWER_S
            assert flooder.stdin is not None
            flooder.stdin.write("go\n")
            flooder.stdin.flush()
            # The coordinator closes each: at its accept (over a cap), or once it has said
            # nothing for the handshake (gRPC) or the connection (metrics) timeout.
            deadline = time.monotonic() + CLOSE_S
            while _sockets(coordinator.pid) > held + 2:
                assert time.monotonic() < deadline, f"{_sockets(coordinator.pid)} sockets held"
                time.sleep(0.2)  # a poll interval: the loop is bounded by the deadline
            closed = _counts(flooder)
        finally:
            if flooder.poll() is None:
                flooder.kill()
            flooder.wait(ANSWER_S)
            for pipe in (flooder.stdin, flooder.stdout):
                if pipe is not None:
                    pipe.close()
        assert closed[grpc_port] == connected[grpc_port] == FLOOD
        # Of a burst past the metrics port's backlog the kernel leaves some half-open (the
        # client counts them connected, the server never accepted them; syncookies): what
        # tells is that the coordinator holds none of them any more (above).
        assert closed[metrics_port] > 0
        assert coordinator.poll() is None
        assert _list_nodes(address) < ANSWER_S
        grown = (tmp_path / "log").stat().st_size - before
        assert grown < LOG_BYTES, (tmp_path / "log").read_text()[-3000:]


async def test_a_session_outlives_the_idle_timeout_and_an_idle_client_does_not() -> None:
    idle_s = 1.0
    config = CoordinatorConfig(
        state_dir=":memory:",
        port=0,
        lease=60.0,
        heartbeat_interval=30.0,
        connection_idle_timeout=idle_s,
    )
    async with Coordinator(config) as c:
        node = FakeNode(c.address, "node-a", "127.0.0.1")
        await node.connect()
        # A connection of its own: channels to one address share one by default.
        client = grpc.aio.insecure_channel(
            c.address, options=[("grpc.use_local_subchannel_pool", 1)]
        )
        try:
            await pb_grpc.CoordinatorStub(client).ListNodes(pb.ListNodesRequest(), timeout=10)
            assert client.get_state() == grpc.ChannelConnectivity.READY
            # No call open: the coordinator sends a GOAWAY and the channel goes idle.
            await wait_for(
                lambda: client.get_state() != grpc.ChannelConnectivity.READY,
                idle_s * 20,
                what="the idle client's connection to be closed",
            )
            # The session, silent all this while (no heartbeat is due for 30 s), is one call
            # open for its whole life: its connection is not idle, and the node stays live.
            idle_since = time.monotonic()
            await wait_for(
                lambda: time.monotonic() - idle_since > 3 * idle_s, 10, what="three idle timeouts"
            )
            assert node.call is not None and not node.call.done()
            assert c.service.cluster.node_is_live("node-a", node.incarnation)
            (seen,) = [n.last_seen for n in c.service.cluster.nodes()]
            await node.send(heartbeat=pb.Heartbeat())
            await wait_for(
                lambda: c.service.cluster.nodes()[0].last_seen > seen, 10, what="the heartbeat"
            )
        finally:
            await client.close()
            await node.close()


async def test_a_client_lets_an_idle_connection_go_before_the_coordinator_closes_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Closed by the coordinator, a connection makes grpc log a GOAWAY on the client's stderr:
    # a client that keeps calling now and then would print one a minute.
    server_idle_s = 30.0
    monkeypatch.setattr(replica_channels, "CLIENT_IDLE_MS", 500)
    config = CoordinatorConfig(state_dir=":memory:", port=0, connection_idle_timeout=server_idle_s)
    async with Coordinator(config) as c:
        client = Client(c.address, timeout=10)
        try:
            await asyncio.to_thread(client.list_nodes)
            states: list[grpc.ChannelConnectivity] = []
            client._channel.subscribe(states.append, try_to_connect=False)
            await wait_for(
                lambda: states[-1:] == [grpc.ChannelConnectivity.IDLE],
                server_idle_s / 3,
                what="the client's channel to let its idle connection go",
            )
            assert states[0] == grpc.ChannelConnectivity.READY
            assert await asyncio.to_thread(client.list_nodes) == []  # a new one, at once
        finally:
            client.close()
