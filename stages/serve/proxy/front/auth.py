"""API keys on the proxy, checked the way vLLM's OpenAI server checks ``--api-key``.

vLLM (``vllm/entrypoints/serve/middleware/authenticate.py``) guards every path under ``/v1``
with ``Authorization: Bearer <key>``, skips ``OPTIONS`` (CORS preflights) and everything else
(``/health``, ``/metrics``, ``/version``), and refuses with ``401 {"error": "Unauthorized"}``.
The proxy does the same and guards ``/admin`` too, which can re-route all traffic and write
cost files under the eldr home: ``/admin`` takes ``--admin-api-key`` and no other key. With no
admin key it answers 403 whenever an inference key is set (a client holding the inference key
is not an operator) or the proxy listens beyond loopback; only a loopback proxy with no key at
all leaves it open.
"""

from __future__ import annotations

import hashlib
import ipaddress
import secrets

from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from stages.errors import EldrError
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


ADMIN_LOCKED = (
    "the admin API is locked: this proxy listens beyond loopback and has no admin key; start"
    " eldr serve with --admin-api-key to use it"
)

ADMIN_NEEDS_ITS_OWN_KEY = (
    "the admin API needs its own key: this proxy has an inference key (--api-key) and no"
    " --admin-api-key, and an inference key does not open /admin; start eldr serve with"
    " --admin-api-key to use it"
)


class ApiKeyMiddleware:
    """Refuses guarded paths without the right bearer key before any routing or body read."""

    def __init__(self, app: ASGIApp, api_key: str | None, admin_api_key: str | None,
                 admin_locked: bool = False) -> None:
        self.app = app
        self._api = _digest(api_key) if api_key is not None else None
        self._admin = _digest(admin_api_key) if admin_api_key is not None else None
        # Why /admin is refused to everyone (None: it is not).
        self._admin_refusal: str | None = None
        if admin_api_key is None and api_key is not None:
            self._admin_refusal = ADMIN_NEEDS_ITS_OWN_KEY
        elif admin_api_key is None and admin_locked:
            self._admin_refusal = ADMIN_LOCKED

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
        if self._admin_refusal is not None and path.startswith(_ADMIN_PREFIX):
            await JSONResponse({"error": self._admin_refusal}, status_code=403)(
                scope, receive, send)
            return
        expected = self._expected(path)
        if expected is None or bearer_matches(Headers(scope=scope), expected):
            await self.app(scope, receive, send)
            return
        await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)


def auth_middleware(config: ProxyConfig) -> list[Middleware]:
    """The middleware for ``config``'s keys and address; none (no per-request cost) when no
    key is set and the proxy listens on loopback only."""
    locked = not is_loopback(config.host)
    if config.api_key is None and config.admin_api_key is None and not locked:
        return []
    return [
        Middleware(
            ApiKeyMiddleware, api_key=config.api_key, admin_api_key=config.admin_api_key,
            admin_locked=locked,
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


def check_exposure(host: str, api_key: str | None, insecure: bool) -> str | None:
    """Refuse (``EldrError``) a proxy that would serve other machines with no API key unless
    ``insecure``; then return the warning to print, or None."""
    if api_key or is_loopback(host):
        return None
    if not insecure:
        raise EldrError(
            f"--host {host} lets other machines reach the proxy, and it has no API key. Set one"
            " (--api-key or ELDR_API_KEY; clients send it as vLLM's), or pass --insecure to"
            " serve /v1 without a key on a private network (/admin stays locked without"
            " --admin-api-key)"
        )
    return (
        f"the proxy listens on {host!r} with no API key (--insecure): anyone who reaches it can"
        " send requests; /admin is locked without an admin key"
    )
