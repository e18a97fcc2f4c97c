"""Validation of kvstack's Kubernetes manifests without a cluster (``python -m k8s.tools.manifest_check``).

``manifest_check`` renders each kustomization with ``kubectl kustomize`` and drives the checks; ``serve_check``
checks a RayService's ``serveConfigV2`` against Ray Serve and the kvstack app; ``monitoring_check`` the PodMonitor
and the dashboard. Run from the repository root; called by ``tests/unit/test_k8s_manifests.py``.
"""
