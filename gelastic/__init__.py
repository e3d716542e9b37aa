"""gelastic's top layer: what runs a coordinator and node agents together, for a user.

The `gelastic` command (`gelastic.cli`, also `python -m gelastic`), whose `run` embeds a
coordinator and an agent in one process, and `LocalCluster`, which starts a `coordinator serve`
and N `nodeagent` processes on this host (tests, demos, trying things out). This package sits
above client, coordinator and nodeagent: it may import all three, and none of them imports it.
"""

from __future__ import annotations

from gelastic.local import LocalCluster

__all__ = ["LocalCluster"]
