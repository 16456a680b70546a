"""Client mistakes get vLLM's status, in vLLM's error shape, on every route; never a 500.

Where each expected status comes from in vLLM (paths under vllm/entrypoints/ and fastapi/):
  [ctype]  serve/utils/api_utils.py validate_json_request: media type not exactly
           application/json -> RequestValidationError -> 400 (exception_handling/handlers/
           validation.py). A missing content-type is "" and refused the same way.
  [json]   fastapi/routing.py: invalid JSON -> RequestValidationError "json_invalid" -> 400;
           a body json.loads cannot even decode (invalid UTF-8, too deep) -> HTTPException(400,
           "There was an error parsing the body") -> 400 (handlers/http.py). What json.loads
           takes and orjson does not (a BOM, UTF-16/32, NaN, lone surrogates) the proxy takes
           too (tests/test_proxy_batch.py).
  [model]  the pydantic request models (openai/completion/protocol.py CompletionRequest,
           openai/chat_completion/protocol.py ChatCompletionRequest), lax mode: a body that is
           not an object, a missing/ill-typed "messages", a "prompt" outside
           str | list[str] | list[int>=0] | list[list[int>=0]], a non-integer "max_tokens"
           (including non-finite or >= 2**63 floats), a "stream" pydantic cannot read as a
           bool -> RequestValidationError -> 400.
  [sampl]  sampling_params.py: max_tokens < 1 -> VLLMValidationError -> 400 (0 is allowed
           there with echo, so the proxy refuses only negatives); n outside 1..16384
           (VLLM_MAX_N_SEQUENCES), or n > 1 with greedy sampling (temperature < 1e-5) -> 400.
  [legs]   the request models' mode="before" validators that only the decode leg's body can
           break (stream_options or prompt_logprobs without/with stream, logprob_token_ids with
           echo and max_tokens 0): the proxy refuses them first, or the prefill's KV blocks
           would stay pinned; and a prompt list over VLLM_MAX_COMPLETION_PROMPTS (1024).
  [route]  Starlette's router: unknown path 404, wrong method 405 (vLLM answers them with
           FastAPI's {"detail": ...}; the proxy uses the error shape for every error).
  [size]   the proxy's own limit (max_body_bytes): 413, deliberately earlier than vLLM, which
           reads a body of any size.
"""

from __future__ import annotations

import gzip
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson
import pytest

from stages.errors import EldrError
from stages.serve.proxy import create_app
from stages.serve.proxy.config import ProxyConfig
from stages.serve.proxy.state import ProxyState
from tests.fakes.artifact import domain_artifact
from tests.fakes.worker import BackgroundServer, FakeBehavior, create_fake_worker

K = 2
LIMIT = 16 * 1024
JSON = {"content-type": "application/json"}
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
ERROR_KEYS = {"message", "type", "param", "code"}


def load_fake_artifact(root: Path, version: str):
    if version == "missing":
        raise EldrError(f"no artifact {version} in {root}")
    if version == "boom":
        raise RuntimeError("the disk caught fire")  # nothing the proxy expects
    return domain_artifact(1 if version == "k1" else K, version=version)


@dataclass
class Proxy:
    client: httpx.Client
    state: ProxyState
    workers: list[FakeBehavior]

    def received(self) -> int:
        return sum(len(b.received) for b in self.workers)

    def admin_state(self) -> dict:
        return self.client.get("/admin/state").json()


