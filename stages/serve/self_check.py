"""Start-up self-check: a worker eldr routes with must really record expert signatures.

A worker in vLLM's compiled mode whose graph lacks eldr's recording hook (plugin missing, or a
compile cache traced without it) would answer every request with an empty signature, and eldr
would route blind without a word. One short prompt per worker settles it before the proxy
opens: a signature of the served model's shape, built MoE layers as the config says, and every
layer counted.
"""

from __future__ import annotations

import httpx

from stages.errors import EldrError
from stages.models import check_built_layers
from stages.serve.upstream import bearer_header
from stages.signature import wire
from stages.signature.dataset import ModelIdentity

PROBE_PROMPT = "eldr self-check: one short prompt must come back with an expert signature."


def check_records_signatures(
    url: str, identity: ModelIdentity, model_name: str | None, api_key: str | None = None,
    timeout_s: float = 120.0,
) -> None:
    body: dict[str, object] = {"prompt": PROBE_PROMPT, "max_tokens": 1, "temperature": 0}
    if model_name:
        body["model"] = model_name
    headers = bearer_header(api_key)
    try:
        response = httpx.post(
            f"{url}/v1/completions", json=body, headers=headers, timeout=timeout_s
        )
        response.raise_for_status()
        params = response.json().get("kv_transfer_params")
    except (httpx.HTTPError, ValueError) as exc:
        raise EldrError(f"self-check of worker {url} failed: {exc}") from exc
    counts = wire.decode(params if isinstance(params, dict) else None)
    if counts is None:
        raise EldrError(
            f"worker {url} returns no expert signature: start it with eldr installed and"
            f" --kv-transfer-config naming EldrSignatureConnector (see README, 'In front of"
            f" your vLLM workers'), or choose a policy that needs none (--policy jsq)"
        )
    if counts.shape != identity.shape:
        raise EldrError(
            f"worker {url} records signatures of shape {counts.shape}, but the served model"
            f" {identity.describe()} has {identity.shape}: is it serving another model?"
        )
    built = wire.decode_moe_layers(params if isinstance(params, dict) else None)
    if built is not None:
        check_built_layers(identity, built, f"worker {url}")
    if len(wire.empty_layers(counts)):
        raise EldrError(
            f"worker {url} returned an empty expert signature for its self-check prompt: its"
            " model runs without eldr's recording hook (a compile cache from a run without"
            " eldr, or a MoE kernel that routes inside the kernel). Restart it, or run it"
            " with --enforce-eager"
        )
