"""A vLLM worker extension (vLLM's ``worker_extension_cls``): what an engine worker process says about itself.

vLLM mixes ``EngineWorkerReport`` into the worker class of every worker process of the replica's engine
(``deployments.replica.build_engine_args`` sets ``worker_extension_cls = WORKER_EXTENSION``); the replica calls
``engine.collective_rpc(BINDING_METHOD)`` once its engine is up and puts the answers into its placement
(``router.hub.EngineWorkerBinding``): each worker's pid and the CPUs the OS lets the worker's main thread run on —
the binding as it is, not as it was asked for. A method name, not a pickled function: it needs no insecure
serialization, so pool-off replicas report it too.
"""

from __future__ import annotations

import os
from typing import Any

WORKER_EXTENSION = "deployments.engine_worker.EngineWorkerReport"
BINDING_METHOD = "kvstack_binding"


class EngineWorkerReport:
    def kvstack_binding(self) -> dict[str, Any]:
        """This worker process's pid and the CPUs its main thread may run on (``sched_getaffinity``)."""
        return {"pid": os.getpid(), "cpus": sorted(os.sched_getaffinity(0))}
