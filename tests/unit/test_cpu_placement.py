"""CPU placement (deployments/cpu_placement.py): the pure choice, real flock claims across real processes, the vLLM
settings that bind an engine, and the config that carries the thread count."""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path

import pytest

from deployments.app_config import AppConfig
from deployments.cpu_placement import (
    CpuInfo,
    PlacementError,
    choose_cores,
    claim_cores,
    cpu_topology,
    engine_arguments,
    engine_environment,
    parse_cpu_list,
    vllm_cpu_bind,
)
from router.hub import ReplicaPlacement

TWO_NODES = [CpuInfo(c, c % 4, c // 4) for c in range(8)]  # cpus 0-3 on NUMA node 0, 4-7 on node 1


def test_parse_cpu_list() -> None:
    assert parse_cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpu_list("5") == [5]


def test_exclusive_fills_one_numa_node_and_never_reuses_a_claimed_cpu() -> None:
    first = choose_cores(TWO_NODES, {}, 2, "exclusive")
    assert first == [0, 1]
    claimed = {c: 1 for c in first}
    second = choose_cores(TWO_NODES, claimed, 2, "exclusive")
    assert second == [4, 5]  # node 1 has more free cpus than node 0's remaining two
    claimed.update({c: 1 for c in second})
    assert choose_cores(TWO_NODES, claimed, 4, "exclusive") == [2, 3, 6, 7]  # no node has 4 free: across nodes
    claimed.update({c: 1 for c in (2, 3, 6, 7)})
    with pytest.raises(PlacementError, match="cpu_binding=shared"):
        choose_cores(TWO_NODES, claimed, 1, "exclusive")


def test_a_gpus_numa_node_is_preferred_when_it_has_room() -> None:
    assert choose_cores(TWO_NODES, {}, 2, "exclusive", prefer_numa=1) == [4, 5]
    claimed = {4: 1, 5: 1, 6: 1}
    assert choose_cores(TWO_NODES, claimed, 2, "exclusive", prefer_numa=1) == [0, 1]  # node 1 is full: elsewhere


def test_shared_takes_the_least_claimed_cpus() -> None:
    claimed = {0: 2, 1: 1, 2: 1, 3: 1, 4: 1, 5: 1, 6: 1, 7: 3}
    assert choose_cores(TWO_NODES, claimed, 2, "shared") == [1, 2]
    with pytest.raises(PlacementError):
        choose_cores(TWO_NODES, {}, 9, "shared")


def test_smt_siblings_of_a_claimed_core_come_last() -> None:
    smt = [CpuInfo(0, 0, 0), CpuInfo(1, 1, 0), CpuInfo(2, 0, 0), CpuInfo(3, 1, 0)]  # 2 cores x 2 threads
    assert choose_cores(smt, {}, 2, "exclusive") == [0, 1]
    assert choose_cores(smt, {0: 1}, 1, "exclusive") == [1]


def test_topology_from_sysfs(tmp_path: Path) -> None:
    for node, cpus in ((0, "0-1"), (1, "2-3")):
        (tmp_path / "node" / f"node{node}").mkdir(parents=True)
        (tmp_path / "node" / f"node{node}" / "cpulist").write_text(cpus + "\n")
    for cpu in range(4):
        (tmp_path / "cpu" / f"cpu{cpu}" / "topology").mkdir(parents=True)
        (tmp_path / "cpu" / f"cpu{cpu}" / "topology" / "core_id").write_text(f"{cpu % 2}\n")
    assert cpu_topology([1, 2, 3], str(tmp_path)) == [CpuInfo(1, 1, 0), CpuInfo(2, 0, 1), CpuInfo(3, 1, 1)]
    assert cpu_topology([7], str(tmp_path / "missing")) == [CpuInfo(7, 7, 0)]


def _claim_in_child(claims_dir: str, conn) -> None:  # a separate process, like another replica
    try:
        claim = claim_cores(1, "exclusive", owner="child", allowed=[0, 1], claims_dir=claims_dir,
                            sys_root="/nonexistent")
        conn.send(claim.cores)
        conn.recv()  # hold the claim until told to exit (then the process dies without releasing)
    except PlacementError as exc:
        conn.send(str(exc))


def test_claims_are_exclusive_across_processes_and_die_with_their_owner(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_claim_in_child, args=(str(tmp_path), child))
    proc.start()
    try:
        assert parent.recv() == [0]
        mine = claim_cores(1, "exclusive", owner="me", allowed=[0, 1], claims_dir=str(tmp_path),
                           sys_root="/nonexistent")
        assert mine.cores == [1]
        with pytest.raises(PlacementError, match="0 free"):
            claim_cores(1, "exclusive", allowed=[0, 1], claims_dir=str(tmp_path), sys_root="/nonexistent")
        shared = claim_cores(1, "shared", owner="third", allowed=[0, 1], claims_dir=str(tmp_path),
                             sys_root="/nonexistent")
        assert shared.placement.shared_with in (["child"], ["me"])
        shared.release()
        parent.send("exit")
        proc.join(30)
        # The child died holding cpu 0 (no release): the kernel dropped its lock, so cpu 0 is free again.
        again = claim_cores(1, "exclusive", allowed=[0, 1], claims_dir=str(tmp_path), sys_root="/nonexistent")
        assert again.cores == [0] and again.placement.shared_with == []
        assert len(list((tmp_path / "cpu0").glob("*.claim"))) == 1  # the dead owner's file was cleaned up
        again.release()
        mine.release()
        assert not list(tmp_path.glob("cpu*/*.claim"))
    finally:
        if proc.is_alive():
            proc.kill()


def test_a_real_claim_on_this_machine_is_within_its_affinity(tmp_path: Path) -> None:
    claim = claim_cores(1, claims_dir=str(tmp_path))
    try:
        assert set(claim.cores) <= os.sched_getaffinity(0)
        assert claim.placement.allowed == sorted(os.sched_getaffinity(0))
    finally:
        claim.release()


def test_vllm_binding_settings() -> None:
    assert vllm_cpu_bind([0, 1, 2, 3], ranks=2) == "0,1|2,3"
    with pytest.raises(PlacementError):
        vllm_cpu_bind([0, 1, 2], ranks=2)
    p = ReplicaPlacement(cores=[2, 3], threads=2, binding="exclusive")
    assert engine_environment(p, gpu=False) == {"OMP_NUM_THREADS": "2", "VLLM_CPU_OMP_THREADS_BIND": "2,3",
                                                "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    assert engine_environment(p, gpu=True) == {"OMP_NUM_THREADS": "2"}
    assert engine_arguments(p, gpu=False) == {}


def test_a_parallel_engine_binds_each_rank_to_its_share_of_the_cores() -> None:
    """A TP=2 engine on CPU: one core list per worker process; cores that do not split are refused with the
    setting to change (the engine would fail later on vLLM's assertion); on GPUs they only host threads, so an
    uneven split leaves vLLM's NUMA binding off instead of refusing."""
    from deployments.cpu_placement import engine_binding

    p = ReplicaPlacement(cores=[2, 3], threads=2, binding="exclusive")
    env, args = engine_binding(p, gpu=False, ranks=2)
    assert env == {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "2|3", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    assert args == {}
    assert engine_binding(p, gpu=False) == (engine_environment(p, gpu=False), {})
    one = ReplicaPlacement(cores=[0], threads=1, binding="exclusive")
    with pytest.raises(PlacementError, match="app.replicas.threads"):
        engine_binding(one, gpu=False, ranks=2)
    assert engine_binding(one, gpu=True, ranks=2) == ({"OMP_NUM_THREADS": "1"}, {})


def test_replicas_carry_the_thread_count() -> None:
    base = {"engine": {"model": "/m", "served_model_name": "m"}, "router": {"model_spec": "tiny-qwen3",
            "gpu_profile": "cpu-2core"}, "pool": {"dram_bytes": 2**28}}
    cfg = AppConfig.model_validate({**base, "replicas": {"num_replicas": 2, "num_cpus": 3}})
    assert cfg.replicas.engine_threads() == 3 and cfg.replicas.cpu_binding == "exclusive"
    cfg = AppConfig.model_validate({**base, "replicas": {"num_replicas": 2, "num_cpus": 0.5, "threads": 2,
                                                         "cpu_binding": "shared"}})
    assert cfg.replicas.engine_threads() == 2 and cfg.replicas.cpu_binding == "shared"
    assert AppConfig.model_validate({**base, "replicas": {"num_replicas": 1, "num_cpus": 0.5}}
                                    ).replicas.engine_threads() == 1


def test_an_unbound_replica_claims_nothing_and_tells_vllm_not_to_bind(tmp_path: Path) -> None:
    """``cpu_binding: unbound``: no claim file is taken (an exclusive replica can still claim every core), vLLM
    gets ``nobind`` with the thread count still set, for any number of worker ranks, and no NUMA binding on GPUs."""
    from deployments.cpu_placement import engine_binding

    claim = claim_cores(2, "unbound", allowed=[0, 1, 2], claims_dir=str(tmp_path))
    p = claim.placement
    assert (p.cores, p.threads, p.binding, p.allowed) == ([0, 1, 2], 2, "unbound", [0, 1, 2])
    other = claim_cores(3, "exclusive", allowed=[0, 1, 2], claims_dir=str(tmp_path))  # nothing was taken
    assert other.cores == [0, 1, 2]
    other.release()
    claim.release()
    env, args = engine_binding(p, gpu=False, ranks=2)
    assert env == {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    assert args == {}
    assert engine_binding(p, gpu=True, ranks=3) == ({"OMP_NUM_THREADS": "1"}, {})
    with pytest.raises(PlacementError, match="positive"):
        claim_cores(0, "unbound", allowed=[0], claims_dir=str(tmp_path))
