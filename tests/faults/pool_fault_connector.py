"""``HookedKvPoolConnector``: a ``KvPoolConnector`` that runs a test's hook at two points of a request's life, for the
fault suite (``tests/faults/test_pool_faults.py``). In-process engines only: vLLM loads it from
``kv_connector_module_path="tests.faults.pool_fault_connector"`` in the test process, and the test arms a hook
through the module-level ``HOOKS``.

- ``HOOKS["before_lease"](scheduler_side, request, num_external_tokens) -> bool``: on vLLM's scheduler thread,
  after the lookup answered and vLLM allocated the blocks, right before the connector starts the lease (the real
  ``update_state_after_alloc`` runs after it, unchanged). Whatever it does to the shard happens between the
  lookup and the lease.
- ``HOOKS["before_load"](worker_side, specs) -> bool``: on the worker's background loader thread, right before it
  reads a batch of leased blocks (the real ``_load_batch`` runs after it, unchanged). It may take its time: the
  requests wait in ``WAITING_FOR_REMOTE_KVS`` meanwhile, the engine keeps stepping.

A hook returns whether it fired (a hook that did not fire stays armed); each firing is appended to
``HOOKS["fired"]`` as ``(point, request ids)``.
"""

from __future__ import annotations

from typing import Any

from kvpool.connector.kv_connector import KvPoolConnector
from kvpool.connector.loader import BlockLoader

HOOKS: dict[str, Any] = {"before_lease": None, "before_load": None, "fired": []}


def arm(point: str, hook: Any) -> None:
    HOOKS[point] = hook


def disarm() -> None:
    HOOKS["before_lease"] = HOOKS["before_load"] = None


def fired(point: str) -> list[list[str]]:
    return [rids for p, rids in HOOKS["fired"] if p == point]


class HookedKvPoolConnector(KvPoolConnector):
    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        hook = HOOKS["before_lease"]
        if hook is not None and num_external_tokens > 0 and self.scheduler_side is not None:
            if hook(self.scheduler_side, request, num_external_tokens):
                HOOKS["fired"].append(("before_lease", [request.request_id]))
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        worker = self.worker_side
        if worker is not None and worker.loader is None:
            real = worker._load_batch

            def load_batch(specs: list[Any]) -> None:
                hook = HOOKS["before_load"]
                if hook is not None and hook(worker, specs):
                    HOOKS["fired"].append(("before_load", [s.req_id for s in specs]))
                real(specs)

            worker.loader = BlockLoader(load_batch, name=f"{worker.agent_name}-loader")
        super().start_load_kv(forward_context, **kwargs)
