"""A job spec's limits, the checks of its fields, and `SpecError`, which names the bad field.

Also the name checks other parts share (`is_name`, `is_host`, `is_job_id`) and `GelasticError`,
the error of any call to the coordinator and `SpecError`'s base.
"""

from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import Mapping
from typing import Any

# Limits that keep one job from hurting the coordinator or another job (docs/python-api.md).
MAX_NODES = 100_000
MAX_NPROC_PER_NODE = 4096
MAX_RESTARTS = 10_000
MAX_TIMEOUT_S = 7 * 24 * 3600.0
MAX_SPEC_BYTES = 1024 * 1024
"""The whole spec in its wire form (client.wire.check_spec_size). Every message that carries a
spec (an assignment, a job with its spec) must stay far below the 16 MiB gRPC message limit
however many workers it lists; the per-field limits below only bound each piece."""
MAX_FUNCTION_ARGS_BYTES = MAX_SPEC_BYTES
MAX_RETURN_VALUE_BYTES = 4 * 1024 * 1024
"""Largest return value one rank may report (tagged bytes, as the worker wrote them)."""
MAX_RESULT_BYTES_PER_JOB = 32 * 1024 * 1024
"""Largest sum of the return values of all ranks of one job; going over fails the job."""
RESULT_KEY_BYTES = 32
"""Length of the key a function job's workers tag their return values with."""
MAX_ARGV_ITEMS = 4096
MAX_STRING = 64 * 1024
MAX_ENV_ITEMS = 1024
MAX_ROLES = 16
"""Most roles one job may have (`JobSpec.roles`)."""

# Always used with fullmatch: `$` with match() accepts a trailing newline, and a name that
# ends in one makes a job id that the job's own lookups then refuse.
_FUNCTION_REF = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}")
MAX_PRELOAD = 32
"""Most modules a spec may ask its standby workers to preload."""
MAX_STANDBY_LINGER_S = 3600.0
STALL_ACTIONS = ("report", "restart", "fail")
"""What a stall does (`JobSpec.stall_action`)."""
"""Longest `standby_linger`: idle interpreters hold memory on the nodes."""
_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}(\.[A-Za-z_][A-Za-z0-9_]{0,127}){0,15}")
_STD_MAPPING = re.compile(r"(\d+:[0123],)*(\d+:[0123])")
# RFC 1123 labels, plus the underscore that glibc's resolver takes from /etc/hosts and DNS
# ("test_host"); a label never starts or ends with a hyphen, so a name is never an option.
_HOST_NAME = re.compile(
    r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
    r"(\.[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?)*\.?"
)
_JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,159}")


def is_name(value: str) -> bool:
    """A node name, role or job name: 1-128 of [A-Za-z0-9_.-], not starting with [_.-]."""
    return bool(_NAME.fullmatch(value))


_EXIT_CODES = re.compile(r"\d{1,3}(?:,\d{1,3}){0,31}")


def parse_restart_policy(value: str) -> frozenset[int] | None:
    """The exit codes that never restart (empty: the default), or None for "always"."""
    if not isinstance(value, str):
        raise SpecError("restart_policy", "must be a string")
    text = value.replace(" ", "")
    if text == "always":
        return None
    if not text:
        return frozenset()
    if not _EXIT_CODES.fullmatch(text) or any(int(c) > 255 for c in text.split(",")):
        raise SpecError(
            "restart_policy",
            f"must be '', 'always' or exit codes 0-255 such as '2,127', got {value[:60]!r}",
        )
    return frozenset(int(c) for c in text.split(","))


def is_host(value: str) -> bool:
    """A host name (RFC 1123 labels, underscores allowed as glibc's resolver allows them; at
    most 253 characters) or an IPv4/IPv6 address."""
    if not isinstance(value, str) or len(value) > 253:
        return False
    if _HOST_NAME.fullmatch(value):
        return True
    try:
        ipaddress.ip_address(value)
    except ValueError:
        return False
    return True


def is_job_id(value: str) -> bool:
    """A job id as the coordinator makes them; also safe as a directory name."""
    return bool(_JOB_ID.fullmatch(value))


def is_function_reference(value: str) -> bool:
    """ "pkg.module:qualname"."""
    return bool(_FUNCTION_REF.fullmatch(value))


class GelasticError(RuntimeError):
    """A call to the coordinator failed, or was refused before it was sent.

    `code` is the gRPC status code (a `grpc.StatusCode`), or None when nothing was sent.
    """

    def __init__(self, code: Any, message: str) -> None:
        super().__init__(message)
        self.code = code


class SpecError(GelasticError, ValueError):
    """A job spec (or request) field is invalid. `field` names it.

    Raised by the client before anything is sent, so its `code` is None; the coordinator
    refuses the same spec with INVALID_ARGUMENT naming the same field.
    """

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(None, f"{field_name}: {message}")
        self.field = field_name
        self.detail = message


def _seconds(field_name: str, value: float, *, allow_zero: bool = True) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SpecError(field_name, f"must be a number of seconds, got {value!r}")
    if math.isnan(value) or value < 0 or (value == 0 and not allow_zero):
        raise SpecError(field_name, f"must be a positive number of seconds, got {value!r}")
    if value > MAX_TIMEOUT_S:
        raise SpecError(field_name, f"must be at most {MAX_TIMEOUT_S:.0f} s, got {value!r}")


def _count(field_name: str, value: int, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(field_name, f"must be an integer, got {value!r}")
    if not low <= value <= high:
        raise SpecError(field_name, f"must be between {low} and {high}, got {value}")


def std_form(value: object) -> str | None:
    """`redirects`/`tee` as the wire carries them: torch's `Std` (any int enum 0-3), an int
    0-3, a `{local_rank: Std | int}` dict, or torchrun's string; None for anything else."""
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(int(value)) if 0 <= value <= 3 else None
    if isinstance(value, Mapping):
        if len(value) > MAX_NPROC_PER_NODE:
            return None
        parts: dict[int, int] = {}
        for k, v in value.items():
            ok = all(isinstance(x, int) and not isinstance(x, bool) for x in (k, v))
            if not ok or not 0 <= k < MAX_NPROC_PER_NODE or not 0 <= v <= 3:
                return None
            parts[int(k)] = int(v)
        return ",".join(f"{k}:{v}" for k, v in sorted(parts.items())) or "0"
    return None


def parse_std_mapping(field_name: str, value: str, nproc: int) -> dict[int, int]:
    """torchrun's `--redirects/--tee` syntax: "3" for every local rank, or "0:3,1:1".

    Returns {local_rank: mask} with mask bits 1 = stdout, 2 = stderr.
    """
    if not isinstance(value, str):
        raise SpecError(
            field_name,
            "must be a torch Std, an int 0-3, a {local_rank: Std} dict or torchrun's "
            f"'3' / '0:3,1:1' form, got {type(value).__name__}",
        )
    if len(value) > MAX_STRING:
        raise SpecError(field_name, f"at most {MAX_STRING} characters")
    value = value.strip() or "0"
    if value.isdigit():
        mask = int(value)
        if mask > 3:
            raise SpecError(field_name, f"must be 0-3 or 'local_rank:mask,...', got {value!r}")
        return dict.fromkeys(range(nproc), mask)
    if not _STD_MAPPING.fullmatch(value):
        raise SpecError(field_name, f"must be 0-3 or 'local_rank:mask,...', got {value!r}")
    out = dict.fromkeys(range(nproc), 0)
    for part in value.split(","):
        rank_s, mask_s = part.split(":")
        out[int(rank_s)] = int(mask_s)
    return out


def _cut(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
