"""Ports for `eldr serve`: checked free before anything starts, or picked free by the system.

A port already taken would otherwise surface only after the workers had loaded their models
(vLLM's or uvicorn's bind error, minutes into the start), or, for NIXL's side channel, as a
decode worker of one deployment pulling KV from another deployment's prefill worker.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Iterable
from pathlib import Path

from stages.errors import EldrError

_LAST_PORT = 65535
_SCAN_FROM = 10000  # above the well-known and registered ports most services use
_EPHEMERAL_LOW_DEFAULT = 32768


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
    """``count`` distinct loopback ports free now, none in ``avoid``, below the kernel's
    ephemeral range.

    A port the system picks (bind to 0) is an ephemeral one, and the kernel hands those to any
    socket at any moment: vLLM's own ZMQ and gloo binds took such a port from a decode worker's
    NIXL listener between the pick and its bind ("Address already in use"). Below the range
    only a deliberate bind can take it. The scan starts at a random point so two deployments
    planned at once rarely try the same ports.
    """
    avoid = set(avoid)
    low, high = _SCAN_FROM, _ephemeral_low()
    if high - low < count + len(avoid):
        raise EldrError(f"no {count} free ports below the ephemeral range ({low}-{high - 1})")
    start = random.SystemRandom().randrange(high - low)
    held: list[socket.socket] = []
    ports: list[int] = []
    try:
        # Holding every socket until all are chosen keeps one port from being picked twice.
        for offset in range(high - low):
            if len(ports) == count:
                break
            port = low + (start + offset) % (high - low)
            if port in avoid:
                continue
            try:
                held.append(_bind("127.0.0.1", port))
            except OSError:
                continue  # taken: try the next one
            ports.append(port)
    finally:
        for sock in held:
            sock.close()
    if len(ports) < count:
        raise EldrError(f"only {len(ports)} of {count} ports free in {low}-{high - 1}")
    return ports


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux; the usual default elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return _EPHEMERAL_LOW_DEFAULT
