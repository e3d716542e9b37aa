"""The port group rank 0's agent reserves for a round: bound on the address as found (a numeric
one without any lookup), or the reason it cannot be."""

from __future__ import annotations

import socket

from client.node_protocol import ReservePort
from nodeagent.session import _port_reserved

ASK = ReservePort("job1", 3)


def test_a_free_port_is_bound_on_the_address_found() -> None:
    info = socket.getaddrinfo("127.0.0.1", 0, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
    answer = _port_reserved(ASK, "127.0.0.1", info[0])
    assert (answer.job_id, answer.round, answer.error) == ("job1", 3, "")
    assert 0 < answer.port < 65536


def test_an_address_that_cannot_be_found_or_bound_says_why() -> None:
    answer = _port_reserved(
        ASK, "nowhere.invalid", socket.gaierror(-2, "Name or service not known")
    )
    assert answer.port == 0
    assert (
        answer.error
        == "cannot bind a port on nowhere.invalid: [Errno -2] Name or service not known"
    )
    # 192.0.2.7 (TEST-NET-1) is no address of this host.
    info = socket.getaddrinfo("192.0.2.7", 0, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
    answer = _port_reserved(ASK, "192.0.2.7", info[0])
    assert answer.port == 0 and answer.error.startswith("cannot bind a port on 192.0.2.7: ")
