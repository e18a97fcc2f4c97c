"""Property tests of the block-key contract (kvpool/keys.py)."""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvpool.keys as keys_mod
from kvpool.keys import KEY_BYTES, BlockKey, Namespace, block_keys, chain_keys, request_salt

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


def test_a_requests_salt_is_its_tenants_and_its_own() -> None:
    """Untenanted, unsalted requests keep the engine's salt (their keys do not change); a tenant or a salt of the
    request's own gives a salt no other (engine salt, tenant, client salt) triple gives, in a form vLLM accepts."""
    from vllm.entrypoints.generate.base.protocol import validate_cache_salt

    assert request_salt() == "" and request_salt("eng") == "eng" and request_salt("eng", "", None) == "eng"
    triples = [("", "a", None), ("", "b", None), ("", "a", "x"), ("", "", "x"), ("e", "a", None), ("", "ab", "c"),
               ("", "a", "bc"), ("a", "", "")]
    salts = [request_salt(*t) for t in triples]
    assert len(set(salts)) == len(salts)
    assert salts[-1] == "a"  # ("a", "", ""): the engine salt alone
    for salt in salts[:-1]:
        validate_cache_salt(salt)
        assert salt.startswith("kvs1-") and "a" != salt
    assert request_salt("", "a", None) == request_salt("", "a", None)  # stable: every process computes the same


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


# --- The numba kernel (kvpool/blake2b_chain.py) and the hashlib fallback give the same bytes --------------------------

PARENT = bytes(range(100, 116))
# 16 + 4 * block_size message bytes: 28 → exactly one 128-byte chunk, 29 → just over;
# 60 → exactly two, 61 → just over.
BLOCK_SIZES = (1, 2, 3, 7, 16, 27, 28, 29, 31, 32, 33, 60, 61, 124, 125, 128, 500)


def reference_chain(parent: bytes, tokens: list[int], bs: int, limit: int | None = None) -> list[bytes]:
    """The contract, written independently of kvpool.keys:
    key_i = BLAKE2b-128(key_{i-1} ‖ uint32-LE ids of block i)."""
    n = len(tokens) // bs if limit is None else max(0, min(len(tokens) // bs, limit))
    keys, prev = [], parent
    for i in range(n):
        block = b"".join(t.to_bytes(4, "little") for t in tokens[i * bs : (i + 1) * bs])
        prev = hashlib.blake2b(prev + block, digest_size=16).digest()
        keys.append(prev)
    return keys


@pytest.fixture(scope="module", autouse=True)
def kernel_loaded_before_timed_tests() -> Iterator[None]:
    """The kernel on (as in the router) and loaded once up front: its first load (~0.3 s, ~1.7 s compiling) would
    blow a hypothesis deadline. Off again after this module, as in every process that did not ask for it."""
    keys_mod.enable_jit()
    yield
    keys_mod.use_jit = False


def test_the_kernel_is_off_unless_a_process_asks_for_it() -> None:
    """A vLLM engine cannot start in a process that loaded numba (vLLM's CPU build scans every module's globals and
    fails on llvmlite's wrappers): importing kvpool.keys and hashing long prompts must not load it, nor must the
    cost model's SPLIT solvers (``router.policies.pricing``, which follow the same switch) when cost_based ranks,
    SPLITs included."""
    script = ("import random, sys, kvpool.keys as k\n"
              "from router.policies import pricing\n"
              "from router.policies.base import ClusterSnapshot\n"
              "from router.policies.cost_based import CostBased\n"
              "from tests.fakes.router import router_tier_map\n"
              "from tests.unit.test_cost_based_reference import _case\n"
              "k.chain_keys(bytes(16), list(range(16 * 100)), 16)\n"
              "rng = random.Random(1)\n"
              "for _ in range(50):\n"
              "    request, hits, replicas = _case(rng)\n"
              "    CostBased(tier_map=router_tier_map()).rank(request, ClusterSnapshot(replicas, tuple(hits)))\n"
              "assert not pricing.warm_up()\n"
              "assert not k.use_jit and 'numba' not in sys.modules and 'llvmlite' not in sys.modules\n"
              "assert k.enable_jit() and 'numba' in sys.modules and pricing.warm_up()\n"
              "print('ok')\n")
    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", script], cwd=repo, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


