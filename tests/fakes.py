"""Fakes that implement the real interfaces (one labelled section per room; append only)."""

from __future__ import annotations


# --- router fakes ---
# Snapshot builders for router policy tests: real ReplicaState / PoolHit / ClusterSnapshot objects on reference
# hardware from configs/, deterministic block keys, and a manual clock.
import functools as _r_functools
import hashlib as _r_hashlib

from configs import loader as _r_loader
from router.cost import Hardware as _RHardware
from router.policies import base as _r_base
from router.policies.pricing import TierMap as _RTierMap


@_r_functools.cache
def router_hw(
    model: str = "qwen3-14b", gpu: str = "h100-sxm5-80gb", mfu: float = 0.5, bw_util: float = 0.8, gpus: int = 1
) -> _RHardware:
    """Reference hardware (one shared object per argument set, as replicas of one deployment share theirs)."""
    return _RHardware(
        model=_r_loader.load_models()[model], gpu=_r_loader.load_gpus()[gpu], mfu=mfu, bw_util=bw_util, gpus=gpus
    )


@_r_functools.cache
def router_tier_map() -> _RTierMap:
    return _RTierMap.from_tiers(_r_loader.load_tiers())


def router_keys(n: int, salt: str = "") -> list[bytes]:
    """``n`` deterministic 16-byte chained keys (stand-ins for kvpool.keys output; the router never looks inside)."""
    out: list[bytes] = []
    prev = _r_hashlib.blake2b(b"fake-root" + salt.encode(), digest_size=16).digest()
    for i in range(n):
        prev = _r_hashlib.blake2b(prev + i.to_bytes(4, "little"), digest_size=16).digest()
        out.append(prev)
    return out


def router_request(
    prompt_tokens: int, *, block_size: int = 16, request_id: str = "req-0", salt: str = ""
) -> _r_base.RouteRequest:
    n = max(prompt_tokens, 0) // block_size
    return _r_base.RouteRequest(request_id, prompt_tokens, block_size, router_keys(n, salt))


def router_replica(
    replica_id: str,
    node_id: str = "node-0",
    *,
    running: int = 0,
    waiting: int = 0,
    queue_delay_s: float = 0.0,
    hbm_prefix_blocks: int = 0,
    hw: _RHardware | None = None,
) -> _r_base.ReplicaState:
    return _r_base.ReplicaState(
        replica_id, node_id, running, waiting, queue_delay_s, hbm_prefix_blocks, hw or router_hw()
    )


def router_cluster(
    n_replicas: int, *, replicas_per_node: int = 1, hits: tuple[_r_base.PoolHit, ...] = (), **replica_kwargs: object
) -> _r_base.ClusterSnapshot:
    """``n_replicas`` identical idle replicas ``r0..`` on nodes ``node-0..`` plus the given pool hits."""
    reps = [
        router_replica(f"r{i}", f"node-{i // replicas_per_node}", **replica_kwargs)  # type: ignore[arg-type]
        for i in range(n_replicas)
    ]
    return _r_base.ClusterSnapshot(reps, hits)


