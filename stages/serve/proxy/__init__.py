"""The routing proxy: a request's path from the client through a prefill worker and a decode
worker and back (``completions``), and what the proxy keeps beside it (health, admin, metrics).
"""

from stages.serve.proxy.app import create_app, run_proxy

__all__ = ["create_app", "run_proxy"]
