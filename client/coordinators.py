"""Lists of coordinator replicas, and which one a client or agent tries next.

`--coordinator a:29400,b:29400,c:29400` (and `$GELASTIC_COORDINATOR`, `submit(coordinator=...)`)
names up to MAX_COORDINATORS replicas. Only the elected leader answers; a standby answers
UNAVAILABLE with the leader's address in the `gelastic-leader` trailing metadata. A caller goes
to that address directly, but only when it is one of the listed addresses (a standby must not be
able to send a client or an agent to a host of its choosing); otherwise it tries the next listed
address. Pure: no grpc, no clock.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Collection, Iterable, Sequence
from typing import Any

__all__ = [
    "LEADER_HEADER",
    "MAX_COORDINATORS",
    "STANDBY_PREFIXES",
    "UNREACHABLE_HEADER",
    "is_standby_answer",
    "leader_hint",
    "next_coordinator",
    "parse_coordinators",
    "reconnect_pause",
]

LEADER_HEADER = "gelastic-leader"
"""Trailing metadata of a standby's UNAVAILABLE: HOST:PORT of the leader it knows of."""
UNREACHABLE_HEADER = "gelastic-unreachable"
"""Metadata of an agent's session call: the listed replica its last session could not reach (a
leader that died). A standby that still names that replica as the leader (its lease has not run
out yet) holds the session until another leads, rather than sending the agent back to it."""
MAX_COORDINATORS = 16
"""Most addresses in one coordinator list."""
MAX_LIST_CHARS = MAX_COORDINATORS * 262
"""A longer list is refused before it is split (16 names of 253 characters and their ports)."""
MAX_TARGET_CHARS = 1024
"""Longest single gRPC target with a scheme (unix:, dns:, ipv4:, ipv6:)."""
HUNT_PAUSE_S = (0.2, 0.5)
"""Pause (random in this range) between session attempts while hunting for the leader."""
HUNT_PASSES_MAX = 20
"""Passes over the list at the hunting pause; past them the doubling backoff applies again."""
STANDBY_PREFIXES = ("not the leader", "no leader elected yet")
"""How a standby's UNAVAILABLE details start: the call was not acted on."""

_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_ENTRY = re.compile(
    rf"(?P<host>{_LABEL}(?:\.{_LABEL})*\.?|\[(?P<v6>[0-9A-Fa-f:.]{{2,45}})\]):(?P<port>[0-9]{{1,5}})"
)
_SCHEMES = ("unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:")


def _entry(raw: str, position: int, total: int) -> str:
    """One validated HOST:PORT of a list, in its canonical form (host lower case)."""
    where = f"entry {position} of {total}" if total > 1 else "the address"
    shown = raw[:80] + ("..." if len(raw) > 80 else "")
    if not raw:
        raise ValueError(f"coordinator: {where} is empty (a stray comma?)")
    m = _ENTRY.fullmatch(raw)
    if m is None:
        raise ValueError(
            f"coordinator: {where}, {shown!r}, is not HOST:PORT (a host name, an IPv4 address "
            "or [IPv6], then a port)"
        )
    host, port = m.group("host"), int(m.group("port"))
    if not 0 < port < 65536:
        raise ValueError(f"coordinator: {where}, {shown!r}: the port must be 1-65535")
    if m.group("v6") is not None:
        try:
            host = f"[{ipaddress.IPv6Address(m.group('v6')).compressed}]"
        except ValueError:
            raise ValueError(f"coordinator: {where}, {shown!r}: not an IPv6 address") from None
    elif len(host.rstrip(".")) > 253:
        raise ValueError(f"coordinator: {where}: the host name is over 253 characters")
    return f"{host.lower()}:{port}"


def parse_coordinators(text: str) -> tuple[str, ...]:
    """The addresses of a coordinator list ("a:29400,b:29400"), validated, in the given order.

    Each entry is HOST:PORT (a name, an IPv4 address or [IPv6]); at most MAX_COORDINATORS of
    them, none twice. A single gRPC target with a scheme (unix:PATH, dns:///NAME:PORT, ipv4:...)
    is taken whole, as one entry. ValueError names the bad entry.
    """
    t = text.strip()
    if not t:
        raise ValueError("coordinator: no address given (want HOST:PORT[,HOST:PORT...])")
    if t.startswith(_SCHEMES):
        if len(t) > MAX_TARGET_CHARS or any(c.isspace() or ord(c) < 32 for c in t):
            raise ValueError(f"coordinator: not a usable gRPC target: {t[:80]!r}")
        return (t,)
    if len(t) > MAX_LIST_CHARS:
        raise ValueError(
            f"coordinator: the list is {len(t)} characters long; at most {MAX_COORDINATORS} "
            "HOST:PORT addresses are allowed"
        )
    raw = [p.strip() for p in t.split(",", MAX_COORDINATORS)]
    if len(raw) > MAX_COORDINATORS:
        raise ValueError(
            f"coordinator: more than {MAX_COORDINATORS} addresses in the list; at most "
            f"{MAX_COORDINATORS} replicas are supported"
        )
    out: list[str] = []
    for i, r in enumerate(raw, 1):
        addr = _entry(r, i, len(raw))
        if addr in out:
            raise ValueError(
                f"coordinator: {addr} is in the list twice (entries {out.index(addr) + 1} and {i})"
            )
        out.append(addr)
    return tuple(out)


def leader_hint(metadata: Iterable[Any] | None, listed: Sequence[str]) -> str:
    """The listed address a standby's trailing metadata names as the leader; "" when it names
    none, or one that is not in `listed` (never followed)."""
    for key, value in metadata or ():
        if key != LEADER_HEADER or not isinstance(value, str) or len(value) > MAX_TARGET_CHARS:
            continue
        try:
            (addr,) = parse_coordinators(value)
        except ValueError:
            return ""
        return addr if addr in listed else ""
    return ""


def is_standby_answer(details: str, hint_present: bool) -> bool:
    """True when an UNAVAILABLE came from a standby replica: the call was not acted on."""
    return hint_present or details.lower().startswith(STANDBY_PREFIXES)


def next_coordinator(
    listed: Sequence[str], current: str, tried: Collection[str], hint: str = ""
) -> str | None:
    """The address to try after `current` failed: the hinted leader when it is listed and not
    yet tried in this pass, else the next listed address after `current` not yet tried; None
    once every address of the list was tried in this pass (time to pause)."""
    if hint and hint in listed and hint not in tried:
        return hint
    start = listed.index(current) + 1 if current in listed else 0
    for i in range(len(listed)):
        addr = listed[(start + i) % len(listed)]
        if addr not in tried:
            return addr
    return None


def reconnect_pause(delay: float, hunting: int, listed: int) -> tuple[float, float]:
    """The range the pause before the next session attempt is drawn from (uniformly).
    `hunting` counts the attempts since the last session that worked that found no leader (a
    standby said it knows none, or a replica did not answer); `listed` is the length of the
    coordinator list. With more than one listed replica, while `hunting` is at most
    HUNT_PASSES_MAX passes over the list: HUNT_PAUSE_S, so a fleet finds a new leader within a
    fraction of a second of its election. Otherwise (one coordinator, or a hunt that lasted too
    long): [0, delay] (full jitter; the caller doubles `delay` up to its cap)."""
    if listed > 1 and 0 < hunting <= HUNT_PASSES_MAX * listed:
        return HUNT_PAUSE_S
    return (0.0, max(0.0, delay))
