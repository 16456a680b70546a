"""Ports for `eldr serve`: checked free before anything starts, or picked free by the system.

A port already taken would otherwise surface only after the workers had loaded their models
(vLLM's or uvicorn's bind error, minutes into the start), or, for NIXL's side channel, as a
decode worker of one deployment pulling KV from another deployment's prefill worker.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable

from stages.errors import EldrError

_LAST_PORT = 65535


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    # As the servers bind: a port whose last connection is in TIME_WAIT is free to them.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def check_free(what: str, ports: Iterable[int], host: str = "127.0.0.1") -> None:
    """Raise a user error naming ``what`` when any of ``ports`` cannot be bound on ``host``."""
    for port in ports:
        if not 1 <= port <= _LAST_PORT:
            raise EldrError(f"{what}: port {port} is out of range (1-{_LAST_PORT})")
        try:
            _bind(host, port).close()
        except OSError as exc:
            raise EldrError(
                f"{what}: port {port} on {host} is not free ({exc.strerror}); another"
                " deployment may be using it"
            ) from None


def free_ports(count: int, avoid: Iterable[int] = ()) -> list[int]:
    """``count`` distinct loopback ports the system reports free now, none in ``avoid``."""
    avoid = set(avoid)
    held: list[socket.socket] = []
    ports: list[int] = []
    try:
        # Holding every socket until all are chosen keeps the system from handing out one
        # port twice.
        while len(ports) < count:
            sock = _bind("127.0.0.1", 0)
            held.append(sock)
            port = int(sock.getsockname()[1])
            if port not in avoid:
                ports.append(port)
    finally:
        for sock in held:
            sock.close()
    return ports
