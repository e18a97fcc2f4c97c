"""The cluster secret: what a pool peer proves it knows before the pool serves it a byte (issue 16, item 3).

One secret per cluster, in the environment of every process of it as ``KVSTACK_POOL_SECRET`` (any non-empty
string; ``kvstack serve`` generates 32 random bytes, hex, before it starts the local Ray cluster, whose processes
inherit it; on KubeRay it comes from a Kubernetes Secret on the pods). It is never logged, never put in a config,
a Serve runtime env or an actor argument. Who uses it: the TCP transport's handshake (``kvpool.transfer.tcp``:
both sides prove it with HMAC-SHA256 over fresh nonces before any request is read, so nothing is allocated or said
to a stranger), and every call to a shard (``kvpool.shard``: each carries ``call_proof(secret, op)``, a
commit ``call_proof(secret, "commit", reservation id, shard epoch)``; a shard refuses a call without it, so a Ray caller
that does not know the secret learns nothing of the shard — not its transfer metadata, not which blocks it holds —
can take no slot or lease and make no block visible). With no secret set, the handshake runs with an empty key: it keeps peers of one build in step but
authenticates nothing (``configured`` says which; the start-up log says so).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import MutableMapping

POOL_SECRET_ENV = "KVSTACK_POOL_SECRET"
NONCE_BYTES = 16
MAC_BYTES = hashlib.sha256().digest_size


def pool_secret(environ: MutableMapping[str, str] | None = None) -> bytes:
    """This process's cluster secret (b"" when none is set)."""
    return (os.environ if environ is None else environ).get(POOL_SECRET_ENV, "").encode()


def configured(environ: MutableMapping[str, str] | None = None) -> bool:
    return bool(pool_secret(environ))


def ensure_pool_secret(environ: MutableMapping[str, str] | None = None) -> bool:
    """Generate a secret into ``environ`` (default ``os.environ``) unless one is set; True if it generated one."""
    env = os.environ if environ is None else environ
    if env.get(POOL_SECRET_ENV):
        return False
    env[POOL_SECRET_ENV] = secrets.token_hex(32)
    return True


def nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def proof(secret: bytes, label: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 of ``label`` and ``parts`` (each length-prefixed, so no two inputs share a message)."""
    msg = b"".join(len(p).to_bytes(4, "big") + p for p in (label, *parts))
    return hmac.new(secret, msg, hashlib.sha256).digest()


def verify(secret: bytes, got: bytes, label: bytes, *parts: bytes) -> bool:
    return hmac.compare_digest(got, proof(secret, label, *parts))


def call_proof(secret: bytes, op: str, reservation_id: int = 0, epoch: str = "") -> bytes:
    """The proof a call ``op`` to a pool shard carries. A ``commit``'s is bound to its reservation and to the shard
    incarnation (``epoch``) that granted it: reservation ids restart with every incarnation, so a commit proof seen
    once never commits into a later incarnation's reservation of the same id. Not bound to the shard's id:
    callers name a shard by what found it (a configured id, a node id), the shard itself by its own id."""
    return proof(secret, b"kvstack-shard-" + op.encode(), str(reservation_id).encode(), epoch.encode())
