"""The small model the simulator's tests route, and one set of its signatures (a fixture, drawn
once per test module that imports it)."""

from __future__ import annotations

import pytest

from stages.bench.sim.synthetic import SyntheticSpec, synthetic_signatures

LAYERS, EXPERTS, TOP_K = 4, 16, 2


@pytest.fixture(scope="module")
def arrays():  # type: ignore[no-untyped-def]
    return synthetic_signatures(SyntheticSpec(num_requests=200, num_layers=LAYERS,
                                              num_experts=EXPERTS, top_k=TOP_K,
                                              domain_experts=6))
