"""Splitting a request that asks for several sequences into sub-requests of one each.

A PD hand-off describes the KV blocks of one prompt, once. A decode worker given one hand-off
for several prompts (``"prompt": [A, B]``) or several choices (``n > 1``) would attach the same
blocks to every sequence: B would continue A, and parallel choices would read blocks the
prefill worker frees after the first read. So such a request becomes one sub-request per
prompt and choice, each with its own prefill, hand-off and decode worker, and the answers are
merged back (:mod:`stages.serve.proxy.front.batch_merge`).

Indices and seeds follow vLLM: choice ``i`` of prompt ``p`` is ``p * n + i``, and choice ``i``
of a seeded request samples with ``seed + i`` (vLLM's ``ParentRequest``), so a greedy or seeded
request gets what one vLLM server would answer. Beam search is not split by choice: its ``n``
is the beam width, and one request per prompt answers all its beams.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import orjson

from stages.serve.proxy.errors import ProxyError
from stages.serve.proxy.front.request import RequestFields, bad_request, lax_int, prompts_of


@dataclass(frozen=True)
class Part:
    """One sub-request, and where its answer goes in the client's."""

    body: dict[str, Any]
    prompt_index: int
    first_index: int  # the merged index of the sub-answer's choice 0
    counts_prompt: bool  # its prompt tokens enter the usage (once per prompt, not per choice)


def split(
    body: dict[str, Any], chat: bool, fields: RequestFields, limit: int, byte_budget: int
) -> list[Part] | None:
    """The sub-requests of ``body``; None when it asks for one sequence (served as it is).

    More than ``limit`` sub-requests is a 400: each costs the proxy two upstream requests.
    Each sub-request repeats every field but the prompt, so those repeats may add up to
    ``byte_budget`` bytes, else a 413: a small body must not become gigabytes upstream.
    """
    prompts = None if chat else prompts_of(body)
    choices = 1 if fields.beam_search else fields.n
    if prompts is None and choices == 1:
        return None
    count = (len(prompts) if prompts is not None else 1) * choices
    if count > limit:
        raise bad_request(
            f"this request asks for {count} sequences (prompts x n); the proxy serves at most"
            f" {limit} per request, one prefill and one decode each",
            "n" if prompts is None else "prompt",
        )
    shared = _json_size({k: v for k, v in body.items() if k != "prompt" or prompts is None})
    if count * shared > byte_budget:
        raise ProxyError(
            413,
            f"split into {count} sequences, this request would send {count * shared} bytes of"
            f" repeated fields upstream; the proxy's limit is {byte_budget}",
            "too_large",
        )
    seed = _seed(body) if choices > 1 else None
    parts = []
    for p, prompt in enumerate(prompts if prompts is not None else [None]):
        for i in range(choices):
            sub = dict(body)
            if prompts is not None:
                # A list of one, so the worker reads it as an element of a batch, as vLLM
                # would ("" is refused as a whole prompt but not in a list).
                sub["prompt"] = [prompt]
            if choices > 1:
                sub["n"] = 1
                if seed is not None:
                    sub["seed"] = seed + i
            parts.append(Part(sub, p, p * fields.n + i, counts_prompt=i == 0))
    return parts


def _json_size(value: object) -> int:
    try:
        return len(orjson.dumps(value))
    except orjson.JSONEncodeError:  # lone surrogates, from a body only the stdlib read
        return len(json.dumps(value))


def _seed(body: dict[str, Any]) -> int | None:
    # What the workers cannot read as an int they refuse themselves, on the first prefill.
    try:
        return lax_int(body.get("seed"))
    except ValueError:
        return None
