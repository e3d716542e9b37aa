"""Return values of function jobs: the tagged form workers write, and how a client opens it.

A function job's worker writes its return value as ``MAGIC + tag + pickle``, where the tag is
HMAC-SHA256 under the job's key (made by the submitting client, known only to it and the job's
workers) over a domain prefix, the job id, the global rank and the pickled bytes. Agents and the
coordinator carry these bytes without looking inside. A client unpickles a value only after the
tag checks out (`verified_load`); `trusted_load` is the explicit way to load bytes nobody
verified, for a caller who trusts everyone who could have written them.

The worker side lives in ``nodeagent/_bootstrap.py`` (standard library only); both sides must
compute `result_tag` the same way.
"""

from __future__ import annotations

import hashlib
import hmac
import pickle
from typing import Any

__all__ = [
    "MAGIC",
    "TAG_BYTES",
    "ReturnValueError",
    "result_tag",
    "tagged",
    "trusted_load",
    "verified_load",
    "verified_pickle",
]

MAGIC = b"GELASTIC-RV/1\x00"
"""First bytes of every tagged return value."""
TAG_BYTES = 32
_DOMAIN = b"gelastic.v1 return value\x00"


class ReturnValueError(ValueError):
    """A return value is not what the job's workers wrote; it was not loaded."""


def result_tag(key: bytes, job_id: str, rank: int, pickled: bytes) -> bytes:
    """The tag that binds `pickled` to one rank of one job under the job's key."""
    msg = _DOMAIN + job_id.encode("utf-8") + b"\x00" + str(int(rank)).encode() + b"\x00"
    return hmac.new(key, msg + pickled, hashlib.sha256).digest()


def tagged(key: bytes, job_id: str, rank: int, pickled: bytes) -> bytes:
    """`pickled` in the tagged form a worker writes (what the bootstrap does, for tests/tools)."""
    return MAGIC + result_tag(key, job_id, rank, pickled) + pickled


def _split(raw: bytes, rank: int) -> tuple[bytes, bytes]:
    if not raw.startswith(MAGIC) or len(raw) < len(MAGIC) + TAG_BYTES:
        raise ReturnValueError(f"the return value of rank {rank} is not tagged; not loaded")
    start = len(MAGIC)
    return raw[start : start + TAG_BYTES], raw[start + TAG_BYTES :]


def verified_pickle(raw: bytes, *, key: bytes, job_id: str, rank: int) -> bytes:
    """The pickled bytes of `raw` once its tag matches `key`, `job_id` and `rank`.

    Raises ReturnValueError naming the rank when the tag is missing or wrong.
    """
    tag, pickled = _split(raw, rank)
    if not key:
        raise ReturnValueError(f"no key to check the return value of rank {rank}; not loaded")
    if not hmac.compare_digest(tag, result_tag(key, job_id, rank, pickled)):
        raise ReturnValueError(
            f"the return value of rank {rank} of job {job_id} does not carry the job's tag "
            "(written or changed by someone other than the job's worker); not loaded"
        )
    return pickled


def verified_load(raw: bytes, *, key: bytes, job_id: str, rank: int) -> Any:
    """Check `raw` against the job's key, then unpickle it."""
    return pickle.loads(verified_pickle(raw, key=key, job_id=job_id, rank=rank))


def trusted_load(raw: bytes, *, rank: int = -1) -> Any:
    """Unpickle a return value WITHOUT checking who wrote it.

    Unpickling runs code chosen by whoever made the bytes: the job's workers, but also anyone
    who could write its return file on the node, any agent-token holder, or anyone on a
    plaintext channel. Call it only when you trust all of them; `verified_load` is the safe way
    when you hold the job's key.
    """
    _, pickled = _split(raw, rank)
    return pickle.loads(pickled)
