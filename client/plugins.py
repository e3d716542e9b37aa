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
import os
import re
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import importlib.metadata

__all__ = ["MAX_PLUGINS", "load_entry_points", "load_plugin", "may_declare", "parse_plugin_ref"]

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
    if not may_declare(group):
        return out
    # Here, not at the top: importlib.metadata brings email, zipfile and csv (about 1.3 MB of
    # a node agent's heap), which a host where no package declares `group` never needs.
    import importlib.metadata

    found: Iterable[importlib.metadata.EntryPoint] = importlib.metadata.entry_points(group=group)
    for ep in sorted(found, key=lambda e: e.name)[:limit]:
        ref = f"{ep.name} ({ep.value})"
        try:
            obj = ep.load()
        except Exception as exc:
            raise ValueError(f"plug-in {ref} of {group}: cannot load: {exc}") from exc
        out.append((ep.value, _instance(ref, obj)))
    return out


def may_declare(group: str) -> bool:
    """Whether an installed distribution may declare entry points of `group`; False only when
    surely none does, the way importlib.metadata looks for them: no `entry_points.txt` of a
    `*.dist-info` or `*.egg-info` directory of a sys.path directory (or an egg's `EGG-INFO`)
    names the group, no sys.path entry is a zip file, and no finder but the standard one finds
    distributions."""
    from importlib.machinery import PathFinder

    if any(f is not PathFinder and hasattr(f, "find_distributions") for f in sys.meta_path):
        return True
    needle = group.encode()
    for entry in sys.path:
        if not isinstance(entry, str):
            return True  # not what the import system reads, but importlib.metadata may
        root = entry or "."
        try:
            children = os.listdir(root)
        except NotADirectoryError:
            return True  # a zip file: importlib.metadata looks inside it
        except OSError:
            continue  # not there: nothing to find
        egg = root.lower().endswith(".egg")
        for child in children:
            low = child.lower()
            if not (low.endswith((".dist-info", ".egg-info")) or (egg and low == "egg-info")):
                continue
            try:
                with open(os.path.join(root, child, "entry_points.txt"), "rb") as f:
                    if needle in f.read():
                        return True
            except (FileNotFoundError, NotADirectoryError, PermissionError):
                continue  # importlib.metadata reads these as no entry points too
            except OSError:
                return True
    return False


def _instance(ref: str, obj: Any) -> Any:
    if not isinstance(obj, type):
        return obj
    try:
        return obj()
    except Exception as exc:
        raise ValueError(f"plug-in {ref}: {obj.__name__}() failed: {exc}") from exc
