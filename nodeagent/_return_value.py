"""A function worker's return value as the bootstrap stores it: JSON or a pickle, tagged.

Standalone (the standard library only): `_bootstrap.py` loads it by path, and only for a
function entrypoint, so that no other worker imports json, pickle, hashlib or hmac before its
target's first line. Kept in step with client.results (MAGIC, the kinds, result_tag,
MAX_JSON_DEPTH), which reads what this writes.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

_RESULT_MAGIC = b"GELASTIC-RV/2\x00"
_RESULT_DOMAIN = b"gelastic.v1 return value/2\x00"
_KIND_JSON = b"j"
_KIND_PICKLE = b"p"
_MAX_JSON_DEPTH = 64
# client.model.MAX_RETURN_VALUE_BYTES, less the magic, the kind and the tag.
_MAX_JSON_BYTES = 4 * 1024 * 1024 - len(_RESULT_MAGIC) - 1 - 32


def _pickle_protocol() -> int:
    """At least 4, so large objects (> 4 GiB) and out-of-band friendly types round-trip (torch's
    own writers, `@record`, use protocol-agnostic json)."""
    import pickle

    return max(4, pickle.DEFAULT_PROTOCOL)


def _tagged(kind: bytes, payload: bytes, key: bytes, job_id: str, rank: int) -> bytes:
    # HMAC-SHA256 over a domain prefix, the job id, the rank, the kind and the bytes, so a
    # value can be neither changed, nor moved to another rank or job, nor read as the other
    # kind by anyone without the job's key.
    import hashlib
    import hmac

    msg = _RESULT_DOMAIN + job_id.encode("utf-8") + b"\x00" + str(rank).encode() + b"\x00"
    tag = hmac.new(key, msg + kind + payload, hashlib.sha256).digest() if key else bytes(32)
    return _RESULT_MAGIC + kind + tag + payload


def _same_json(value: Any, back: Any, depth: int) -> bool:
    """`back` (what JSON gave back) equals `value` with the very same types, at most
    _MAX_JSON_DEPTH lists and dicts deep."""
    if type(value) is not type(back):
        return False
    if isinstance(value, dict):
        return (
            depth < _MAX_JSON_DEPTH
            and all(type(k) is str for k in value)
            and value.keys() == back.keys()
            and all(_same_json(v, back[k], depth + 1) for k, v in value.items())
        )
    if isinstance(value, list):
        if depth >= _MAX_JSON_DEPTH or len(value) != len(back):
            return False
        # The lengths are equal; zip's strict= needs python 3.10, and this runs on 3.7+.
        return all(_same_json(v, b, depth + 1) for v, b in zip(value, back))  # noqa: B905
    return bool(value == back)


def _json_payload(value: Any) -> bytes | None:
    """`value` as JSON when JSON gives it back exactly (same values, same types), else None:
    a tuple, an int-keyed dict, NaN, bytes or a tensor is no JSON, and goes as a pickle. So
    does JSON over the size limit: the pickle of the same value may be small enough."""
    import json

    try:
        text = json.dumps(value, allow_nan=False, separators=(",", ":"))
        if len(text) > _MAX_JSON_BYTES:  # ASCII (json.dumps escapes the rest): chars are bytes
            return None
        back = json.loads(text)
        same = _same_json(value, back, 0)
    except Exception:  # whatever a user's type raises here: the pickle says what is wrong
        return None
    return text.encode("utf-8") if same else None


def return_value_bytes(value: Any, key: bytes, job_id: str, rank: int) -> bytes:
    """What the worker stores for `value`: JSON when it survives JSON exactly, else a pickle.

    Raises what pickling raises for a value that is neither.
    """
    import pickle

    payload = _json_payload(value)
    if payload is not None:
        return _tagged(_KIND_JSON, payload, key, job_id, rank)
    return _tagged(
        _KIND_PICKLE, pickle.dumps(value, protocol=_pickle_protocol()), key, job_id, rank
    )
