"""API keys on the proxy, as vLLM's --api-key: 401 {"error": "Unauthorized"} without the key.

vLLM's check: vllm/entrypoints/serve/middleware/authenticate.py (AuthenticationMiddleware).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from stages.errors import EldrError
from stages.serve.proxy import create_app
from stages.serve.proxy.config import ProxyConfig
from stages.serve.proxy.front.auth import (
    ADMIN_LOCKED,
    ADMIN_NEEDS_ITS_OWN_KEY,
    ApiKeyMiddleware,
    check_exposure,
)
from tests.fakes.artifact import domain_artifact
from tests.fakes.worker import BackgroundServer, FakeBehavior, create_fake_worker

API_KEY, WORKER_KEY, ADMIN_KEY = "client-key-123", "worker-key-456", "admin-key-789"
UNAUTHORIZED = {"error": "Unauthorized"}

# Every guarded route with a request it accepts: (method, path, json body).
GUARDED = [
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("GET", "/v1/models", None),
    ("GET", "/admin/state", None),
    ("POST", "/admin/policy", {"policy": "rr"}),
    ("POST", "/admin/artifact", {"version": "v1"}),
]
OPEN = ["/health", "/metrics", "/version"]
WRONG_AUTH = {
    "missing": None,
    "wrong-key": f"Bearer {API_KEY}x",
    "key-prefix": f"Bearer {API_KEY[:-1]}",
    "key-case": f"Bearer {API_KEY.upper()}",
    "scheme-only": "Bearer",
    "no-scheme": API_KEY,
    "basic-scheme": f"Basic {API_KEY}",
    "worker-key": f"Bearer {WORKER_KEY}",
    "the-other-routes-key": "the other",
    "extra-space": f"Bearer  {API_KEY}",
}


@dataclass
class Proxy:
    client: httpx.Client
    workers: list[FakeBehavior]

    def send(self, method: str, path: str, body: object, auth: str | None) -> httpx.Response:
        headers = {"authorization": auth} if auth is not None else {}
        return self.client.request(method, path, json=body, headers=headers)


@pytest.fixture(scope="module")
def proxy() -> Iterator[Proxy]:
    behaviors = [FakeBehavior("p"), FakeBehavior("d")]
    workers = [BackgroundServer(create_fake_worker(b), "critical").start() for b in behaviors]
    config = ProxyConfig(
        prefill_urls=(workers[0].url,),
        decode_urls=(workers[1].url,),
        policy="rr",
        artifact_store=Path("/artifacts"),
        model="fake-model",
        health_interval_s=0.05,
        api_key=API_KEY,
        admin_api_key=ADMIN_KEY,
        worker_api_key=WORKER_KEY,
    )
    app = create_app(config, artifact_loader=lambda root, v: domain_artifact(1, version=v))
    try:
        with BackgroundServer(app) as server, httpx.Client(base_url=server.url, timeout=10) as c:
            yield Proxy(c, behaviors)
    finally:
        for w in workers:
            w.stop()


@pytest.fixture
def env(proxy: Proxy) -> Proxy:
    for b in proxy.workers:
        b.reset()
    return proxy


@pytest.mark.parametrize("auth", WRONG_AUTH.values(), ids=WRONG_AUTH.keys())
@pytest.mark.parametrize(("method", "path", "body"), GUARDED, ids=[g[1] for g in GUARDED])
def test_guarded_route_refuses(
    env: Proxy, method: str, path: str, body: object, auth: str | None
) -> None:
    if auth == "the other":  # the inference key on /admin, the admin key on /v1
        auth = f"Bearer {API_KEY if path.startswith('/admin') else ADMIN_KEY}"
    r = env.send(method, path, body, auth)
    assert r.status_code == 401
    assert r.headers["content-type"] == "application/json"
    assert r.json() == UNAUTHORIZED
    assert not any(b.received for b in env.workers)


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER"])  # vLLM lowercases it
@pytest.mark.parametrize(("method", "path", "body"), GUARDED, ids=[g[1] for g in GUARDED])
def test_guarded_route_accepts_the_key(
    env: Proxy, method: str, path: str, body: object, scheme: str
) -> None:
    key = ADMIN_KEY if path.startswith("/admin") else API_KEY
    r = env.send(method, path, body, f"{scheme} {key}")
    assert r.is_success, r.text


def test_unknown_guarded_paths_need_the_key_before_they_are_unknown(env: Proxy) -> None:
    # As vLLM: the key is checked before routing, so probing learns nothing without it.
    assert env.send("GET", "/v1/nope", None, None).json() == UNAUTHORIZED
    assert env.send("GET", "/admin/nope", None, None).status_code == 401
    r = env.send("GET", "/v1/nope", None, f"Bearer {API_KEY}")
    assert r.status_code == 404 and r.json()["error"]["code"] == 404


@pytest.mark.parametrize("path", OPEN)
def test_open_routes_stay_open(env: Proxy, path: str) -> None:
    assert env.client.get(path).status_code == 200
    assert env.client.get(path, headers={"authorization": "Bearer wrong"}).status_code == 200


def test_unknown_open_path_is_a_404_without_a_key(env: Proxy) -> None:
    r = env.client.get("/nope")
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_options_is_not_checked(env: Proxy) -> None:
    # vLLM lets OPTIONS through (CORS preflights); the proxy has no such route: a JSON 405.
    r = env.client.options("/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == 405


def test_workers_get_the_worker_key_never_the_clients(env: Proxy) -> None:
    r = env.send(*GUARDED[0], f"Bearer {API_KEY}")
    assert r.status_code == 200, r.text
    seen = [rec.headers.get("authorization") for b in env.workers for rec in b.received]
    assert len(seen) == 2  # one prefill, one decode
    assert seen == [f"Bearer {WORKER_KEY}"] * 2


# --- which key opens which route: the middleware alone ----------------------------------


def key_app(api_key: str | None, admin_api_key: str | None, locked: bool = False) -> TestClient:
    async def ok(request: Request) -> PlainTextResponse:
        return PlainTextResponse("ok")

    routes = [Route(p, ok) for p in ("/v1/x", "/admin/x", "/health")]
    app = Starlette(
        routes=routes,
        middleware=[Middleware(ApiKeyMiddleware, api_key=api_key, admin_api_key=admin_api_key,
                               admin_locked=locked)],
    )
    return TestClient(app)


def statuses(client: TestClient, key: str | None) -> tuple[int, int, int]:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return tuple(client.get(p, headers=headers).status_code for p in ("/v1/x", "/admin/x",
                                                                        "/health"))


@pytest.mark.parametrize(
    ("api_key", "admin_key", "sent", "expected"),
    [
        # an inference key never opens /admin: with no admin key it is refused to all
        ("api", None, "api", (200, 403, 200)),
        ("api", None, None, (401, 403, 200)),
        # the admin key, when set, is the only one for /admin, and opens nothing else
        ("api", "adm", "api", (200, 401, 200)),
        ("api", "adm", "adm", (401, 200, 200)),
        ("api", "adm", None, (401, 401, 200)),
        # an admin key alone guards /admin only
        (None, "adm", None, (200, 401, 200)),
        (None, "adm", "adm", (200, 200, 200)),
        (None, "adm", "api", (200, 401, 200)),
    ],
)
def test_which_key_opens_which_route(
    api_key: str | None, admin_key: str | None, sent: str | None, expected: tuple
) -> None:
    with key_app(api_key, admin_key) as client:
        assert statuses(client, sent) == expected


@pytest.mark.parametrize(
    ("api_key", "admin_key", "sent", "expected"),
    [
        # beyond loopback with no key at all (--insecure): /v1 open, /admin locked
        (None, None, None, (200, 403, 200)),
        # the api key does not open /admin where no admin key is set
        ("api", None, "api", (200, 403, 200)),
        ("api", None, None, (401, 403, 200)),
        (None, "adm", "adm", (200, 200, 200)),
        (None, "adm", None, (200, 401, 200)),
    ],
)
def test_admin_beyond_loopback_needs_a_key(
    api_key: str | None, admin_key: str | None, sent: str | None, expected: tuple
) -> None:
    with key_app(api_key, admin_key, locked=True) as client:
        assert statuses(client, sent) == expected
        if expected[1] == 403:
            locked = ADMIN_LOCKED if api_key is None else ADMIN_NEEDS_ITS_OWN_KEY
            assert client.get("/admin/x").json() == {"error": locked}


def test_an_inference_key_alone_leaves_admin_refused_with_the_reason() -> None:
    """Every client holding the inference key could otherwise re-route all traffic and write
    cost files on the proxy's disk."""
    config = ProxyConfig(prefill_urls=("http://p",), decode_urls=("http://d",), policy="rr",
                         api_key=API_KEY)
    with TestClient(create_app(config)) as client:
        r = client.post("/admin/policy", json={"policy": "jsq"},
                        headers={"authorization": f"Bearer {API_KEY}"})
        assert r.status_code == 403 and "--admin-api-key" in r.json()["error"]
        assert client.get("/admin/state", headers={"authorization": f"Bearer {API_KEY}"}
                          ).status_code == 403


