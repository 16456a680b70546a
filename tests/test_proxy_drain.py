"""The drain waits for every request let in: leased to a worker, or still sending its body."""

from __future__ import annotations

import signal

import pytest
import uvicorn

from stages.serve.proxy import create_app
from stages.serve.proxy.app import DrainingServer
from stages.serve.proxy.front.completions import admit
from tests.test_proxy import fast_config


@pytest.mark.anyio
async def test_the_drain_waits_for_a_request_still_uploading_its_body() -> None:
    app = create_app(fast_config(["http://p0"], ["http://d0"], policy="rr"))
    state = app.state.proxy
    server = DrainingServer(uvicorn.Config(app), state, drain_timeout_s=30)
    uploading = admit(state)  # let in, its body still on the way: no worker lease yet
    server.handle_exit(signal.SIGTERM, None)
    assert state.draining and state.in_flight() == 0
    assert not await server.on_tick(1)
    assert not server.should_exit  # it would be cut off with its answer half done
    uploading.settle()  # its body came and it leased a worker, or it ended
    await server.on_tick(1)
    assert server.should_exit
