"""Decode routing shared by the proxy and the simulator: the policies, their registry and the
decode step-time model some of them (and the simulator) read.

Nothing here imports from ``stages.serve`` or ``stages.bench``: both build on it.
"""
