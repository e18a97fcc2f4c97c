"""Integration: who may talk to the Ray cluster the pool runs in (issue 16: nothing in the pool trusts a peer that
has not proven it belongs to the cluster; the pool's call proofs travel in Ray's traffic, and Ray's gRPC servers
listen on every interface whatever the node IP).

- Ray's mutual TLS, as the KubeRay manifests turn it on: the init container's script
  (``k8s/base/ray-tls/make-cert.sh``, the file the ConfigMap carries) makes a certificate from a cluster CA made
  with ``openssl``; a peer without a certificate from that CA cannot talk to the cluster at all — a plaintext gRPC
  channel to the GCS, a TLS channel that presents no client certificate and one that presents a certificate of
  another CA never become ready, while one with the cluster's certificate does (the control).
- Ray's token authentication, which ``LocalCluster`` (``kvstack serve``) turns on with a token of its own unless
  the caller chose a mode: a driver with the certificate but without the token, or with a wrong one, does not join.
- On that cluster (a real local multi-node one, started by ``LocalCluster`` with the TLS settings and no
  ``RAY_AUTH_MODE``), a driver with both starts a pool shard on every worker node and calls it with the cluster
  secret's proofs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.cluster_process import REPO, ClusterProcess, running_cluster

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

SCRIPT = REPO / "k8s/base/ray-tls/make-cert.sh"
TOKEN = "c0ffee" * 8
LOOPBACK_NODES = " ".join(f"127.0.0.{i}" for i in range(2, 10))  # LocalCluster's node IPs (127.0.0.2, .3, ...)


def make_ca(where: Path) -> Path:
    where.mkdir(parents=True)
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(where / "ca.key"),
                    "-out", str(where / "ca.crt"), "-days", "2", "-subj", "/CN=kvstack-test-ca"],
                   check=True, capture_output=True, timeout=60)
    return where


def make_cert(ca: Path, out: Path) -> dict[str, str]:
    """Run the pod's script as the init container does; Ray's TLS settings for what it made."""
    env = {"PATH": os.environ["PATH"], "RAY_TLS_CA_DIR": str(ca), "RAY_TLS_DIR": str(out), "POD_IP": "127.0.0.1",
           "RAY_TLS_EXTRA_IPS": LOOPBACK_NODES, "POD_NAMESPACE": "kvstack"}
    subprocess.run(["sh", str(SCRIPT)], env=env, check=True, capture_output=True, timeout=60)
    return {"RAY_USE_TLS": "1", "RAY_TLS_SERVER_CERT": str(out / "tls.crt"),
            "RAY_TLS_SERVER_KEY": str(out / "tls.key"), "RAY_TLS_CA_CERT": str(out / "ca.crt")}


@pytest.fixture(scope="module")
def tls_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ClusterProcess, dict[str, str], Path]]:
    if any(k.startswith("RAY_TLS") or k == "RAY_USE_TLS" for k in os.environ):
        pytest.skip("this process already has Ray TLS settings")
    tmp = tmp_path_factory.mktemp("ray-tls")
    tls = make_cert(make_ca(tmp / "ca"), tmp / "tls")
    # as kvstack serve starts it: no RAY_AUTH_MODE chosen (LocalCluster turns token authentication on; the token is
    # given here only so the test's own drivers can present it), the pool secret in every process's environment
    env = {**tls, "RAY_AUTH_MODE": "", "RAY_AUTH_TOKEN": TOKEN, "KVSTACK_POOL_SECRET": "tls-test-secret"}
    yield from ((c, tls, tmp) for c in running_cluster(tmp, workers=2, env=env))


def joins(address: str, env: dict[str, str], timeout_s: float = 10.0) -> bool:
    """Whether a plain ``ray.init`` with ``env`` (over this process's environment, Ray's TLS and auth settings
    removed) joins the cluster at ``address`` within ``timeout_s``."""
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("VLLM_", "RAY_TLS", "RAY_USE_TLS", "RAY_AUTH"))}
    probe = f"import ray; ray.init(address={address!r}); print('joined', len(ray.nodes()))"
    try:
        run = subprocess.run([sys.executable, "-c", probe], env={**base, **env}, capture_output=True, text=True,
                             timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return False
    return "joined" in run.stdout


def channel_ready(address: str, credentials: object | None, wait_s: float = 5.0) -> bool:
    """Whether a gRPC channel to ``address`` (plaintext when ``credentials`` is None) gets through its handshake."""
    import grpc

    channel = grpc.insecure_channel(address) if credentials is None else grpc.secure_channel(address, credentials)
    try:
        grpc.channel_ready_future(channel).result(timeout=wait_s)
        return True
    except grpc.FutureTimeoutError:
        return False
    finally:
        channel.close()


def test_the_script_makes_a_certificate_for_the_pods_names_signed_by_the_ca(tmp_path: Path) -> None:
    ca = make_ca(tmp_path / "ca")
    tls = make_cert(ca, tmp_path / "tls")
    verify = subprocess.run(["openssl", "verify", "-CAfile", str(ca / "ca.crt"), tls["RAY_TLS_SERVER_CERT"]],
                            capture_output=True, text=True, timeout=30)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    text = subprocess.run(["openssl", "x509", "-in", tls["RAY_TLS_SERVER_CERT"], "-noout", "-text"],
                          capture_output=True, text=True, check=True, timeout=30).stdout
    assert "IP Address:127.0.0.1" in text and "IP Address:127.0.0.2" in text
    assert "DNS:*.kvstack.svc.cluster.local" in text
    assert "TLS Web Server Authentication, TLS Web Client Authentication" in text  # both ends of mutual TLS
    assert oct(os.stat(tls["RAY_TLS_SERVER_KEY"]).st_mode & 0o777) == "0o600"
    assert subprocess.run(["sh", str(SCRIPT)], env={"PATH": os.environ["PATH"]}, capture_output=True,
                          timeout=30).returncode != 0  # without its inputs it fails instead of making nothing


def test_the_pool_runs_on_a_ray_cluster_with_mutual_tls_and_a_token(
        tls_cluster: tuple[ClusterProcess, dict[str, str], Path]) -> None:
    cluster, tls, _ = tls_cluster
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}, **tls,
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": TOKEN, "KVSTACK_POOL_SECRET": "tls-test-secret"}
    run = subprocess.run([sys.executable, "-m", "tests.integration.ray_access_driver", cluster.address], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen["nodes"] == 3 and len(seen["shards"]) == 2
    assert all(s["reserved"] == 2 and s["prefix"] == 0 for s in seen["shards"])


def test_a_peer_without_a_certificate_of_the_cluster_cannot_talk_to_it(
        tls_cluster: tuple[ClusterProcess, dict[str, str], Path]) -> None:
    import grpc

    cluster, tls, tmp = tls_cluster
    read = {k: Path(v).read_bytes() for k, v in tls.items() if k != "RAY_USE_TLS"}
    ca, key, cert = read["RAY_TLS_CA_CERT"], read["RAY_TLS_SERVER_KEY"], read["RAY_TLS_SERVER_CERT"]
    other = make_cert(make_ca(tmp / "other-ca"), tmp / "other-tls")
    other_key, other_cert = (Path(other[k]).read_bytes() for k in ("RAY_TLS_SERVER_KEY", "RAY_TLS_SERVER_CERT"))

    assert channel_ready(cluster.address, grpc.ssl_channel_credentials(ca, key, cert), wait_s=30)  # the control
    assert not channel_ready(cluster.address, None)  # plaintext
    assert not channel_ready(cluster.address, grpc.ssl_channel_credentials(ca))  # no client certificate
    assert not channel_ready(cluster.address, grpc.ssl_channel_credentials(ca, other_key, other_cert))  # another CA

    assert not joins(cluster.address, {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": TOKEN})  # no certificate


def test_a_peer_with_a_certificate_but_without_the_token_cannot_join(
        tls_cluster: tuple[ClusterProcess, dict[str, str], Path]) -> None:
    cluster, tls, _ = tls_cluster
    assert not joins(cluster.address, {**tls, "RAY_AUTH_MODE": "disabled"})
    assert not joins(cluster.address, {**tls, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 48})
    assert joins(cluster.address, {**tls, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": TOKEN}, 90.0)  # the control
