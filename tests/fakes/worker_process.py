"""A fake worker in a process of its own, on a given port: a worker that can die and return.

``python -m tests.fakes.worker_process PORT NAME`` serves ``create_fake_worker`` until killed.
"""

from __future__ import annotations

import sys

import uvicorn

from tests.fakes.worker import FakeBehavior, create_fake_worker

if __name__ == "__main__":
    port, name = int(sys.argv[1]), sys.argv[2]
    app = create_fake_worker(FakeBehavior(name))
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)