@pytest.fixture
def jit_everywhere(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The kernel for every chain of at least one block; the test fails if it cannot load where numba is installed."""
    pytest.importorskip("numba")
    monkeypatch.setattr(keys_mod, "JIT_MIN_BLOCKS", 1)
    monkeypatch.setattr(keys_mod, "use_jit", True)
    assert keys_mod.warm_up(), "numba is installed but the BLAKE2b kernel did not load"
    errors = keys_mod._kernel_errors
    yield
    assert keys_mod._kernel_errors == errors, "the kernel raised and chain_keys fell back to hashlib"


@pytest.fixture
def hashlib_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(keys_mod, "use_jit", False)


def test_kernel_equals_hashlib_reference(jit_everywhere: None) -> None:
    rng = np.random.default_rng(7)
    for bs in BLOCK_SIZES:
        for n in sorted({0, 1, bs - 1, bs, bs + 1, 3 * bs - 1, 5 * bs, 9 * bs + 3, 1000}):
            toks = rng.integers(0, 2**32, size=max(n, 0), dtype=np.uint64).tolist()
            toks[:2] = [0, 2**32 - 1][: len(toks)]
            want = reference_chain(PARENT, toks, bs)
            assert chain_keys(BlockKey(PARENT), toks, bs) == want, (bs, n)
            assert chain_keys(BlockKey(PARENT), np.asarray(toks, dtype=np.uint32), bs) == want, (bs, n)
            for limit in (0, 1, 3, len(want) + 5, -1):
                assert chain_keys(BlockKey(PARENT), toks, bs, limit=limit) == reference_chain(PARENT, toks, bs, limit)


def test_kernel_long_prompt_equals_hashlib(jit_everywhere: None, monkeypatch: pytest.MonkeyPatch) -> None:
    toks = np.random.default_rng(8).integers(0, 150_000, size=131_072 + 5, dtype=np.int64)
    for bs in (16, 128):
        fast = chain_keys(BlockKey(PARENT), toks.tolist(), bs)
        monkeypatch.setattr(keys_mod, "use_jit", False)
        slow = chain_keys(BlockKey(PARENT), toks.tolist(), bs)
        monkeypatch.setattr(keys_mod, "use_jit", True)
        assert len(fast) == 131_072 // bs and fast == slow
        assert all(type(k) is bytes and len(k) == KEY_BYTES for k in fast)


@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=300),
    bs=st.integers(1, 40),
    parent=st.binary(min_size=16, max_size=16),
)
def test_kernel_and_hashlib_agree_on_any_input(tokens: list[int], bs: int, parent: bytes) -> None:
    want = reference_chain(parent, tokens, bs)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(keys_mod, "JIT_MIN_BLOCKS", 1)
        mp.setattr(keys_mod, "use_jit", True)
        assert chain_keys(BlockKey(parent), tokens, bs) == want
        mp.setattr(keys_mod, "use_jit", False)
        assert chain_keys(BlockKey(parent), tokens, bs) == want


def test_keys_ending_in_zero_bytes_keep_them(jit_everywhere: None) -> None:
    """The rows become ``bytes`` through a 16-byte void dtype, which (unlike ``S16``) keeps trailing NULs."""
    out = keys_mod._kernel(np.zeros(32, np.uint32), 16, 2, np.zeros(2, np.uint64))  # type: ignore[misc]
    out[0] = 0
    assert out.view("V16").reshape(-1).tolist()[0] == bytes(16)


def _array_inputs(toks: list[int]) -> list[np.ndarray]:
    """The same ids as arrays of every integer kind, byte order and layout the callers might pass."""
    wide = np.asarray(toks, dtype=np.uint32)  # ids up to 2**32 - 1
    small = wide % 2**31
    return [
        wide, wide.astype(">u4"), wide.astype(np.uint64), wide.astype(np.int64), wide.astype(object),
        small.astype(np.int32), (wide % 256).astype(np.uint8), (wide % 100).astype(np.int8),
        (wide % 60000).astype(np.uint16), (wide % 30000).astype(np.int16),
        wide[: 16 * 9].reshape(-1, 16),  # 2-D: flattened in C order
        np.frombuffer(wide.tobytes(), dtype=np.uint32),  # read-only
        np.frombuffer(b"\0" + wide.tobytes(), dtype=np.uint32, offset=1),  # unaligned
        np.repeat(wide, 2)[::2],  # strided
    ]


@pytest.mark.parametrize("path", ["jit_everywhere", "hashlib_only"])
def test_lists_and_arrays_of_any_int_dtype_agree(path: str, request: pytest.FixtureRequest) -> None:
    request.getfixturevalue(path)
    toks = np.random.default_rng(9).integers(0, 2**31, size=16 * 9 + 5, dtype=np.int64).tolist()
    toks[0] = 2**32 - 1
    for arr in _array_inputs(toks):
        want = reference_chain(PARENT, [int(t) for t in np.asarray(arr).reshape(-1)], 16)
        assert len(want) == 9
        assert chain_keys(BlockKey(PARENT), arr, 16) == want, (arr.dtype, arr.shape, arr.strides, arr.flags)
    assert chain_keys(BlockKey(PARENT), tuple(toks), 16) == chain_keys(BlockKey(PARENT), toks, 16)
    assert chain_keys(BlockKey(PARENT), [True, False] * 40, 16) == reference_chain(PARENT, [1, 0] * 40, 16)
    assert chain_keys(BlockKey(PARENT), np.array([True, False] * 40), 16) == reference_chain(PARENT, [1, 0] * 40, 16)


BAD_LISTS = [[-1], [2**32], [1.5], ["1"], [None], [2**70]]
BAD_ARRAYS = [np.array([-1]), np.array([2**32]), np.array([2**32], dtype=np.uint64), np.array([-1], dtype=np.int8)]


@pytest.mark.parametrize("path", ["jit_everywhere", "hashlib_only"])
@pytest.mark.parametrize("bad", BAD_LISTS + BAD_ARRAYS, ids=repr)
def test_bad_token_ids_are_refused_on_both_paths(
    path: str, bad: list | np.ndarray, request: pytest.FixtureRequest
) -> None:
    request.getfixturevalue(path)
    good = list(range(16 * 8))
    tokens = np.concatenate([np.asarray(good, dtype=bad.dtype), bad]) if isinstance(bad, np.ndarray) else good + bad
    with pytest.raises(ValueError):
        chain_keys(BlockKey(PARENT), tokens, 16)


def test_fallback_when_numba_cannot_be_imported(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "kvpool.blake2b_chain", None)  # makes the import raise ImportError
    monkeypatch.setattr(keys_mod, "_kernel", None)
    monkeypatch.setattr(keys_mod, "_kernel_failed", False)
    monkeypatch.setattr(keys_mod, "use_jit", True)
    toks = list(range(16 * 50))
    with caplog.at_level(logging.WARNING, logger="kvpool.keys"):
        assert chain_keys(BlockKey(PARENT), toks, 16) == reference_chain(PARENT, toks, 16)
        assert chain_keys(BlockKey(PARENT), toks, 16) == reference_chain(PARENT, toks, 16)
    assert keys_mod._kernel_failed and not keys_mod.warm_up()
    assert len([r for r in caplog.records if "unavailable" in r.getMessage()]) == 1  # logged once, not per call


def test_fallback_when_the_kernel_raises(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def broken(*args: object) -> np.ndarray:
        raise TypeError("no matching definition")

    monkeypatch.setattr(keys_mod, "_kernel", broken)
    monkeypatch.setattr(keys_mod, "_kernel_errors", 0)
    monkeypatch.setattr(keys_mod, "use_jit", True)
    toks = list(range(16 * 50))
    with caplog.at_level(logging.ERROR, logger="kvpool.keys"):
        for _ in range(3):
            assert chain_keys(BlockKey(PARENT), toks, 16) == reference_chain(PARENT, toks, 16)
    assert keys_mod._kernel_errors == 3
    assert len([r for r in caplog.records if r.name == "kvpool.keys"]) == 1  # logged once, not per call


def test_parent_of_another_length_uses_hashlib(jit_everywhere: None) -> None:
    toks = list(range(16 * 10))
    for parent in (b"", b"short", bytes(32)):
        assert chain_keys(BlockKey(parent), toks, 16) == reference_chain(parent, toks, 16)


def test_kernel_has_one_compiled_signature(jit_everywhere: None) -> None:
    """Every input kind reaches the kernel as the one signature it was compiled for (no compile per call site)."""
    from kvpool import blake2b_chain

    toks = list(range(16 * 9))
    for arr in [*_array_inputs(toks), toks]:
        chain_keys(BlockKey(PARENT), arr, 16)
    assert blake2b_chain.chain_digests.signatures == [blake2b_chain.SIGNATURE.args]


def test_kernel_imports_without_a_writable_cache(tmp_path: Path) -> None:
    """A read-only install with no writable cache dir: numba finds no cache locator; the kernel compiles in memory."""
    pytest.importorskip("numba")
    script = (
        "import numba.core.caching as c\n"
        "def refuse(self): raise PermissionError('read-only')\n"
        "c._CacheLocator.ensure_cache_path = refuse\n"
        "import kvpool.blake2b_chain as b, kvpool.keys as k\n"
        "assert not b.CACHED and k.enable_jit()\n"
        "toks = list(range(16 * 40))\n"
        "fast = k.chain_keys(bytes(16), toks, 16); k.use_jit = False\n"
        "assert fast == k.chain_keys(bytes(16), toks, 16) and k._kernel_errors == 0\n"
        "print('ok')\n"
    )
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "nb"), "PYTHONPATH": str(repo)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
    assert "compiling the BLAKE2b kernel in memory" in done.stderr
