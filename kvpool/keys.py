"""Block keys: chained 128-bit digests over token ids, rooted in a namespace.

    key_{-1} = H("kvstack.ns.v1" ‖ model id ‖ layout fingerprint ‖ cache salt)
    cache salt = request_salt(engine's configured salt, tenant, the request's own cache_salt)
    key_i    = H(key_{i-1} ‖ uint32-LE token ids of block i)

A key therefore names a block *at its position after exactly these preceding tokens*: KV is position-bound,
and two prompts share key_i only if they share every token up to the end of block i. Only full blocks get keys.
Used verbatim by the router (ingress computes keys once per request) and by the vLLM connector; never hash text.
The cache salt is composed once per request, at the ingress (``request_salt``), and travels with the request: the
router's keys, the engine's HBM prefix cache (vLLM's ``cache_salt``), the replica's HBM reports, the connector and
the pool all key that request's blocks under the same salt, so one tenant's prefix is never another's hit.
H is BLAKE2b with a 16-byte digest (unkeyed, RFC 7693): a cryptographic hash, because prompts come from the network
and a crafted collision would hand one tenant's KV blocks to another prompt.

Tensor parallelism: each of an engine's TP ranks holds other heads of the same block, so each rank stores its part
under its own key, ``rank_key(key_i, r, W)`` = key_i for rank 0 (the key the router computes and indexes) and
H("kvstack.rank.v1" ‖ key_i ‖ r ‖ W) for the others; W is also in the layout fingerprint (``model_digest``), so a
TP engine's rank-0 keys never name a single-rank engine's blocks. ``rank_interleaved`` lays an engine's keys out
block-major, rank-minor (block i of ranks 0..W-1, then block i+1): the pool's longest-prefix calls (lookup,
lease, pull) over that list count only blocks every rank holds (prefix // W).

Two implementations give identical bytes: a loop of ``hashlib.blake2b`` calls, and ``kvpool.blake2b_chain``, one
numba call for the whole chain (~3-4x faster on long prompts: the loop's ~0.7 µs per block of interpreter overhead
goes; the compression itself runs at hashlib's C speed).

The kernel is opt-in per process: ``enable_jit()`` (the router's ingress calls it at start; the import costs ~0.3 s
with numba's disk cache warm, ~1.7 s compiling). ``use_jit`` is the process's one numba switch: the cost model's
compiled SPLIT solvers (``router.policies.pricing``) follow it too. Never in a process that builds a vLLM engine:
vLLM's CPU build scans every loaded module's globals when a worker starts (``register_triton_kernel_overrides``) and
fails on llvmlite's function wrappers once numba is loaded — so the connector, which runs inside the engine, and
in-process engines in tests and benches hash with hashlib. hashlib also serves chains shorter than
``JIT_MIN_BLOCKS``, parents that are not 16 bytes, big-endian hosts, processes where the kernel cannot be imported
(numba missing), ``KVSTACK_KEYS_JIT=0`` in the environment, and any call where the kernel raises (logged once).
"""

from __future__ import annotations

import array
import hashlib
import logging
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NewType

import numpy as np

log = logging.getLogger(__name__)

BlockKey = NewType("BlockKey", bytes)
KEY_BYTES = 16
_NS_TAG = b"kvstack.ns.v1"

# Chains shorter than this use hashlib: the kernel's fixed cost per call (~2 µs) outweighs the ~0.5 µs per block the
# Python loop costs until ~4 blocks for an array, ~6 for a list (measured, block sizes 16 and 128).
JIT_MIN_BLOCKS = 6
_LITTLE = sys.byteorder == "little"
_JIT_ALLOWED = os.environ.get("KVSTACK_KEYS_JIT", "1") != "0" and _LITTLE  # the kernel assumes little-endian
use_jit: bool = False  # enable_jit() turns it on (see the module docstring)
_kernel: Callable[[np.ndarray, int, int, np.ndarray], np.ndarray] | None = None
_kernel_failed = False  # the import failed: hashlib for the rest of the process
_kernel_errors = 0  # calls where the kernel raised (each fell back to hashlib); logged once
_U4 = np.dtype("<u4")


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


