"""E2E: two models in one app (``app.models``), each with its own replicas, hub and block-key namespace, behind one
endpoint that routes by the request's ``model``: both answer under their own names, an unknown name is the OpenAI
404, and neither hits the other's cache — the same prompt (the same token ids: the two tiny models share a tokenizer)
gives the second model no cached tokens and no HOLDER or FETCH, though the first model's blocks are in HBM and in the
pool. Driven with the ``openai`` SDK, on the package's two-model server (``conftest.py``)."""

from __future__ import annotations

import httpx
import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_each_model_answers_under_its_own_name(client, server) -> None:
    import openai

    assert sorted(m.id for m in client.models.list().data) == ["alpha", "beta"]
    for name in ("alpha", "beta"):
        reply = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hello"}],
                                               max_tokens=6, temperature=0)
        assert reply.model == name and reply.usage.completion_tokens == 6
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gamma", messages=[{"role": "user", "content": "Hello"}], max_tokens=2)
    missing = httpx.get(server["base"] + "/models/gamma", timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    status = httpx.get(server["base"][:-3] + "/kvstack/status", timeout=60).json()
    assert sorted(r["model"] for r in status["replicas"]) == ["alpha", "beta"]
    specs = {m["model"]: m["model_spec"] for m in status["models"]}
    assert (specs["alpha"]["layers"], specs["beta"]["layers"], specs["beta"]["n_kv"]) == (4, 6, 3)


def test_neither_model_hits_the_others_cache(client, server) -> None:
    system = "You answer briefly. " + " ".join(f"fact {i}: the value {i * 11} is kept." for i in range(100))
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Which fact is first?"}]

    def ask(model: str) -> tuple[int, str]:
        raw = client.chat.completions.with_raw_response.create(model=model, messages=messages, max_tokens=4,
                                                               temperature=0)
        reply = raw.parse()
        return (reply.usage.prompt_tokens_details.cached_tokens or 0), raw.headers["x-kvstack-action"]

    ask("alpha")
    cached, _ = ask("alpha")
    assert cached >= 128  # alpha's own prefix: in its replica's HBM (and saved to the pool)
    cached, action = ask("beta")
    assert cached == 0 and action not in ("holder", "fetch", "split"), (cached, action)
    cached, _ = ask("beta")
    assert cached >= 128  # beta reuses its own
    # The pool accounts each model's blocks apart (per layout fingerprint, labelled with the model id).
    import time

    deadline = time.monotonic() + 30.0  # saves are asynchronous
    while True:
        status = httpx.get(server["base"][:-3] + "/kvstack/status", timeout=60).json()
        held: dict[str, int] = {}
        for shard in status["shards"]:
            for m in shard.get("models", []):
                held[m["model"]] = held.get(m["model"], 0) + m["dram_blocks"] + m["ssd_blocks"]
        if (held.get("alpha", 0) > 0 and held.get("beta", 0) > 0) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert held.get("alpha", 0) >= 1 and held.get("beta", 0) >= 1, status["shards"]
    assert sum(held.values()) == sum(s["dram_blocks"] + s["ssd_blocks"] for s in status["shards"])