def test_no_key_configured_adds_no_check_on_loopback_only() -> None:
    config = ProxyConfig(prefill_urls=("http://p",), decode_urls=("http://d",), policy="rr")
    app = create_app(config)
    assert not any(m.cls is ApiKeyMiddleware for m in app.user_middleware)
    open_config = ProxyConfig(prefill_urls=("http://p",), decode_urls=("http://d",),
                              policy="rr", host="0.0.0.0")
    with TestClient(create_app(open_config)) as client:
        locked = client.post("/admin/policy", json={"policy": "jsq"})
        assert locked.status_code == 403 and "admin API is locked" in locked.json()["error"]
        assert client.get("/admin/state").status_code == 403
        assert client.get("/health").status_code != 403


# --- configuration -----------------------------------------------------------------------


@pytest.mark.parametrize("field", ["api_key", "admin_api_key", "worker_api_key"])
@pytest.mark.parametrize("bad", ["", " s3cret", "s3cret ", "s3c\nret", "s3crét"])
def test_unusable_keys_are_refused(field: str, bad: str) -> None:
    with pytest.raises(EldrError) as info:
        ProxyConfig(prefill_urls=("http://p",), decode_urls=("http://d",), **{field: bad})
    assert field in str(info.value) and "s3c" not in str(info.value)  # never echo a key


