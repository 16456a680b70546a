"""Traffic with history: multi-turn conversations (bundled generator, ShareGPT files), the
tokens they send, and the prefix-cache hit share an ideal router would get on them."""
