"""Site plug-ins: objects named `module:object` on a command line, or in an entry-point group.

A site that customised torchelastic (a subclassed agent, an event handler) keeps its code in its
own package and names it: `nodeagent --plugin mysite.health:Checks`, `coordinator serve
--event-sink mysite.events:to_kafka`. A name that is a class is instantiated with no arguments.
Installed packages may also offer plug-ins through the entry-point groups `gelastic.agent_plugins`
and `gelastic.event_sinks`; every object of a group is loaded when the program asks for it.
Loading runs the plug-in's import: it is code of the site, trusted as the program itself is.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
from collections.abc import Iterable
from typing import Any

__all__ = ["MAX_PLUGINS", "load_entry_points", "load_plugin", "parse_plugin_ref"]

MAX_PLUGINS = 32
"""The most plug-ins one program loads (flags and entry points together)."""

_REF = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,99}(?:\.[A-Za-z_][A-Za-z0-9_]{0,99}){0,15}")


def parse_plugin_ref(ref: str) -> tuple[str, str]:
    """(module, qualified name) of `module:object`; ValueError naming the bad value."""
    module, sep, qualname = ref.partition(":")
    if not sep or not _REF.fullmatch(module) or not _REF.fullmatch(qualname):
        raise ValueError(
            f"plug-in {ref[:200]!r}: expected module:object, such as mysite.health:Checks"
        )
    return module, qualname


def load_plugin(ref: str) -> Any:
    """The object `module:object` names (a class: an instance of it). ValueError when the module
    cannot be imported or has no such object, with what went wrong."""
    module_name, qualname = parse_plugin_ref(ref)
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:
        raise ValueError(f"plug-in {ref}: cannot import {module_name}: {exc}") from exc
    for part in qualname.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"plug-in {ref}: {module_name} has no {qualname}") from None
    return _instance(ref, obj)


def load_entry_points(group: str, *, limit: int = MAX_PLUGINS) -> list[tuple[str, Any]]:
    """(name, object) of every installed entry point of `group`, at most `limit` of them."""
    out: list[tuple[str, Any]] = []
    found: Iterable[importlib.metadata.EntryPoint] = importlib.metadata.entry_points(group=group)
    for ep in sorted(found, key=lambda e: e.name)[:limit]:
        ref = f"{ep.name} ({ep.value})"
        try:
            obj = ep.load()
        except Exception as exc:
            raise ValueError(f"plug-in {ref} of {group}: cannot load: {exc}") from exc
        out.append((ep.value, _instance(ref, obj)))
    return out


def _instance(ref: str, obj: Any) -> Any:
    if not isinstance(obj, type):
        return obj
    try:
        return obj()
    except Exception as exc:
        raise ValueError(f"plug-in {ref}: {obj.__name__}() failed: {exc}") from exc
