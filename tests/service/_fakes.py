"""Scripted node agents speaking the real session protocol, for service tests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from protos.gelastic.v1 import gelastic_pb2 as pb
from protos.gelastic.v1 import gelastic_pb2_grpc as pb_grpc

STEP = 10.0


class FakeNode:
    """A scripted node agent speaking the real session protocol."""

    def __init__(
        self,
        address: str,
        name: str,
        addr: str,
        slots: int = 2,
        incarnation: str = "",
        gpus: list[pb.GpuDevice] | None = None,
        node_secret: str = "",
    ) -> None:
        self.address, self.name, self.addr, self.slots = address, name, addr, slots
        self.gpus = gpus or []
        self.node_secret = node_secret
        self.incarnation = incarnation or f"inc-{name}"
        self.outbox: asyncio.Queue[pb.NodeMessage | None] = asyncio.Queue()
        self.channel = grpc.aio.insecure_channel(address)
        self.call: grpc.aio.StreamStreamCall | None = None  # type: ignore[type-arg]

    async def connect(
        self,
        running: list[pb.RunningGroup] | None = None,
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> pb.CoordinatorMessage:
        hello = pb.Hello(
            name=self.name,
            addr=self.addr,
            slots=self.slots,
            incarnation=self.incarnation,
            running=running or [],
            gpus=self.gpus,
            node_secret=self.node_secret,
        )
        await self.outbox.put(pb.NodeMessage(hello=hello))

        async def gen() -> AsyncIterator[pb.NodeMessage]:
            while True:
                m = await self.outbox.get()
                if m is None:
                    return
                yield m

        self.call = pb_grpc.NodeSessionStub(self.channel).Session(gen(), metadata=metadata)
        return await self.expect("welcome")

    async def expect(self, kind: str) -> pb.CoordinatorMessage:
        assert self.call is not None
        while True:
            msg = await asyncio.wait_for(self.call.read(), STEP)
            assert msg is not grpc.aio.EOF, f"{self.name}: stream ended while waiting for {kind}"
            if msg.WhichOneof("kind") == kind:
                return msg

    async def send(self, **kind: object) -> None:
        await self.outbox.put(pb.NodeMessage(**kind))  # type: ignore[arg-type]

    async def close(self) -> None:
        await self.outbox.put(None)
        await self.channel.close()


async def run_round(a: FakeNode, b: FakeNode) -> tuple[pb.Assign, pb.Assign]:
    rp = await a.expect("reserve_port")
    await a.send(
        port_reserved=pb.PortReserved(
            job_id=rp.reserve_port.job_id, round=rp.reserve_port.round, port=40000
        )
    )
    aa = (await a.expect("assign")).assign
    ab = (await b.expect("assign")).assign
    for node, asg in ((a, aa), (b, ab)):
        await node.send(
            workers_started=pb.WorkersStarted(
                job_id=asg.job_id,
                round=asg.round,
                workers=[
                    pb.WorkerPid(
                        local_rank=w.local_rank, pid=1000 + w.global_rank, global_rank=w.global_rank
                    )
                    for w in asg.workers
                ],
            )
        )
    return aa, ab


def worker_exit(asg: pb.Assign, local_rank: int, code: int, **kw: object) -> pb.NodeMessage:
    g = asg.workers[local_rank].global_rank
    return pb.NodeMessage(
        worker_exited=pb.WorkerExited(
            job_id=asg.job_id,
            round=asg.round,
            exit=pb.WorkerExit(
                local_rank=local_rank, global_rank=g, pid=1000 + g, exitcode=code, **kw
            ),
        )
    )  # type: ignore[arg-type]
