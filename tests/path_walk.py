"""Walk one request through the proxy and say which files of ``stages/`` it enters on its way
from ``completions._handle`` to the worker socket.

The proxy runs in this thread against fake workers (``tests.fakes.worker``); ``sys.settrace``
sees every Python call of the request's own task. A file counts once it is entered. The
routing is one question a leg asks: a file of another stage (``stages/routing``) counts where
the proxy calls into it, what that stage reads inside to answer does not (``Walk.inside``
lists it). A *return* is a call into a file that the path first entered before the calling
file: a callback, or a helper file the path left and comes back to; a callee returning to its
caller, or a coroutine resuming, is not one. The walk stops at the first write to a worker's
socket (``http1``'s ``send``): the prefill leg's.

Run it as ``python -m tests.path_walk [POLICY...]`` from a checkout's root to print the walk.
"""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import httpx

from stages.serve.proxy import create_app
from stages.serve.proxy.config import ProxyConfig
from tests.fakes.worker import BackgroundServer, FakeBehavior, create_fake_worker

_ROOT = Path(__file__).resolve().parent.parent
_STAGES = str(_ROOT / "stages") + "/"


@dataclass
class Walk:
    files: list[str] = field(default_factory=list)  # in the order first entered
    inside: list[str] = field(default_factory=list)  # another stage's files it read inside
    returns: list[str] = field(default_factory=list)  # "from -> to", a file left re-entered
    done: bool = False


_PROXY = "stages/serve/"


def _relative(filename: str) -> str | None:
    return filename[len(str(_ROOT)) + 1:] if filename.startswith(_STAGES) else None


def _is_socket_write(frame: FrameType) -> bool:
    return frame.f_code.co_name == "send" and frame.f_code.co_filename.endswith("/http1.py")


class _Tracer:
    def __init__(self) -> None:
        self.walk = Walk()
        self._task: asyncio.Task[Any] | None = None
        self._seen: set[int] = set()
        self._frames: list[FrameType] = []  # kept alive: a frame's id is never reused
        self._before: set[int] = set()

    def __call__(self, frame: FrameType, event: str, arg: object) -> None:
        if event != "call" or self.walk.done:
            return None
        name = _relative(frame.f_code.co_filename)
        if name is None:
            return None
        if self._task is None:
            if frame.f_code.co_name != "_handle":
                return None
            self._task = asyncio.current_task()
            outer = frame.f_back
            while outer is not None:  # the frames that were running before _handle was called
                self._before.add(id(outer))
                self._frames.append(outer)
                outer = outer.f_back
        elif asyncio.current_task() is not self._task or id(frame) in self._before:
            return None
        fresh = id(frame) not in self._seen
        self._seen.add(id(frame))
        self._frames.append(frame)
        caller = frame.f_back
        came_from = _relative(caller.f_code.co_filename) if caller is not None else None
        walk = self.walk
        inside = not name.startswith(_PROXY) and came_from is not None and (
            not came_from.startswith(_PROXY))
        if inside:  # another stage answering from its own files
            if name not in walk.files and name not in walk.inside:
                walk.inside.append(name)
        elif name not in walk.files:
            walk.files.append(name)
        elif fresh and came_from in walk.files and name != came_from and (
                walk.files.index(name) < walk.files.index(came_from)):
            walk.returns.append(f"{came_from} -> {name}")
        walk.done = _is_socket_write(frame)
        return None


async def _one_request(config: ProxyConfig, body: dict[str, Any]) -> tuple[Walk, int]:
    app = create_app(config)
    tracer = _Tracer()
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            sys.settrace(tracer)
            try:
                resp = await client.post("/v1/completions", json=body)
            finally:
                sys.settrace(None)
    return tracer.walk, resp.status_code


def walk_one_request(policy: str = "eldr-kv", stream: bool = False) -> tuple[Walk, int]:
    """The walk of one completion through a proxy of one prefill and two decode fakes."""
    behaviours = [FakeBehavior("p0"), FakeBehavior("d0"), FakeBehavior("d1")]
    workers = [BackgroundServer(create_fake_worker(b), "critical").start() for b in behaviours]
    try:
        config = ProxyConfig(
            prefill_urls=(workers[0].url,),
            decode_urls=(workers[1].url, workers[2].url),
            policy=policy,
            model="fake-model",
        )
        body = {"prompt": "hello", "max_tokens": 4, "stream": stream}
        return asyncio.run(_one_request(config, body))
    finally:
        for w in workers:
            w.stop()


if __name__ == "__main__":
    for name in (sys.argv[1:] or ["eldr-kv"]):
        walk, status = walk_one_request(name)
        print(f"policy {name}: status {status}, {len(walk.files)} files, "
              f"{len(walk.returns)} returns, reached the socket: {walk.done}")
        for f in walk.files:
            print("  ", f)
        for r in walk.returns:
            print("   return:", r)
        for f in walk.inside:
            print("   inside the routing:", f)
