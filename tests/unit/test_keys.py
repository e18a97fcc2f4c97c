"""Property tests of the block-key contract (kvpool/keys.py)."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool.keys import KEY_BYTES, Namespace, block_keys, chain_keys

TOKENS = st.lists(st.integers(min_value=0, max_value=2**32 - 1), min_size=0, max_size=200)
BLOCK = st.integers(min_value=1, max_value=16)
NAMES = st.text(max_size=12)
NS = st.builds(Namespace, NAMES, NAMES, NAMES)


@given(tokens=TOKENS, bs=BLOCK, ns=NS)
def test_one_key_per_full_block_and_partial_block_has_none(tokens: list[int], bs: int, ns: Namespace) -> None:
    keys = block_keys(ns, tokens, bs)
    assert len(keys) == len(tokens) // bs
    assert all(len(k) == KEY_BYTES for k in keys)
    full = len(tokens) - len(tokens) % bs
    assert block_keys(ns, tokens[:full], bs) == keys  # the partial tail contributes nothing


@given(tokens=st.lists(st.integers(0, 2**32 - 1), min_size=2, max_size=200), bs=BLOCK, ns=NS, data=st.data())
def test_key_depends_on_every_earlier_token(tokens: list[int], bs: int, ns: Namespace, data: st.DataObject) -> None:
    n_full = len(tokens) // bs
    if n_full == 0:
        return
    pos = data.draw(st.integers(0, n_full * bs - 1), label="changed position")
    new = data.draw(st.integers(0, 2**32 - 1).filter(lambda t: t != tokens[pos]), label="new token")
    changed = list(tokens)
    changed[pos] = new
    a, b = block_keys(ns, tokens, bs), block_keys(ns, changed, bs)
    first = pos // bs
    assert a[:first] == b[:first]  # blocks before the change keep their keys
    for i in range(first, n_full):  # the changed block and every later block get new keys
        assert a[i] != b[i]


@given(tokens=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=64), bs=BLOCK, ns1=NS, ns2=NS)
def test_namespaces_never_collide(tokens: list[int], bs: int, ns1: Namespace, ns2: Namespace) -> None:
    if ns1 == ns2:
        assert ns1.root() == ns2.root()
        return
    assert ns1.root() != ns2.root()
    assert not set(block_keys(ns1, tokens, bs)) & set(block_keys(ns2, tokens, bs))


def test_namespace_fields_are_length_prefixed() -> None:
    assert Namespace("ab", "c").root() != Namespace("a", "bc").root()
    assert Namespace("m", "fp", "").root() != Namespace("m", "fp", "tenant").root()


@given(tokens=TOKENS, bs=BLOCK, ns=NS, data=st.data())
def test_chain_resumes_from_any_block(tokens: list[int], bs: int, ns: Namespace, data: st.DataObject) -> None:
    keys = block_keys(ns, tokens, bs)
    if not keys:
        return
    i = data.draw(st.integers(0, len(keys) - 1))
    assert chain_keys(keys[i], tokens[(i + 1) * bs :], bs) == keys[i + 1 :]
    assert chain_keys(ns.root(), tokens, bs, limit=i) == keys[:i]


def test_numpy_and_list_inputs_agree() -> None:
    ns = Namespace("m", "fp")
    toks = list(range(100))
    assert block_keys(ns, toks, 16) == block_keys(ns, np.arange(100, dtype=np.int64), 16)


@pytest.mark.parametrize("bad", [[-1], [2**32]])
def test_out_of_range_tokens_are_refused(bad: list[int]) -> None:
    with pytest.raises(ValueError):
        block_keys(Namespace("m", "fp"), bad * 16, 16)


def test_block_size_must_be_positive() -> None:
    with pytest.raises(ValueError):
        block_keys(Namespace("m", "fp"), [1, 2, 3], 0)


def test_speed_128k_prompt_recorded(record_property: pytest.RecordProperty) -> None:
    """Keys for a 131072-token prompt (block 16 → 8192 keys). Recorded, not asserted."""
    toks = np.random.default_rng(0).integers(0, 150_000, size=131_072, dtype=np.int64)
    ns = Namespace("qwen3-tiny", "0" * 32)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        keys = block_keys(ns, toks, 16)
        best = min(best, time.perf_counter() - t0)
    assert len(keys) == 8192
    record_property("keys_128k_tokens_block16_s", best)
    print(f"\nblock keys for 131072 tokens (block 16, 8192 keys): {best * 1e3:.2f} ms (best of 5)")
