"""Files whose owner proves it is alive by holding an exclusive ``flock`` on them for its whole life.

``reap_if_orphan(path)`` is the one check both users of this convention make: try the lock without waiting; when
it is free the owner is gone (the kernel drops a dead process's locks however it died), so the file is removed
while we hold it. Who calls it: the SSD tier (``kvpool.ssd``: slabs of shards that died) and the CPU core claims
(``deployments.cpu_placement``: claims of replicas that died).
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Literal

Fate = Literal["held", "removed", "gone"]


def reap_if_orphan(path: Path) -> tuple[Fate, int]:
    """``("held", 0)`` when a live process holds ``path``'s lock; ``("removed", size)`` when nobody did and it was
    removed (its size in bytes); ``("gone", 0)`` when it no longer exists. Any other ``OSError`` is raised."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return "gone", 0
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return "held", 0
        size = os.fstat(fd).st_size
        path.unlink(missing_ok=True)
        return "removed", size
    finally:
        os.close(fd)