_SALT_TAG = b"kvstack.salt.v1"
SALT_PREFIX = "kvs1-"


def request_salt(engine_salt: str = "", tenant: str = "", client_salt: str | None = None) -> str:
    """The one cache salt of a request: the engine's configured salt alone when the request has no tenant and no
    salt of its own (so untenanted keys do not change), else a digest of all three, length-prefixed (a tenant named
    ``a`` with salt ``bc`` is not tenant ``ab`` with salt ``c``). The digest form is 37 characters of ``[0-9a-z-]``,
    which vLLM accepts as a ``cache_salt`` and which names no tenant in the engine's logs."""
    if not tenant and not client_salt:
        return engine_salt
    h = hashlib.blake2b(_SALT_TAG, digest_size=KEY_BYTES)
    for part in (engine_salt, tenant, client_salt or ""):
        data = part.encode()
        h.update(len(data).to_bytes(4, "little"))
        h.update(data)
    return SALT_PREFIX + h.hexdigest()


def _token_ids(token_ids: Sequence[int] | np.ndarray) -> array.array[int] | np.ndarray:
    """The token ids as 4-byte unsigned ints: an ``array.array("I")`` (native byte order) for a Python sequence, else
    a 1-D C-contiguous ``<u4`` array. ValueError unless all are integers in [0, 2**32).

    ``array.array("I", list)`` is the fastest conversion of a list measured (~6-8 ns per id; ``np.array(list,
    dtype=np.uint32)`` and ``np.fromiter`` are 2-4x slower) and refuses floats and strings where numpy would convert
    them; the kernel then reads it zero-copy through ``np.frombuffer``. An array is copied only if its dtype, shape
    or layout is not already that."""
    if not isinstance(token_ids, np.ndarray):
        try:
            buf = array.array("I", token_ids)
        except (OverflowError, TypeError):
            raise ValueError("token ids must be integers in [0, 2**32)") from None
        if buf.itemsize == 4:
            return buf
        token_ids = np.asarray(buf)  # a platform whose C unsigned int is not 4 bytes
    arr = np.asarray(token_ids)
    if arr.dtype != _U4:
        fits = arr.dtype.kind in "ub" and arr.dtype.itemsize <= 4
        if arr.size and not fits and (arr.min() < 0 or arr.max() >= 2**32):
            raise ValueError("token ids must be in [0, 2**32)")
        arr = arr.astype(_U4)
    if arr.ndim != 1 or not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr).reshape(-1)
    return arr


def _le_bytes(toks: array.array[int] | np.ndarray) -> bytes:
    """The uint32-LE bytes of ``_token_ids``' result (an ``array.array`` holds native byte order)."""
    if isinstance(toks, array.array) and not _LITTLE:
        toks = array.array("I", toks)
        toks.byteswap()
    return toks.tobytes()


def _load_kernel() -> Callable[[np.ndarray, int, int, np.ndarray], np.ndarray] | None:
    """Import (and so compile or load from cache) the numba kernel once; None where that is impossible."""
    global _kernel, _kernel_failed
    if _kernel is None and not _kernel_failed:
        try:
            from kvpool.blake2b_chain import chain_digests
        except Exception as exc:  # numba missing, or refusing this numpy, or failing to compile
            _kernel_failed = True
            log.warning("kvpool.keys: numba BLAKE2b kernel unavailable (%r); hashing with hashlib", exc)
        else:
            _kernel = chain_digests
    return _kernel


def enable_jit() -> bool:
    """Hash long chains with the numba kernel in this process from now on, loading it now (process start) rather
    than on the first long prompt; True if it is in use. Not in a process that builds a vLLM engine (module
    docstring)."""
    global use_jit
    use_jit = _JIT_ALLOWED
    return warm_up()


