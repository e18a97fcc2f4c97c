"""Per-block checksums: the one function writers and shards both use.

Who calls what: a writer (the vLLM connector's saver through ``slot_checksum``, tests, the transfer bench)
computes ``block_checksum`` over each block it writes into a reserved shard slot and sends the values with
``commit``; the connector's loads check what they read the same way; the block store recomputes them over its
arena bytes at commit and over the bytes read back from SSD, and treats any mismatch as a miss, never as data.

Algorithm: XXH3-64 (``xxhash`` package). Measured on this machine (2 shared cores, 64 KiB / 1 MiB blocks):
xxh3_64 ≈ 17 / 10 GB/s, crc32c ≈ 14 / 9.5, zlib.crc32 ≈ 1.9 / 2.2-3.4, blake3 ≈ 2.0 / 2.2, blake2b ≈ 0.5 / 0.5.
Detection of accidental corruption (torn writes, bit rot, wrong slot) is the goal, not adversaries, so the fastest
64-bit hash wins. ``CHECKSUM_ALGO`` travels in commit requests so a writer with another algorithm is refused.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

CHECKSUM_ALGO = "xxh3_64"


def block_checksum(data: bytes | bytearray | memoryview) -> int:
    """XXH3-64 of ``data`` as an unsigned int (fits msgpack uint64)."""
    return xxhash.xxh3_64_intdigest(data)


def slot_checksum(pieces: Sequence[np.ndarray], slot_bytes: int) -> int:
    """``block_checksum`` of a pool slot that holds ``pieces`` (uint8 arrays, in order) followed by zeros up to
    ``slot_bytes``, computed piece by piece without building the slot (the connector's loads and saves)."""
    h = xxhash.xxh3_64()
    payload = 0
    for piece in pieces:
        h.update(piece)
        payload += piece.nbytes
    if slot_bytes > payload:
        h.update(bytes(slot_bytes - payload))
    return h.intdigest()
