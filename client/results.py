"""Return values of function jobs: the tagged form workers write, and how a client reads it.

A function job's worker stores its return value as ``MAGIC + kind + tag + payload``:

- kind ``KIND_JSON`` (``b"j"``): the payload is UTF-8 JSON. The worker uses it only for a value
  that comes back from JSON exactly (the same values with the same types: dicts with string
  keys, lists, strings, finite floats, ints, bools, None, at most `MAX_JSON_DEPTH` deep).
- kind ``KIND_PICKLE`` (``b"p"``): the payload is a pickle, for any other value (tuples,
  int-keyed dicts, NaN, bytes, tensors, objects).

The tag is HMAC-SHA256 under the job's key (made by the submitting client) over a domain prefix,
the job id, the global rank, the kind and the payload. Agents and the coordinator carry these
bytes without looking inside. Values an older worker wrote (``LEGACY_MAGIC + tag + pickle``)
read as pickles.

What the tag proves, and what it does not: that a process holding the job's key wrote the value
for this rank of this job. Every node the coordinator places on the job is sent the key (its
agent writes it into the workers' args files), and anyone holding the agent token can register
a node, so the tag does NOT prove that the value is harmless. Hence:

- `decode` (what `Job.wait()` and `Job.poll()` give) never unpickles: a JSON value is decoded
  (bounded in size and depth; a malformed one becomes an `UnreadableReturnValue` for its rank,
  never an exception), a pickle stays a `PickledReturnValue` holding its bytes.
- `trusted_load`, `PickledReturnValue.trusted_load()`, `RunResult.trusted_return_values()` and
  ``wait(trust_pickles=True)`` unpickle, for a caller who trusts every node that could have
  been placed on the job (docs/deployment.md, "What a node can do to a client").

The worker side lives in ``nodeagent/_bootstrap.py`` (standard library only); both sides must
lay out the bytes and compute the tag the same way.
"""

from __future__ import annotations

import itertools
import json
import pickle
import re
from dataclasses import dataclass
from typing import Any

from client._spec_fields import MAX_RETURN_VALUE_BYTES

__all__ = [
    "KIND_JSON",
    "KIND_PICKLE",
    "LEGACY_MAGIC",
    "MAGIC",
    "MAX_JSON_DEPTH",
    "TAG_BYTES",
    "PickledReturnValue",
    "ReturnValueError",
    "UnreadableReturnValue",
    "decode",
    "result_tag",
    "tagged",
    "trusted_load",
]

MAGIC = b"GELASTIC-RV/2\x00"
"""First bytes of every return value a worker stores; the kind byte follows."""
LEGACY_MAGIC = b"GELASTIC-RV/1\x00"
"""First bytes of a return value in the earlier format: tag and pickle, no kind byte."""
KIND_JSON = b"j"
KIND_PICKLE = b"p"
TAG_BYTES = 32
MAX_JSON_DEPTH = 64
"""Deepest nesting of lists and objects a JSON return value may have; the worker pickles a
deeper value (kept in step with nodeagent._bootstrap)."""
_DOMAIN = b"gelastic.v1 return value/2\x00"
_LEGACY_DOMAIN = b"gelastic.v1 return value\x00"
_KINDS = (KIND_JSON, KIND_PICKLE)


class ReturnValueError(ValueError):
    """A return value is not what the job's workers wrote; it was not loaded."""


class PickledReturnValue:
    """A return value JSON cannot carry, as the worker pickled it. NOT loaded.

    Reading it (its repr, its attributes, comparing it) runs nothing; only `trusted_load()`
    unpickles. `data` is the pickle, `rank` the global rank that returned it, `verified`
    whether its tag matched the job's key (False for a result read without the key).
    """

    __slots__ = ("data", "rank", "verified")

    def __init__(self, rank: int, data: bytes, *, verified: bool) -> None:
        self.rank = rank
        self.data = data
        self.verified = verified

    def trusted_load(self) -> Any:
        """Unpickle the value. This runs code chosen by whoever wrote the bytes.

        Trusting it means trusting every party that could have written them. A `verified`
        value was written by a process holding the job's key: one of the job's workers, or any
        node the coordinator placed on the job (each is sent the key), and any holder of the
        cluster's agent token can register such a node. An unverified value could also come
        from anyone who could change the worker's return file on its node or the bytes on the
        way. Reasonable when every node is yours (a private `LocalCluster`, or a cluster whose
        agent token only your own hosts hold, with TLS).
        """
        return pickle.loads(self.data)

    def __repr__(self) -> str:
        how = "verified" if self.verified else "not verified"
        return (
            f"<PickledReturnValue of rank {self.rank}: {len(self.data)} bytes, {how}, not "
            "loaded; trusted_load() unpickles it>"
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PickledReturnValue):
            return NotImplemented
        return (self.rank, self.data, self.verified) == (other.rank, other.data, other.verified)

    def __hash__(self) -> int:
        return hash((self.rank, self.data, self.verified))