@pytest.fixture(scope="module")
def proxy() -> Iterator[Proxy]:
    behaviors = [FakeBehavior("p"), *(FakeBehavior(f"d{i}") for i in range(K))]
    workers = [BackgroundServer(create_fake_worker(b), "critical").start() for b in behaviors]
    config = ProxyConfig(
        prefill_urls=(workers[0].url,),
        decode_urls=tuple(w.url for w in workers[1:]),
        policy="rr",
        artifact_store=Path("/artifacts"),
        model="fake-model",
        max_body_bytes=LIMIT,
        connect_timeout_s=1.0,
        prefill_timeout_s=3.0,
        decode_timeout_s=3.0,
        health_interval_s=0.05,
    )
    app = create_app(config, artifact_loader=load_fake_artifact)
    try:
        with BackgroundServer(app) as server, httpx.Client(base_url=server.url, timeout=10) as c:
            yield Proxy(c, app.state.proxy, behaviors)
    finally:
        for w in workers:
            w.stop()


@pytest.fixture
def env(proxy: Proxy) -> Iterator[Proxy]:
    for b in proxy.workers:
        b.reset()
    assert proxy.client.post("/admin/policy", json={"policy": "rr"}).is_success
    yield proxy


def assert_error_shape(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json"), r.headers
    error = r.json()["error"]
    assert set(error) == ERROR_KEYS, error
    assert error["code"] == status
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    assert error["param"] is None or isinstance(error["param"], str)
    return error


# --- the table -------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    id: str
    status: int
    path: str = CMPL
    method: str = "POST"
    content: bytes | Callable[[], Iterator[bytes]] | None = None
    headers: dict[str, str] = field(default_factory=lambda: dict(JSON))


def body(id: str, status: int, data: object, path: str = CMPL) -> Case:
    return Case(id, status, path, content=orjson.dumps(data))


def raw(id: str, status: int, content: bytes, ctype: str | None = "application/json",
        path: str = CMPL) -> Case:
    return Case(id, status, path, content=content, headers={"content-type": ctype} if ctype else {})


def chunked_over_limit() -> Iterator[bytes]:
    yield b'{"prompt": "'
    for _ in range(LIMIT // 1000 + 2):
        yield b"y" * 1000
    yield b'"}'


OK_PROMPT = {"prompt": "hi", "max_tokens": 2}
OK_CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
DEEP = b'{"prompt": "x", "junk": ' + b"[" * 3000 + b"]" * 3000 + b"}"

CASES = [
    # [ctype] the media type
    raw("text-plain", 400, orjson.dumps(OK_PROMPT), "text/plain"),
    raw("no-content-type", 400, orjson.dumps(OK_PROMPT), None),
    raw("form-urlencoded", 400, b"prompt=hi&max_tokens=2", "application/x-www-form-urlencoded"),
    raw("multipart", 400, b"--b\r\n\r\nhi\r\n--b--", "multipart/form-data; boundary=b"),
    raw("json-suffix", 400, orjson.dumps(OK_PROMPT), "application/vnd.api+json"),
    raw("chat-text-plain", 400, orjson.dumps(OK_CHAT), "text/plain", CHAT),
    raw("admin-text-plain", 400, b'{"policy": "rr"}', "text/plain", "/admin/policy"),
    # vLLM does not strip the media type before the parameters
    raw("json-space-before-params", 400, orjson.dumps(OK_PROMPT),
        "application/json ; charset=utf-8"),
    # [json] bytes that are no JSON document
    raw("empty-body", 400, b""),
    raw("whitespace-body", 400, b"  \n "),
    raw("truncated", 400, b'{"prompt": "x", "max_tokens": 2'),
    raw("lone-brace", 400, b"{"),
    raw("trailing-garbage", 400, b'{"prompt": "x"} extra'),
    raw("single-quotes", 400, b"{'prompt': 'x'}"),
    raw("trailing-comma", 400, b'{"prompt": "x",}'),
    raw("bare-word", 400, b"prompt"),
    raw("invalid-utf8", 400, b'{"prompt": "\xff\xfe"}'),
    raw("latin1-declared", 400, '{"prompt": "café"}'.encode("latin-1"),
        "application/json; charset=latin-1"),
    raw("gzip-not-decoded", 400, gzip.compress(orjson.dumps(OK_PROMPT))),
    Case("gzip-declared-not-decoded", 400, content=gzip.compress(orjson.dumps(OK_PROMPT)),
         headers={**JSON, "content-encoding": "gzip"}),
    raw("nul-bytes", 400, b"\x00\x00\x00\x00"),
    raw("too-deep", 400, DEEP),
    raw("chat-truncated", 400, b'{"messages": [{"role": "user"', path=CHAT),
    raw("admin-invalid-json", 400, b'{"policy": ', path="/admin/policy"),
    # [model] JSON that is not an object
    body("array", 400, [1, 2]),
    body("empty-array", 400, []),
    body("string", 400, "prompt"),
    body("number", 400, 5),
    body("null", 400, None),
    body("true", 400, True),
    body("chat-array", 400, [OK_CHAT], CHAT),
    body("admin-array", 400, [], "/admin/policy"),
    # [model] "messages"
    body("messages-int", 400, {"messages": 5}, CHAT),
    body("messages-true", 400, {"messages": True}, CHAT),
    body("messages-string", 400, {"messages": "x"}, CHAT),
    body("messages-list-of-int", 400, {"messages": [1]}, CHAT),
    body("messages-list-of-list", 400, {"messages": [[]]}, CHAT),
    body("messages-list-of-null", 400, {"messages": [None]}, CHAT),
    body("messages-object", 400, {"messages": {"role": "user", "content": "x"}}, CHAT),
    body("messages-missing", 400, {"max_tokens": 2}, CHAT),
    body("messages-null", 400, {"messages": None}, CHAT),
    body("messages-mixed", 400, {"messages": [{"role": "user", "content": "x"}, "y"]}, CHAT),
    # [model] "prompt"
    body("prompt-int", 400, {"prompt": 5}),
    body("prompt-true", 400, {"prompt": True}),
    body("prompt-float", 400, {"prompt": 1.5}),
    body("prompt-object", 400, {"prompt": {"text": "x"}}),
    body("prompt-mixed-list", 400, {"prompt": [1, "a"]}),
    body("prompt-negative-token", 400, {"prompt": [-1]}),
    body("prompt-fractional-token", 400, {"prompt": [1.5]}),
    body("prompt-null-token", 400, {"prompt": [None]}),
    body("prompt-nested-mixed", 400, {"prompt": [[1, "a"]]}),
    body("prompt-nested-strings", 400, {"prompt": [["a"]]}),
    body("prompt-too-nested", 400, {"prompt": [[[1]]]}),
    # [model] / [sampl] "max_tokens" (and chat's max_completion_tokens)
    body("max-tokens-negative", 400, {"prompt": "x", "max_tokens": -1}),
    body("max-tokens-fraction", 400, {"prompt": "x", "max_tokens": 1.5}),
    body("max-tokens-word", 400, {"prompt": "x", "max_tokens": "ten"}),
    body("max-tokens-list", 400, {"prompt": "x", "max_tokens": [2]}),
    body("max-tokens-object", 400, {"prompt": "x", "max_tokens": {}}),
    body("max-tokens-huge-negative", 400, {"prompt": "x", "max_tokens": -1e30}),
    # pydantic refuses int from a float >= 2**63 ("exceeded maximum size")
    body("max-tokens-huge-float", 400, {"prompt": "x", "max_tokens": 1e30}),
    raw("max-tokens-overflow", 400, b'{"prompt": "x", "max_tokens": 1e400}'),  # inf / non-JSON
    raw("max-tokens-nan", 400, b'{"prompt": "x", "max_tokens": NaN}'),  # nan / non-JSON
    body("chat-max-tokens-negative", 400, {**OK_CHAT, "max_tokens": -5}, CHAT),
    body("chat-max-completion-tokens-word", 400, {**OK_CHAT, "max_completion_tokens": "x"},
         CHAT),
    # [model] "stream"
    body("stream-word", 400, {"prompt": "x", "stream": "sometimes"}),
    body("stream-two", 400, {"prompt": "x", "stream": 2}),
    body("stream-fraction", 400, {"prompt": "x", "stream": 0.5}),
    body("stream-list", 400, {"prompt": "x", "stream": []}),
    body("stream-object", 400, {"prompt": "x", "stream": {"on": True}}),
    body("stream-padded-word", 400, {"prompt": "x", "stream": " true"}),
    body("chat-stream-word", 400, {**OK_CHAT, "stream": "maybe"}, CHAT),
    # [sampl] / [model] "n" and "use_beam_search" (the proxy splits on them)
    body("n-zero", 400, {"prompt": "x", "n": 0}),
    body("n-negative", 400, {"prompt": ["a", "b"], "n": -1}),
    body("n-word", 400, {"prompt": "x", "n": "two"}),
    body("n-null", 400, {"prompt": "x", "n": None}),
    body("n-fraction", 400, {"prompt": "x", "n": 1.5}),
    body("n-over-vllm-max", 400, {"prompt": "x", "n": 16385}),
    body("chat-n-zero", 400, {**OK_CHAT, "n": 0}, CHAT),
    body("n-greedy", 400, {"prompt": "x", "n": 2, "temperature": 0}),
    body("chat-n-greedy-text", 400, {**OK_CHAT, "n": 3, "temperature": "0.0"}, CHAT),
    body("beam-search-null", 400, {"prompt": "x", "use_beam_search": None}),
    body("beam-search-word", 400, {"prompt": "x", "use_beam_search": "maybe"}),
    # [legs]
    body("stream-options-without-stream", 400,
         {"prompt": "x", "stream_options": {"include_usage": True}}),
    body("chat-stream-options-without-stream", 400,
         {**OK_CHAT, "stream": False, "stream_options": {"include_usage": True}}, CHAT),
    body("prompt-logprobs-with-stream", 400, {"prompt": "x", "stream": True,
                                              "prompt_logprobs": 1}),
    body("logprob-ids-echo-no-tokens", 400, {"prompt": "x", "echo": True, "max_tokens": 0,
                                             "logprobs": 1, "logprob_token_ids": [1]}),
    body("too-many-prompts", 400, {"prompt": ["a"] * 1025, "max_tokens": 1}),
    # [size]
    body("over-limit", 413, {"prompt": "x" * (LIMIT + 1)}),
    body("chat-over-limit", 413, {"messages": [{"role": "user", "content": "x" * LIMIT}]},
         CHAT),
    Case("chunked-over-limit", 413, content=chunked_over_limit),
    raw("over-limit-text-plain", 413, b"x" * (LIMIT + 1), "text/plain"),
    # [route] methods
    Case("get-completions", 405, CMPL, "GET"),
    Case("put-chat", 405, CHAT, "PUT", content=orjson.dumps(OK_CHAT)),
    Case("delete-completions", 405, CMPL, "DELETE"),
    Case("patch-chat", 405, CHAT, "PATCH", content=b"{}"),
    Case("post-models", 405, "/v1/models", content=b"{}"),
    Case("post-health", 405, "/health", content=b"{}"),
    Case("post-version", 405, "/version"),
    Case("get-admin-policy", 405, "/admin/policy", "GET"),
    Case("delete-admin-state", 405, "/admin/state", "DELETE"),
    # [route] paths
    Case("unknown-v1", 404, "/v1/nope", "GET"),
    Case("unknown-v1-post", 404, "/v1/embeddings", content=orjson.dumps(OK_PROMPT)),
    Case("unknown-v2", 404, "/v2/completions", content=orjson.dumps(OK_PROMPT)),
    Case("root", 404, "/", "GET"),
    Case("unknown-admin", 404, "/admin/nope", "GET"),
    Case("trailing-slash-typo", 404, "/v1/completion", content=orjson.dumps(OK_PROMPT)),
]


def test_table_is_big_enough() -> None:
    assert len(CASES) >= 40
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_malformed_request(env: Proxy, case: Case) -> None:
    content = case.content() if callable(case.content) else case.content
    r = env.client.request(case.method, case.path, content=content, headers=case.headers)
    error = assert_error_shape(r, case.status)
    if case.status == 405:
        assert r.headers.get("allow"), "a 405 says which methods the route takes"
    if case.status == 400 and case.path in (CMPL, CHAT):
        assert error["type"] == "bad_request"
    # Refused at the door: no worker spent a prefill on it.
    assert env.received() == 0


# --- what vLLM accepts is accepted, read as vLLM reads it -------------------------------


@pytest.mark.parametrize(
    ("extra", "streams"),
    [
        ({"stream": "false"}, False),  # a truthy string that means False
        ({"stream": "TRUE"}, True),
        ({"stream": 1}, True),
        ({"stream": 0.0}, False),
        ({"stream": None}, False),
        ({"max_tokens": "3"}, False),
        ({"max_tokens": 3.0}, False),
        ({"max_tokens": 0}, False),
        ({"prompt": ["1", 2]}, False),  # lax ints in a token list
        ({"prompt": [[1, 2], [3]]}, False),
    ],
)
def test_lax_values_vllm_accepts_pass(env: Proxy, extra: dict, streams: bool) -> None:
    r = env.client.post(CMPL, json={"prompt": "hi", "max_tokens": 2, **extra})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith(
        "text/event-stream" if streams else "application/json"
    )


def test_valid_requests_still_pass(env: Proxy) -> None:
    assert env.client.post(CMPL, json=OK_PROMPT).status_code == 200
    mixed_case = {"content-type": "Application/JSON; charset=utf-8"}
    r = env.client.post(CHAT, content=orjson.dumps(OK_CHAT), headers=mixed_case)
    assert r.status_code == 200, r.text
    # Nested garbage in fields the proxy does not read is the workers' to judge.
    junk = {**OK_PROMPT, "junk": [[[{"a": [None, 1e300, -(2**62)]}]]]}
    assert env.client.post(CMPL, json=junk).status_code == 200


# --- admin: every value checked, nothing stored on a refusal -----------------------------


def policy_view(p: Proxy) -> tuple:
    s = p.admin_state()
    return s["policy"], s["config"], s["policy_config"]


def test_bad_policy_values_store_nothing_and_later_switches_work(env: Proxy) -> None:
    before = policy_view(env)
    r = env.client.post(
        "/admin/policy", json={"policy": "eldr-bl", "config": {"tau": 0.5, "epsilon": -7}}
    )
    assert assert_error_shape(r, 400)["param"] == "config.epsilon"
    assert policy_view(env) == before
    # The bug this guards: a refused value kept for eldr-bl broke every later switch to it.
    r = env.client.post("/admin/policy", json={"policy": "eldr-bl"})
    assert r.status_code == 200, r.text
    config = r.json()["config"]
    assert r.json()["policy"] == "eldr-bl" and config["epsilon"] >= 0 and config["tau"] != 0.5


@pytest.mark.parametrize(
    ("payload", "param"),
    [
        ({"policy": "eldr-bl", "config": {"tau": -5, "epsilon": -7}}, "config.tau"),
        ({"policy": "eldr-bl", "config": {"epsilon": -7}}, "config.epsilon"),
        ({"policy": "eldr", "config": {"tau": 1.5}}, "config.tau"),
        ({"policy": "eldr", "config": {"tau": -0.01}}, "config.tau"),
        ({"policy": "eldr", "config": {"tau": "0.1"}}, "config.tau"),
        ({"policy": "eldr", "config": {"tau": True}}, "config.tau"),
        ({"policy": "eldr-bl", "config": {"epsilon": [1]}}, "config.epsilon"),
        ({"policy": "eldr-bl", "config": {"epsilon": "big"}}, "config.epsilon"),
        ({"policy": "eldr-bl", "config": {"eps": 0.1}}, "config.eps"),
        ({"policy": "rr", "config": {"tau": 0.1}}, "config.tau"),  # rr has no options
        ({"policy": "eldr-union", "config": {"load_slack": -1}}, "config.load_slack"),
        ({"policy": "eldr", "config": [0.1]}, "config"),
        ({"policy": "eldr", "config": 0.1}, "config"),
        ({"policy": "eldr", "tau": 0.1}, "tau"),  # options go in "config"
        ({"policy": "nope"}, "policy"),
        ({"policy": "RR"}, "policy"),
        ({"policy": 5}, "policy"),
        ({"policy": None}, "policy"),
        ({"config": {"tau": 0.2}}, "policy"),
        ({}, "policy"),
        ({"policy": "nope", "config": {"tau": 0.2}}, "policy"),
    ],
)
def test_admin_policy_refusals(env: Proxy, payload: dict, param: str) -> None:
    before = policy_view(env)
    r = env.client.post("/admin/policy", json=payload)
    assert assert_error_shape(r, 400)["param"] == param
    assert policy_view(env) == before


def test_admin_policy_bounds_are_inclusive(env: Proxy) -> None:
    for name, config in (("eldr", {"tau": 0}), ("eldr", {"tau": 1}), ("eldr-bl", {"epsilon": 0}),
                         ("eldr-bl", {"epsilon": 100}), ("eldr-union", {"load_slack": 0})):
        r = env.client.post("/admin/policy", json={"policy": name, "config": config})
        assert r.status_code == 200, r.text
        assert all(r.json()["config"][k] == v for k, v in config.items())


@pytest.mark.parametrize(
    "payload",
    [{}, {"version": 5}, {"version": ""}, {"version": "  "}, {"version": None},
     {"version": ["v2"]}, {"version": "v2", "force": True}],
)
def test_admin_artifact_refusals(env: Proxy, payload: dict) -> None:
    before = env.admin_state()["artifact_version"]
    assert_error_shape(env.client.post("/admin/artifact", json=payload), 400)
    assert env.admin_state()["artifact_version"] == before


def test_admin_artifact_that_cannot_be_used_changes_nothing(env: Proxy) -> None:
    before = env.admin_state()["artifact_version"]
    for version in ("missing", "k1"):  # not in the store; K=1 for 2 decode workers
        r = env.client.post("/admin/artifact", json={"version": version})
        assert assert_error_shape(r, 400)["param"] == "version"
        assert env.admin_state()["artifact_version"] == before
    r = env.client.post("/admin/artifact", content=b"[]", headers=JSON)
    assert_error_shape(r, 400)


# --- the unexpected: 500 in the error shape, and the traceback in the log ----------------


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def error_log() -> Iterator[Records]:
    # On the logger itself: the proxy runs in another thread and "stages" may not propagate.
    handler, logger = Records(), logging.getLogger("stages.serve.proxy.front.responses")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


def test_unexpected_admin_error_is_a_logged_500(env: Proxy, error_log: Records) -> None:
    before = env.admin_state()["artifact_version"]
    r = env.client.post("/admin/artifact", json={"version": "boom"})
    assert assert_error_shape(r, 500)["type"] == "internal_error"
    assert "disk caught fire" not in r.text  # internals stay in the log
    assert env.admin_state()["artifact_version"] == before
    [record] = error_log.records
    assert record.exc_info is not None and "disk caught fire" in str(record.exc_info[1])


def test_unexpected_completion_error_is_a_logged_500(
    env: Proxy, error_log: Records, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: object) -> int:
        raise ZeroDivisionError("routing bug")

    monkeypatch.setattr(env.state.prefill_router, "choose", broken)
    assert_error_shape(env.client.post(CMPL, json=OK_PROMPT), 500)
    [record] = error_log.records
    assert record.exc_info is not None and isinstance(record.exc_info[1], ZeroDivisionError)
