"""What reaches the web dashboard at all, before any page or login: the Host a request names.

Pure checks on strings (no aiohttp), so they are tested without a server.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable

__all__ = ["WILDCARDS", "HostCheck", "wildcard_names"]

WILDCARDS = frozenset({"", "0.0.0.0", "::"})


def _host_key(host: str) -> str:
    """One spelling per host: IP literals compressed, names lower case without a final dot."""
    try:
        return ipaddress.ip_address(host).compressed
    except ValueError:
        return host.lower().removesuffix(".")


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class HostCheck:
    """Which `Host` headers the dashboard answers: its own names, with its port.

    A page of another site whose name an attacker points at this address (DNS rebinding) sends
    that site's name as its Host, so it is refused, and a browser never lets that site read
    the dashboard. Served: the bound address; `localhost`, 127.0.0.1 and [::1] when that is a
    loopback address; the names given (the advertised name). On a wildcard address, also the
    host's own name and any IP literal (an IP in the Host is the dashboard's own origin).
    """

    def __init__(self, bound: str, port: int, default_port: int, names: Iterable[str] = ()) -> None:
        bound = bound.strip("[]")
        self.port = port
        self._default_port = default_port
        self.wildcard = bound in WILDCARDS
        hosts = {_host_key(n.strip("[]")) for n in names if n}
        if not self.wildcard:
            hosts.add(_host_key(bound))
        loopback = bound == "localhost" or (
            _is_ip(bound) and ipaddress.ip_address(bound).is_loopback
        )
        if loopback:
            hosts |= {"localhost", "127.0.0.1", "::1"}
        self.hosts = frozenset(hosts)

    def allows(self, header: str | None) -> bool:
        if not header or len(header) > 300:
            return False
        if header.startswith("["):
            host, bracket, rest = header[1:].partition("]")
            if not bracket or not _is_ip(host):
                return False
        else:
            host, colon, port_text = header.rpartition(":")
            rest = colon + port_text
            if not colon:
                host, rest = header, ""
            if ":" in host:
                return False  # an IPv6 literal needs its brackets
        if rest:
            digits = rest[1:]
            if not rest.startswith(":") or not digits.isdigit() or len(digits) > 5:
                return False
            port = int(digits)
        else:
            port = self._default_port
        if port != self.port:
            return False
        key = _host_key(host)
        return key in self.hosts or (self.wildcard and _is_ip(host))


def wildcard_names() -> list[str]:
    """This host's own names, for a dashboard bound on every address."""
    return [socket.gethostname(), socket.getfqdn()]