class UnreadableReturnValue:
    """A return value that is neither JSON data within the bounds nor a pickle: not loaded.

    `reason` says why (never any of the value's own bytes); `rank` is the global rank.
    """

    __slots__ = ("rank", "reason")

    def __init__(self, rank: int, reason: str) -> None:
        self.rank = rank
        self.reason = reason

    def __repr__(self) -> str:
        return f"<UnreadableReturnValue of rank {self.rank}: {self.reason}>"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, UnreadableReturnValue):
            return NotImplemented
        return (self.rank, self.reason) == (other.rank, other.reason)

    def __hash__(self) -> int:
        return hash((self.rank, self.reason))


def result_tag(key: bytes, job_id: str, rank: int, payload: bytes, *, kind: bytes) -> bytes:
    """The tag that binds `kind` and `payload` to one rank of one job under the job's key."""
    return _tag(_DOMAIN, key, job_id, rank, kind + payload)


def tagged(key: bytes, job_id: str, rank: int, payload: bytes, *, kind: bytes) -> bytes:
    """`payload` in the tagged form a worker stores (what the bootstrap does, for tests/tools)."""
    if kind not in _KINDS:
        raise ValueError(f"unknown return value kind {kind!r}")
    return MAGIC + kind + result_tag(key, job_id, rank, payload, kind=kind) + payload


def _tag(domain: bytes, key: bytes, job_id: str, rank: int, body: bytes) -> bytes:
    # Imported here: hashlib maps libcrypto (4 MB), which a node agent at rest has no use for.
    import hashlib
    import hmac

    msg = domain + job_id.encode("utf-8") + b"\x00" + str(int(rank)).encode() + b"\x00"
    return hmac.new(key, msg + body, hashlib.sha256).digest()


@dataclass(frozen=True)
class _Parts:
    kind: bytes
    tag: bytes
    payload: bytes
    legacy: bool

    def tag_matches(self, key: bytes, job_id: str, rank: int) -> bool:
        if self.legacy:
            want = _tag(_LEGACY_DOMAIN, key, job_id, rank, self.payload)
        else:
            want = _tag(_DOMAIN, key, job_id, rank, self.kind + self.payload)
        import hmac  # see _tag

        return hmac.compare_digest(self.tag, want)


def _parts(raw: bytes) -> _Parts | None:
    """The kind, tag and payload of `raw`; None when it is in no format a worker stores."""
    if raw.startswith(MAGIC) and len(raw) >= len(MAGIC) + 1 + TAG_BYTES:
        start = len(MAGIC) + 1
        kind = raw[len(MAGIC) : start]
        return _Parts(kind, raw[start : start + TAG_BYTES], raw[start + TAG_BYTES :], False)
    if raw.startswith(LEGACY_MAGIC) and len(raw) >= len(LEGACY_MAGIC) + TAG_BYTES:
        start = len(LEGACY_MAGIC)
        return _Parts(KIND_PICKLE, raw[start : start + TAG_BYTES], raw[start + TAG_BYTES :], True)
    return None


def _checked(raw: bytes, key: bytes, job_id: str, rank: int) -> _Parts:
    """The parts of `raw` once its tag matches the job's key; raises ReturnValueError."""
    parts = _parts(raw)
    if parts is None:
        raise ReturnValueError(f"the return value of rank {rank} is not tagged; not loaded")
    if not parts.tag_matches(key, job_id, rank):
        raise ReturnValueError(
            f"the return value of rank {rank} of job {job_id} does not carry the job's tag "
            "(written or changed by someone other than the job's worker); not loaded"
        )
    return parts


