"""The open-files limit of a long-lived gelastic process (coordinator, node agent).

Every agent's session, client call, log relay, worker pipe and dashboard connection holds a
descriptor, and the usual soft limit (1,024) is far below what a large cluster needs.
"""

from __future__ import annotations

import logging
import resource

__all__ = ["raise_open_files_limit"]

logger = logging.getLogger(__name__)


def raise_open_files_limit() -> int:
    """Raise the soft limit on open files to the hard one; return the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # Where the hard limit is "unlimited" (macOS), the kernel takes a finite soft one only.
    for target in (hard, 1 << 20, 1 << 16, 10_240):
        if target == resource.RLIM_INFINITY or target <= soft:
            continue
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            continue
        logger.info("open files limit raised from %d to %d", soft, target)
        return target
    if hard != resource.RLIM_INFINITY and soft < hard:
        logger.warning("open files limit stays at %d (hard limit %d)", soft, hard)
    return soft
