"""Fakes of the neighbours of what a test is about, one module per neighbour. Each implements (or subclasses) the
real interface it stands in for, and never stands in for the thing under test.

- ``tests.fakes.router``: real router inputs (hardware, tier map, block keys, replica states, cluster snapshots)
  built on the reference specs in configs/, and a manual clock — for policy, index and calibration tests.
- ``tests.fakes.serve``: Ray Serve's ``RunningReplica`` without a live actor — for ``DecisionRequestRouter``.
- ``tests.fakes.openai_server``: an OpenAI-compatible HTTP server — for the load generator.
- ``tests.fakes.transfer``: ``TransferEndpoint`` over this process's memory (``LoopbackEndpoint``).
- ``tests.fakes.shard``: a source shard (``kvpool.shard.pull.PullSource``) over a real ``BlockStore`` — for the pull.
"""
