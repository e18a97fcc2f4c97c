"""KV layouts: what the bytes of one KV block mean, per layer group, and a stable fingerprint of all of it.

Layout mistakes fail silently (wrong tokens, no error), so every byte the pool stores or moves is tagged with the
fingerprint of the layout that produced it, and a fingerprint mismatch is a miss, never data.

Who calls what:
- The vLLM connector (``kvpool.connector.worker``, ``register_kv_caches``) derives a ``KvLayout`` from
  vLLM's KV cache config and the registered tensors, using the plain-value constructors here (this module never
  imports vllm or torch), then passes ``KvLayout.fingerprint`` to the block-key namespace (``kvpool.keys.Namespace``)
  and to every pool commit / lookup / lease.
- The pool shard stores the fingerprint per entry (``kvpool.store``); it never interprets the layout itself.
- The router reads ``KIND_REGISTRY`` to know which layer groups a prefix fetch must cover.

Kinds (``KIND_REGISTRY``) and how each is reused across requests:
- ``full_attention``: per block (block i is valid after exactly the tokens of blocks 0..i).
- ``mla``: per block (the compressed latent KV behaves like full attention).
- ``sliding_window``: NOT offloaded for now. A block is only useful while inside the window of the request being
  served, so reuse would need per-request window bookkeeping; until that exists the pool refuses to store it and
  a model whose only reusable groups are sliding-window gets no pool reuse (recompute).
- ``linear_state`` and ``mamba``: a constant-size state snapshot that is valid only at a block boundary; a prefix
  is reusable only up to a boundary for which both the full-attention blocks and the state snapshot exist.
- ``cross_attention``, ``encoder``: no reuse semantics across requests (they depend on per-request encoder
  input); never offloaded.
A kind not in the registry raises ``UnknownLayoutKindError`` naming it and the known kinds: a refusal, never a
guess. Likewise an unknown dtype raises ``UnknownDTypeError``.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Sequence

import msgspec

LAYOUT_VERSION = 1
FINGERPRINT_BYTES = 16


class Reuse(enum.Enum):
    """How a layer group's KV can be reused by a later request."""

    PER_BLOCK = "per_block"  # every full block, keyed by the chained block key
    BOUNDARY_SNAPSHOT = "boundary_snapshot"  # a state snapshot, valid only at a block boundary
    NEVER = "never"  # no reuse semantics across requests: never offloaded


class KindInfo(msgspec.Struct, frozen=True):
    reuse: Reuse
    offloaded: bool
    why: str


KIND_REGISTRY: dict[str, KindInfo] = {
    "full_attention": KindInfo(Reuse.PER_BLOCK, True, "KV per block, valid after exactly the preceding tokens"),
    "mla": KindInfo(Reuse.PER_BLOCK, True, "compressed latent KV per block, like full attention"),
    "sliding_window": KindInfo(
        Reuse.PER_BLOCK, False, "only the window is live; not offloaded until per-request window bookkeeping exists"
    ),
    "linear_state": KindInfo(Reuse.BOUNDARY_SNAPSHOT, True, "recurrent state snapshot valid only at a block boundary"),
    "mamba": KindInfo(Reuse.BOUNDARY_SNAPSHOT, True, "SSM state snapshot valid only at a block boundary"),
    "cross_attention": KindInfo(Reuse.NEVER, False, "depends on per-request encoder input"),
    "encoder": KindInfo(Reuse.NEVER, False, "encoder outputs are per request"),
}

# Canonical dtype names (torch spelling without the "torch." prefix) and their element sizes.
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,
    "int8": 1,
}
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp8": "float8_e4m3fn"}


class UnknownLayoutKindError(ValueError):
    """A layer-group kind the project does not know how to reuse: refuse to start rather than guess."""

    def __init__(self, kind: str) -> None:
        super().__init__(
            f"unknown KV layout kind {kind!r}; known kinds: {', '.join(sorted(KIND_REGISTRY))}. "
            "kvstack refuses to offload KV it does not know how to reuse."
        )
        self.kind = kind


