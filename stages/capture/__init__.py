"""Signature capture inside vLLM (plugin + KV connector) and the `eldr capture` runner."""
