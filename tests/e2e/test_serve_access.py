"""E2E: a real ``kvstack serve`` with API keys, an admin key and ``app.ingress.max_queued_requests`` (issue 16,
items 1 and 6), driven with the ``openai`` SDK and httpx: 401 without or with a wrong key, the tenant's key works,
``/kvstack/*`` needs the admin key, ``/health`` stays open; 64 concurrent requests against a bound of 4 get only
200s and 429s (with ``Retry-After``), never a 500, and every 200 carries the answer a lone request gets."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.e2e.serve_run import running_serve

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

KEYS = {"key-alpha": "alpha", "key-beta": "beta"}
ADMIN = "admin-secret-1"
MODEL = "tiny-qwen3"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("serve-access")
    env = {"KVSTACK_API_KEYS": ",".join(f"{k}={t}" for k, t in KEYS.items()), "KVSTACK_ADMIN_KEY": ADMIN}
    yield from running_serve(tmp, ["app.ingress.max_queued_requests=4"], env=env)


def test_keys_are_needed_and_name_a_tenant(server) -> None:
    import openai

    def client(key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=server["base"], api_key=key, timeout=120, max_retries=0)

    bare = httpx.get(server["base"] + "/models", timeout=30)  # no key at all (the SDK refuses to send none)
    assert bare.status_code == 401 and bare.json()["error"]["code"] == "invalid_api_key"
    for key in ("key-gamma", ADMIN):  # unknown, and the admin key (it is no tenant's)
        with pytest.raises(openai.AuthenticationError) as err:
            client(key).models.list()
        assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
    reply = client("key-beta").chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, temperature=0)
    assert reply.choices[0].message.content is not None
    root = server["base"][:-3]
    assert httpx.get(root + "/health", timeout=30).status_code == 200
    assert httpx.get(root + "/kvstack/status", timeout=30).status_code == 401
    assert httpx.get(root + "/kvstack/status", headers={"Authorization": "Bearer key-alpha"},
                     timeout=30).status_code == 401
    status = httpx.get(root + "/kvstack/status", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)
    assert status.status_code == 200 and status.json()["replicas"]
    assert "admin-secret" not in server["log"].read_text()  # keys are never logged


def test_overload_gets_429_never_500_and_every_answer_is_right(server) -> None:
    body = {"model": MODEL, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "Count the colours of the rainbow, briefly."}]}
    headers = {"Authorization": "Bearer key-alpha"}
    url = server["base"] + "/chat/completions"
    lone = httpx.post(url, json=body, headers=headers, timeout=120)
    assert lone.status_code == 200
    want = lone.json()["choices"][0]["message"]["content"]

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=180) as c:
            return list(await asyncio.gather(*(c.post(url, json=body, headers=headers) for _ in range(64))))

    replies = asyncio.run(burst())
    codes = [r.status_code for r in replies]
    assert set(codes) <= {200, 429}, codes
    assert codes.count(200) >= 4 and codes.count(429) >= 1, codes
    for r in replies:
        if r.status_code == 429:
            assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "too_many_requests"
        else:
            assert r.json()["choices"][0]["message"]["content"] == want
    assert httpx.post(url, json=body, headers=headers, timeout=120).status_code == 200  # the bound is released
