"""Benchmarks: the load generator against the proxy, engine cost measurement, the simulator.

Every path reports the same ``vllm bench serve``-shaped metrics per policy (``metrics``) and the
same comparison table (``report``), so a simulated run and a real one read alike.
"""
