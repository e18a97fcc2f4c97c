"""KV block transfer between processes: one interface (``base``), NIXL and TCP implementations, and shared memory
between processes of one host (``shm``)."""

from kvpool.transfer.base import (
    TRANSFER_WIRE_VERSION,
    AgentMetadata,
    BlockOp,
    RegionDesc,
    StaleMetadataError,
    TransferEndpoint,
    TransferResult,
    decode_metadata,
    encode_metadata,
)

__all__ = [
    "TRANSFER_WIRE_VERSION",
    "AgentMetadata",
    "BlockOp",
    "RegionDesc",
    "StaleMetadataError",
    "TransferEndpoint",
    "TransferResult",
    "decode_metadata",
    "encode_metadata",
]


def make_endpoint(backend: str, agent_name: str, *, options: object = None, metrics: object = None
                  ) -> TransferEndpoint:
    """Factory used by shards and clients; imports the backend lazily (nixl is optional at import time).
    ``options`` is the backend's typed options struct (``NixlOptions`` / ``TcpOptions``; None: defaults)."""
    if backend == "nixl":
        from kvpool.transfer.nixl import NixlEndpoint

        return NixlEndpoint(agent_name, options=options, metrics=metrics)  # type: ignore[arg-type]
    if backend == "tcp":
        from kvpool.transfer.tcp import TcpEndpoint

        return TcpEndpoint(agent_name, options=options, metrics=metrics)  # type: ignore[arg-type]
    if backend == "shm":
        from kvpool.transfer.shm import ShmEndpoint

        return ShmEndpoint(agent_name, metrics=metrics)  # type: ignore[arg-type]
    raise ValueError(f"unknown transfer backend {backend!r}; known: nixl, tcp, shm")
