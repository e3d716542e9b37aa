"""The state codec: what it writes decodes to the same value, and decoding a large state does
not re-evaluate the dataclasses' annotations for every record (a take-over of 1,000 nodes spent
seconds there)."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import pytest

from coordinator import _codec
from coordinator._codec import decode, encode


@dataclasses.dataclass
class _Inner:
    rank: int
    tag: bytes = b""


@dataclasses.dataclass
class _Outer:
    name: str
    inner: list[_Inner] = dataclasses.field(default_factory=list)
    by_rank: dict[int, _Inner] = dataclasses.field(default_factory=dict)
    ratio: float | None = None


def _sample(i: int) -> _Outer:
    inner = [_Inner(rank=r, tag=bytes([r])) for r in range(3)]
    return _Outer(name=f"node-{i}", inner=inner, by_rank={r.rank: r for r in inner}, ratio=i / 2)


def test_decode_gives_back_what_encode_wrote() -> None:
    for i in range(5):
        assert decode(_Outer, encode(_sample(i))) == _sample(i)
    # A record written before a field existed still loads (the field keeps its default).
    assert decode(_Outer, {"name": "old"}) == _Outer(name="old")


def test_decoding_many_records_evaluates_each_dataclass_s_hints_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[type] = []
    real = typing.get_type_hints

    def counting(obj: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(obj)
        return real(obj, *args, **kwargs)

    monkeypatch.setattr(_codec, "_FIELD_TYPES", {}, raising=False)  # nothing cached yet
    monkeypatch.setattr(typing, "get_type_hints", counting)
    rows = [encode(_sample(i)) for i in range(200)]
    decoded = [decode(_Outer, row) for row in rows]
    assert decoded == [_sample(i) for i in range(200)]
    assert sorted(c.__name__ for c in calls) == ["_Inner", "_Outer"]
