"""`eldr serve`: vLLM prefill/decode workers behind an expert-locality routing proxy."""
