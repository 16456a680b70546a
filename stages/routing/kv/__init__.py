"""What each worker holds in its KV cache: the blocks a prompt maps to, and which worker has
which of them, read from vLLM's own KV events (``stages.serve.proxy.view.kv_events``)."""
