"""One ``kvstack serve`` for the modules of this package, as a user starts it with two routers
(``app.ingress.num_replicas=2``; the anti-herding test and the router fault need them): a real local Ray cluster
(head + 2 workers), 2 real vLLM replicas (CPU build), pool shards, driven with the real ``openai`` SDK.

Starting a server takes 70-120 s on a 2-core box, so the modules that need this configuration share one (a
package-scoped fixture, torn down after the package's last test). pytest runs the modules in file-name order:
``test_serve_local.py`` (the cluster through the OpenAI surface), ``test_serve_local_faults.py`` (crashes; each
case leaves the server healthy for the next), ``test_serve_stop.py`` (SIGTERM, which ends the server: last).
"""

from __future__ import annotations

import pytest

from tests.e2e.serve_run import running_serve


@pytest.fixture(scope="package")
def server(tmp_path_factory: pytest.TempPathFactory):
    yield from running_serve(tmp_path_factory.mktemp("serve"), ["app.ingress.num_replicas=2"])


@pytest.fixture(scope="package")
def client(server):
    import openai

    return openai.OpenAI(base_url=server["base"], api_key="unused", timeout=120, max_retries=0)
