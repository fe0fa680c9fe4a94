"""Request body cap (cluster.ingress.body_limit) on a bare Starlette app: 413 before parsing, bodies within
the cap reach the app byte for byte, with and without Content-Length."""

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from cluster.ingress.body_limit import BodyLimit, BodyLimitSetting

LIMIT = 2048


async def echo(request: Request):
    body = await request.body()
    return PlainTextResponse(f"{len(body)}:{body[:8].decode()}:{body[-8:].decode()}")


@pytest.fixture
def client():
    app = Starlette(routes=[Route("/v1/completions", echo, methods=["POST"])])
    app.add_middleware(BodyLimit, setting=BodyLimitSetting(LIMIT))
    return TestClient(app)


def chunks(data: bytes, size: int = 500):
    for i in range(0, len(data), size):
        yield data[i : i + size]


@pytest.mark.parametrize("n", [0, 1, LIMIT - 1, LIMIT])
@pytest.mark.parametrize("chunked", [False, True])
def test_bodies_within_the_cap_reach_the_app_unchanged(client, n, chunked):
    data = bytes(ord("a") + i % 26 for i in range(n))
    resp = client.post("/v1/completions", content=chunks(data) if chunked else data)
    assert resp.status_code == 200
    assert resp.text == f"{n}:{data[:8].decode()}:{data[-8:].decode()}"


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_over_the_cap_gets_413_in_the_openai_error_format(client, chunked):
    data = b"x" * (LIMIT + 1)
    resp = client.post("/v1/completions", content=chunks(data) if chunked else data)
    assert resp.status_code == 413
    error = resp.json()["error"]
    assert error["code"] == "request_too_large" and str(LIMIT) in error["message"]
    assert "serve.max_request_body_bytes" in error["message"]


def test_no_cap_when_the_setting_is_none():
    app = Starlette(routes=[Route("/v1/completions", echo, methods=["POST"])])
    app.add_middleware(BodyLimit, setting=BodyLimitSetting(None))
    resp = TestClient(app).post("/v1/completions", content=b"y" * (LIMIT * 10))
    assert resp.status_code == 200 and resp.text.startswith(f"{LIMIT * 10}:")
