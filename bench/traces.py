"""Mooncake-format traces: load, scale, and turn hash ids into deterministic token blocks.

A Mooncake trace is JSONL, one request per line: ``timestamp`` (ms since the trace start), ``input_length`` and
``output_length`` (tokens), ``hash_ids`` (one id per 512-token block of the prompt; the last block may be partial;
equal ids at equal positions mean equal prefixes). Real traces live in ``../shared/traces/``.

Who calls what:
- ``bench.simulate`` reads ``TraceRecord.hash_ids`` and ``block_lengths()`` (no tokens needed).
- ``bench.trace_cli`` (live replay) turns each record into a prompt with ``TokenMapper``: every hash id maps to
  one deterministic block of token ids (or words, for chat endpoints), so equal ids give equal blocks and the
  trace's prefix sharing survives into the engine's prefix cache.
- ``scale_trace`` stretches time (``time_scale`` > 1 = slower arrivals) and shrinks lengths (``length_scale``
  < 1 = shorter blocks, prompts and outputs) so a CPU cluster can replay a GPU trace. Scaling keeps the number of
  blocks per request, hence the sharing structure, unchanged.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

MOONCAKE_BLOCK_TOKENS = 512


class TraceError(ValueError):
    """A trace file or record is malformed; the message names the file and line."""


@dataclass(frozen=True, slots=True)
class TraceRecord:
    """One request of a trace. ``block_tokens`` is the size of every block but the last (512 unscaled)."""

    index: int
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    block_tokens: int = MOONCAKE_BLOCK_TOKENS

    @property
    def timestamp_s(self) -> float:
        return self.timestamp_ms / 1000.0

    def block_lengths(self) -> list[int]:
        """Tokens of each block: ``block_tokens`` for all but the last, the remainder for the last."""
        n = len(self.hash_ids)
        if n == 0:
            return []
        last = self.input_length - (n - 1) * self.block_tokens
        return [self.block_tokens] * (n - 1) + [last]


def _validate(raw: object, where: str, index: int, block_tokens: int) -> TraceRecord:
    if not isinstance(raw, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(raw).__name__}")
    missing = [k for k in ("timestamp", "input_length", "output_length", "hash_ids") if k not in raw]
    if missing:
        raise TraceError(f"{where}: missing field(s) {', '.join(missing)}")
    ts, inp, out, ids = raw["timestamp"], raw["input_length"], raw["output_length"], raw["hash_ids"]
    if not isinstance(ts, (int, float)) or ts < 0:
        raise TraceError(f"{where}: timestamp must be a number >= 0 (ms), got {ts!r}")
    if not isinstance(inp, int) or inp <= 0:
        raise TraceError(f"{where}: input_length must be a positive integer, got {inp!r}")
    if not isinstance(out, int) or out < 0:
        raise TraceError(f"{where}: output_length must be an integer >= 0, got {out!r}")
    if not isinstance(ids, list) or not all(isinstance(h, int) and h >= 0 for h in ids):
        raise TraceError(f"{where}: hash_ids must be a list of non-negative integers")
    n = len(ids)
    if not (n - 1) * block_tokens < inp <= n * block_tokens:
        raise TraceError(
            f"{where}: input_length {inp} does not fit {n} hash ids of {block_tokens} tokens "
            f"(need {(n - 1) * block_tokens} < input_length <= {n * block_tokens})"
        )
    return TraceRecord(index, float(ts), inp, out, tuple(ids), block_tokens)


def iter_trace(path: Path | str, *, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> Iterator[TraceRecord]:
    """Records of a Mooncake JSONL trace in file order; blank lines are skipped."""
    p = Path(path)
    try:
        fh = p.open()
    except OSError as exc:
        raise TraceError(f"{p}: cannot open trace: {exc}") from exc
    with fh:
        index = 0
        last_ts = -math.inf
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            where = f"{p}:{lineno}"
            try:
                raw = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{where}: not JSON: {exc}") from None
            rec = _validate(raw, where, index, block_tokens)
            if rec.timestamp_ms < last_ts:
                raise TraceError(f"{where}: timestamps must not decrease ({rec.timestamp_ms} < {last_ts})")
            last_ts = rec.timestamp_ms
            yield rec
            index += 1


def load_trace(
    path: Path | str, *, max_requests: int | None = None, block_tokens: int = MOONCAKE_BLOCK_TOKENS
) -> list[TraceRecord]:
    """The first ``max_requests`` records (all if None)."""
    if max_requests is not None and max_requests <= 0:
        raise ValueError(f"max_requests must be positive, got {max_requests}")
    out: list[TraceRecord] = []
    for rec in iter_trace(path, block_tokens=block_tokens):
        if max_requests is not None and len(out) >= max_requests:
            break
        out.append(rec)
    return out


def scale_trace(
    records: Iterable[TraceRecord], *, time_scale: float = 1.0, length_scale: float = 1.0
) -> list[TraceRecord]:
    """Stretch timestamps by ``time_scale`` and lengths by ``length_scale``, keeping blocks per request.

    Blocks become ``max(1, round(block_tokens·length_scale))`` tokens; the last (partial) block is scaled the same
    way and clamped to [1, new block size]; outputs become ``max(1, round(output·length_scale))`` (0 stays 0).
    """
    if time_scale <= 0 or not math.isfinite(time_scale):
        raise ValueError(f"time_scale must be a positive finite number, got {time_scale}")
    if length_scale <= 0 or not math.isfinite(length_scale):
        raise ValueError(f"length_scale must be a positive finite number, got {length_scale}")
    out = []
    for r in records:
        bt = max(1, round(r.block_tokens * length_scale))
        n = len(r.hash_ids)
        last = r.input_length - (n - 1) * r.block_tokens
        new_last = min(bt, max(1, round(last * length_scale)))
        out_len = 0 if r.output_length == 0 else max(1, round(r.output_length * length_scale))
        out.append(
            replace(
                r,
                timestamp_ms=r.timestamp_ms * time_scale,
                input_length=(n - 1) * bt + new_last,
                output_length=out_len,
                block_tokens=bt,
            )
        )
    return out


def prefix_reuse_bound(records: Sequence[TraceRecord]) -> float:
    """The trace's own maximum token-weighted prefix hit rate (one infinite cache that has seen every earlier
    request): for each request, the tokens of its longest prefix of blocks that some earlier request contained."""
    prefixes: dict[tuple[int, int], int] = {}  # (parent prefix id, hash id) -> prefix id: chained, like block keys
    hit = total = 0
    for r in records:
        lengths = r.block_lengths()
        total += r.input_length
        parent, matching = -1, True
        for i, h in enumerate(r.hash_ids):
            pid = prefixes.get((parent, h))
            if pid is None:
                matching = False
                pid = prefixes[(parent, h)] = len(prefixes)
            elif matching:
                hit += lengths[i]
            parent = pid
    return hit / total if total else 0.0


@dataclass(frozen=True, slots=True)
class TokenMapper:
    """Hash id -> a deterministic block of token ids (or words): equal ids give equal blocks.

    Token ids are drawn uniformly from ``[low, vocab_size)`` by a generator seeded with ``(seed, hash_id)``, so
    the mapping depends on nothing else (not on the order of requests, not on the process). A block shorter than
    ``block_tokens`` (a trace's partial last block) is the prefix of the id's full block.
    """

    vocab_size: int = 4096
    low: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.low < self.vocab_size:
            raise ValueError(f"need 0 <= low < vocab_size, got low={self.low} vocab_size={self.vocab_size}")

    def block(self, hash_id: int, length: int) -> np.ndarray:
        if length < 0:
            raise ValueError(f"block length must be >= 0, got {length}")
        rng = np.random.default_rng([self.seed, hash_id])
        return rng.integers(self.low, self.vocab_size, size=length, dtype=np.int64)

    def prompt_tokens(self, record: TraceRecord) -> list[int]:
        """The record's prompt as token ids: its blocks, in order, ``input_length`` tokens in all."""
        parts = [self.block(h, n) for h, n in zip(record.hash_ids, record.block_lengths(), strict=True)]
        return np.concatenate(parts).tolist() if parts else []

    def block_text(self, hash_id: int, length: int) -> str:
        """``length`` pseudo-words for a text endpoint (one word is roughly one token for most tokenizers)."""
        return " ".join(f"w{t}" for t in self.block(hash_id, length).tolist())

    def prompt_text(self, record: TraceRecord) -> str:
        """The record's prompt as text: each block's words, blocks joined by a newline.

        Tokenizers do not respect block boundaries, so the engine sees the same *text* prefixes as the trace, not
        the same token-block boundaries; use ``prompt_tokens`` with a completions endpoint for exact sharing.
        """
        return "\n".join(self.block_text(h, n) for h, n in zip(record.hash_ids, record.block_lengths(), strict=True))
