"""Live benchmarks: the load generator against a running proxy, and what it reads from
the workers."""
