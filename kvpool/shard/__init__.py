"""The pool shard, one module per concern (this package re-exports nothing; import the module you need).

Import order (each module imports only the ones above it)::

    wire       every request / reply struct, ShardConfig, the errors, encode / decode (wire-version check), check_pull
    client     ShardClient, AsyncShardClient, ShardEventSource, ShardHandle, lookup_many: the only code that
               encodes requests
    registry   naming and discovery of the named shard actors: shard_actor_name, list_shards, find_shard
    pull       the one transfer a shard initiates: Puller, its source over a ShardClient
    actor      PoolShard / PoolShardActor, the Ray actor wrapping a kvpool.store.BlockStore
    placement  build_pool (the one way to build a pool for a cluster), stop_shards, alive_nodes
"""
