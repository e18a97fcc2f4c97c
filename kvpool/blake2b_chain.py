"""BLAKE2b-128 block-key chains in one numba call: the fast path of ``kvpool.keys.chain_keys``.

Contract: ``chain_digests(tokens, block_size, n_blocks, parent)`` returns an ``(n_blocks, 2)`` uint64 array whose row i,
as little-endian bytes, is

    key_i = BLAKE2b-128(key_{i-1} ‖ tokens[i * block_size : (i + 1) * block_size] as uint32-LE),  key_{-1} = parent

with BLAKE2b-128 the standard unkeyed RFC 7693 hash with a 16-byte digest, no salt, no personalisation: byte for byte
``hashlib.blake2b(data, digest_size=16).digest()``. ``tokens`` is a C-contiguous, aligned uint32 array holding at least
``n_blocks * block_size`` ids, ``parent`` a uint64 array of 2 words (the 16 parent bytes, little-endian), ``block_size``
and ``n_blocks`` are positive; none of this is checked here (the caller validates). Little-endian hosts only (the
caller checks ``sys.byteorder``). One compiled signature, readonly or writable arrays alike; it releases the GIL.

Only ``kvpool.keys`` uses it, and imports it lazily the first time a chain is long enough to beat hashlib: importing
numba costs ~0.2 s and the import compiles the kernel (~1.5 s) or loads it from numba's disk cache (``cache=True``: the
``__pycache__`` next to this file, else the user cache dir, or ``NUMBA_CACHE_DIR``). Where no cache location is
writable it compiles in memory, once per process, and logs a warning. Tests: ``tests/unit/test_keys.py``.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
from numba import njit, types

log = logging.getLogger(__name__)

_U64 = np.uint64
_IV0, _IV1 = _U64(0x6A09E667F3BCC908), _U64(0xBB67AE8584CAA73B)
_IV2, _IV3 = _U64(0x3C6EF372FE94F82B), _U64(0xA54FF53A5F1D36F1)
_IV4, _IV5 = _U64(0x510E527FADE682D1), _U64(0x9B05688C2B3E6C1F)
_IV6, _IV7 = _U64(0x1F83D9ABFB41BD6B), _U64(0x5BE0CD19137E2179)
_H0 = _IV0 ^ _U64(0x01010000 | 16)  # IV0 ^ parameter block word 0: digest 16 bytes, no key, fanout 1, depth 1
_ALL_ONES = _U64(0xFFFFFFFFFFFFFFFF)
# uint64 shift counts: numba would turn uint64 <op> int64 into float64.
_S1, _S16, _S24, _S32, _S40, _S48, _S63 = _U64(1), _U64(16), _U64(24), _U64(32), _U64(40), _U64(48), _U64(63)

# The one compiled signature: (tokens, block_size, n_blocks, parent) -> key words. Readonly array types accept
# writable arrays too, so neither kind triggers a second compilation.
SIGNATURE = types.uint64[:, ::1](
    types.Array(types.uint32, 1, "C", readonly=True),
    types.intp,
    types.intp,
    types.Array(types.uint64, 1, "C", readonly=True),
)


def _mix(a: int, b: int, c: int, d: int, x: int, y: int) -> tuple[int, int, int, int]:
    """The mixing function G (RFC 7693 §3.1) on uint64 words; wraps mod 2**64 like the C code."""
    a = a + b + x
    d ^= a
    d = (d >> _S32) | (d << _S32)
    c = c + d
    b ^= c
    b = (b >> _S24) | (b << _S40)
    a = a + b + y
    d ^= a
    d = (d >> _S16) | (d << _S48)
    c = c + d
    b ^= c
    b = (b >> _S63) | (b << _S1)
    return a, b, c, d


def _compress(
    h0: int, h1: int, h2: int, h3: int, h4: int, h5: int, h6: int, h7: int, w: np.ndarray, o: int, t: int, last: bool
) -> tuple[int, int, int, int, int, int, int, int]:
    """The compression function F (RFC 7693 §3.2) of state h0..h7 over the 16 words ``w[o : o + 16]``, byte count
    ``t``; unrolled over the 12 rounds (message schedule SIGMA[r % 10]) so that every word stays in a register."""
    m0, m1, m2, m3, m4, m5, m6, m7 = w[o], w[o + 1], w[o + 2], w[o + 3], w[o + 4], w[o + 5], w[o + 6], w[o + 7]
    m8, m9, m10, m11 = w[o + 8], w[o + 9], w[o + 10], w[o + 11]
    m12, m13, m14, m15 = w[o + 12], w[o + 13], w[o + 14], w[o + 15]
    v0, v1, v2, v3, v4, v5, v6, v7 = h0, h1, h2, h3, h4, h5, h6, h7
    v8, v9, v10, v11, v12, v13, v14, v15 = _IV0, _IV1, _IV2, _IV3, _IV4 ^ t, _IV5, _IV6, _IV7  # t < 2**64: t_hi = 0
    if last:
        v14 = v14 ^ _ALL_ONES
    # round 0
    v0, v4, v8, v12 = _mix_jit(v0, v4, v8, v12, m0, m1)
    v1, v5, v9, v13 = _mix_jit(v1, v5, v9, v13, m2, m3)
    v2, v6, v10, v14 = _mix_jit(v2, v6, v10, v14, m4, m5)
    v3, v7, v11, v15 = _mix_jit(v3, v7, v11, v15, m6, m7)
    v0, v5, v10, v15 = _mix_jit(v0, v5, v10, v15, m8, m9)
    v1, v6, v11, v12 = _mix_jit(v1, v6, v11, v12, m10, m11)
    v2, v7, v8, v13 = _mix_jit(v2, v7, v8, v13, m12, m13)
    v3, v4, v9, v14 = _mix_jit(v3, v4, v9, v14, m14, m15)
    # round 1
    v0, v4, v8, v12 = _mix_jit(v0, v4, v8, v12, m14, m10)
    v1, v5, v9, v13 = _mix_jit(v1, v5, v9, v13, m4, m8)
    v2, v6, v10, v14 = _mix_jit(v2, v6, v10, v14, m9, m15)
    v3, v7, v11, v15 = _mix_jit(v3, v7, v11, v15, m13, m6)
    v0, v5, v10, v15 = _mix_jit(v0, v5, v10, v15, m1, m12)
    v1, v6, v11, v12 = _mix_jit(v1, v6, v11, v12, m0, m2)
    v2, v7, v8, v13 = _mix_jit(v2, v7, v8, v13, m11, m7)
    v3, v4, v9, v14 = _mix_jit(v3, v4, v9, v14, m5, m3)
    # round 2
    v0, v4, v8, v12 = _mix_jit(v0, v4, v8, v12, m11, m8)
    v1, v5, v9, v13 = _mix_jit(v1, v5, v9, v13, m12, m0)
    v2, v6, v10, v14 = _mix_jit(v2, v6, v10, v14, m5, m2)
    v3, v7, v11, v15 = _mix_jit(v3, v7, v11, v15, m15, m13)
    v0, v5, v10, v15 = _mix_jit(v0, v5, v10, v15, m10, m14)
    v1, v6, v11, v12 = _mix_jit(v1, v6, v11, v12, m3, m6)
    v2, v7, v8, v13 = _mix_jit(v2, v7, v8, v13, m7, m1)
    v3, v4, v9, v14 = _mix_jit(v3, v4, v9, v14, m9, m4)
    # round 3
    v0, v4, v8, v12 = _mix_jit(v0, v4, v8, v12, m7, m9)
    v1, v5, v9, v13 = _mix_jit(v1, v5, v9, v13, m3, m1)
    v2, v6, v10, v14 = _mix_jit(v2, v6, v10, v14, m13, m12)
    v3, v7, v11, v15 = _mix_jit(v3, v7, v11, v15, m11, m14)
    v0, v5, v10, v15 = _mix_jit(v0, v5, v10, v15, m2, m6)
    v1, v6, v11, v12 = _mix_jit(v1, v6, v11, v12, m5, m10)
    v2, v7, v8, v13 = _mix_jit(v2, v7, v8, v13, m4, m0)
    v3, v4, v9, v14 = _mix_jit(v3, v4, v9, v14, m15, m8)
    # round 4
    v0, v4, v8, v12 = _mix_jit(v0, v4, v8, v12, m9, m0)
    v1, v5, v9, v13 = _mix_jit(v1, v5, v9, v13, m5, m7)
    v2, v6, v10, v14 = _mix_jit(v2, v6, v10, v14, m2, m4)
    v3, v7, v11, v15 = _mix_jit(v3, v7, v11, v15, m10, m15)
    v0, v5, v10, v15 = _mix_jit(v0, v5, v10, v15, m14, m1)
    v1, v6, v11, v12 = _mix_jit(v1, v6, v11, v12, m11, m12)
    v2, v7, v8, v13 = _mix_jit(v2, v7, v8, v13, m6, m8)
    v3, v4, v9, v14 = _mix_jit(v3, v4, v9, v14, m3, m13)
    # round 5
    v0, v4, v8, v12 = _mix_jit(v0, v4, v8, v12, m2, m12)
    v1, v5, v9, v13 = _mix_jit(v1, v5, v9, v13, m6, m10)
    v2, v6, v10, v14 = _mix_jit(v2, v6, v10, v14, m0, m11)
    v3, v7, v11, v15 = _mix_jit(v3, v7, v11, v15, m8, m3)
    v0, v5, v10, v15 = _mix_jit(v0, v5, v10, v15, m4, m13)
    v1, v6, v11, v12 = _mix_jit(v1, v6, v11, v12, m7, m5)
    v2, v7, v8, v13 = _mix_jit(v2, v7, v8, v13, m15, m14)
    v3, v4, v9, v14 = _mix_jit(v3, v4, v9, v14, m1, m9)
    # round 6
    v0, v4, v8, v12 = _mix_jit(v0, v4, v8, v12, m12, m5)
    v1, v5, v9, v13 = _mix_jit(v1, v5, v9, v13, m1, m15)
    v2, v6, v10, v14 = _mix_jit(v2, v6, v10, v14, m14, m13)
    v3, v7, v11, v15 = _mix_jit(v3, v7, v11, v15, m4, m10)
    v0, v5, v10, v15 = _mix_jit(v0, v5, v10, v15, m0, m7)
    v1, v6, v11, v12 = _mix_jit(v1, v6, v11, v12, m6, m3)
    v2, v7, v8, v13 = _mix_jit(v2, v7, v8, v13, m9, m2)
    v3, v4, v9, v14 = _mix_jit(v3, v4, v9, v14, m8, m11)
    # round 7
    v0, v4, v8, v12 = _mix_jit(v0, v4, v8, v12, m13, m11)
    v1, v5, v9, v13 = _mix_jit(v1, v5, v9, v13, m7, m14)
    v2, v6, v10, v14 = _mix_jit(v2, v6, v10, v14, m12, m1)
    v3, v7, v11, v15 = _mix_jit(v3, v7, v11, v15, m3, m9)
    v0, v5, v10, v15 = _mix_jit(v0, v5, v10, v15, m5, m0)
    v1, v6, v11, v12 = _mix_jit(v1, v6, v11, v12, m15, m4)
    v2, v7, v8, v13 = _mix_jit(v2, v7, v8, v13, m8, m6)
    v3, v4, v9, v14 = _mix_jit(v3, v4, v9, v14, m2, m10)
    # round 8
    v0, v4, v8, v12 = _mix_jit(v0, v4, v8, v12, m6, m15)
    v1, v5, v9, v13 = _mix_jit(v1, v5, v9, v13, m14, m9)
    v2, v6, v10, v14 = _mix_jit(v2, v6, v10, v14, m11, m3)
    v3, v7, v11, v15 = _mix_jit(v3, v7, v11, v15, m0, m8)
    v0, v5, v10, v15 = _mix_jit(v0, v5, v10, v15, m12, m2)
    v1, v6, v11, v12 = _mix_jit(v1, v6, v11, v12, m13, m7)
    v2, v7, v8, v13 = _mix_jit(v2, v7, v8, v13, m1, m4)
    v3, v4, v9, v14 = _mix_jit(v3, v4, v9, v14, m10, m5)
    # round 9
    v0, v4, v8, v12 = _mix_jit(v0, v4, v8, v12, m10, m2)
    v1, v5, v9, v13 = _mix_jit(v1, v5, v9, v13, m8, m4)
    v2, v6, v10, v14 = _mix_jit(v2, v6, v10, v14, m7, m6)
    v3, v7, v11, v15 = _mix_jit(v3, v7, v11, v15, m1, m5)
    v0, v5, v10, v15 = _mix_jit(v0, v5, v10, v15, m15, m11)
    v1, v6, v11, v12 = _mix_jit(v1, v6, v11, v12, m9, m14)
    v2, v7, v8, v13 = _mix_jit(v2, v7, v8, v13, m3, m12)
    v3, v4, v9, v14 = _mix_jit(v3, v4, v9, v14, m13, m0)
    # round 10
    v0, v4, v8, v12 = _mix_jit(v0, v4, v8, v12, m0, m1)
    v1, v5, v9, v13 = _mix_jit(v1, v5, v9, v13, m2, m3)
    v2, v6, v10, v14 = _mix_jit(v2, v6, v10, v14, m4, m5)
    v3, v7, v11, v15 = _mix_jit(v3, v7, v11, v15, m6, m7)
    v0, v5, v10, v15 = _mix_jit(v0, v5, v10, v15, m8, m9)
    v1, v6, v11, v12 = _mix_jit(v1, v6, v11, v12, m10, m11)
    v2, v7, v8, v13 = _mix_jit(v2, v7, v8, v13, m12, m13)
    v3, v4, v9, v14 = _mix_jit(v3, v4, v9, v14, m14, m15)
    # round 11
    v0, v4, v8, v12 = _mix_jit(v0, v4, v8, v12, m14, m10)
    v1, v5, v9, v13 = _mix_jit(v1, v5, v9, v13, m4, m8)
    v2, v6, v10, v14 = _mix_jit(v2, v6, v10, v14, m9, m15)
    v3, v7, v11, v15 = _mix_jit(v3, v7, v11, v15, m13, m6)
    v0, v5, v10, v15 = _mix_jit(v0, v5, v10, v15, m1, m12)
    v1, v6, v11, v12 = _mix_jit(v1, v6, v11, v12, m0, m2)
    v2, v7, v8, v13 = _mix_jit(v2, v7, v8, v13, m11, m7)
    v3, v4, v9, v14 = _mix_jit(v3, v4, v9, v14, m5, m3)

    return (
        h0 ^ v0 ^ v8, h1 ^ v1 ^ v9, h2 ^ v2 ^ v10, h3 ^ v3 ^ v11,
        h4 ^ v4 ^ v12, h5 ^ v5 ^ v13, h6 ^ v6 ^ v14, h7 ^ v7 ^ v15,
    )


def _chain(tokens: np.ndarray, block_size: int, n_blocks: int, parent: np.ndarray) -> np.ndarray:
    """The key words of the chain (see the module docstring)."""
    msg_bytes = 16 + 4 * block_size
    n_chunks = (msg_bytes + 127) // 128
    w = np.zeros(n_chunks * 16, np.uint64)  # one message, zero-padded: parent (2 words), then the ids in pairs
    out = np.empty((n_blocks, 2), np.uint64)
    k0, k1 = parent[0], parent[1]
    pairs = block_size // 2
    odd = block_size % 2 == 1
    for i in range(n_blocks):
        w[0] = k0
        w[1] = k1
        base = i * block_size
        for j in range(pairs):
            w[2 + j] = _U64(tokens[base + 2 * j]) | (_U64(tokens[base + 2 * j + 1]) << _S32)
        if odd:
            w[2 + pairs] = _U64(tokens[base + block_size - 1])
        h0, h1, h2, h3, h4, h5, h6, h7 = _H0, _IV1, _IV2, _IV3, _IV4, _IV5, _IV6, _IV7
        for c in range(n_chunks):
            last = c == n_chunks - 1
            t = _U64(msg_bytes) if last else _U64((c + 1) * 128)
            h0, h1, h2, h3, h4, h5, h6, h7 = _compress_jit(h0, h1, h2, h3, h4, h5, h6, h7, w, c * 16, t, last)
        out[i, 0] = h0
        out[i, 1] = h1
        k0, k1 = h0, h1
    return out


_mix_jit: Any = None
_compress_jit: Any = None


def _build(cache: bool) -> Any:
    """Compile (or load from numba's cache) the kernel for ``SIGNATURE``; the helpers compile into it, inlined."""
    global _mix_jit, _compress_jit
    _mix_jit = njit(cache=cache, nogil=True)(_mix)
    _compress_jit = njit(cache=cache, nogil=True)(_compress)
    return njit(SIGNATURE, cache=cache, nogil=True)(_chain)


try:
    chain_digests = _build(cache=True)
    CACHED = True
except (RuntimeError, OSError) as exc:  # no writable cache location ("no locator available"), or saving to it failed
    log.warning("numba disk cache unusable (%s); compiling the BLAKE2b kernel in memory for this process", exc)
    chain_digests = _build(cache=False)
    CACHED = False