def warm_up() -> bool:
    """Load the fast kernel now if this process hashes with it; True if it is in use."""
    return use_jit and _load_kernel() is not None


def _chain_hashlib(parent: bytes, raw: bytes, step: int, n_blocks: int) -> list[BlockKey]:
    """The reference path: one ``hashlib.blake2b`` call per block of ``step`` bytes."""
    keys: list[BlockKey] = []
    append = keys.append
    prev = parent
    blake = hashlib.blake2b
    for start in range(0, n_blocks * step, step):
        prev = blake(prev + raw[start : start + step], digest_size=KEY_BYTES).digest()
        append(prev)  # type: ignore[arg-type]
    return keys


def chain_keys(
    parent: BlockKey, token_ids: Sequence[int] | np.ndarray, block_size: int, *, limit: int | None = None
) -> list[BlockKey]:
    """Keys of the full blocks of ``token_ids`` following ``parent`` (a namespace root or the previous block's key).

    ``limit`` stops after that many blocks. A trailing partial block has no key.
    """
    global _kernel_errors
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    toks = _token_ids(token_ids)
    n_blocks = len(toks) // block_size
    if limit is not None:
        n_blocks = min(n_blocks, limit)
    if n_blocks <= 0:
        return []
    prev = bytes(parent)
    if use_jit and n_blocks >= JIT_MIN_BLOCKS and len(prev) == KEY_BYTES:
        kernel = _kernel or _load_kernel()
        if kernel is not None:
            arr = np.frombuffer(toks, dtype=np.uint32) if isinstance(toks, array.array) else toks  # zero-copy
            parent_words = np.frombuffer(prev, dtype=np.uint64)
            if not arr.flags.aligned:  # the kernel's one signature takes aligned arrays
                arr = arr.copy()
            if not parent_words.flags.aligned:
                parent_words = parent_words.copy()
            try:
                words = kernel(arr, block_size, n_blocks, parent_words)
            except Exception:  # never expected (the tests check every input kind); hashlib gives the same keys
                _kernel_errors += 1
                if _kernel_errors == 1:
                    log.exception("kvpool.keys: numba BLAKE2b kernel failed; this call (and any like it) uses hashlib")
            else:
                return words.view("V16").reshape(-1).tolist()  # one 16-byte ``bytes`` per row, in C
    return _chain_hashlib(prev, _le_bytes(toks), block_size * 4, n_blocks)


def block_keys(namespace: Namespace, token_ids: Sequence[int] | np.ndarray, block_size: int) -> list[BlockKey]:
    """Keys of every full block of a prompt under ``namespace``."""
    return chain_keys(namespace.root(), token_ids, block_size)


_RANK_TAG = b"kvstack.rank.v1"


def rank_key(key: bytes, rank: int, world: int) -> BlockKey:
    """The key rank ``rank`` of a ``world``-rank tensor-parallel engine stores block ``key`` under (module
    docstring): the key itself for rank 0 and for single-rank engines."""
    if not 0 <= rank < max(world, 1):
        raise ValueError(f"rank {rank} outside a world of {world}")
    if rank == 0:
        return BlockKey(bytes(key))
    h = hashlib.blake2b(_RANK_TAG, digest_size=KEY_BYTES)
    h.update(bytes(key))
    h.update(rank.to_bytes(4, "little"))
    h.update(world.to_bytes(4, "little"))
    return BlockKey(h.digest())


def rank_interleaved(keys: Sequence[bytes], world: int) -> list[BlockKey]:
    """Every rank's key of every block, block-major (``[k0 r0, k0 r1, …, k1 r0, …]``); ``keys`` unchanged (as
    ``BlockKey``s) for a single-rank engine."""
    if world <= 1:
        return [BlockKey(bytes(k)) for k in keys]
    return [rank_key(k, r, world) for k in keys for r in range(world)]


def key_hex(key: BlockKey) -> str:
    """Short printable form for logs and metrics labels."""
    return bytes(key).hex()
