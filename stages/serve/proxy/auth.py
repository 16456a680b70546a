"""API keys on the proxy, checked the way vLLM's OpenAI server checks ``--api-key``.

vLLM (``vllm/entrypoints/serve/middleware/authenticate.py``) guards every path under ``/v1``
with ``Authorization: Bearer <key>``, skips ``OPTIONS`` (CORS preflights) and everything else
(``/health``, ``/metrics``, ``/version``), and refuses with ``401 {"error": "Unauthorized"}``.
The proxy does the same and guards ``/admin`` too, which can re-route all traffic.
"""

from __future__ import annotations

import hashlib
import ipaddress
import secrets

from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from stages.serve.proxy.config import ProxyConfig

# Prefix matches, as vLLM's: "/v1x" is guarded too, so a guess at a route learns nothing.
_API_PREFIX = "/v1"
_ADMIN_PREFIX = "/admin"
_LOOPBACK_NAMES = frozenset({"localhost", "localhost."})


def _digest(key: str) -> bytes:
    # Comparing fixed-size digests keeps compare_digest from leaking the key's length.
    return hashlib.sha256(key.encode("utf-8")).digest()


def bearer_matches(headers: Headers, expected: bytes) -> bool:
    """Whether ``Authorization`` is ``Bearer <key>`` (any case of "bearer") for this digest."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    return secrets.compare_digest(_digest(token), expected)


class ApiKeyMiddleware:
    """Refuses guarded paths without the right bearer key before any routing or body read."""

    def __init__(self, app: ASGIApp, api_key: str | None, admin_api_key: str | None) -> None:
        self.app = app
        self._api = _digest(api_key) if api_key is not None else None
        admin = admin_api_key if admin_api_key is not None else api_key
        self._admin = _digest(admin) if admin is not None else None

    def _expected(self, path: str) -> bytes | None:
        if path.startswith(_ADMIN_PREFIX):
            return self._admin
        if path.startswith(_API_PREFIX):
            return self._api
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        expected = self._expected(path)
        if expected is None or bearer_matches(Headers(scope=scope), expected):
            await self.app(scope, receive, send)
            return
        await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)


def auth_middleware(config: ProxyConfig) -> list[Middleware]:
    """The middleware for ``config``'s keys; none (no per-request cost) when no key is set."""
    if config.api_key is None and config.admin_api_key is None:
        return []
    return [
        Middleware(
            ApiKeyMiddleware, api_key=config.api_key, admin_api_key=config.admin_api_key
        )
    ]


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 (also bracketed or IPv4-mapped) and ``localhost``."""
    name = host.strip().lower()
    if name in _LOOPBACK_NAMES:
        return True
    try:
        address = ipaddress.ip_address(name.removeprefix("[").removesuffix("]"))
    except ValueError:
        return False  # another host name: it may resolve to anything
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def warn_if_exposed(host: str, api_key: str | None) -> str | None:
    """A warning for the CLI when the proxy would serve other machines without a key."""
    if api_key or is_loopback(host):
        return None
    return (
        f"the proxy listens on {host!r}, which other machines may reach, and has no API key:"
        " anyone who reaches it can send requests and change its routing (/admin). Set an API"
        " key, or bind to 127.0.0.1."
    )
