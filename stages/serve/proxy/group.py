"""Several proxy processes on one port (``eldr serve --proxy-workers N``).

One Python process relays about one core's worth of requests and tokens; a cluster that needs
more gets more processes. This process binds N listening sockets on the port with
``SO_REUSEPORT``, so the kernel spreads new connections over them, and a private loopback
socket per process, through which the processes reach each other as peers (admin changes,
merged ``/metrics``: ``stages.serve.proxy.front.peers``). Every socket is bound here, before any
process starts, so a port in use fails at once and no connection is ever refused while a
process starts: the kernel queues it on its socket until that process accepts.

Process 0 is this one; the others are started from it, each in a session of its own (a
Ctrl-C reaches this process only) and killed by the kernel if this one dies. The first SIGINT
or SIGTERM here is passed to every other process: all drain together.

Process 0 holds every socket open, so a process that dies leaves a listener nobody accepts on,
and the kernel would keep handing it about 1/N of new connections, which would hang. A thread
here watches the others (their exit wakes it at once): a dead one's listening socket is closed,
which takes it out of the kernel's choice (connections it had queued are reset, as those it
had accepted were), and a new process takes its place on a new socket that starts listening
only once that process accepts. Nothing is restarted once the group drains.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess

from stages.errors import EldrError
from stages.procs.platform_check import owns_processes
from stages.serve.proxy.app import run_proxy
from stages.serve.proxy.config import ProxyConfig
from stages.serve.proxy.ops.rejoin import RestartCounts, no_restarts

log = logging.getLogger(__name__)

# How long the other processes get past the drain to stop before they are killed.
_STOP_GRACE_S = 10.0
# A process that dies sooner than this after its start is replaced only this long after that
# start: one that cannot start is not respawned in a tight loop.
_RESPAWN_MIN_S = 5.0


def listener(host: str, port: int, reuse_port: bool, listen: bool = True) -> socket.socket:
    """A listening TCP socket on ``host``:``port`` (IPv6 when ``host`` is an IPv6 address);
    with ``listen`` False, bound only: whoever serves it listens (asyncio's ``create_server``
    does), and until then the kernel hands it no connection."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        if listen:
            sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise EldrError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    sock.set_inheritable(True)
    return sock


def serve_group(
    config: ProxyConfig,
    host: str,
    port: int,
    processes: int,
    *,
    log_level: str = "info",
    restarts: RestartCounts = no_restarts,
    drain_timeout_s: float = 30.0,
    on_ready: Callable[[], None] | None = None,
) -> None:
    """Serve ``processes`` proxies on ``host``:``port`` until interrupted (blocking);
    ``on_ready`` is called once, from a thread, when every process answers ``/health`` 200
    (``front.readiness``: each heard its workers' streams)."""
    if processes < 1:
        raise EldrError(f"--proxy-workers must be >= 1, got {processes}")
    if not hasattr(socket, "SO_REUSEPORT") and processes > 1:
        raise EldrError("--proxy-workers above 1 needs SO_REUSEPORT, which this platform lacks")
    public = [listener(host, port, reuse_port=True) for _ in range(processes)]
    control = [listener("127.0.0.1", 0, reuse_port=False) for _ in range(processes)]
    urls = [f"http://127.0.0.1:{s.getsockname()[1]}" for s in control]
    # Names unique across machines too, for peers named with --peer: the merged /metrics
    # labels each proxy's series with it.
    name = f"{socket.gethostname()}:{port}"
    configs = [
        replace(config, proxy_id=f"{name}/{i}", peers=(*config.peers, *urls[:i], *urls[i + 1:]))
        for i in range(processes)
    ]
    ctx = mp.get_context("spawn")

    def start_one(i: int, public_socket: socket.socket) -> BaseProcess:
        process = ctx.Process(
            target=_serve_one, name=f"eldr-proxy-{i}", daemon=False,
            args=(configs[i], [public_socket, control[i]], log_level, drain_timeout_s,
                  os.getpid()),
        )
        process.start()
        return process

    others = _Others(start_one, public, lambda: listener(host, port, True, listen=False))
    serving = threading.Event()
    try:
        others.start()
        if on_ready is not None:
            threading.Thread(target=_announce_ready, args=(urls, on_ready, serving),
                             name="eldr-ready", daemon=True).start()
        # The supervisor's restart counts live in this process: only proxy 0 reports them.
        run_proxy(configs[0], host=host, port=port, log_level=log_level, restarts=restarts,
                  drain_timeout_s=drain_timeout_s, sockets=[public[0], control[0]],
                  on_signal=others.drain)
    finally:
        serving.set()
        others.stop(drain_timeout_s + _STOP_GRACE_S)
        for sock in (*public, *control):
            sock.close()


