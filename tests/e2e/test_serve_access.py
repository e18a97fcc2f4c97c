"""E2E: a real ``kvstack serve`` with API keys, an admin key and ``app.ingress.max_queued_requests`` (issue 16,
items 1, 2 and 6), driven with the ``openai`` SDK and httpx: 401 without or with a wrong key, the tenant's key
works, ``/kvstack/*`` needs the admin key, ``/health`` stays open; two tenants' caches share nothing (neither HBM
nor the pool: no HOLDER, no FETCH, 0 cached tokens for the second tenant of a prompt, while the first tenant's own
revisits are reused, from the pool too); 64 concurrent requests against a bound of 4 get only 200s and 429s (with
``Retry-After``), never a 500, and every 200 carries the answer a lone request gets."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.e2e.serve_run import hbm_blocks, pool_blocks, running_serve, wait_for_status

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

KEYS = {"key-alpha": "alpha", "key-beta": "beta", "key-gamma": "gamma"}
TOKENS_PER_MINUTE = 20_000  # per tenant, per router: the other tests stay well below it
ADMIN = "admin-secret-1"
MODEL = "tiny-qwen3"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("serve-access")
    env = {"KVSTACK_API_KEYS": ",".join(f"{k}={t}" for k, t in KEYS.items()), "KVSTACK_ADMIN_KEY": ADMIN}
    for server in running_serve(tmp, ["app.ingress.max_queued_requests=4",
                                      f"app.ingress.tenant_tokens_per_minute={TOKENS_PER_MINUTE}"], env=env):
        server["status_headers"] = {"Authorization": f"Bearer {ADMIN}"}
        yield server


def test_keys_are_needed_and_name_a_tenant(server) -> None:
    import openai

    def client(key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=server["base"], api_key=key, timeout=120, max_retries=0)

    bare = httpx.get(server["base"] + "/models", timeout=30)  # no key at all (the SDK refuses to send none)
    assert bare.status_code == 401 and bare.json()["error"]["code"] == "invalid_api_key"
    for key in ("key-delta", ADMIN):  # unknown, and the admin key (it is no tenant's)
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


def test_tenants_share_no_cache_and_their_decisions_are_their_own(server) -> None:
    """Tenant beta sends the prompt tenant alpha just ran (in alpha's replica's HBM and in the pool): beta gets no
    HOLDER, no FETCH and 0 cached tokens, so it can neither reuse nor time alpha's prefix; alpha's own revisit is
    reused, and after every HBM cache is dropped alpha's prefix comes back from the pool under alpha's salt. A
    client's own ``cache_salt`` is a namespace of its own too."""
    import openai

    def client(key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=server["base"], api_key=key, timeout=180, max_retries=0)

    alpha, beta = client("key-alpha"), client("key-beta")
    system = "You are a careful assistant. " + " ".join(f"item {i} costs {i * 11} coins." for i in range(120))
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "What does item 5 cost?"}]

    def ask(c: openai.OpenAI, **extra):
        raw = c.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=8,
                                                          temperature=0, **extra)
        reply = raw.parse()
        return raw.headers["x-kvstack-action"], reply.usage.prompt_tokens_details.cached_tokens or 0, \
            reply.choices[0].message.content, raw.headers["x-kvstack-replica"], reply.usage.prompt_tokens

    saved_before = pool_blocks(wait_for_status(server, lambda st: True, what="status"))
    _, _, want, holder, prompt_tokens = ask(alpha)
    blocks = prompt_tokens // 128  # configs/local.yaml's block size
    wait_for_status(server, lambda st: hbm_blocks(st).get(holder, 0) >= blocks and
                    pool_blocks(st) >= saved_before + blocks, answers=6,
                    what=f"alpha's {blocks}-block prompt in {holder}'s HBM report (both routers) and in the pool")
    action, cached, text, _, _ = ask(alpha)
    assert action in ("holder", "fetch") and cached >= 128 and text == want  # alpha's own prefix is reused
    action, cached, text, _, _ = ask(beta)
    assert action not in ("holder", "fetch") and cached == 0, (action, cached)
    assert text == want  # the same greedy answer, computed afresh
    action, cached, text, _, _ = ask(alpha, extra_body={"cache_salt": "conversation-7"})
    assert action not in ("holder", "fetch") and cached == 0, (action, cached)
    root, admin = server["base"][:-3], server["status_headers"]
    reset = httpx.post(root + "/kvstack/admin/reset_prefix_cache", headers=admin, timeout=60).json()
    assert all(r["ok"] for r in reset), reset
    wait_for_status(server, lambda st: all(n == 0 for n in hbm_blocks(st).values()), answers=6,
                    what="both routers saw the replicas' HBM reset")
    action, cached, text, _, _ = ask(alpha)
    assert action == "fetch" and cached >= 128 and text == want, (action, cached)  # the pool, under alpha's salt
    deadline = time.monotonic() + 30
    while True:  # the routers publish their decisions to the hub about every second
        rows = httpx.get(root + "/kvstack/status", params={"tenant": "beta", "decisions": 50}, headers=admin,
                         timeout=60).json()["decisions"]
        if rows or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert rows and {r["tenant"] for r in rows} == {"beta"}
    own = httpx.get(root + "/kvstack/decisions", params={"tenant": "alpha"}, headers=admin, timeout=60).json()
    assert {r["tenant"] for r in own} <= {"alpha"}


def test_a_tenant_past_its_tokens_per_minute_gets_429_and_the_others_are_served(server) -> None:
    """Tenant gamma sends a long prompt until its routers' budgets (prompt + generated tokens, charged as requests
    end) are spent: then 429 ``rate_limit_exceeded`` with ``Retry-After``, never a 500, while tenant beta is served."""
    url = server["base"] + "/chat/completions"
    body = {"model": MODEL, "max_tokens": 1, "temperature": 0, "messages": [
        {"role": "user", "content": " ".join(f"line {i} of the quota test." for i in range(300))}]}
    codes: list[int] = []
    limited = None
    for _ in range(120):  # two routers, ~2k tokens a request: ~20 requests spend both budgets
        r = httpx.post(url, json=body, headers={"Authorization": "Bearer key-gamma"}, timeout=120)
        codes.append(r.status_code)
        if r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded":
            limited = r
            break
    assert limited is not None, codes
    assert set(codes) <= {200, 429} and codes.count(200) >= 5, codes
    assert int(limited.headers["retry-after"]) >= 1
    beta = httpx.post(url, json={**body, "max_tokens": 2}, headers={"Authorization": "Bearer key-beta"}, timeout=120)
    assert beta.status_code == 200
