"""What vLLM's KV cache looks like to the pool: layer-group kinds, the ``KvLayout``, and where each byte of a pool
block lies in the engine's KV memory.

Who calls what:
- Both connector roles call ``group_kinds(kv_cache_config)``: vLLM spec class → layout kind (exact class match,
  so a subclass with other semantics is never mistaken for full attention). An unmapped spec becomes a kind named
  after its class, which the layout registry (``kvpool.layout``) refuses with ``UnknownLayoutKindError``.
- The worker role calls ``derive_layout(...)`` in ``register_kv_caches``: from the KV cache config and the tensors
  vLLM registered it builds the typed ``KvLayout`` (its fingerprint goes into every block key and pool call) and a
  ``PoolGeometry`` (byte ranges per pool block). It raises on anything it cannot describe exactly (the engine then
  refuses to start) — layout mistakes fail silently, so there is no best effort here.

Pool block contents (the pool stores opaque, checksummed slots; this module defines what is in them):
- Block slot for key ``k_i``: for every per-block group (full attention / MLA) in group order, for every layer of
  the group in order, the bytes of that layer's block ``block_table[group][i]``.
- State slot for ``state_key(k_{i})`` (hybrids): the state snapshot at the boundary after block ``i``: for every
  state group in order, for every layer, the used bytes of the state page ``block_table[group][i]`` (vLLM's
  align mode keeps the state after tokens ``[0, (i+1)·B)`` in block index ``i`` of each state group).
- A payload shorter than the shard's slot is zero-padded; the checksum covers the whole slot.

The registered tensors must be in host memory, with the block dimension outermost and a contiguous per-block
slice (vLLM's CPU layout ``[num_blocks, heads, block_size, 2·head_dim]`` and its raw state pages). Anything else
is refused with a message naming the layer and its device, or its shape and strides.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from kvpool.keys import KEY_BYTES, BlockKey
from kvpool.layout import (
    KvLayout,
    LayerGroupLayout,
    LayoutError,
    Reuse,
    attention_group,
    canonical_dtype,
    kind_info,
    state_group,
)

_STATE_TAG = b"kvstack.state.v1"

# vLLM spec class name → layout kind. Exact names: a subclass (RSWASpec, SinkFullAttentionSpec, ...) is unknown.
_SPEC_KINDS: dict[str, str] = {
    "FullAttentionSpec": "full_attention",
    "MLAAttentionSpec": "mla",
    "SlidingWindowSpec": "sliding_window",
    "CrossAttentionSpec": "cross_attention",
    "EncoderOnlyAttentionSpec": "encoder",
}
_LINEAR_STATE_MAMBA_TYPES = ("gdn", "linear", "kda")  # gated delta net & friends: a linear-attention state


def state_key(block_key: BlockKey) -> BlockKey:
    """Pool key of the state snapshot at the boundary right after the block named ``block_key``.

    Derived from the block key, so it names the same token prefix; the tag keeps it disjoint from block keys.
    """
    return BlockKey(hashlib.blake2b(_STATE_TAG + bytes(block_key), digest_size=KEY_BYTES).digest())


def spec_kind(spec: Any) -> str:
    """Layout kind of one vLLM ``KVCacheSpec`` (by exact class; unknown classes keep their class name)."""
    name = type(spec).__name__
    if name == "MambaSpec":
        mamba_type = str(getattr(spec, "mamba_type", "")).lower()
        return "linear_state" if any(t in mamba_type for t in _LINEAR_STATE_MAMBA_TYPES) else "mamba"
    kind = _SPEC_KINDS.get(name, name)
    if kind == "full_attention" and (
        getattr(spec, "sliding_window", None) is not None or getattr(spec, "attention_chunk_size", None) is not None
    ):
        return "full_attention_windowed"  # a full-attention spec that only sees a window: not in the registry
    return kind


@dataclass(frozen=True)
class GroupKind:
    """One vLLM KV cache group as the connector sees it."""

    group_id: int
    kind: str
    reuse: Reuse
    offloaded: bool
    layer_names: tuple[str, ...]
    block_size: int


def group_kinds(kv_cache_config: Any) -> list[GroupKind]:
    """Kinds of every KV cache group; ``UnknownLayoutKindError`` (naming the kind) for a kind we do not know."""
    out: list[GroupKind] = []
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        kind = spec_kind(group.kv_cache_spec)
        info = kind_info(kind)
        out.append(GroupKind(gid, kind, info.reuse, info.offloaded, tuple(group.layer_names),
                             int(group.kv_cache_spec.block_size)))
    return out


class PoolPlan(msgspec.Struct, frozen=True):
    """The scheduler's view: which groups hold per-block KV, which hold boundary state, and the block size.

    ``usable`` is False when a group of a known but non-offloaded kind (e.g. sliding window) exists: loading the
    other groups alone would give wrong tokens, so the pool is not used for that model.
    """

    block_size: int
    block_groups: tuple[int, ...]
    state_groups: tuple[int, ...]
    usable: bool
    why_unusable: str = ""

    @property
    def hybrid(self) -> bool:
        return bool(self.state_groups)


def pool_plan(kinds: Sequence[GroupKind]) -> PoolPlan:
    if not kinds:
        return PoolPlan(0, (), (), False, "no KV cache groups")
    sizes = {k.block_size for k in kinds}
    block = tuple(k.group_id for k in kinds if k.offloaded and k.reuse is Reuse.PER_BLOCK)
    state = tuple(k.group_id for k in kinds if k.offloaded and k.reuse is Reuse.BOUNDARY_SNAPSHOT)
    skipped = [f"{k.kind} (group {k.group_id})" for k in kinds if not k.offloaded]
    why = ""
    if skipped:
        why = f"groups of kinds the pool does not offload: {', '.join(skipped)}"
    elif len(sizes) != 1:
        why = f"groups with different block sizes {sorted(sizes)}"
    elif not block:
        why = "no per-block (attention) group"
    return PoolPlan(min(sizes), block, state, not why, why)


# ---------------------------------------------------------------------------------------------- worker geometry
class LayerSpan(msgspec.Struct, frozen=True, array_like=True):
    """Where one layer's blocks lie: region (index into the registered storages), byte offset of block 0 within
    that region, bytes between consecutive blocks, and the bytes of one block the pool carries."""

    layer_name: str
    region: int
    base: int
    block_stride: int
    payload: int


class GroupSpans(msgspec.Struct, frozen=True):
    group_id: int
    layers: list[LayerSpan]


class PoolGeometry(msgspec.Struct, frozen=True):
    """Byte ranges of pool blocks inside the engine's KV memory (worker side)."""

    block_groups: list[GroupSpans]
    state_groups: list[GroupSpans]
    num_blocks: int

    @property
    def block_payload(self) -> int:
        return sum(span.payload for g in self.block_groups for span in g.layers)

    @property
    def state_payload(self) -> int:
        return sum(span.payload for g in self.state_groups for span in g.layers)

    @property
    def slot_bytes_needed(self) -> int:
        return max(self.block_payload, self.state_payload)

    def pieces(self, groups: list[GroupSpans], block_ids: Mapping[int, int]) -> list[tuple[int, int, int]]:
        """(region, offset, length) of one pool block, in slot order, given each group's engine block id."""
        out: list[tuple[int, int, int]] = []
        for g in groups:
            bid = block_ids[g.group_id]
            if not 0 <= bid < self.num_blocks:
                raise ValueError(f"block id {bid} of group {g.group_id} outside [0, {self.num_blocks})")
            for span in g.layers:
                out.append((span.region, span.base + bid * span.block_stride, span.payload))
        return out


