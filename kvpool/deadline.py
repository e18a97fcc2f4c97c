"""Bound a blocking call that has no timeout of its own (Ray's GCS look-ups: ``ray.get_actor``,
``ray.util.list_named_actors``).

Who calls what: ``kvpool.shard.registry`` (every shard look-up by name) and ``kvpool.connector.pool`` (the actor
handle of a configured shard). ``call_with_deadline(fn, deadline_s, what)`` runs ``fn()`` on a daemon thread and
waits at most ``deadline_s``: its result, its exception re-raised, or ``ShardUnavailableError`` when it did not
return in time (the thread is abandoned; it ends whenever the call does and its result is dropped).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

from kvpool.shard.wire import ShardUnavailableError

T = TypeVar("T")

GCS_DEADLINE_S = 5.0  # a GCS look-up that takes longer: the GCS is overloaded or gone


def call_with_deadline(fn: Callable[[], T], deadline_s: float, what: str) -> T:
    box: list[object] = []
    done = threading.Event()

    def run() -> None:
        try:
            box.append((True, fn()))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box.append((False, exc))
        finally:
            done.set()

    threading.Thread(target=run, name=f"deadline-{what}"[:60], daemon=True).start()
    if not done.wait(deadline_s):
        raise ShardUnavailableError(f"{what}: no answer within {deadline_s}s")
    ok, value = box[0]  # type: ignore[misc]
    if ok:
        return value  # type: ignore[return-value]
    raise value  # type: ignore[misc]