class UnknownDTypeError(ValueError):
    def __init__(self, dtype: str) -> None:
        super().__init__(f"unknown KV dtype {dtype!r}; known: {', '.join(sorted(DTYPE_BYTES))} (or {_DTYPE_ALIASES})")
        self.dtype = dtype


class LayoutError(ValueError):
    """A layout whose values contradict each other (e.g. bytes per block smaller than the tensor slice)."""


def kind_info(kind: str) -> KindInfo:
    """Registry entry of ``kind``; ``UnknownLayoutKindError`` if the kind is not registered."""
    info = KIND_REGISTRY.get(kind)
    if info is None:
        raise UnknownLayoutKindError(kind)
    return info


def canonical_dtype(dtype: str) -> str:
    """``"torch.bfloat16"`` / ``"bf16"`` / ``"bfloat16"`` → ``"bfloat16"``; unknown → ``UnknownDTypeError``."""
    name = dtype.removeprefix("torch.")
    name = _DTYPE_ALIASES.get(name, name)
    if name not in DTYPE_BYTES:
        raise UnknownDTypeError(dtype)
    return name


class LayerGroupLayout(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One layer group as the engine registered it.

    ``tensor_shape`` / ``tensor_strides`` (in elements) are those of one layer's registered KV tensor, exactly as
    the engine reports them (e.g. vLLM's flash-attention layout ``(2, num_blocks, block_size, num_kv_heads,
    head_dim)``), so two engines that lay the same numbers out differently get different fingerprints.
    ``bytes_per_block`` is what one block of this group occupies across all its layers; the pool stores that many
    bytes per block for this group. For state kinds ``block_size`` is the boundary spacing in tokens and
    ``num_kv_heads`` / ``head_dim`` describe the state (0 where not meaningful).
    """

    kind: str
    layer_names: tuple[str, ...]
    layer_indices: tuple[int, ...]
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    tensor_shape: tuple[int, ...]
    tensor_strides: tuple[int, ...]
    bytes_per_block: int

    def __post_init__(self) -> None:
        kind_info(self.kind)
        if canonical_dtype(self.dtype) != self.dtype:
            raise LayoutError(f"dtype {self.dtype!r} is not canonical; use {canonical_dtype(self.dtype)!r}")
        if not self.layer_names or len(self.layer_names) != len(self.layer_indices):
            raise LayoutError(
                f"{self.kind}: need one index per layer name, got {len(self.layer_names)} names and "
                f"{len(self.layer_indices)} indices"
            )
        if len(set(self.layer_indices)) != len(self.layer_indices):
            raise LayoutError(f"{self.kind}: duplicate layer indices {self.layer_indices}")
        if self.block_size <= 0 or self.bytes_per_block <= 0:
            raise LayoutError(f"{self.kind}: block_size and bytes_per_block must be positive")
        if self.num_kv_heads < 0 or self.head_dim < 0:
            raise LayoutError(f"{self.kind}: num_kv_heads and head_dim must be >= 0")
        if len(self.tensor_shape) != len(self.tensor_strides) or not self.tensor_shape:
            raise LayoutError(f"{self.kind}: tensor shape {self.tensor_shape} and strides {self.tensor_strides} differ")
        if any(s <= 0 for s in self.tensor_shape) or any(s < 0 for s in self.tensor_strides):
            raise LayoutError(f"{self.kind}: bad tensor shape {self.tensor_shape} / strides {self.tensor_strides}")

    @property
    def info(self) -> KindInfo:
        return kind_info(self.kind)

    @property
    def element_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]


def attention_group(
    kind: str,
    layer_names: Sequence[str],
    layer_indices: Sequence[int],
    *,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: str,
    tensor_shape: Sequence[int],
    tensor_strides: Sequence[int],
    kv_planes: int = 2,
) -> LayerGroupLayout:
    """An attention-like group (full_attention, sliding_window, mla) from plain values.

    ``bytes_per_block = kv_planes · block_size · num_kv_heads · head_dim · elem · n_layers`` (``kv_planes`` = 2 for
    K and V, 1 for MLA's single latent).
    """
    kind_info(kind)
    dt = canonical_dtype(dtype)
    if kv_planes not in (1, 2):
        raise LayoutError(f"kv_planes must be 1 or 2, got {kv_planes}")
    per_layer = kv_planes * block_size * num_kv_heads * head_dim * DTYPE_BYTES[dt]
    return LayerGroupLayout(
        kind=kind,
        layer_names=tuple(layer_names),
        layer_indices=tuple(int(i) for i in layer_indices),
        block_size=int(block_size),
        num_kv_heads=int(num_kv_heads),
        head_dim=int(head_dim),
        dtype=dt,
        tensor_shape=tuple(int(s) for s in tensor_shape),
        tensor_strides=tuple(int(s) for s in tensor_strides),
        bytes_per_block=per_layer * len(layer_names),
    )


def state_group(
    kind: str,
    layer_names: Sequence[str],
    layer_indices: Sequence[int],
    *,
    block_size: int,
    dtype: str,
    tensor_shape: Sequence[int],
    tensor_strides: Sequence[int],
    state_bytes_per_layer: int,
    num_heads: int = 0,
    head_dim: int = 0,
) -> LayerGroupLayout:
    """A state group (linear_state, mamba): one snapshot of ``state_bytes_per_layer`` per layer per boundary."""
    info = kind_info(kind)
    if info.reuse is not Reuse.BOUNDARY_SNAPSHOT:
        raise LayoutError(f"state_group needs a boundary-snapshot kind, {kind!r} is {info.reuse.value}")
    return LayerGroupLayout(
        kind=kind,
        layer_names=tuple(layer_names),
        layer_indices=tuple(int(i) for i in layer_indices),
        block_size=int(block_size),
        num_kv_heads=int(num_heads),
        head_dim=int(head_dim),
        dtype=canonical_dtype(dtype),
        tensor_shape=tuple(int(s) for s in tensor_shape),
        tensor_strides=tuple(int(s) for s in tensor_strides),
        bytes_per_block=int(state_bytes_per_layer) * len(layer_names),
    )


class KvLayout(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """All layer groups of one model as one engine instance registered them."""

    model_id: str
    groups: tuple[LayerGroupLayout, ...]
    version: int = LAYOUT_VERSION

    def __post_init__(self) -> None:
        if self.version != LAYOUT_VERSION:
            raise LayoutError(f"layout version {self.version}, this build understands {LAYOUT_VERSION}")
        if not self.groups:
            raise LayoutError("a layout needs at least one layer group")
        seen: set[int] = set()
        for g in self.groups:
            overlap = seen.intersection(g.layer_indices)
            if overlap:
                raise LayoutError(f"layer indices {sorted(overlap)} appear in more than one group")
            seen.update(g.layer_indices)

    def canonical_bytes(self) -> bytes:
        """The canonical encoding the fingerprint is taken over (JSON, struct fields in declaration order)."""
        return msgspec.json.encode(self, order="deterministic")

    @property
    def fingerprint(self) -> str:
        """Hex BLAKE2b-128 over ``canonical_bytes()``: stable across processes and runs."""
        return hashlib.blake2b(self.canonical_bytes(), digest_size=FINGERPRINT_BYTES).hexdigest()

    def offloaded_groups(self) -> tuple[LayerGroupLayout, ...]:
        """Groups the pool stores, in declaration order."""
        return tuple(g for g in self.groups if g.info.offloaded)

    def offloaded_bytes_per_block(self) -> int:
        """Bytes one pool block carries (all offloaded groups at one block boundary)."""
        return sum(g.bytes_per_block for g in self.offloaded_groups())

    def is_hybrid(self) -> bool:
        """True when per-block KV and boundary snapshots must both be present for a prefix to be reusable."""
        reuses = {g.info.reuse for g in self.offloaded_groups()}
        return Reuse.PER_BLOCK in reuses and Reuse.BOUNDARY_SNAPSHOT in reuses

    def encode(self) -> bytes:
        return self.canonical_bytes()

    @staticmethod
    def decode(raw: bytes) -> KvLayout:
        """Decode a layout; unknown kinds / dtypes / fields are refused (``msgspec.ValidationError``)."""
        return msgspec.json.decode(raw, type=KvLayout)
