"""Where a vLLM worker publishes its KV events, as eldr configures and finds them."""

from __future__ import annotations

from stages.errors import EldrError


def replay_endpoint(endpoint: str) -> str:
    """Where a worker publishing on ``endpoint`` serves replays: ``tcp://HOST:PORT`` on
    PORT + 1, ``ipc://PATH`` on ``PATH.replay``."""
    if endpoint.startswith("ipc://") and len(endpoint) > len("ipc://"):
        return endpoint + ".replay"
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    if not endpoint.startswith("tcp://") or not host or not port.isdigit():
        raise EldrError(f"KV event endpoint {endpoint!r}: use tcp://HOST:PORT (replay on"
                        " PORT+1) or ipc://PATH (replay on PATH.replay)")
    return f"tcp://{host}:{int(port) + 1}"


def kv_events_config(endpoint: str) -> dict[str, object]:
    """vLLM's ``--kv-events-config`` for a worker publishing on ``endpoint`` (vLLM binds a
    wildcard or ipc endpoint and connects to any other)."""
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
            "replay_endpoint": replay_endpoint(endpoint), "topic": "kv"}
