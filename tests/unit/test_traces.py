"""bench.traces: Mooncake loader, scaling, the hash-id -> token-block mapping (equal ids, equal blocks)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bench.traces import (
    TokenMapper,
    TraceError,
    TraceRecord,
    load_trace,
    prefix_reuse_bound,
    scale_trace,
)
from kvpool.keys import Namespace, block_keys

REPO = Path(__file__).resolve().parents[2]
SHARED_TRACES = REPO.parent / "shared" / "traces"
CONVERSATION = SHARED_TRACES / "mooncake_conversation_trace.jsonl"
SYNTHETIC = SHARED_TRACES / "mooncake_synthetic_trace.jsonl"


def _write(tmp_path: Path, rows: list[object], name: str = "t.jsonl") -> Path:
    p = tmp_path / name
    p.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return p


SMALL = [
    {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]},
    {"timestamp": 10, "input_length": 1300, "output_length": 7, "hash_ids": [0, 1, 3]},
    {"timestamp": 20, "input_length": 700, "output_length": 0, "hash_ids": [4, 5]},
    {"timestamp": 30, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]},
]


def test_load_small_trace_fields(tmp_path: Path) -> None:
    recs = load_trace(_write(tmp_path, SMALL))
    assert [r.index for r in recs] == [0, 1, 2, 3]
    assert recs[1] == TraceRecord(1, 10.0, 1300, 7, (0, 1, 3), 512)
    assert recs[0].block_lengths() == [512, 512, 76]
    assert recs[2].block_lengths() == [512, 188]
    assert recs[1].timestamp_s == pytest.approx(0.010)
    assert len(load_trace(_write(tmp_path, SMALL), max_requests=2)) == 2


@pytest.mark.parametrize(
    ("row", "needle"),
    [
        ("{not json", "not JSON"),
        ({"timestamp": 0, "input_length": 10, "hash_ids": [0]}, "missing field(s) output_length"),
        ({"timestamp": 0, "input_length": 2000, "output_length": 1, "hash_ids": [0]}, "does not fit 1 hash ids"),
        ({"timestamp": -1, "input_length": 10, "output_length": 1, "hash_ids": [0]}, "timestamp"),
        ({"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": ["a"]}, "hash_ids"),
    ],
)
def test_malformed_rows_name_file_and_line(tmp_path: Path, row: object, needle: str) -> None:
    path = _write(tmp_path, [SMALL[0], row])
    with pytest.raises(TraceError) as exc:
        load_trace(path)
    assert f"{path}:2" in str(exc.value)
    assert needle in str(exc.value)


def test_decreasing_timestamps_rejected(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="must not decrease"):
        load_trace(_write(tmp_path, [SMALL[1], SMALL[0]]))


def test_equal_hash_ids_give_equal_token_blocks_and_equal_block_keys(tmp_path: Path) -> None:
    recs = load_trace(_write(tmp_path, SMALL))
    m = TokenMapper(vocab_size=4096, seed=7)
    a, b, c, d = (m.prompt_tokens(r) for r in recs)
    assert [len(x) for x in (a, b, c, d)] == [r.input_length for r in recs]
    assert a[:1024] == b[:1024]  # hash ids 0, 1 shared
    assert a[1024:1100] != b[1024:1100]  # id 2 vs id 3
    assert a == d  # same ids -> same prompt
    assert c[:512] != a[:512]
    assert all(16 <= t < 4096 for t in a + b + c)
    # the same prefix gives the same chained block keys (what the engine's and the pool's caches index by)
    ns = Namespace("m", "fp")
    ka, kb, kc = block_keys(ns, a, 512), block_keys(ns, b, 512), block_keys(ns, c, 512)
    assert ka[:2] == kb[:2]
    assert not set(ka) & set(kc)
    # deterministic across mapper instances, independent of request order
    m2 = TokenMapper(vocab_size=4096, seed=7)
    assert m2.prompt_tokens(recs[3]) == a
    assert TokenMapper(vocab_size=4096, seed=8).prompt_tokens(recs[0]) != a


def test_partial_block_is_prefix_of_the_full_block() -> None:
    m = TokenMapper()
    assert m.block(42, 100).tolist() == m.block(42, 512)[:100].tolist()
    assert m.block_text(42, 5) == m.block_text(42, 5)
    assert len(m.block_text(42, 5).split()) == 5


def test_prompt_text_shares_prefixes(tmp_path: Path) -> None:
    recs = load_trace(_write(tmp_path, SMALL))
    m = TokenMapper()
    ta, tb = m.prompt_text(recs[0]), m.prompt_text(recs[1])
    shared = m.block_text(0, 512) + "\n" + m.block_text(1, 512) + "\n"
    assert ta.startswith(shared) and tb.startswith(shared)
    assert ta != tb


def test_scale_keeps_blocks_and_scales_time_and_lengths(tmp_path: Path) -> None:
    recs = load_trace(_write(tmp_path, SMALL))
    scaled = scale_trace(recs, time_scale=2.0, length_scale=0.25)
    for r, s in zip(recs, scaled, strict=True):
        assert s.hash_ids == r.hash_ids
        assert s.block_tokens == 128
        assert s.timestamp_ms == 2 * r.timestamp_ms
        assert (len(s.hash_ids) - 1) * 128 < s.input_length <= len(s.hash_ids) * 128
        assert s.output_length == (0 if r.output_length == 0 else max(1, round(r.output_length * 0.25)))
    assert scaled[0].block_lengths() == [128, 128, 19]
    assert prefix_reuse_bound(scaled) > 0
    with pytest.raises(ValueError):
        scale_trace(recs, time_scale=0)
    with pytest.raises(ValueError):
        scale_trace(recs, length_scale=-1)


def test_reuse_bound_small() -> None:
    recs = [
        TraceRecord(0, 0, 1100, 1, (0, 1, 2)),
        TraceRecord(1, 0, 1300, 1, (0, 1, 3)),  # hits 0, 1 -> 1024
        TraceRecord(2, 0, 1100, 1, (0, 1, 2)),  # hits all -> 1100 (last block partial: 76)
        TraceRecord(3, 0, 600, 1, (9, 1)),  # id 1 after a different parent is a different prefix -> 0
    ]
    assert prefix_reuse_bound(recs) == pytest.approx((1024 + 1100) / (1100 + 1300 + 1100 + 600))


@pytest.mark.skipif(not CONVERSATION.exists(), reason=f"Mooncake traces not found at {SHARED_TRACES}")
@pytest.mark.parametrize("path", [CONVERSATION, SYNTHETIC], ids=["conversation", "synthetic"])
def test_real_traces_load(path: Path) -> None:
    recs = load_trace(path)
    assert len(recs) > 3000
    ts = np.array([r.timestamp_ms for r in recs])
    assert (np.diff(ts) >= 0).all()
    assert 0.0 < prefix_reuse_bound(recs) < 1.0
    m = TokenMapper()
    r0 = recs[0]
    assert len(m.prompt_tokens(r0)) == r0.input_length
