"""The cluster simulator: a PD cluster driven by the proxy's own policies on a cost model,
and the locality dial."""
