"""A function entrypoint: the reference a worker imports it by, and the checks of its arguments.

`JobSpec` resolves a callable to "module:qualname" here (and the main script's path for a
function of `__main__`), refusing what a worker could not import by name, and checks that its
arguments pickle within the limit before anything is sent.
"""

from __future__ import annotations

import os
import pickle
import sys
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from client._spec_fields import MAX_FUNCTION_ARGS_BYTES, SpecError, _cut

MAX_MAIN_PATH = 4096
"""Longest `JobSpec.main_path`, as for `cwd`."""
_UNBOUND = object()
_HOW = "define it at the top level of an importable module or of the script you run"


def function_reference(fn: Callable[..., Any]) -> str:
    """ "module:qualname" of an importable function; raises SpecError otherwise.

    A function of the main script gives "__main__:qualname"; `JobSpec` records the script's path
    with it (`main_path`). What a worker cannot import by name is refused, saying why.
    """
    return _function_entrypoint(fn)[0]


def _function_entrypoint(fn: Callable[..., Any]) -> tuple[str, str, Any]:
    """(reference, main script path or "", the object a bound method is bound to or _UNBOUND)."""
    bound_self: Any = _UNBOUND
    target: Any = fn
    if isinstance(fn, (types.BuiltinFunctionType, types.BuiltinMethodType)):
        raise SpecError(
            "entrypoint",
            f"{fn!r} is a builtin, which a worker cannot call by reference; wrap it in a "
            f"function and {_HOW}",
        )
    if isinstance(fn, types.MethodType):
        if isinstance(fn.__self__, type):  # a classmethod: Class.method is that very method
            target = fn
        else:
            target = fn.__func__
            bound_self = fn.__self__
    module = getattr(target, "__module__", None)
    qualname = getattr(target, "__qualname__", None)
    if not isinstance(module, str) or not module or not isinstance(qualname, str) or not qualname:
        raise SpecError(
            "entrypoint",
            f"{_shown(fn)} has no module:qualname a worker can import it by; {_HOW}",
        )
    name = f"{module}:{qualname}"
    if "<lambda>" in qualname:
        raise SpecError(
            "entrypoint",
            f"{name} is a lambda, which a worker cannot import by name; {_HOW}",
        )
    if "<locals>" in qualname or "<" in qualname:
        raise SpecError(
            "entrypoint",
            f"{name} is defined inside another function (a closure or nested function), "
            f"which a worker cannot import by name; {_HOW}",
        )
    main_path = ""
    main = sys.modules.get("__main__")
    if module == "__main__":
        file = getattr(main, "__file__", None)
        if not isinstance(file, str) or not file:
            raise SpecError(
                "entrypoint",
                f"{name} is defined in an interactive session (a REPL, notebook or python -c), "
                f"which the workers cannot run; {_HOW}",
            )
        main_path = os.path.abspath(file)
    resolved = _lookup(sys.modules.get(module), qualname)
    # A classmethod is bound anew on each lookup: equal (same class, same function), not identical.
    if not (resolved is target or (isinstance(target, types.MethodType) and resolved == target)):
        raise SpecError(
            "entrypoint",
            f"{name} does not name {_shown(fn)} (a worker importing {name} gets another "
            f"object); {_HOW}",
        )
    if bound_self is not _UNBOUND:
        try:
            pickle.dumps(bound_self, protocol=4)
        except Exception as e:
            raise SpecError(
                "entrypoint",
                f"{name} is a method bound to an object that cannot be pickled "
                f"({type(e).__name__}: {_cut(str(e))}); pass a picklable object or {_HOW}",
            ) from None
    # multiprocessing does the same: a return value of a class of the main script is pickled by
    # the workers as __mp_main__.<class>, which must resolve here to this very script.
    if module == "__main__" and main is not None:
        sys.modules.setdefault("__mp_main__", main)
    return name, main_path, bound_self


def _lookup(obj: Any, qualname: str) -> Any:
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _shown(fn: Any) -> str:
    return _cut(repr(fn))


class _PickleSizeExceeded(Exception):
    pass


class _CountingSink:
    """Where the picklability check writes: counts, keeps nothing, stops past the limit."""

    def __init__(self, limit: int) -> None:
        self.size = 0
        self.limit = limit

    def write(self, data: bytes) -> int:
        self.size += len(data)
        if self.size > self.limit:
            raise _PickleSizeExceeded
        return len(data)


def _check_picklable(function: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    """SpecError naming the first argument of `function` that cannot be pickled."""
    items: list[tuple[str, str, Any]] = [("args", f"args[{i}]", a) for i, a in enumerate(args)]
    items += [("kwargs", f"kwargs[{k!r}]", v) for k, v in kwargs.items()]
    total = 0
    for field_name, label, value in items:
        sink = _CountingSink(MAX_FUNCTION_ARGS_BYTES - total)
        try:
            pickle.Pickler(sink, protocol=4).dump(value)
        except _PickleSizeExceeded:
            raise SpecError(
                field_name,
                f"the pickled arguments of {function} are over the limit of "
                f"{MAX_FUNCTION_ARGS_BYTES} bytes (at {label})",
            ) from None
        except Exception as e:
            raise SpecError(
                field_name,
                f"{label} of {function} cannot be pickled ({type(e).__name__}: "
                f"{_cut(str(e))}); pass a picklable value (its class {_HOW})",
            ) from None
        total += sink.size


def _check_main_path(function: str, main_path: str) -> None:
    is_main = function.partition(":")[0] == "__main__"
    if not isinstance(main_path, str):
        raise SpecError("main_path", "must be a string")
    if not main_path:
        if is_main:
            raise SpecError(
                "entrypoint",
                f"{function} is a function of a main script: give the function itself (its "
                "script's path is then recorded) or set main_path",
            )
        return
    if not is_main:
        raise SpecError("main_path", "only for a function of the main script ('__main__:fn')")
    if "\x00" in main_path or len(main_path) > MAX_MAIN_PATH:
        raise SpecError("main_path", f"invalid path (NUL, or over {MAX_MAIN_PATH} characters)")
    if not main_path.endswith(".py"):
        raise SpecError("main_path", f"must name a .py file, got {_cut(main_path)!r}")
