"""The pool shard actor: one Ray actor per node wrapping a ``BlockStore``, its DRAM arena registered with a transfer
endpoint. Started and stopped by ``kvpool.shard.placement``; called only through ``kvpool.shard.client``.

What its methods serve (every request and reply is a ``kvpool.shard.wire`` struct as msgpack bytes):
- The vLLM connector's scheduler side calls ``lookup`` (side-effect free), ``lease`` / ``release``; its save path
  calls ``reserve``, writes the blocks with its own transfer endpoint into the shard's arena at the reserved
  offsets, then ``commit`` (or ``abort``). Its worker side ``add_peer``s ``transfer_metadata()`` and reads leased
  blocks at the returned offsets of ``region_id``. A store with a shared arena (a memfd) is also exported to
  same-host clients (``shm_metadata()``, ``kvpool.transfer.shm``: the same region id and offsets); the connector
  uses it for the shard on its own node: its loads and saves are one memory copy.
- A replica ``touch``es the pool blocks of a prefix its engine served from its own HBM (without waiting), so a
  prefix that stays hot in HBM does not age out of the pool meanwhile.
- A replica (the router's SPLIT action: fetch the tail while the head is computed) or an operator asks a shard to
  ``pull`` blocks from a peer shard. This is the ONLY time a shard initiates a transfer: it leases the blocks on
  the source, reads them with its own endpoint into reserved slots of its arena, commits the ones whose checksums
  match and always releases the lease (``kvpool.shard.pull``). Every other transfer is initiated by a client.
- The router's cluster view pulls ``events_since`` / ``snapshot``, or long-polls ``events_wait``: the same answer,
  held until there is an event or the request's ``wait_s`` has passed.
- Operators / Prometheus read ``stats`` and ``metrics_text`` (or the HTTP exporter when ``metrics_port`` > 0);
  tests and draining read ``entry_info`` and call ``demote``.

Every call carries the cluster secret's proof (``kvpool.secret.call_proof`` for its op; a commit's is bound to its
reservation in this incarnation): a call without it is refused with a ``PermissionError`` that says nothing of the
shard and counted in ``kvstack_pool_unauthenticated_total`` — a Ray caller that does not know the secret gets no
transfer metadata, no lookup, no lease, no slot, no event. On the TCP backend its server also checks grants: a
transfer moves only spans inside the slots of a lease (read) or reservation (read, write) whose grant the peer
presents (``kvpool.store``, "Grants"; refusals counted with op ``tcp_read`` / ``tcp_write``).

A request of another wire version is refused (``WireVersionError``). The actor is threaded (``max_concurrency``) and
calls its store without a lock of its own: the store is thread-safe (``kvpool.store``: its lock covers metadata
only; SSD reads and writes and lease checksums run outside it, so a slow disk stalls only the calls that wait on
that block). Lease and reservation expiry run on a background sweeper thread every ``sweep_interval_s``, so expiry
does not wait for the next request. ``pull`` runs in its own concurrency group (``PULL_CONCURRENCY`` threads; more
pulls queue there): a pull waits on its source for up to its deadline, and pulls stuck on a frozen source must not
starve ``lookup`` / ``lease`` of the connectors. ``events_wait`` has its own group for the same reason
(``EVENTS_CONCURRENCY`` threads: a router keeps one long poll per shard; with more routers than threads, the
extra polls queue for at most one wait each).
"""

from __future__ import annotations

import hmac
import logging
import threading
from collections.abc import Sequence
from typing import Any

import msgspec
import ray

from kvpool.checksum import CHECKSUM_ALGO
from kvpool.metrics import PoolMetrics
from kvpool.secret import call_proof, pool_secret
from kvpool.shard.pull import Puller, named_shard_resolver
from kvpool.shard.wire import (
    MAX_EVENTS_WAIT_S,
    AbortRequest,
    AckReply,
    CommitReply,
    CommitRequest,
    CountReply,
    DemoteRequest,
    EntryReply,
    EventsRequest,
    LeaseReply,
    LeaseRequest,
    LookupReply,
    LookupRequest,
    PullRequest,
    ReleaseRequest,
    ReserveReply,
    ReserveRequest,
    ShardConfig,
    ShardInfo,
    StatsReply,
    TouchRequest,
    WireVersionError,
    decode,
    encode,
)
from kvpool.store import BlockStore
from kvpool.transfer.nixl import NixlOptions
from kvpool.transfer.tcp import TcpOptions

log = logging.getLogger(__name__)

PULL_CONCURRENCY = 4  # pulls run in their own Ray concurrency group of this many threads (see the module doc)
EVENTS_CONCURRENCY = 16  # events long polls (``events_wait``): one per router at a time; more queue (module doc)


