"""The proxy's admin API as the load generator uses it: read state, switch the policy."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import httpx

from stages.errors import EldrError

log = logging.getLogger(__name__)


class ProxyAdmin:
    def __init__(self, client: httpx.AsyncClient, base_url: str, timeout_s: float = 10.0) -> None:
        self._client = client
        self._base = base_url.rstrip("/")
        self._timeout = timeout_s

    async def state(self) -> dict[str, Any]:
        url = f"{self._base}/admin/state"
        try:
            response = await self._client.get(url, timeout=self._timeout)
            response.raise_for_status()
            state = response.json()
        except httpx.ConnectError as exc:
            raise EldrError(
                f"no eldr proxy answers at {self._base} ({exc}): start one with `eldr serve`"
                " (or pass --url), or run `eldr bench --simulate` without one"
            ) from exc
        except (httpx.HTTPError, ValueError) as exc:
            raise EldrError(f"cannot read the proxy's state at {url}: {exc}") from exc
        if not isinstance(state, dict):
            raise EldrError(f"{url} returned {type(state).__name__}, expected a JSON object")
        return state

    async def served_model(self) -> str | None:
        """The model name the proxy's workers serve (results files name it, as vLLM's do)."""
        try:
            response = await self._client.get(f"{self._base}/v1/models", timeout=self._timeout)
            response.raise_for_status()
            return str(response.json()["data"][0]["id"])
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
            # The comparison does not need it; the results file then says null.
            log.warning("cannot read the served model name from %s/v1/models: %s", self._base, exc)
            return None

    async def set_policy(
        self, name: str, config: Mapping[str, Any] | None = None, seed: int | None = None
    ) -> dict[str, Any]:
        """Switch the decode policy, updating its options by ``config`` when given (the proxy
        keeps them for that policy) and drawing from ``seed`` when given, and confirm it took
        effect; returns the new state."""
        url = f"{self._base}/admin/policy"
        body: dict[str, Any] = {"policy": name}
        if config:
            body["config"] = inline_cost(config)
        if seed is not None:
            body["seed"] = seed
        try:
            response = await self._client.post(url, json=body, timeout=self._timeout)
        except httpx.HTTPError as exc:
            raise EldrError(f"cannot switch the proxy's policy at {url}: {exc}") from exc
        if response.status_code >= 400:
            raise EldrError(
                f"the proxy refused policy {name!r} (HTTP {response.status_code}):"
                f" {response.text[:300]}"
            )
        state = await self.state()
        if state.get("policy") != name:
            raise EldrError(
                f"asked the proxy for policy {name!r} but it reports {state.get('policy')!r}"
            )
        if seed is not None and state.get("policy_seed") != seed:
            raise EldrError(
                f"asked the proxy for policy seed {seed} but it reports"
                f" {state.get('policy_seed')!r} (a proxy older than this bench?)"
            )
        return state


def inline_cost(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` with a cost model file read into the request: the proxy may run on another
    machine, and reads cost files of a client's naming only under its own eldr home."""
    from pathlib import Path

    from stages.routing.cost_model import COST_PRESETS, CostModel

    out = dict(config)
    cost = out.get("cost")
    if isinstance(cost, str) and cost not in ("", *COST_PRESETS):
        out["cost"] = CostModel.load(Path(cost)).to_json()  # EldrError names a missing file
    return out


def decode_worker_urls(state: dict[str, Any]) -> tuple[str, ...]:
    """Decode worker URLs listed in ``/admin/state`` (``decode_workers: [{"url": ...}]``)."""
    workers = state.get("decode_workers")
    if not isinstance(workers, list):
        return ()
    urls = []
    for worker in workers:
        if not isinstance(worker, dict) or not isinstance(worker.get("url"), str):
            raise EldrError(f"/admin/state lists a decode worker without a url: {worker!r}")
        urls.append(worker["url"])
    return tuple(urls)
