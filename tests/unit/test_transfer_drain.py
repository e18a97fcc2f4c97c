"""TransferDrain: the replica's load report never waits for the engine's answer (a frozen engine here: a read that
does not return until released); the samples of a read go with the first report after it answers; the engine is
asked again only after new requests finished, one read at a time; a read past its deadline or failing loses its
samples and nothing else."""

from __future__ import annotations

import asyncio

from deployments.transfer_drain import TransferDrain
from router.hub import TransferSample

SAMPLE = TransferSample("shard-a", False, 1_000_000, 0.01)


def test_a_report_does_not_wait_for_a_frozen_engine_and_gets_the_samples_once_it_answers() -> None:
    async def scenario() -> None:
        release = asyncio.Event()
        calls = 0

        async def read() -> list[TransferSample]:
            nonlocal calls
            calls += 1
            await release.wait()  # the engine is in the middle of a long step
            return [SAMPLE]

        drain = TransferDrain(read, deadline_s=30.0)
        assert drain.collect(served=0) == [] and calls == 0  # nothing finished yet: nothing to ask
        assert drain.collect(served=1) == []  # asks, and returns at once
        await asyncio.sleep(0.01)
        assert calls == 1 and drain.reading
        assert drain.collect(served=3) == [] and calls == 1  # one read at a time
        release.set()
        await asyncio.sleep(0.01)
        assert drain.collect(served=3) == [SAMPLE]  # the next report carries them; served moved: asks again
        await asyncio.sleep(0.01)
        assert calls == 2 and drain.collect(served=3) == [SAMPLE]
        assert drain.collect(served=3) == [] and not drain.reading  # nothing new finished: not asked
        assert calls == 2

    asyncio.run(scenario())


def test_a_read_past_its_deadline_or_failing_loses_its_samples_only() -> None:
    async def scenario() -> None:
        frozen = asyncio.Event()
        fail = True

        async def read() -> list[TransferSample]:
            if fail:
                raise RuntimeError("engine dead")
            await frozen.wait()
            return [SAMPLE]

        drain = TransferDrain(read, deadline_s=0.05)
        drain.collect(served=1)
        await asyncio.sleep(0.01)
        assert drain.collect(served=1) == []  # failed: logged, nothing sent
        fail = False
        drain.collect(served=2)
        await asyncio.sleep(0.1)
        assert drain.collect(served=2) == [] and not drain.reading  # past its deadline: cancelled, nothing sent
        drain.collect(served=3)
        assert drain.reading
        drain.close()
        await asyncio.sleep(0)
        assert not drain.reading

    asyncio.run(scenario())