def _announce_ready(urls: list[str], on_ready: Callable[[], None], ended: threading.Event,
                    poll_s: float = 0.2) -> None:
    """Call ``on_ready`` once every proxy at ``urls`` answers ``/health`` 200, unless the
    group ends first."""
    from stages.procs.health import healthy

    waiting = list(urls)
    while waiting and not ended.wait(poll_s):
        waiting = [u for u in waiting if not healthy(u, timeout_s=2.0)]
    if not waiting and not ended.is_set():
        on_ready()


def _serve_one(config: ProxyConfig, sockets: list[socket.socket], log_level: str,
               drain_timeout_s: float, parent: int) -> None:
    os.setsid()  # a terminal's Ctrl-C goes to process 0, which passes it on once
    if owns_processes():
        from stages.procs.linux import die_with_parent

        die_with_parent(signal.SIGKILL)
    if os.getppid() != parent:  # it died before the line above: nothing will kill this one
        return
    run_proxy(config, log_level=log_level, drain_timeout_s=drain_timeout_s, sockets=sockets)


class _Others:
    """The proxy processes this one started (1 to N-1, as ``public`` indexes their listening
    sockets), watched and replaced when one dies."""

    def __init__(self, start_one: Callable[[int, socket.socket], BaseProcess],
                 public: list[socket.socket], new_socket: Callable[[], socket.socket]) -> None:
        self._start_one = start_one
        self._public = public  # replaced in place: the caller closes what is there at the end
        self._new_socket = new_socket
        self.processes: dict[int, BaseProcess] = {}
        self._started: dict[int, float] = {}
        self._respawn_at: dict[int, float] = {}  # died too soon after its start: wait
        self._lock = threading.RLock()
        self._draining = False
        self._stopping = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="eldr-proxy-watch",
                                         daemon=True)

    def start(self) -> None:
        with self._lock:
            for i in range(1, len(self._public)):
                self._spawn(i, self._public[i])
        self._watcher.start()

    def _spawn(self, i: int, public_socket: socket.socket) -> None:
        self.processes[i] = self._start_one(i, public_socket)
        self._started[i] = time.monotonic()

    def _watch(self) -> None:
        while not self._stopping.is_set():
            with self._lock:
                running = {p.sentinel: i for i, p in self.processes.items()
                           if p.exitcode is None}
                waits = [at - time.monotonic() for at in self._respawn_at.values()]
            timeout = max(0.0, min([0.5, *waits]))
            for sentinel in wait(list(running), timeout) if running else ():
                self._died(running[sentinel])  # type: ignore[index]
            if not running:
                self._stopping.wait(timeout)
            self._respawn_due()

    def _died(self, i: int) -> None:
        with self._lock:
            if self._draining or self._stopping.is_set():
                return
            process = self.processes[i]
            process.join()
            # Closed at once: the kernel stops choosing it for new connections.
            self._public[i].close()
            lived = time.monotonic() - self._started[i]
            log.warning("proxy process %s died (exit code %s) after %.1f s: its socket closed,"
                        " a new process starts", process.name, process.exitcode, lived)
            self._respawn_at[i] = self._started[i] + (_RESPAWN_MIN_S if lived < _RESPAWN_MIN_S
                                                      else 0.0)

    def _respawn_due(self) -> None:
        with self._lock:
            now = time.monotonic()
            for i, at in list(self._respawn_at.items()):
                if at > now:
                    continue
                del self._respawn_at[i]
                if self._draining or self._stopping.is_set():
                    continue
                try:
                    self._public[i] = self._new_socket()
                except EldrError as exc:  # the port taken meanwhile: the others serve it
                    log.error("proxy process %d not replaced: %s", i, exc)
                    continue
                self._spawn(i, self._public[i])

    def drain(self) -> None:
        """Pass the first stop signal on, once: a second one would end their drain at once."""
        with self._lock:
            if self._draining:
                return
            self._draining = True
            for process in self.processes.values():
                if process.pid is not None and process.exitcode is None:
                    try:
                        os.kill(process.pid, signal.SIGTERM)
                    except ProcessLookupError:
                        continue

    def stop(self, timeout_s: float) -> None:
        """Drain every process still running, wait for them up to ``timeout_s``, then kill what
        is left."""
        self.drain()
        self._stopping.set()
        if self._watcher.is_alive():
            self._watcher.join()
        deadline = time.monotonic() + timeout_s
        for process in self.processes.values():
            if process.pid is None:
                continue
            process.join(max(0.0, deadline - time.monotonic()))
            if process.exitcode is None:
                log.warning("proxy process %s did not stop in time: killed", process.name)
                process.kill()
                process.join()