class TensorInfo(msgspec.Struct, frozen=True):
    """Plain facts about one registered KV tensor (what ``derive_layout`` needs; built from torch by the worker)."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]  # elements
    dtype: str  # torch dtype name, e.g. "torch.bfloat16"
    element_size: int
    data_ptr: int
    storage_ptr: int
    storage_nbytes: int
    device: str = "cpu"  # torch's device string: "cpu", "cuda:0", ...


def tensor_info(t: Any) -> TensorInfo:
    """``TensorInfo`` of a torch tensor."""
    storage = t.untyped_storage()
    return TensorInfo(tuple(int(s) for s in t.shape), tuple(int(s) for s in t.stride()), str(t.dtype),
                      int(t.element_size()), int(t.data_ptr()), int(storage.data_ptr()), int(storage.nbytes()),
                      str(t.device))


_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def _layer_index(name: str, fallback: int) -> int:
    m = _LAYER_INDEX.search(name)
    return int(m.group(1)) if m else fallback


def model_digest(hf_config_json: str, kv_cache_config: Any, cache_dtype: str, weights: str = "",
                 quantization: str = "", tensor_parallel: int = 1) -> str:
    """Digest of everything about the model and engine settings that shapes KV bytes (goes into ``KvLayout``):
    the config, the KV-cache dtype, the cache groups, the weights' identity (``kvpool.connector.weights``: another
    checkpoint at the same path is another namespace), the quantization and the tensor-parallel world size (each
    rank holds its share of the heads; a single-rank engine's digest is what it was before TP was keyed)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(hf_config_json.encode())
    h.update(cache_dtype.encode())
    h.update(f"\0weights={weights}\0quantization={quantization}\0".encode())
    if tensor_parallel > 1:
        h.update(f"tensor_parallel={tensor_parallel}\0".encode())
    for group in kv_cache_config.kv_cache_groups:
        h.update(repr(group.kv_cache_spec).encode())
    return h.hexdigest()


def derive_layout(
    model_id: str,
    digest: str,
    kv_cache_config: Any,
    tensors: Mapping[str, TensorInfo],
) -> tuple[KvLayout, PoolGeometry, list[tuple[int, int]]]:
    """The engine's ``KvLayout``, the ``PoolGeometry`` and the storages to register as ``(ptr, nbytes)``.

    Raises ``UnknownLayoutKindError`` (unknown kind), ``LayoutError`` (a layout we cannot describe exactly, or KV
    memory the connector cannot reach: it copies blocks through host memory, so a KV cache on a GPU is refused).
    """
    for name, info in tensors.items():
        if info.device != "cpu":
            raise LayoutError(
                f"layer {name!r}: the KV cache is on {info.device}; the kvpool connector copies blocks between the "
                "pool and a KV cache in host memory (vLLM's CPU build) only. Run this engine with "
                "app.pool.enabled: false"
            )
    kinds = group_kinds(kv_cache_config)
    num_blocks = int(kv_cache_config.num_blocks)
    storages: list[tuple[int, int]] = []
    region_of: dict[int, int] = {}
    layouts: list[LayerGroupLayout] = []
    block_groups: list[GroupSpans] = []
    state_groups: list[GroupSpans] = []
    position = 0
    for gk, group in zip(kinds, kv_cache_config.kv_cache_groups, strict=True):
        spec = group.kv_cache_spec
        spans: list[LayerSpan] = []
        first: TensorInfo | None = None
        indices: list[int] = []
        for name in group.layer_names:
            info = tensors.get(name)
            if info is None:
                raise LayoutError(f"layer {name!r} of group {gk.group_id} ({gk.kind}) has no registered KV tensor")
            if first is None:
                first = info
            elif (info.shape, info.strides, info.dtype) != (first.shape, first.strides, first.dtype):
                raise LayoutError(f"layers of group {gk.group_id} disagree: {name!r} has {info.shape}/{info.strides}")
            spans.append(_span(name, info, num_blocks, storages, region_of))
            indices.append(_layer_index(name, position))
            position += 1
        if first is None:
            raise LayoutError(f"group {gk.group_id} ({gk.kind}) has no layers")
        per_block_shape, per_block_strides = first.shape[1:], first.strides[1:]
        payload = spans[0].payload
        if gk.reuse is Reuse.BOUNDARY_SNAPSHOT:
            used = _state_used_bytes(spec)
            if used > payload:
                raise LayoutError(f"group {gk.group_id}: state of {used} bytes exceeds the {payload}-byte page")
            spans = [msgspec.structs.replace(s, payload=used) for s in spans]
            shapes = getattr(spec, "shapes", ())
            heads, head_dim = (int(shapes[-1][0]), int(shapes[-1][-1])) if shapes else (0, 0)
            layouts.append(state_group(
                gk.kind, group.layer_names, indices, block_size=gk.block_size, dtype=_dtype_name(first.dtype),
                tensor_shape=per_block_shape, tensor_strides=per_block_strides, state_bytes_per_layer=used,
                num_heads=heads, head_dim=head_dim,
            ))
            if gk.offloaded:
                state_groups.append(GroupSpans(gk.group_id, spans))
        else:
            heads = int(getattr(spec, "num_kv_heads", 0) or 0)
            head_dim = int(getattr(spec, "head_size", 0) or 0)
            planes = 1 if gk.kind == "mla" else 2
            lay = attention_group(
                gk.kind, group.layer_names, indices, block_size=gk.block_size, num_kv_heads=heads,
                head_dim=head_dim, dtype=_dtype_name(str(spec.dtype)), tensor_shape=per_block_shape,
                tensor_strides=per_block_strides, kv_planes=planes,
            )
            if lay.bytes_per_block != payload * len(spans):
                raise LayoutError(
                    f"group {gk.group_id} ({gk.kind}): registered blocks hold {payload} bytes per layer but the spec "
                    f"implies {lay.bytes_per_block // len(spans)} (shape {first.shape}, strides {first.strides})"
                )
            layouts.append(lay)
            if gk.offloaded and gk.reuse is Reuse.PER_BLOCK:
                block_groups.append(GroupSpans(gk.group_id, spans))
    layout = KvLayout(model_id=f"{model_id}#{digest}", groups=tuple(layouts))
    return layout, PoolGeometry(block_groups, state_groups, num_blocks), storages


def _dtype_name(dtype: str) -> str:
    return canonical_dtype(str(dtype))


def _state_used_bytes(spec: Any) -> int:
    """Bytes of one state page that carry data (vLLM pads pages to a common size)."""
    import math

    shapes = getattr(spec, "shapes", None)
    dtypes = getattr(spec, "dtypes", None)
    if not shapes or not dtypes or len(shapes) != len(dtypes):
        raise LayoutError(f"state spec {type(spec).__name__} without matching shapes/dtypes: {spec!r}")
    total = 0
    for shape, dt in zip(shapes, dtypes, strict=True):
        itemsize = getattr(dt, "itemsize", None)
        if itemsize is None:
            raise LayoutError(f"state dtype {dt!r} has no itemsize")
        total += math.prod(int(s) for s in shape) * int(itemsize)
    return total


def _span(
    name: str, info: TensorInfo, num_blocks: int, storages: list[tuple[int, int]], region_of: dict[int, int]
) -> LayerSpan:
    if not info.shape or info.shape[0] != num_blocks:
        raise LayoutError(
            f"layer {name!r}: KV tensor {info.shape} / strides {info.strides} does not have the block dimension "
            f"({num_blocks} blocks) outermost; this layout is not supported by the kvpool connector"
        )
    # The per-block slice must be contiguous: strides[i] == prod(shape[i+1:]) for i >= 1.
    expect = 1
    for size, stride in zip(reversed(info.shape[1:]), reversed(info.strides[1:]), strict=True):
        if size > 1 and stride != expect:
            raise LayoutError(
                f"layer {name!r}: per-block slice of {info.shape} with strides {info.strides} is not contiguous"
            )
        expect *= size
    payload = expect * info.element_size
    block_stride = info.strides[0] * info.element_size
    if block_stride < payload:
        raise LayoutError(f"layer {name!r}: blocks overlap (stride {block_stride} < {payload} bytes)")
    base = info.data_ptr - info.storage_ptr
    if base < 0 or base + (num_blocks - 1) * block_stride + payload > info.storage_nbytes:
        raise LayoutError(f"layer {name!r}: blocks fall outside their storage")
    region = region_of.get(info.storage_ptr)
    if region is None:
        region = len(storages)
        region_of[info.storage_ptr] = region
        storages.append((info.storage_ptr, info.storage_nbytes))
    return LayerSpan(name, region, base, block_stride, payload)