class PoolShard:
    """Ray actor body (see ``PoolShardActor``). Methods take and return msgpack bytes of ``kvpool.shard.wire``
    structs."""

    def __init__(self, config: bytes) -> None:
        cfg = msgspec.msgpack.decode(config, type=ShardConfig)
        self.config = cfg
        self.metrics = PoolMetrics(cfg.shard_id)
        self._secret = pool_secret()  # the cluster secret of this process (kvpool.secret): the write path needs it
        self.store = BlockStore(cfg.store, shard_id=cfg.shard_id, metrics=self.metrics)
        ctx = ray.get_runtime_context()
        self.node_id = ctx.get_node_id()
        self.node_ip = ray.util.get_node_ip_address()
        self.agent_name = f"kvpool-{cfg.shard_id}"
        self.endpoint: Any = None
        self.region_id = -1
        if cfg.backend != "none":
            from kvpool.transfer import make_endpoint

            if cfg.backend == "tcp":  # the one backend that checks grants per span (kvpool.transfer.tcp, "Grants")
                from kvpool.transfer.tcp import TcpEndpoint

                self.endpoint = TcpEndpoint(self.agent_name, options=cfg.tcp or TcpOptions(bind_host=self.node_ip),
                                            grant_check=self._granted)
            else:
                self.endpoint = make_endpoint(cfg.backend, self.agent_name, options=cfg.nixl or NixlOptions())
            self.region_id = self.endpoint.register(self.store.arena.buffer)
        self.shm: Any = None  # the arena exported to same-host clients (kvpool.transfer.shm), with the same region id
        if self.endpoint is not None and self.store.arena.fd is not None:
            from kvpool.transfer.shm import ShmEndpoint

            self.shm = ShmEndpoint(self.agent_name)
            if self.shm.register_shared(self.store.arena.buffer, self.store.arena.fd) != self.region_id:
                raise RuntimeError("shared-memory region id differs from the transfer endpoint's")
        self._puller = Puller(self.store, self.endpoint, self.region_id, named_shard_resolver(cfg.registry_namespace))
        self._http: Any = None
        if cfg.metrics_port > 0:
            from prometheus_client import start_http_server

            self._http, _ = start_http_server(cfg.metrics_port, registry=self.metrics.registry)
        self._stop = threading.Event()
        self._sweeper = threading.Thread(target=self._sweep_loop, name=f"sweep-{cfg.shard_id}", daemon=True)
        self._sweeper.start()

    def _granted(self, op: str, grants: Sequence[bytes], spans: Sequence[tuple[int, int, int]]) -> bool:
        """The TCP server's grant check: every span in the arena, inside slots the grants cover
        (``BlockStore.granted``). A refusal is counted like an unauthenticated call."""
        ok = all(region == self.region_id for region, _, _ in spans) and self.store.granted(
            grants, [(offset, length) for _, offset, length in spans], write=op == "write")
        if not ok:
            self.metrics.refused(f"tcp_{op}")
        return ok

    def _sweep_loop(self) -> None:
        while not self._stop.wait(self.config.sweep_interval_s):
            try:
                self.store.sweep()
            except Exception:  # keep sweeping; a failing sweep is logged, never fatal
                log.exception("shard %s: sweep failed", self.config.shard_id)

    def info(self, proof: bytes = b"") -> bytes:
        self._check(proof, "info")
        return encode(
            ShardInfo(
                self.config.shard_id, self.store.epoch, self.node_id, self.node_ip, self.config.backend,
                self.agent_name, self.region_id, self.config.store.slot_bytes,
            )
        )

    def transfer_metadata(self, proof: bytes = b"") -> bytes:
        """``kvpool.transfer.encode_metadata`` of this shard's endpoint (peers ``add_peer`` it)."""
        self._check(proof, "transfer_metadata")
        if self.endpoint is None:
            raise RuntimeError(f"shard {self.config.shard_id} runs without a transfer endpoint (backend 'none')")
        from kvpool.transfer import encode_metadata

        return encode_metadata(self.endpoint.metadata())

    def shm_metadata(self, proof: bytes = b"") -> bytes:
        """``kvpool.transfer.encode_metadata`` of the shared-memory export of the arena (same-host clients)."""
        self._check(proof, "shm_metadata")
        if self.shm is None:
            raise RuntimeError(f"shard {self.config.shard_id} does not export its arena through shared memory")
        from kvpool.transfer import encode_metadata

        return encode_metadata(self.shm.metadata())

    def lookup(self, raw: bytes, proof: bytes = b"") -> bytes:
        self._check(proof, "lookup")
        req = decode(raw, LookupRequest)
        res = self.store.lookup(req.keys, req.fingerprint)
        return encode(LookupReply(self.config.shard_id, self.store.epoch, res))

    def lease(self, raw: bytes, proof: bytes = b"") -> bytes:
        self._check(proof, "lease")
        req = decode(raw, LeaseRequest)
        lease = self.store.lease(req.keys, req.fingerprint, req.ttl_s)
        return encode(LeaseReply(self.config.shard_id, self.store.epoch, self.agent_name, self.region_id, lease))

    def touch(self, raw: bytes, proof: bytes = b"") -> bytes:
        """``TouchRequest`` → ``CountReply``: how many of its keys are held here (callers usually do not wait)."""
        self._check(proof, "touch")
        req = decode(raw, TouchRequest)
        return encode(CountReply(self.store.touch(req.keys, req.fingerprint)))

    def release(self, raw: bytes, proof: bytes = b"") -> bytes:
        self._check(proof, "release")
        req = decode(raw, ReleaseRequest)
        ok = self.store.release(req.lease_id)
        return encode(AckReply(self.config.shard_id, self.store.epoch, ok))

    def _check(self, got: bytes, op: str, reservation_id: int = 0, epoch: str = "") -> None:
        """Refuse a call without the cluster secret's proof (``kvpool.secret.call_proof``), saying nothing else."""
        if not hmac.compare_digest(got, call_proof(self._secret, op, reservation_id, epoch)):
            self.metrics.refused(op)
            raise PermissionError(f"{op}: not authenticated (the cluster secret's proof is missing or wrong)")

    def reserve(self, raw: bytes, proof: bytes = b"") -> bytes:
        self._check(proof, "reserve")
        req = decode(raw, ReserveRequest)
        res = self.store.reserve(req.n)
        return encode(
            ReserveReply(self.config.shard_id, self.store.epoch, self.agent_name, self.region_id, res)
        )

    def commit(self, raw: bytes, proof: bytes = b"") -> bytes:
        req = decode(raw, CommitRequest)
        # bound to its reservation in this incarnation (the call's own proof: unused)
        self._check(req.proof, "commit", req.reservation_id, self.store.epoch)
        if req.checksum_algo != CHECKSUM_ALGO:
            raise WireVersionError(f"checksum algorithm {req.checksum_algo!r}, this shard uses {CHECKSUM_ALGO!r}")
        res = self.store.commit(req.reservation_id, req.keys, req.checksums, req.fingerprint, model=req.model)
        return encode(CommitReply(self.config.shard_id, self.store.epoch, res))

    def abort(self, raw: bytes, proof: bytes = b"") -> bytes:
        self._check(proof, "abort")
        req = decode(raw, AbortRequest)
        ok = self.store.abort(req.reservation_id)
        return encode(AckReply(self.config.shard_id, self.store.epoch, ok))

    def events_since(self, raw: bytes, proof: bytes = b"") -> bytes:
        self._check(proof, "events_since")
        req = decode(raw, EventsRequest)
        return encode(self.store.events_since(req.after_seq, req.max_events))

    @ray.method(concurrency_group="events")
    def events_wait(self, raw: bytes, proof: bytes = b"") -> bytes:
        """``events_since`` as a long poll (``EventsRequest.wait_s``, capped at ``MAX_EVENTS_WAIT_S``): a router
        asks again as soon as it has applied a batch, and an idle shard answers once per wait instead of once per
        poll interval. Its own concurrency group, so waiting polls never hold up the connectors' calls."""
        self._check(proof, "events_wait")
        req = decode(raw, EventsRequest)
        wait_s = min(max(req.wait_s, 0.0), MAX_EVENTS_WAIT_S)
        return encode(self.store.events_since(req.after_seq, req.max_events, wait_s=wait_s))

    def snapshot(self, proof: bytes = b"") -> bytes:
        self._check(proof, "snapshot")
        return encode(self.store.snapshot())

    @ray.method(concurrency_group="pull")
    def pull(self, raw: bytes, proof: bytes = b"") -> bytes:
        """``PullRequest`` → ``PullReply`` (``kvpool.shard.pull``); the store lock is not held while bytes move."""
        self._check(proof, "pull")
        req = decode(raw, PullRequest)
        return encode(self._puller.pull(req))

    def stats(self, proof: bytes = b"") -> bytes:
        self._check(proof, "stats")
        st = self.store.stats()
        return encode(StatsReply(msgspec.structs.replace(st, counters={**st.counters, **self._puller.counters()})))

    def metrics_text(self, proof: bytes = b"") -> bytes:
        self._check(proof, "metrics_text")
        return self.metrics.exposition()

    def entry_info(self, key: bytes, proof: bytes = b"") -> bytes:
        """Where one block lies (tests and debugging; e.g. the slab path and offset of an SSD block)."""
        self._check(proof, "entry_info")
        return encode(EntryReply(self.store.entry_info(key)))

    def demote(self, raw: bytes, proof: bytes = b"") -> bytes:
        """``DemoteRequest`` → ``CountReply``: move these unpinned DRAM blocks to SSD now (draining, tests)."""
        self._check(proof, "demote")
        req = decode(raw, DemoteRequest)
        return encode(CountReply(self.store.demote(req.keys)))

    def close(self) -> None:
        """Stop the sweeper, close the endpoint and the store. Idempotent; the actor can be killed afterwards."""
        self._stop.set()
        self._sweeper.join(timeout=5.0)
        self._puller.close()
        if self._http is not None:
            self._http.shutdown()
            self._http = None
        if self.shm is not None:
            self.shm.close()
            self.shm = None
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None
        self.store.close()


PoolShardActor = ray.remote(concurrency_groups={"pull": PULL_CONCURRENCY, "events": EVENTS_CONCURRENCY})(PoolShard)
