"""What the real-vLLM tests compare between the proxy and one plain vLLM server.

``BATCHES``: requests for several sequences (prompt lists, token-id lists, n > 1, echo, chat),
greedy or seeded, and ``answer`` reads a response (whole or streamed) into what must agree:
text and finish reason per choice index, usage, one ``[DONE]`` and no error event.

``MORE_CASES``: malformed or refused requests beyond ``tests.test_proxy_errors.CASES`` that
the proxy passes on to its workers (a worker's 4xx must reach the client as it is) or that only
the stdlib's JSON reads; their status must be vLLM's, whatever it is.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import orjson

from tests.test_proxy_errors import CHAT, CMPL, JSON, Case, body, raw

GREEDY = {"model": "tiny", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
_PROMPTS = [
    "def merge_sorted(a, b):\n    out = []\n",
    "The capital of France is",
    "Continuez ce texte : La rivière traverse le village.",
]

BATCHES: dict[str, tuple[str, dict[str, Any]]] = {
    "prompts": (CMPL, {**GREEDY, "prompt": _PROMPTS}),
    "token-ids": (CMPL, {**GREEDY, "prompt": [[1, 5, 9, 13, 17, 21], [100, 200, 300]]}),
    # n > 1 wants sampling (vLLM refuses it greedy); seeded, choice i samples with seed + i.
    "prompts-n2": (CMPL, {**GREEDY, "prompt": _PROMPTS[:2], "n": 2, "temperature": 0.7,
                          "seed": 7}),
    "seeded-n3": (CMPL, {**GREEDY, "prompt": _PROMPTS[1], "n": 3, "temperature": 0.8,
                         "seed": 1234}),
    "echo": (CMPL, {**GREEDY, "prompt": _PROMPTS[1:], "echo": True}),
    # Not a batch: vLLM 0.32 ignores best_of (an unknown field), and so does the proxy.
    "best-of-ignored": (CMPL, {**GREEDY, "prompt": _PROMPTS[0], "best_of": 3}),
    "chat-n2": (CHAT, {**GREEDY, "messages": [{"role": "user", "content": _PROMPTS[2]}],
                       "n": 2, "temperature": 0.9, "seed": 99}),
}


def answer(url: str, path: str, request: dict[str, Any], stream: bool) -> dict[str, Any]:
    """The response to ``request`` as what must agree: texts, finish reasons, usage."""
    chat = path == CHAT
    texts: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    if not stream:
        r = httpx.post(url + path, json=request, timeout=120)
        assert r.status_code == 200, r.text
        data = r.json()
        for c in data["choices"]:
            texts[c["index"]] = c["message"]["content"] if chat else c["text"]
            finish[c["index"]] = c["finish_reason"]
        usage = data["usage"]
    else:
        request = {**request, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", url + path, json=request, timeout=120) as r:
            assert r.status_code == 200, r.read()
            assert r.headers["content-type"].startswith("text/event-stream")
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]" and lines.count("data: [DONE]") == 1
        usages = []
        for line in lines[:-1]:
            event = json.loads(line[len("data: "):])
            assert "error" not in event, event
            if event["choices"] == []:
                usages.append(event["usage"])
            for c in event["choices"]:
                piece = (c["delta"].get("content") or "") if chat else c["text"]
                texts[c["index"]] = texts.get(c["index"], "") + piece
                if c.get("finish_reason") is not None:
                    finish[c["index"]] = c["finish_reason"]
        assert len(usages) == 1 and lines[-2].startswith('data: {"id"'), usages
        assert json.loads(lines[-2][len("data: "):])["choices"] == []  # usage comes last
        usage = usages[0]
    counts = {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    return {"texts": dict(sorted(texts.items())), "finish": dict(sorted(finish.items())),
            "usage": counts}


def status_of(url: str, case: Case) -> int:
    content = case.content() if callable(case.content) else case.content
    r = httpx.request(case.method, url + case.path, content=content, headers=case.headers,
                      timeout=120)
    return r.status_code


_SHORT = {"prompt": "x", "max_tokens": 2}
MORE_CASES = [
    # refused by the workers, passed on by the proxy
    body("unknown-model", 404, {**_SHORT, "model": "nope"}),
    body("temperature-negative", 400, {**_SHORT, "temperature": -1}),
    body("max-tokens-over-context", 400, {**_SHORT, "max_tokens": 100_000}),
    body("max-tokens-zero-no-echo", 400, {**_SHORT, "max_tokens": 0}),
    body("empty-prompt", 400, {**_SHORT, "prompt": ""}),
    body("no-prompt", 400, {"max_tokens": 2}),
    body("logprobs-too-many", 400, {**_SHORT, "logprobs": 1000}),
    body("stop-int", 400, {**_SHORT, "stop": 5}),
    body("top-k-word", 400, {**_SHORT, "top_k": "x"}),
    body("echo-with-suffix", 400, {**_SHORT, "echo": True, "suffix": "y"}),
    body("stream-with-beam-search", 400, {**_SHORT, "prompt": ["a", "b"], "n": 2,
                                          "stream": True, "use_beam_search": True}),
    body("batch-one-over-context", 400, {"prompt": ["a", "b " * 1100], "max_tokens": 2}),
    body("batch-embeds-and-prompts", 400, {**_SHORT, "prompt": ["a", "b"],
                                           "prompt_embeds": "AAAA"}),
    body("chat-message-no-role", 400, {"messages": [{"content": "x"}], "max_tokens": 2},
         CHAT),
    body("chat-top-logprobs-without-logprobs", 400,
         {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, CHAT),
    # accepted by both: lenient values and bodies only the stdlib's JSON reads
    body("greedy-n2", 400, {**_SHORT, "prompt": ["a", "b"], "n": 2, "temperature": 0}),
    body("batch-with-empty-string", 200, {**_SHORT, "prompt": ["a", ""]}),
    body("stream-word-false", 200, {**_SHORT, "stream": "false"}),
    body("n-as-text", 200, {**_SHORT, "n": "2"}),
    raw("utf8-bom", 200, b"\xef\xbb\xbf" + orjson.dumps(_SHORT)),
    raw("utf16", 200, json.dumps(_SHORT).encode("utf-16")),
    raw("lone-surrogate", 200, b'{"prompt": "x", "max_tokens": 2, "user": "\\ud800"}'),
    raw("nan-temperature", 400, b'{"prompt": "x", "max_tokens": 2, "temperature": NaN}'),
    Case("chunked-valid", 200, content=lambda: iter([b'{"prompt": "x",', b'"max_tokens": 2}']),
         headers=dict(JSON)),
]
