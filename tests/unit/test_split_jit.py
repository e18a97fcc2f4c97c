"""The SPLIT solvers compiled with numba (``router.policies.split_jit``) give the Python solvers' exact results and
the policy prices and decides the same with either. (That a process which did not opt into numba never loads it for
pricing: ``tests/unit/test_keys.py``, with the key kernel's switch they share.)"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from kvpool import keys as keys_mod
from router.policies import pricing
from router.policies.base import ClusterSnapshot
from router.policies.cost_based import _SPLIT, CostBased, _Group
from router.policies.pricing import HwCoeffs, Pricer, solve_overlap, solve_staged
from tests.fakes.router import router_hw, router_tier_map
from tests.unit.test_cost_based_reference import HARDWARE, _case, replica_cases


@pytest.fixture
def jit_on(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[object, object]]:
    """This process opted into numba (as the router's ingress does); the compiled solvers, loaded."""
    pytest.importorskip("numba")
    monkeypatch.setattr(keys_mod, "use_jit", True)
    assert pricing.warm_up(), "numba is installed but the SPLIT solvers did not compile"
    yield pricing._split_solvers()


def _solver_args(rng: random.Random) -> tuple[tuple, tuple]:  # type: ignore[type-arg]
    """Random overlap and staged arguments as ``HwCoeffs.split_tail`` builds them for ``_Group.options`` and
    ``HwCoeffs.split``, edges included."""
    co = HwCoeffs(rng.choice(HARDWARE), router_tier_map())
    bs = rng.choice([1, 16, 32])
    c = float(bs * rng.randint(0, 4000))
    blocks = int(c) // bs
    h0 = float(bs * (rng.randint(0, blocks) if rng.random() < 0.8 else max(0, blocks - rng.randint(0, 2))))
    extra = rng.choice([0.0, rng.uniform(0, 0.05)])
    quad = rng.choice([co.quad, 0.0])
    cls = rng.randrange(4)  # a remote class is pulled then loaded, a local one only loaded
    o = co.split_tail(cls, extra, staged=False)
    overlap = (co.lin, quad, co.kvb, co.state, o.l_lat, o.l_spb, h0, c, bs)
    t = co.split_tail(cls, extra)
    staged = (co.lin, quad, co.kvb, co.state, t.p_lat, t.p_spb, t.l_lat, t.l_spb, t.pull, h0, c, bs)
    return overlap, staged


def test_the_compiled_solvers_return_the_python_solvers_floats(jit_on: tuple[object, object]) -> None:
    fast_overlap, fast_staged = jit_on
    assert fast_overlap is not solve_overlap and fast_staged is not solve_staged
    rng = random.Random(5)
    found = none = 0
    for _ in range(3000):
        overlap, staged = _solver_args(rng)
        assert fast_overlap(*overlap) == solve_overlap(*overlap), overlap  # type: ignore[operator]
        want = solve_staged(*staged)
        assert fast_staged(*staged) == want, staged  # type: ignore[operator]
        found += want[0] >= 0
        none += want[0] < 0
    assert found > 100 and none > 100  # both outcomes (a boundary, no interior boundary) were compared


def test_the_policy_prices_and_ranks_the_same_with_compiled_solvers(jit_on: tuple[object, object],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Every replica's priced actions (``_Group.options``, SPLITs included) and the ranking are identical with the
    compiled solvers and with the Python ones."""
    tiers = router_tier_map()
    fast_pricer = Pricer(tiers)
    with monkeypatch.context() as mp:
        mp.setattr(keys_mod, "use_jit", False)
        slow_pricer = Pricer(tiers)
        for hw in HARDWARE:
            assert slow_pricer.coeffs(hw).solve_staged is solve_staged
    assert fast_pricer.coeffs(router_hw()).solve_staged is jit_on[1]
    splits = 0
    # split factor 1.0: a SPLIT counts whenever it is the best action (no minimum gain), so many are compared
    for request, clamped, r, hb in replica_cases(random.Random(9), 300):
        fast, slow = (_Group(p.coeffs(r.hw), float(request.prompt_tokens), request.block_size, clamped, 1.0)
                      .options(hb, r.node_id) for p in (fast_pricer, slow_pricer))
        assert fast == slow
        splits += sum(plan.action == _SPLIT for _, plan in fast)
    assert splits > 50
    rng = random.Random(10)
    for case in range(300):
        request, hits, replicas = _case(rng)
        snapshot = ClusterSnapshot(replicas, tuple(hits))
        compiled = CostBased(tier_map=tiers, rng=None).rank(request, snapshot)  # HwCoeffs made now: compiled
        with monkeypatch.context() as mp:
            mp.setattr(keys_mod, "use_jit", False)
            python = CostBased(tier_map=tiers, rng=None).rank(request, snapshot)
        assert compiled.candidates == python.candidates and compiled.choosable == python.choosable, case
