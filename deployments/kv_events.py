"""HBM prefix events: vLLM's own KV cache events (ZMQ) turned into kvstack block keys for the router.

Who calls what: ``deployments.replica.VLLMReplica`` starts the engine with a ``KVEventsConfig`` publishing to
``tcp://127.0.0.1:<port>`` (``events_config``) and runs a ``KvEventSubscriber`` thread next to it. The subscriber
binds that port (vLLM's publisher connects to a non-wildcard endpoint) before the engine starts. vLLM publishes
``BlockStored`` (its block hashes, the parent hash, the blocks' token ids), ``BlockRemoved`` and
``AllBlocksCleared`` whenever its prefix cache changes. The subscriber re-chains the token ids with
``kvpool.keys.chain_keys`` from the parent's kvstack key, or for a first block from the namespace root of the salt
vLLM hashed into it (the event's ``extra_keys``: vLLM salts a request's first block with its ``cache_salt``, the
request's ``kvpool.keys.request_salt``), so the keys are exactly the ones the ingress computes for that prompt and
tenant, and feeds them to the ``HbmPrefixLedger`` that the replica reports to the hub. A stored block whose parent
it never saw (events lost), or whose first block's extra keys are not a bare salt (LoRA, multimodal), is skipped:
under-reporting costs a missed HOLDER, never a wrong one (nor one tenant's HOLDER on another's prefix). Every wait is
bounded (poll timeout) so ``stop()`` returns promptly.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import msgspec

from kvpool.keys import BlockKey, chain_keys

log = logging.getLogger("kvstack.replica.kv_events")


def events_config(port: int, topic: str = "kvstack") -> Any:
    from vllm.config import KVEventsConfig

    return KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://127.0.0.1:{port}",
                          topic=topic)


def first_block_salt(extra_keys: list[Any] | None) -> str | None:
    """The cache salt vLLM hashed into a request's first block, from a ``BlockStored``'s ``extra_keys`` ("" for
    none); None when the block's extra keys are more than a salt (a LoRA name, multimodal items): not ours to key."""
    entry = extra_keys[0] if extra_keys else None
    if not entry:
        return ""
    if len(entry) == 1 and isinstance(entry[0], str):
        return entry[0]
    return None


class KeyTranslator:
    """vLLM block hash → kvstack key, from the stream of vLLM events (pure; unit-tested without an engine).
    ``root_of(salt)``: the namespace root of a request salted ``salt`` (the replica's ``key_root``)."""

    def __init__(self, root_of: Callable[[str], BlockKey], on_stored: Callable[[list[bytes]], None],
                 on_removed: Callable[[list[bytes]], None], on_cleared: Callable[[], None]) -> None:
        self.root_of = root_of
        self._keys: dict[Any, bytes] = {}
        self._on_stored, self._on_removed, self._on_cleared = on_stored, on_removed, on_cleared
        self.skipped = 0

    def stored(self, block_hashes: list[Any], parent: Any | None, token_ids: list[int], block_size: int,
               first_salt: str | None = "") -> None:
        """``first_salt``: for a first block (no parent), the salt vLLM hashed into it (None: unknown, skipped)."""
        if parent is None:
            if first_salt is None:
                self.skipped += len(block_hashes)
                return
            prev = self.root_of(first_salt)
        elif parent in self._keys:
            prev = BlockKey(self._keys[parent])
        else:
            self.skipped += len(block_hashes)
            return
        keys = chain_keys(prev, token_ids, block_size, limit=len(block_hashes))
        for h, k in zip(block_hashes, keys, strict=False):
            self._keys[h] = bytes(k)
        self._on_stored([bytes(k) for k in keys])

    def removed(self, block_hashes: list[Any]) -> None:
        gone = [self._keys.pop(h) for h in block_hashes if h in self._keys]
        if gone:
            self._on_removed(gone)

    def cleared(self) -> None:
        self._keys.clear()
        self._on_cleared()

    def apply(self, event: Any) -> None:
        name = type(event).__name__
        if name == "BlockStored":
            if getattr(event, "group_idx", None) not in (None, 0):
                return  # hybrid models: the full-attention group's events are the prefix; others repeat it
            salt = "" if event.parent_block_hash is not None else first_block_salt(getattr(event, "extra_keys", None))
            if getattr(event, "lora_name", None) or getattr(event, "lora_id", None):
                salt = None  # kvstack serves no adapters; never key an adapter's blocks as the base model's
            self.stored(list(event.block_hashes), event.parent_block_hash, list(event.token_ids), event.block_size,
                        first_salt=salt)
        elif name == "BlockRemoved":
            if getattr(event, "group_idx", None) not in (None, 0):
                return
            self.removed(list(event.block_hashes))
        elif name == "AllBlocksCleared":
            self.cleared()


class KvEventSubscriber(threading.Thread):
    """Binds a SUB socket on a free loopback port (``port``), then, once started, feeds a ``KeyTranslator`` under
    ``lock`` with every event batch the engine publishes to it."""

    def __init__(self, translator: KeyTranslator, lock: threading.Lock, topic: str = "kvstack") -> None:
        import zmq

        super().__init__(name="kv-events", daemon=True)
        self.translator, self.lock, self.topic = translator, lock, topic
        self._stop = threading.Event()
        self._sock = zmq.Context.instance().socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.port = self._sock.bind_to_random_port("tcp://127.0.0.1")

    def run(self) -> None:
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        sock = self._sock
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not dict(poller.poll(200)):
                    continue
                _topic, _seq, payload = sock.recv_multipart()
                try:
                    batch = decoder.decode(payload)
                except msgspec.DecodeError as exc:
                    log.warning("undecodable KV event batch: %s", exc)
                    continue
                with self.lock:
                    for event in batch.events:
                        self.translator.apply(event)
        finally:
            sock.close()

    def stop(self) -> None:
        self._stop.set()
