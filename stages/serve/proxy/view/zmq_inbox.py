"""A ZMQ socket read from the event loop, every queued message at each wake-up.

pyzmq's asyncio sockets cost a future, a poll and several callbacks per message received; a
follower of a busy worker's KV events gets one message per request the worker runs. Here the
socket is a plain one: the loop watches its descriptor, and each wake-up takes what is queued
without waiting, either in a task (``wait``) or, cheaper still, in a reader callback
(``on_readable``: no task switch a message).

ZeroMQ's descriptor is edge-like: it turns readable when the socket's state changes, and
reading ``EVENTS`` clears it, whatever is still queued. Whoever reads must take messages until
``queued`` says none is left; a reader paused (``pause``) is not called while messages queue,
and must be drained by hand once resumed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import zmq


class ZmqInbox:
    """Owns ``socket`` (closed by ``close``); used from one event loop's thread.
    ``on_readable``: called from the loop when messages may be queued (else ``wait`` them)."""

    def __init__(self, socket: zmq.Socket, on_readable: Callable[[], None] | None = None) -> None:
        self.socket = socket
        self._loop = asyncio.get_running_loop()
        self._woken = asyncio.Event()
        self._fd = socket.FD
        self._reader = self._woken.set if on_readable is None else on_readable
        self._loop.add_reader(self._fd, self._reader)
        self._watched = True

    def queued(self) -> bool:
        """Whether a message is queued (clears the descriptor's readiness)."""
        return bool(self.socket.get(zmq.EVENTS) & zmq.POLLIN)

    def pause(self) -> None:
        """Stop calling ``on_readable`` (a readable descriptor no one reads would spin the
        loop)."""
        if self._watched:
            self._loop.remove_reader(self._fd)
            self._watched = False

    def resume(self) -> None:
        if not self._watched:
            self._loop.add_reader(self._fd, self._reader)
            self._watched = True

    async def wait(self, timeout_s: float | None = None) -> bool:
        """Until a message is queued (True) or ``timeout_s`` passed (False)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            # The descriptor only tells that something changed, and reading EVENTS re-arms it:
            # clear first, so a message that comes after the check still wakes the wait.
            self._woken.clear()
            if self.socket.get(zmq.EVENTS) & zmq.POLLIN:
                return True
            if deadline is None:
                await self._woken.wait()
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(self._woken.wait(), left)
            except TimeoutError:
                return bool(self.socket.get(zmq.EVENTS) & zmq.POLLIN)

    def recv(self) -> list[bytes]:
        """The next queued message; raises zmq.Again when none is."""
        # Frames tell whether more follow, without recv_multipart's getsockopt per frame
        # (the rest of a multipart message is always there once its first frame is).
        frame = self.socket.recv(zmq.NOBLOCK, copy=False)
        parts = [frame.bytes]
        while frame.more:
            frame = self.socket.recv(zmq.NOBLOCK, copy=False)
            parts.append(frame.bytes)
        return parts

    def close(self) -> None:
        self.pause()
        self.socket.close(linger=0)
