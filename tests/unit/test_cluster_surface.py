"""`Cluster`'s module docstring lists its public surface (methods and properties), and the
list is true both ways: nothing public goes unlisted, nothing listed is missing."""

from __future__ import annotations

import inspect
import re

from coordinator import _cluster
from coordinator._cluster import Cluster


def _listed() -> set[str]:
    doc = _cluster.__doc__ or ""
    surface = doc[doc.index("Its inputs:") : doc.index("`step` checks once")]
    return {m for m in re.findall(r"`([a-z_]+)(?:\(|`)", surface) if not m.startswith("client")}


def _public() -> set[str]:
    return {
        n
        for n in dir(Cluster)
        if not n.startswith("_")
        and (
            callable(getattr(Cluster, n))
            or isinstance(inspect.getattr_static(Cluster, n), property)
        )
    }


def test_every_public_method_of_the_cluster_is_listed_in_its_docstring() -> None:
    assert _public() - _listed() == set()


def test_every_name_the_docstring_lists_is_a_public_method_of_the_cluster() -> None:
    assert _listed() - _public() == set()
    assert {"step", "tick", "submit", "node_connected"} <= _listed()
