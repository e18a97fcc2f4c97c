"""vLLM's KV connector for the kvstack pool, one module per role (this package re-exports nothing).

vLLM loads the connector class ``KvPoolConnector`` from the module ``kvpool.connector.kv_connector``: that is the
``kv_connector_module_path`` (``config.CONNECTOR_MODULE``, the one place it is set; ``config.kv_transfer_config``
builds the whole ``KVTransferConfig``). Importing this package imports nothing (the config is importable without vLLM).

    config        ConnectorConfig (parsed once from kv_connector_extra_config), kv_transfer_config, ShardRef
    kv_connector  KvPoolConnector (vLLM's KVConnectorBase_V1: dispatches to the two roles), drain_transfer_records
    scheduler     the scheduler role: lookups, leases, releases, the per-step metadata
    worker        the worker role: layout check, transfer registration, loads, staging saves
    saver         the background saver: staged blocks written and committed off the forward path
    layout        the engine's KV cache tensors as pool blocks (geometry, per-group plans, state keys)
    meta          messages between the roles (and the transfer records for calibration)
    pool          the connector's handle on the pool shards (discovery, clients, parallel lookups)
    timing        what one request's pool calls cost (to the replica via kv_transfer_params; no vLLM import)
"""