def test_keys_stay_out_of_the_config_repr() -> None:
    config = ProxyConfig(
        prefill_urls=("http://p",), decode_urls=("http://d",), api_key="s3cret-a",
        admin_api_key="s3cret-b", worker_api_key="s3cret-c",
    )
    assert "s3cret" not in repr(config)


@pytest.mark.parametrize(
    ("host", "key", "exposed"),
    [
        ("127.0.0.1", None, False),
        ("127.8.9.10", None, False),
        ("::1", None, False),
        ("[::1]", None, False),
        ("::ffff:127.0.0.1", None, False),
        ("localhost", None, False),
        ("LocalHost", None, False),
        ("0.0.0.0", None, True),
        ("::", None, True),
        ("", None, True),
        ("192.168.1.20", None, True),
        ("10.0.0.1", None, True),
        ("proxy.example.com", None, True),
        ("0.0.0.0", "k", False),
        ("192.168.1.20", "k", False),
    ],
)
def test_an_exposed_proxy_without_a_key_is_refused_unless_insecure(
    host: str, key: str | None, exposed: bool
) -> None:
    if exposed:
        with pytest.raises(EldrError) as info:
            check_exposure(host, key, insecure=False)
        assert "--api-key" in str(info.value) and "--insecure" in str(info.value)
    else:
        assert check_exposure(host, key, insecure=False) is None
    text = check_exposure(host, key, insecure=True)
    assert (text is not None) == exposed
    if text is not None:
        assert "--insecure" in text and repr(host) in text


# --- what an admin client may write, and what workers publish ------------------------------


def test_inline_cost_models_are_bounded_in_size_and_count(tmp_path: Path) -> None:
    from stages.routing.cost_model import cpu_like
    from stages.serve.proxy.front.admin_cost import MAX_INLINE_BYTES, MAX_INLINE_FILES, client_cost

    model = cpu_like(4).to_json()
    huge = {**model, "name": "x" * MAX_INLINE_BYTES}
    with pytest.raises(EldrError, match="bytes"):
        client_cost({"cost": huge}, tmp_path)
    assert not (tmp_path / "admin-costs").exists() or not any((tmp_path / "admin-costs").iterdir())
    saved = [client_cost({"cost": {**model, "name": f"m{i}"}}, tmp_path)["cost"]
             for i in range(MAX_INLINE_FILES)]
    assert len(set(saved)) == MAX_INLINE_FILES
    # One already kept is sent again: no new file, accepted.
    assert client_cost({"cost": {**model, "name": "m0"}}, tmp_path)["cost"] == saved[0]
    with pytest.raises(EldrError, match=f"{MAX_INLINE_FILES} inline cost models"):
        client_cost({"cost": {**model, "name": "one-more"}}, tmp_path)
    assert len(list((tmp_path / "admin-costs").iterdir())) == MAX_INLINE_FILES


@pytest.mark.parametrize(("host", "warned"), [("*", True), ("0.0.0.0", True), ("[::]", True),
                                              ("127.0.0.1", False)])
def test_a_batch_publisher_on_every_interface_warns(
    host: str, warned: bool, caplog: pytest.LogCaptureFixture
) -> None:
    from stages.capture.batch_publisher import BatchPublisher
    from tests.conftest import free_port

    endpoint = f"tcp://{host}:{free_port()}"
    with caplog.at_level("WARNING", logger="stages.capture.batch_publisher"):
        publisher = BatchPublisher(endpoint)
        publisher.close()
    warnings = [r.getMessage() for r in caplog.records if "every interface" in r.getMessage()]
    assert bool(warnings) == warned, warnings
    if warned:
        assert endpoint in warnings[0] and "127.0.0.1" in warnings[0]
