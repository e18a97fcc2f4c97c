"""The pool fetches a replica's engine finished, read off the engine without making the load report wait for it.

Why: the replica reads its connector's transfer records (``kvpool.connector.kv_connector.drain_transfer_records``)
through vLLM's ``collective_rpc``, a utility call the engine core answers between two steps. A step that prefills a
long prompt on a slow CPU takes seconds (8–10 s in issue 13's overloaded live runs), and the report used to wait for
the answer (up to its 5 s deadline, which it hit): the routers priced queues from a report that many seconds old
while their own record of what they had sent there had expired. Now the read runs in a task of its own; its samples
go with the first report after it answers.

Who calls it: ``deployments.replica`` — ``collect(served)`` once per load report (``served``: the requests the
replica finished so far; the engine is asked again only after new ones finished, one read at a time), on its
event loop; ``close`` when the replica goes. ``read`` is the call itself (the replica's: the RPC and the decoding
of its records); a read that fails or passes ``deadline_s`` loses those samples, nothing else (they only calibrate
the routers' tier prices).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from router.hub import TransferSample

log = logging.getLogger("kvstack.replica")

#: How long one read may wait for the engine (its step, then the workers' answer).
DRAIN_DEADLINE_S = 60.0


class TransferDrain:
    def __init__(self, read: Callable[[], Awaitable[list[TransferSample]]], *, name: str = "",
                 deadline_s: float = DRAIN_DEADLINE_S) -> None:
        if deadline_s <= 0:
            raise ValueError(f"deadline_s must be positive, got {deadline_s}")
        self._read = read
        self._name = name
        self.deadline_s = deadline_s
        self._task: asyncio.Task[list[TransferSample]] | None = None
        self._asked_at_served = 0

    def collect(self, served: int) -> list[TransferSample]:
        """The samples of a read that has answered since the last call (else none); starts the next read when
        requests finished since the last one was started and none is in flight. Never waits."""
        out: list[TransferSample] = []
        task = self._task
        if task is not None and task.done():
            self._task = None
            if not task.cancelled():  # cancelled: closed, nothing to send
                if (exc := task.exception()) is None:
                    out = task.result()
                else:
                    log.warning("replica %s: reading transfer records failed: %r", self._name, exc)
        if self._task is None and served != self._asked_at_served:
            self._asked_at_served = served
            self._task = asyncio.get_running_loop().create_task(self._timed_read())
        return out

    async def _timed_read(self) -> list[TransferSample]:
        return await asyncio.wait_for(self._read(), self.deadline_s)

    @property
    def reading(self) -> bool:
        return self._task is not None and not self._task.done()

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