class RouterClock:
    """A manual clock (seconds) for the index, the runner and calibration."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


# --- deployments fakes (request router) ---
# A stand-in for Serve's ``RunningReplica`` as ``DecisionRequestRouter`` reads it: the real ``ReplicaID`` (its
# ``unique_id`` is what the policy targets) and the ``routing_stats`` dict the replica's ``record_routing_stats``
# returns. The real class needs a live actor handle (a running Ray cluster). Ray Serve is imported on first use only.
class FakeRunningReplica:
    def __init__(self, unique_id: str, running: int = 0, waiting: int = 0,
                 routing_stats: dict[str, object] | None = None) -> None:
        from ray.serve._private.common import DeploymentID, ReplicaID

        self.replica_id = ReplicaID(unique_id, DeploymentID(name="VLLMReplica", app_name="kvstack"))
        self.routing_stats: dict[str, object] = (
            routing_stats if routing_stats is not None else {"running": running, "waiting": waiting}
        )

    def __repr__(self) -> str:
        return f"FakeRunningReplica({self.replica_id.unique_id!r}, {self.routing_stats!r})"


# --- bench fakes (OpenAI-compatible neighbour server) ---
# A small OpenAI-compatible HTTP server on 127.0.0.1 (FastAPI + uvicorn in a thread) for the load-generator tests:
# /v1/models, streamed /v1/chat/completions and /v1/completions (SSE, usage chunk, [DONE]), and /metrics in the
# router's exposition format (the real ``router.metrics.RouterMetrics`` names). It is a neighbour endpoint, not
# kvstack's: it "reuses" a prefix when an earlier prompt shared it (64-unit chunks) and reports that as an HBM hit.
import asyncio as _b_asyncio
import json as _b_json
import socket as _b_socket
import threading as _b_threading
import time as _b_time
from typing import Any as _BAny


class FakeOpenAIServer:
    """Start with ``with FakeOpenAIServer(...) as srv:``; ``srv.base_url`` is the OpenAI base URL (…/v1).

    ``received`` holds every request body in arrival order with its arrival time (``_t``, monotonic seconds);
    ``max_concurrent`` the most streams open at once; ``fail_every`` = k answers every k-th request with a 500.
    """

    CHUNK = 64

    def __init__(
        self,
        *,
        model: str = "fake-model",
        token_delay_s: float = 0.002,
        base_ttft_s: float = 0.005,
        ttft_per_new_unit_s: float = 2e-6,
        fail_every: int = 0,
        metrics: bool = True,
    ) -> None:
        self.model = model
        self.token_delay_s = token_delay_s
        self.base_ttft_s = base_ttft_s
        self.ttft_per_new_unit_s = ttft_per_new_unit_s
        self.fail_every = fail_every
        self.metrics_enabled = metrics
        self.received: list[dict[str, _BAny]] = []
        self.max_concurrent = 0
        self._open = 0
        self._seen: set[int] = set()
        self._count = 0
        self._server: _BAny = None
        self._thread: _b_threading.Thread | None = None
        self.port = 0
        from router.metrics import RouterMetrics

        self.router_metrics = RouterMetrics()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    # -- prompt bookkeeping: longest previously seen prefix, in chunks of CHUNK units (words or token ids)
    def _reuse(self, units: list[_BAny]) -> int:
        hit, parent, matching = 0, 0, True
        for i in range(0, len(units) - len(units) % self.CHUNK, self.CHUNK):
            parent = hash((parent, tuple(units[i : i + self.CHUNK])))
            if matching and parent in self._seen:
                hit += self.CHUNK
            else:
                matching = False
                self._seen.add(parent)
        return hit

    @staticmethod
    def _chat_units(body: dict[str, _BAny]) -> list[str]:
        parts = [_b_json.dumps(body.get("tools", []), sort_keys=True)]
        for m in body.get("messages", []):
            content = m.get("content") or ""
            parts.append(f"<{m.get('role')}>")
            parts.append(content if isinstance(content, str) else _b_json.dumps(content))
            if m.get("tool_calls"):
                parts.append(_b_json.dumps(m["tool_calls"], sort_keys=True))
        return " ".join(parts).split()

    def _app(self) -> _BAny:
        from fastapi import FastAPI, Request
        from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

        app = FastAPI()

        @app.get("/v1/models")
        async def models() -> dict[str, _BAny]:
            return {"object": "list", "data": [{"id": self.model, "object": "model", "created": 0, "owned_by": "fake"}]}

        @app.get("/metrics")
        async def metrics() -> _BAny:
            if not self.metrics_enabled:
                return PlainTextResponse("not found", status_code=404)
            from prometheus_client import generate_latest

            return PlainTextResponse(generate_latest(self.router_metrics.registry).decode())

        async def handle(request: Request, chat: bool) -> _BAny:
            body = await request.json()
            body["_t"] = _b_time.monotonic()
            self.received.append(body)
            self._count += 1
            if self.fail_every and self._count % self.fail_every == 0:
                return JSONResponse({"error": {"message": "injected failure", "type": "server_error"}}, status_code=500)
            if body.get("model") != self.model:
                return JSONResponse({"error": {"message": f"unknown model {body.get('model')!r}"}}, status_code=404)
            if chat:
                units: list[_BAny] = self._chat_units(body)
            else:
                prompt = body.get("prompt")
                units = list(prompt) if isinstance(prompt, list) else str(prompt).split()
            hit = self._reuse(units)
            m = self.router_metrics
            m.decisions.labels(policy="fake", action="holder" if hit else "recompute").inc()
            m.hit_tokens.labels(policy="fake", tier="hbm").inc(hit)
            n_out = max(1, int(body.get("max_tokens") or 16))
            ttft = self.base_ttft_s + self.ttft_per_new_unit_s * (len(units) - hit)
            rid = f"fake-{self._count}"
            if not body.get("stream"):
                await _b_asyncio.sleep(ttft + self.token_delay_s * n_out)
                text = " ".join(f"t{i}" for i in range(n_out))
                choice = {"index": 0, "finish_reason": "length"}
                choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
                usage = {"prompt_tokens": len(units), "completion_tokens": n_out, "total_tokens": len(units) + n_out}
                obj = "chat.completion" if chat else "text_completion"
                return {"id": rid, "object": obj, "created": 0, "model": self.model, "choices": [choice], "usage": usage}
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

            async def events() -> _BAny:
                self._open += 1
                self.max_concurrent = max(self.max_concurrent, self._open)
                try:
                    obj = "chat.completion.chunk" if chat else "text_completion"
                    if chat:
                        first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                        yield "data: " + _b_json.dumps({"id": rid, "object": obj, "created": 0, "model": self.model,
                                                        "choices": [first]}) + "\n\n"
                    await _b_asyncio.sleep(ttft)
                    for i in range(n_out):
                        if i:
                            await _b_asyncio.sleep(self.token_delay_s)
                        piece = f"t{i} "
                        ch = {"index": 0, "finish_reason": "length" if i == n_out - 1 else None}
                        ch.update({"delta": {"content": piece}} if chat else {"text": piece})
                        yield "data: " + _b_json.dumps({"id": rid, "object": obj, "created": 0, "model": self.model,
                                                        "choices": [ch]}) + "\n\n"
                    if include_usage:
                        usage = {"prompt_tokens": len(units), "completion_tokens": n_out,
                                 "total_tokens": len(units) + n_out}
                        yield "data: " + _b_json.dumps({"id": rid, "object": obj, "created": 0, "model": self.model,
                                                        "choices": [], "usage": usage}) + "\n\n"
                    yield "data: [DONE]\n\n"
                finally:
                    self._open -= 1

            return StreamingResponse(events(), media_type="text/event-stream")

        async def chat_completions(request: Request) -> _BAny:
            return await handle(request, chat=True)

        async def completions(request: Request) -> _BAny:
            return await handle(request, chat=False)

        # This module uses postponed annotations and Request is imported here, not at module level: give FastAPI
        # the class itself, or it cannot resolve the name and treats ``request`` as a query parameter.
        for endpoint, path in ((chat_completions, "/v1/chat/completions"), (completions, "/v1/completions")):
            endpoint.__annotations__["request"] = Request
            app.post(path)(endpoint)

        return app

    def start(self, timeout_s: float = 15.0) -> FakeOpenAIServer:
        import uvicorn

        with _b_socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        config = uvicorn.Config(self._app(), host="127.0.0.1", port=self.port, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = _b_threading.Thread(target=self._server.run, name="fake-openai", daemon=True)
        self._thread.start()
        deadline = _b_time.monotonic() + timeout_s
        while not self._server.started:
            if _b_time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"fake OpenAI server did not start on port {self.port} within {timeout_s}s")
            _b_time.sleep(0.02)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise RuntimeError("fake OpenAI server did not stop")

    def __enter__(self) -> FakeOpenAIServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --- kvpool fakes (shard pull) ---
# ``LoopbackEndpoint``: the ``TransferEndpoint`` interface over memory of this one process. Endpoints that share a
# ``LoopbackFabric`` reach each other's registered buffers by agent name; a fabric can mark an agent dead (its ops
# fail, like a dead peer) or fail chosen op indices of every call (a partial failure, as TCP can report).
# ``StoreSource``: a pull source (``kvpool.shard_pull.PullSource``) over a real ``BlockStore`` of this process, with
# its arena registered on a loopback endpoint; it can be dead (every call raises ``ShardDeadError``), frozen (every
# call waits out its deadline, then raises ``ShardUnavailableError``) or refuse leases (``PullSourceError``).
import threading as _p_threading
import time as _p_time
from collections.abc import Sequence as _PSequence

from kvpool.store import BlockStore as _PBlockStore
from kvpool.transfer.base import TRANSFER_WIRE_VERSION as _P_TRANSFER_WIRE_VERSION
from kvpool.transfer.base import AgentMetadata as _PAgentMetadata
from kvpool.transfer.base import BlockOp as _PBlockOp
from kvpool.transfer.base import RegionDesc as _PRegionDesc
from kvpool.transfer.base import TransferEndpoint as _PTransferEndpoint
from kvpool.transfer.base import StaleMetadataError as _PStaleMetadataError
from kvpool.transfer.base import TransferResult as _PTransferResult
from kvpool.transfer.common import Deadline as _PDeadline
from kvpool.transfer.common import OpTable as _POpTable
from kvpool.transfer.common import admit as _p_admit
from kvpool.transfer.common import all_failed as _p_all_failed
from kvpool.transfer.common import new_epoch as _p_new_epoch
from kvpool.transfer.metrics import TransferMetrics as _PTransferMetrics


class LoopbackFabric:
    def __init__(self) -> None:
        self.buffers: dict[str, list[memoryview]] = {}
        self.dead: set[str] = set()
        self.frozen: set[str] = set()  # ops to a frozen agent wait out their deadline, then fail
        self.fail_ops: set[int] = set()


class LoopbackEndpoint(_PTransferEndpoint):
    """Runs through the transport conformance suite like the real backends: peers admitted by the shared rule
    (``kvpool.transfer.common.admit``: version, backend, epoch order), ops validated up front (``OpTable``), every
    call bounded by its deadline, failures as data, ``TransferMetrics`` observed per call."""

    backend = "loopback"

    def __init__(self, fabric: LoopbackFabric, agent_name: str, epoch: str | None = None,
                 metrics: _PTransferMetrics | None = None) -> None:
        self.fabric = fabric
        self.name = agent_name
        self.epoch = epoch if epoch is not None else _p_new_epoch()
        self.peers: dict[str, _PAgentMetadata] = {}
        self.reads = 0
        self.metrics = metrics
        fabric.buffers[agent_name] = []

    def register(self, buffer: memoryview) -> int:
        self.fabric.buffers[self.name].append(memoryview(buffer).cast("B"))
        return len(self.fabric.buffers[self.name]) - 1

    def metadata(self) -> _PAgentMetadata:
        regions = [_PRegionDesc(i, len(b)) for i, b in enumerate(self.fabric.buffers[self.name])]
        return _PAgentMetadata(_P_TRANSFER_WIRE_VERSION, self.backend, self.name, self.epoch, regions)

    def add_peer(self, meta: _PAgentMetadata) -> None:
        _p_admit(meta, self.backend, self.peers.get(meta.agent_name))
        if meta.payload:
            raise _PStaleMetadataError(f"peer {meta.agent_name!r}: loopback metadata carries no payload")
        self.peers[meta.agent_name] = meta

    def remove_peer(self, agent_name: str) -> None:
        self.peers.pop(agent_name, None)

    def _move(self, peer: str, ops: _PSequence[_PBlockOp], deadline_s: float, read: bool) -> _PTransferResult:
        deadline = _PDeadline(deadline_s)
        table = _POpTable(ops)
        mine = self.fabric.buffers.get(self.name, [])
        table.check_local({i: len(b) for i, b in enumerate(mine)})
        meta = self.peers.get(peer)
        if meta is not None:
            table.check_remote({r.region_id: r.length for r in meta.regions}, peer)
        result = self._transfer(peer, meta, ops, deadline, read)
        if self.metrics is not None:
            self.metrics.observe(self.backend, "read" if read else "write", result)
        return result

    def _transfer(self, peer: str, meta: _PAgentMetadata | None, ops: _PSequence[_PBlockOp], deadline: _PDeadline,
                  read: bool) -> _PTransferResult:
        theirs = self.fabric.buffers.get(peer)
        if meta is None or peer in self.fabric.dead or theirs is None:
            return _p_all_failed(len(ops), deadline.elapsed(), f"peer {peer!r} is gone")
        if peer in self.fabric.frozen:
            _p_time.sleep(max(0.0, deadline.remaining()))
            return _p_all_failed(len(ops), deadline.elapsed(), f"peer {peer!r} did not answer before the deadline")
        if deadline.expired():
            return _p_all_failed(len(ops), deadline.elapsed(), "deadline expired before the transfer started")
        mine = self.fabric.buffers[self.name]
        moved = 0
        failed = sorted(i for i in self.fabric.fail_ops if i < len(ops))
        for i, op in enumerate(ops):
            if i in self.fabric.fail_ops:
                continue
            src = theirs[op.remote_region] if read else mine[op.local_region]
            dst = mine[op.local_region] if read else theirs[op.remote_region]
            s_off, d_off = (op.remote_offset, op.local_offset) if read else (op.local_offset, op.remote_offset)
            dst[d_off : d_off + op.length] = src[s_off : s_off + op.length]
            moved += op.length
        ok = [i for i in range(len(ops)) if i not in self.fabric.fail_ops]
        return _PTransferResult(ok, failed, moved, deadline.elapsed(), "injected" if failed else "")

    def read(self, peer: str, ops: _PSequence[_PBlockOp], deadline_s: float) -> _PTransferResult:
        self.reads += 1
        return self._move(peer, ops, deadline_s, read=True)

    def write(self, peer: str, ops: _PSequence[_PBlockOp], deadline_s: float) -> _PTransferResult:
        return self._move(peer, ops, deadline_s, read=False)

    def close(self) -> None:
        self.fabric.buffers.pop(self.name, None)


class StoreSource:
    """A ``PullSource`` over a real ``BlockStore`` in this process (mode: "ok" | "dead" | "frozen" | "refuse")."""

    def __init__(self, store: _PBlockStore, fabric: LoopbackFabric, epoch: str = "e1") -> None:
        self.store = store
        self.shard_id = store.shard_id
        self.agent_name = f"kvpool-{store.shard_id}"
        self.endpoint = LoopbackEndpoint(fabric, self.agent_name, epoch)
        self.region_id = self.endpoint.register(store.arena.buffer)
        self.mode = "ok"
        self.leased: list[list[bytes]] = []  # keys of every lease asked for
        self.released: list[int] = []
        self.metadata_calls = 0
        self._lock = _p_threading.Lock()

    def _enter(self, deadline_s: float) -> None:
        from kvpool.shard import ShardDeadError, ShardUnavailableError

        if self.mode == "dead":
            raise ShardDeadError(f"source shard {self.shard_id}: actor is dead (fake)")
        if self.mode == "frozen":
            _p_time.sleep(max(deadline_s, 0.0))
            raise ShardUnavailableError(f"source shard {self.shard_id}: no answer within {deadline_s}s (fake)")

    def lease(self, keys: list[bytes], fingerprint: str, ttl_s: float, deadline_s: float) -> object:
        from kvpool.shard import LeaseReply
        from kvpool.shard_pull import PullSourceError

        self._enter(deadline_s)
        if self.mode == "refuse":
            raise PullSourceError(f"source shard {self.shard_id}.lease refused: ttl too long (fake)")
        self.leased.append(list(keys))
        with self._lock:
            lease = self.store.lease(keys, fingerprint, ttl_s)
        return LeaseReply(self.shard_id, self.store.epoch, self.agent_name, self.region_id, lease)

    def release(self, lease_id: int, deadline_s: float) -> bool:
        if self.mode in ("dead", "frozen"):
            return False
        self.released.append(lease_id)
        with self._lock:
            return self.store.release(lease_id)

    def transfer_metadata(self, deadline_s: float) -> bytes:
        from kvpool.transfer import encode_metadata

        self._enter(deadline_s)
        self.metadata_calls += 1
        return encode_metadata(self.endpoint.metadata())
