"""What the real-vLLM tests look at from outside: processes eldr started, their sockets, and
when `eldr serve` is ready; ``running_serve`` starts one and makes sure all of it is gone."""

from __future__ import annotations

import ipaddress
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from stages.procs import linux
from stages.procs.health import healthy
from stages.serve.cluster.ports import free_ports

_LISTEN = "0A"  # TCP state LISTEN in /proc/net/tcp
_UNCONNECTED = "07"  # UDP sockets bound but not connected


@dataclass(frozen=True)
class Listener:
    pid: int
    command: str
    proto: str
    address: str
    port: int

    @property
    def loopback(self) -> bool:
        return ipaddress.ip_address(self.address).is_loopback


def eldr_ok(*args: str, home: Path, timeout: int = 600) -> str:
    """`eldr ARGS` as a user runs it, with ``home`` as its ELDR_HOME; its stdout, once it has
    exited 0."""
    env = {**os.environ, "ELDR_HOME": str(home)}
    result = subprocess.run([sys.executable, "-m", "eldr_cli", *args], capture_output=True,
                            text=True, timeout=timeout, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def alive(pid: int) -> bool:
    info = linux.read_info(pid)
    return info is not None and not info.zombie


def tree(pid: int) -> set[int]:
    return {info.pid for info in linux.descendants(pid) if not info.zombie}


def wait_gone(pids: set[int], timeout_s: float) -> set[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        left = {p for p in pids if alive(p)}
        if not left:
            return set()
        time.sleep(0.2)
    return {p for p in pids if alive(p)}


def command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


def _address(hex_address: str, v6: bool) -> str:
    raw = bytes.fromhex(hex_address)
    if not v6:
        return str(ipaddress.IPv4Address(raw[::-1]))
    # Four 32-bit words, each in host (little-endian) order.
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    return str(ipaddress.IPv6Address(words))


def listeners(pids: set[int]) -> list[Listener]:
    """TCP listening and unconnected UDP sockets held by ``pids``."""
    owner: dict[str, int] = {}
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if target.startswith("socket:["):
                    owner[target[8:-1]] = pid
        except OSError:
            continue
    found = []
    for proto, state in (("tcp", _LISTEN), ("tcp6", _LISTEN), ("udp", _UNCONNECTED),
                         ("udp6", _UNCONNECTED)):
        lines = Path(f"/proc/net/{proto}").read_text().splitlines()[1:]
        for line in lines:
            fields = line.split()
            local, st, inode = fields[1], fields[3], fields[9]
            if st != state or inode not in owner:
                continue
            address, port = local.split(":")
            pid = owner[inode]
            found.append(Listener(pid, command(pid)[:80], proto, _address(address, "6" in proto),
                                  int(port, 16)))
    return found


def wait_healthy(
    proc: subprocess.Popen[Any],
    url: str,
    timeout_s: float,
    output: Callable[[], str],
    on_poll: Callable[[], object] | None = None,
) -> None:
    """Wait until ``eldr serve`` (``proc``) answers 200 on ``url``/health; fail with its output
    if it exits first or the time runs out. ``on_poll`` runs every second (to record the
    processes it starts while they come up)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"eldr serve exited with {proc.returncode}:\n{output()[-4000:]}")
        if on_poll is not None:
            on_poll()
        if healthy(url):
            return
        time.sleep(1)
    pytest.fail(f"eldr serve did not become healthy in {timeout_s:.0f} s:\n{output()[-4000:]}")


def start_serve(args: list[str], home: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """``eldr serve ARGS`` with its output in ``home``/serve.log (``serve_log``)."""
    with serve_log(home).open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "eldr_cli", "serve", *args], env=env, stdout=out,
            stderr=subprocess.STDOUT,
        )


def serve_log(home: Path) -> Path:
    return home / "serve.log"


def api_server(root: int, port: int) -> int:
    """The vLLM API server listening on ``port`` below process ``root`` (a keeper's child)."""
    for pid in tree(root):
        text = command(pid)
        if "vllm.entrypoints.openai.api_server" in text and "stages.procs.keeper" not in text \
                and f"--port {port} " in text:
            return pid
    raise AssertionError(f"no vLLM API server for port {port} below process {root}")


@dataclass
class Served:
    proc: subprocess.Popen[bytes]
    url: str
    worker_port: int
    log: Path
    started: set[int] = field(default_factory=set)  # every process seen below eldr serve

    def seen(self) -> set[int]:
        self.started |= tree(self.proc.pid)
        return self.started

    def state(self) -> dict[str, object]:
        return httpx.get(f"{self.url}/admin/state", timeout=10).json()  # type: ignore[no-any-return]

    def health(self) -> dict[str, object]:
        """The proxy's /health; empty while it does not answer in time (a loaded machine)."""
        try:
            return httpx.get(f"{self.url}/health", timeout=5).json()  # type: ignore[no-any-return]
        except httpx.HTTPError:
            return {}

    def api_server(self, port: int) -> int:
        return api_server(self.proc.pid, port)

    def decode_api_server(self, index: int) -> int:
        return self.api_server(self.worker_port + 1 + index)  # the prefill worker is first


@contextmanager
def running_serve(args: list[str], home: Path, timeout_s: float = 500) -> Iterator[Served]:
    """``eldr serve ARGS`` on free ports with ELDR_HOME=``home``, healthy; on exit SIGTERM,
    and every process it started gone."""
    port, worker_port = free_ports(2)
    proc = start_serve([*args, "--port", str(port), "--worker-port", str(worker_port)], home,
                       {**os.environ, "ELDR_HOME": str(home)})
    served = Served(proc, f"http://127.0.0.1:{port}", worker_port, serve_log(home))
    try:
        wait_healthy(proc, served.url, timeout_s, served.log.read_text, on_poll=served.seen)
        yield served
    finally:
        served.seen()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        wait_gone(served.started, 30)
