"""``KvPoolConnector`` subclasses that inject real faults, for the e2e rollback and refusal tests.

Loaded by vLLM from ``kv_connector_module_path="tests.e2e.faulty_connector"`` in the test process (in-process
engines only: the tests arm a fault through the module-level ``FAULT`` and read back what fired).

- ``FaultyKvPoolConnector``: right before the worker pulls a request's leased blocks, one armed fault fires:
  ``"kill_shard"`` kills the shard actor that holds them (a dead peer during the load), ``"corrupt"`` overwrites
  the first leased slot in the shard's arena with garbage through the worker's own transfer endpoint (bytes that
  changed after the lease), once the background loader has finished the earlier loads; ``"unsettled"`` makes the
  worker's next transfer read report every op failed and ``settled=False`` after the bytes moved (a late transfer
  NIXL refused to cancel: it may still land), so the worker must fence its endpoint. The real load path then runs
  unchanged.
- ``UnknownKindKvPoolConnector``: presents the first KV cache group to ``KvPoolConnector`` as a vLLM
  ``ChunkedLocalAttentionSpec`` (a real spec class the layout registry does not know), as an engine with such
  layers would; the connector must refuse, and vLLM must fail to start, naming the kind.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import time
from typing import Any

import numpy as np

from kvpool.connector.kv_connector import KvPoolConnector
from kvpool.transfer.base import BlockOp
from kvpool.transfer.common import all_failed

FAULT: dict[str, Any] = {"mode": None, "fired": []}


def arm(mode: str | None) -> None:
    FAULT["mode"] = mode
    FAULT["fired"] = []


class FaultyKvPoolConnector(KvPoolConnector):
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        worker = self.worker_side
        meta = getattr(worker, "_meta", None)
        mode = FAULT["mode"]
        if worker is not None and mode and meta is not None and meta.loads:
            spec = meta.loads[0]
            assert worker.wait_loads(30.0), "earlier loads did not finish"  # the loader owns the endpoint
            if mode == "kill_shard":
                import ray

                client = worker.shards.client(spec.shard_id)
                pid = ray.get(client.handle.__ray_call__.remote(lambda _self: os.getpid()), timeout=30)
                ray.kill(client.handle, no_restart=True)
                _wait_gone(pid)
            elif mode == "corrupt":
                first = spec.blocks[0].remote
                assert first is not None and worker.endpoint is not None
                worker._ensure_peer(spec.shard_id, spec.agent_name, spec.shard_epoch)
                garbage = np.random.default_rng(0).integers(0, 256, first.length, dtype=np.uint8)
                region = worker.endpoint.register(memoryview(garbage))
                FAULT.setdefault("keep", []).append(garbage)
                res = worker.endpoint.write(
                    spec.agent_name, [BlockOp(spec.region_id, first.offset, region, 0, first.length)], 10.0
                )
                if res.failed:
                    raise RuntimeError(f"fault injection could not corrupt the slot: {res}")
            elif mode == "unsettled":
                endpoint = worker.peers.transfer_endpoint
                real = endpoint.read

                def late(peer: str, ops: list[BlockOp], deadline_s: float, grants: Any = ()) -> Any:
                    del endpoint.read  # once
                    real(peer, ops, deadline_s, grants)  # the bytes land, as a late transfer's may
                    return all_failed(len(ops), deadline_s, "injected: the cancel was refused", settled=False)

                endpoint.read = late
            else:
                raise ValueError(f"unknown fault {mode!r}")
            FAULT["fired"].append((mode, spec.req_id, spec.shard_id))
            FAULT["mode"] = None
        super().start_load_kv(forward_context, **kwargs)


def _wait_gone(pid: int, deadline_s: float = 30.0) -> None:
    """Return once the process is gone (``ray.kill`` is asynchronous; the shard runs on this machine)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise RuntimeError(f"the killed shard (pid {pid}) is still running")


def _with_unknown_first_group(kv_cache_config: Any) -> Any:
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec

    cfg = copy.copy(kv_cache_config)
    groups = list(cfg.kv_cache_groups)
    spec = groups[0].kv_cache_spec
    fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)
              if f.name in {g.name for g in dataclasses.fields(ChunkedLocalAttentionSpec)}
              and f.name != "attention_chunk_size"}
    chunked = ChunkedLocalAttentionSpec(**fields, attention_chunk_size=spec.block_size * 2)
    groups[0] = dataclasses.replace(groups[0], kv_cache_spec=chunked)
    cfg.kv_cache_groups = groups
    return cfg


class UnknownKindKvPoolConnector(KvPoolConnector):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, _with_unknown_first_group(kv_cache_config))