def decode(raw: bytes, *, key: bytes = b"", job_id: str = "", rank: int = -1) -> Any:
    """A return value as data: JSON decoded, a pickle left unloaded. Never unpickles.

    With the job's `key` (and its `job_id` and the value's global `rank`) the tag is checked
    first: a missing or wrong tag raises ReturnValueError naming the rank. Without a key
    nothing is verified (the value is as trustworthy as the channel and the node it came from).

    Returns the decoded JSON value, a `PickledReturnValue` for a pickle, or an
    `UnreadableReturnValue` for bytes that decode to neither within the bounds (size, depth,
    UTF-8, strict JSON without NaN or infinities); malformed input never raises.
    """
    if len(raw) > MAX_RETURN_VALUE_BYTES:
        return UnreadableReturnValue(rank, f"{len(raw)} bytes is over the size limit")
    if key:
        parts: _Parts | None = _checked(raw, key, job_id, rank)
    else:
        parts = _parts(raw)
    if parts is None:
        return UnreadableReturnValue(rank, "not in the format gelastic's workers store")
    if parts.kind == KIND_PICKLE:
        return PickledReturnValue(rank, parts.payload, verified=bool(key))
    if parts.kind == KIND_JSON:
        return _json_value(parts.payload, rank)
    return UnreadableReturnValue(rank, f"unknown kind {parts.kind!r}")


def trusted_load(raw: bytes, *, key: bytes = b"", job_id: str = "", rank: int = -1) -> Any:
    """Load a return value, UNPICKLING it when it is a pickle: this runs code chosen by
    whoever wrote the bytes (see `PickledReturnValue.trusted_load`).

    With the job's `key` the tag is checked first (ReturnValueError when it does not match);
    without one nothing is verified. A JSON value is decoded as `decode` does; one that
    cannot be read raises ReturnValueError.
    """
    parts = _checked(raw, key, job_id, rank) if key else _parts(raw)
    if parts is None:
        raise ReturnValueError(f"the return value of rank {rank} is not tagged; not loaded")
    if parts.kind == KIND_PICKLE:
        return pickle.loads(parts.payload)
    value = _json_value(parts.payload, rank) if parts.kind == KIND_JSON else None
    if parts.kind != KIND_JSON or isinstance(value, UnreadableReturnValue):
        why = value.reason if isinstance(value, UnreadableReturnValue) else "unknown kind"
        raise ReturnValueError(f"the return value of rank {rank} cannot be read: {why}")
    return value


# --- bounded JSON ----------------------------------------------------------------------------

# A JSON string, escapes included (unrolled so the engine never backtracks).
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")


def _json_depth(payload: bytes) -> int:
    """How deep the lists and objects of `payload` nest (exact for valid JSON), computed
    without recursion, so a hostile value is refused before the parser descends into it."""
    brackets = _JSON_STRING.sub(b"", payload).translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    return max(itertools.accumulate(memoryview(brackets.translate(_STEPS)).cast("b")))


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _json_value(payload: bytes, rank: int) -> Any:
    if len(payload) > MAX_RETURN_VALUE_BYTES:
        return UnreadableReturnValue(rank, f"{len(payload)} bytes is over the size limit")
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError as e:
        return UnreadableReturnValue(rank, f"JSON that is not UTF-8 ({e.reason} at {e.start})")
    depth = _json_depth(payload)
    if depth > MAX_JSON_DEPTH:
        return UnreadableReturnValue(
            rank, f"JSON nested {depth} deep, over the limit of {MAX_JSON_DEPTH}"
        )
    try:
        return json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        return UnreadableReturnValue(rank, f"malformed JSON ({e.msg} at {e.pos})")
    except RecursionError:
        return UnreadableReturnValue(rank, "JSON nested too deep to decode here")
    except ValueError as e:
        # The parser's own words (an int of too many digits, a NaN), never the value's bytes.
        return UnreadableReturnValue(rank, f"JSON this client does not take ({str(e)[:200]})")
