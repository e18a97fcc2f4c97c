"""``router.access``: API keys, the admin key and the bound on unfinished generation requests, through the real ASGI
middleware on a FastAPI app with the ingress's paths (httpx's ASGI transport; the e2e is
``tests/e2e/test_serve_access.py``)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from router import access
from router.access import AccessConfigError, AccessGate, AccessMiddleware, AccessSettings


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def make_app(release: asyncio.Event | None = None) -> FastAPI:
    app = FastAPI()
    app.add_middleware(AccessMiddleware)

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> JSONResponse:
        return JSONResponse({"m": 1})

    @app.get("/v1/models")
    async def models(raw: Request) -> JSONResponse:
        return JSONResponse({"tenant": raw.scope["state"]["tenant"]})

    @app.get("/kvstack/status")
    async def status() -> JSONResponse:
        return JSONResponse({"ok": True})

    @app.post("/v1/chat/completions")
    async def chat() -> StreamingResponse:
        async def body():
            yield b"data: first\n\n"
            if release is not None:
                await release.wait()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    return app


@pytest.fixture
def gate():
    installed: list[AccessGate] = []

    def _install(settings: AccessSettings | None = None, env: dict[str, str] | None = None) -> AccessGate:
        g = AccessGate.from_settings(settings or AccessSettings(), env or {})
        access.install(g)
        installed.append(g)
        return g

    yield _install
    access.install(None)


def client(app: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_key_pairs_and_the_keys_file(tmp_path: Path) -> None:
    assert access.parse_key_pairs(" k1=a, k2=b ,", "env") == {"k1": "a", "k2": "b"}
    with pytest.raises(AccessConfigError, match="entry 2 is not key=tenant"):
        access.parse_key_pairs("k1=a,k2", "env")
    f = tmp_path / "keys.yaml"
    f.write_text("k3: c\n")
    keys, admin = access.load_keys(AccessSettings(api_keys_file=str(f)), {access.API_KEYS_ENV: "k1=a",
                                                                          access.ADMIN_KEY_ENV: "root"})
    assert (keys, admin) == ({"k1": "a", "k3": "c"}, "root")
    f.write_text("- not a mapping\n")
    with pytest.raises(AccessConfigError, match="mapping of key -> tenant"):
        access.load_keys(AccessSettings(api_keys_file=str(f)), {})


@pytest.mark.anyio
async def test_without_keys_everything_is_open(gate) -> None:
    gate()
    async with client(make_app()) as c:
        assert (await c.get("/v1/models")).json() == {"tenant": None}
        assert (await c.get("/kvstack/status")).status_code == 200
        assert (await c.get("/metrics")).status_code == 200


@pytest.mark.anyio
async def test_until_a_gate_is_installed_only_health_answers() -> None:
    access.install(None)
    async with client(make_app()) as c:
        assert (await c.get("/health")).status_code == 200
        r = await c.get("/v1/models")
    assert r.status_code == 503 and r.headers["retry-after"] == "1"


@pytest.mark.anyio
async def test_api_keys_name_the_tenant_and_refuse_everyone_else(gate) -> None:
    gate(env={access.API_KEYS_ENV: "ka=alpha,kb=beta"})
    async with client(make_app()) as c:
        missing, wrong = await c.get("/v1/models"), await c.get("/v1/models", headers=bearer("kz"))
        assert (await c.get("/v1/models", headers=bearer("kb"))).json() == {"tenant": "beta"}
        assert (await c.get("/health")).status_code == 200  # always open
        assert (await c.get("/metrics")).status_code == 200  # open unless metrics_need_key
        closed = await c.get("/kvstack/status", headers=bearer("ka"))  # keys but no admin key: closed
    for r in (missing, wrong):
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        err = r.json()["error"]
        assert err["code"] == "invalid_api_key" and err["type"] == "authentication_error"
    assert "no API key" in missing.json()["error"]["message"]
    assert closed.status_code == 403 and access.ADMIN_KEY_ENV in closed.json()["error"]["message"]


@pytest.mark.anyio
async def test_the_admin_key_guards_kvstack_routes_and_optionally_metrics(gate) -> None:
    gate(AccessSettings(metrics_need_key=True), env={access.API_KEYS_ENV: "ka=alpha", access.ADMIN_KEY_ENV: "root"})
    async with client(make_app()) as c:
        assert (await c.get("/kvstack/status")).status_code == 401
        assert (await c.get("/kvstack/status", headers=bearer("ka"))).status_code == 401  # a tenant is no admin
        assert (await c.get("/kvstack/status", headers=bearer("root"))).status_code == 200
        assert (await c.get("/metrics")).status_code == 401
        assert (await c.get("/metrics", headers=bearer("ka"))).status_code == 200
        assert (await c.get("/metrics", headers=bearer("root"))).status_code == 200
        assert (await c.get("/v1/models", headers=bearer("root"))).status_code == 401  # admin is no tenant


@pytest.mark.anyio
async def test_unfinished_generation_requests_are_bounded_with_429(gate) -> None:
    g = gate(AccessSettings(max_queued_requests=2))
    release = asyncio.Event()
    async with client(make_app(release)) as c:

        async def stream() -> tuple[int, bytes]:
            async with c.stream("POST", "/v1/chat/completions") as r:
                return r.status_code, b"".join([chunk async for chunk in r.aiter_bytes()])

        held = [asyncio.create_task(stream()) for _ in range(2)]
        for _ in range(200):  # both streams started (their first chunk is out)
            if g.in_flight == 2:
                break
            await asyncio.sleep(0.01)
        assert g.in_flight == 2
        busy = await c.post("/v1/chat/completions")
        assert busy.status_code == 429 and busy.headers["retry-after"] == str(access.RETRY_AFTER_S)
        assert busy.json()["error"]["code"] == "too_many_requests"
        assert (await c.get("/v1/models")).status_code == 200  # only generation requests are bounded
        release.set()
        done = await asyncio.gather(*held)
        assert all(status == 200 and body.endswith(b"[DONE]\n\n") for status, body in done)
        assert g.in_flight == 0 and g.rejected_busy == 1
        assert (await c.post("/v1/chat/completions")).status_code == 200  # room again
    assert g.in_flight == 0


def test_a_tenant_budget_refills_at_its_rate_and_tells_how_long_to_wait() -> None:
    from router.tenant_budget import TenantBudget

    now = [0.0]
    b = TenantBudget(600, clock=lambda: now[0])  # 10 tokens a second, 600 at most
    assert b.retry_after("a") is None
    b.charge("a", 650)  # a request is admitted on what was used before it: it may leave a debt
    assert b.balance("a") == pytest.approx(-50)
    assert b.retry_after("a") == 6  # (1 - (-50)) / 10 = 5.1 -> 6 s
    assert b.retry_after("b") is None  # tenants are apart
    now[0] = 5.0
    assert b.retry_after("a") == 1 and b.refused == 2
    now[0] = 5.2
    assert b.retry_after("a") is None
    now[0] = 1000.0
    assert b.balance("a") == pytest.approx(600)  # never above one minute's worth
    with pytest.raises(ValueError):
        TenantBudget(0)


@pytest.mark.anyio
async def test_a_tenant_past_its_tokens_per_minute_gets_429_and_the_others_do_not(gate) -> None:
    g = gate(AccessSettings(tenant_tokens_per_minute=120), {"KVSTACK_API_KEYS": "ka=alpha,kb=beta"})
    async with client(make_app()) as c:
        assert (await c.post("/v1/chat/completions", headers=bearer("ka"))).status_code == 200
        g.charge("alpha", 500)  # what the engine client charges when alpha's request ends
        limited = await c.post("/v1/chat/completions", headers=bearer("ka"))
        assert limited.status_code == 429 and limited.json()["error"]["code"] == "rate_limit_exceeded"
        assert int(limited.headers["retry-after"]) >= 190  # (1 + 380) / 2 tokens a second
        assert (await c.get("/v1/models", headers=bearer("ka"))).status_code == 200  # only generation is limited
        assert (await c.post("/v1/chat/completions", headers=bearer("kb"))).status_code == 200
