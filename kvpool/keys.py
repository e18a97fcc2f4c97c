"""Block keys: chained 128-bit digests over token ids, rooted in a namespace.

    key_{-1} = H("kvstack.ns.v1" ‖ model id ‖ layout fingerprint ‖ cache salt)
    key_i    = H(key_{i-1} ‖ uint32-LE token ids of block i)

A key therefore names a block *at its position after exactly these preceding tokens*: KV is position-bound,
and two prompts share key_i only if they share every token up to the end of block i. Only full blocks get keys.
Used verbatim by the router (ingress computes keys once per request) and by the vLLM connector; never hash text.
H is BLAKE2b with a 16-byte digest (hashlib, C speed).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NewType

import numpy as np

BlockKey = NewType("BlockKey", bytes)
KEY_BYTES = 16
_NS_TAG = b"kvstack.ns.v1"


@dataclass(frozen=True, slots=True)
class Namespace:
    """What makes KV bytes interchangeable: the same model, the same layout, the same tenant salt."""

    model_id: str
    layout_fingerprint: str
    cache_salt: str = ""

    def root(self) -> BlockKey:
        h = hashlib.blake2b(_NS_TAG, digest_size=KEY_BYTES)
        for part in (self.model_id, self.layout_fingerprint, self.cache_salt):
            data = part.encode()
            h.update(len(data).to_bytes(4, "little"))
            h.update(data)
        return BlockKey(h.digest())


def _token_bytes(token_ids: Sequence[int] | np.ndarray) -> bytes:
    arr = np.asarray(token_ids)
    if arr.size and (arr.min() < 0 or arr.max() >= 2**32):
        raise ValueError("token ids must be in [0, 2**32)")
    return arr.astype("<u4", copy=False).tobytes()


def chain_keys(
    parent: BlockKey, token_ids: Sequence[int] | np.ndarray, block_size: int, *, limit: int | None = None
) -> list[BlockKey]:
    """Keys of the full blocks of ``token_ids`` following ``parent`` (a namespace root or the previous block's key).

    ``limit`` stops after that many blocks. A trailing partial block has no key.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    raw = _token_bytes(token_ids)
    step = block_size * 4
    n_blocks = len(raw) // step
    if limit is not None:
        n_blocks = min(n_blocks, limit)
    keys: list[BlockKey] = []
    prev = bytes(parent)
    blake = hashlib.blake2b
    for i in range(n_blocks):
        prev = blake(prev + raw[i * step : (i + 1) * step], digest_size=KEY_BYTES).digest()
        keys.append(BlockKey(prev))
    return keys


def block_keys(namespace: Namespace, token_ids: Sequence[int] | np.ndarray, block_size: int) -> list[BlockKey]:
    """Keys of every full block of a prompt under ``namespace``."""
    return chain_keys(namespace.root(), token_ids, block_size)


def key_hex(key: BlockKey) -> str:
    """Short printable form for logs and metrics labels."""
    return bytes(key).hex()
