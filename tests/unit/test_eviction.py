"""Eviction policies (kvpool/eviction.py): pure ranking, pin-aware through ``is_evictable``."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool.eviction import POLICIES, EvictionPolicy, LruPolicy, make_policy


@pytest.fixture(params=sorted(POLICIES))
def policy(request: pytest.FixtureRequest) -> EvictionPolicy:
    return make_policy(request.param)


def test_contract_common_to_every_policy(policy: EvictionPolicy) -> None:
    for k in "abcd":
        policy.insert(k)
    assert len(policy) == 4 and "a" in policy
    victims = policy.victims(2, lambda k: True)
    assert len(victims) == 2 and set(victims) <= set("abcd")
    assert len(policy) == 4  # victims does not mutate
    assert policy.victims(10, lambda k: k != "b") and "b" not in policy.victims(10, lambda k: k != "b")
    assert policy.victims(0, lambda k: True) == []
    assert policy.victims(3, lambda k: False) == []
    policy.remove("a")
    policy.remove("zz")  # unknown: ignored
    policy.touch("zz")
    assert "a" not in policy and len(policy) == 3


def test_lru_order_touch_and_reinsert() -> None:
    lru: LruPolicy[str] = LruPolicy()
    for k in "abcd":
        lru.insert(k)
    assert lru.victims(4, lambda k: True) == list("abcd")
    lru.touch("a")
    assert lru.victims(2, lambda k: True) == ["b", "c"]
    lru.insert("b")  # re-insert counts as a use
    assert list(lru) == ["c", "d", "a", "b"]


def test_lru_skips_pinned_keys_in_order() -> None:
    lru: LruPolicy[int] = LruPolicy()
    for k in range(6):
        lru.insert(k)
    pinned = {0, 2, 3}
    assert lru.victims(2, lambda k: k not in pinned) == [1, 4]


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="lru"):
        make_policy("fifo-ish")


OPS = st.lists(
    st.tuples(st.sampled_from(["insert", "touch", "remove"]), st.integers(0, 7)), max_size=60
)


@given(ops=OPS, pinned=st.sets(st.integers(0, 7)), n=st.integers(0, 9))
def test_lru_matches_a_reference_model(ops: list[tuple[str, int]], pinned: set[int], n: int) -> None:
    lru: LruPolicy[int] = LruPolicy()
    model: list[int] = []  # oldest first
    for op, k in ops:
        getattr(lru, op)(k)
        if op == "insert":
            if k in model:
                model.remove(k)
            model.append(k)
        elif op == "touch" and k in model:
            model.remove(k)
            model.append(k)
        elif op == "remove" and k in model:
            model.remove(k)
    assert list(lru) == model
    assert lru.victims(n, lambda k: k not in pinned) == [k for k in model if k not in pinned][:n]
