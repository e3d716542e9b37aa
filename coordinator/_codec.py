"""Plain-JSON encoding of the coordinator's state (dataclasses, enums, bytes, int-keyed maps).

What the store writes must never be pickle: the coordinator never unpickles anything. The decoder
is driven by the dataclasses' type hints, so adding a field with a default stays compatible with
rows written before it existed.
"""

from __future__ import annotations

import base64
import dataclasses
import enum
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["decode", "encode"]


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}
_FIELD_TYPES: dict[type, tuple[tuple[str, Any], ...]] = {}
"""(name, type hint) of each field, per dataclass: `typing.get_type_hints` evaluates every
annotation string again on each call, which dominated loading a large state. Bounded by the
program's dataclasses."""


def encode(obj: Any) -> Any:
    """A JSON-compatible form of `obj`."""
    fn = _ENCODERS.get(type(obj))
    if fn is None:
        fn = _encoder(type(obj))
        _ENCODERS[type(obj)] = fn
    return fn(obj)


_ENCODERS: dict[type, Callable[[Any], Any]] = {}
"""The encoder of each type met, chosen once: checking what a value is (a number, an enum, a
dataclass...) for every value dominated writing a job of ten thousand nodes. Bounded by the
program's types."""


def _encoder(tp: type) -> Callable[[Any], Any]:
    """How `encode` turns a value of type `tp` into JSON (TypeError: it cannot)."""
    if tp is type(None) or issubclass(tp, bool | int | float | str):
        return _same
    if issubclass(tp, bytes | bytearray):
        return _encode_bytes
    if issubclass(tp, enum.Enum):
        return _encode_enum
    if dataclasses.is_dataclass(tp):
        names = _FIELD_NAMES.get(tp)
        if names is None:
            names = _FIELD_NAMES[tp] = tuple(f.name for f in dataclasses.fields(tp))

        def encode_dataclass(obj: Any) -> Any:
            return {name: encode(getattr(obj, name)) for name in names}

        return encode_dataclass
    if issubclass(tp, Mapping):
        return _encode_map
    if issubclass(tp, list | tuple | set | frozenset):
        return _encode_items
    raise TypeError(f"cannot encode {tp.__name__}")


def _same(obj: Any) -> Any:
    return obj


def _encode_bytes(obj: bytes | bytearray) -> Any:
    return {"__b64__": base64.b64encode(bytes(obj)).decode("ascii")}


def _encode_enum(obj: enum.Enum) -> Any:
    return obj.value


def _encode_map(obj: Mapping[Any, Any]) -> Any:
    return {"__map__": [[encode(k), encode(v)] for k, v in obj.items()]}


def _encode_items(obj: Sequence[Any]) -> Any:
    return [encode(x) for x in obj]


def _hints(cls: type) -> tuple[tuple[str, Any], ...]:
    got = _FIELD_TYPES.get(cls)
    if got is None:
        hints = typing.get_type_hints(cls)
        got = _FIELD_TYPES[cls] = tuple((f.name, hints[f.name]) for f in dataclasses.fields(cls))
    return got


def decode(tp: Any, data: Any) -> Any:
    """The value of type `tp` that `encode` turned into `data`."""
    fn = _DECODERS.get(tp)
    if fn is None:
        fn = _DECODERS[tp] = _decoder(tp)
    return fn(data)


_DECODERS: dict[Any, Callable[[Any], Any]] = {}
"""The decoder of each type hint, built once: working out what a hint means (its origin, its
arguments, whether it is a dataclass) for every value dominated loading a large state. Bounded
by the program's type hints."""


def _decoder(tp: Any) -> Callable[[Any], Any]:
    """A function turning what `encode` made of a `tp` back into one."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any or tp is object:
        return _plain
    if origin in (typing.Union, types.UnionType):
        alts = [alt for alt in args if alt is not type(None)]
        optional = type(None) in args

        def union(data: Any) -> Any:
            if data is None and optional:
                return None
            errors = []
            for alt in alts:
                try:
                    return decode(alt, data)
                except (TypeError, ValueError, KeyError) as exc:
                    errors.append(exc)
            raise ValueError(f"no alternative of {tp} fits {data!r:.80}: {errors}")

        return union
    if tp is bytes:

        def as_bytes(data: Any) -> bytes:
            if not isinstance(data, dict) or "__b64__" not in data:
                raise TypeError("expected bytes")
            return base64.b64decode(data["__b64__"])

        return as_bytes
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return tp
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        cls: Any = tp

        def record(data: Any) -> Any:
            if not isinstance(data, dict):
                raise TypeError(f"expected an object for {cls.__name__}")
            # Looked up at each call, not captured: a dataclass may name itself in a field.
            return cls(
                **{name: decode(hint, data[name]) for name, hint in _hints(cls) if name in data}
            )

        return record
    if origin in (dict, Mapping, typing.Mapping) or tp is dict:
        kt, vt = args if args else (Any, Any)

        def mapping(data: Any) -> dict[Any, Any]:
            if not isinstance(data, dict) or "__map__" not in data:
                raise TypeError("expected a map")
            return {decode(kt, k): decode(vt, v) for k, v in data["__map__"]}

        return mapping
    if origin in (list, Sequence, typing.Sequence) or tp is list:
        (et,) = args or (Any,)
        return lambda data: [decode(et, x) for x in _seq(data)]
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return lambda data: tuple(decode(args[0], x) for x in _seq(data))
        return lambda data: tuple(decode(t, x) for t, x in zip(args, _seq(data), strict=True))
    if origin in (set, frozenset):
        (et,) = args
        return lambda data: origin(decode(et, x) for x in _seq(data))
    if origin is typing.Callable or (
        origin is not None and getattr(origin, "__name__", "") == "Callable"
    ):

        def callable_(data: Any) -> Any:
            raise TypeError("callables are not stored")

        return callable_
    if tp in (int, float, str, bool):

        def scalar(data: Any) -> Any:
            if tp is float and isinstance(data, int) and not isinstance(data, bool):
                return float(data)
            if not isinstance(data, tp) or (tp is int and isinstance(data, bool)):
                raise TypeError(f"expected {tp.__name__}, got {type(data).__name__}")
            return data

        return scalar
    if tp is type(None):

        def none(data: Any) -> None:
            if data is not None:
                raise TypeError("expected null")

        return none

    def unknown(data: Any) -> Any:
        raise TypeError(f"cannot decode {tp}")

    return unknown


def _seq(data: Any) -> list[Any]:
    if not isinstance(data, list):
        raise TypeError("expected a list")
    return data


def _plain(data: Any) -> Any:
    if isinstance(data, dict):
        if "__b64__" in data:
            return base64.b64decode(data["__b64__"])
        if "__map__" in data:
            return {_plain(k): _plain(v) for k, v in data["__map__"]}
        return {k: _plain(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_plain(x) for x in data]
    return data
