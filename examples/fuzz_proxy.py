"""Schema fuzzing of a live proxy: requests generated from the OpenAPI document a vLLM worker
publishes (valid and not, tests/openapi_fuzz.py), each sent to the proxy and to that worker,
then the figures: examples per route, the (proxy, vLLM) statuses seen, 5xx answers from the
proxy, proxy 4xx answers not in vLLM's error shape, status classes that differ from vLLM's, and
answers not read to their end. Exit 1 when any of those is not zero.

    .venv/bin/python -m examples.fuzz_proxy --proxy http://127.0.0.1:8000 \\
        --vllm http://127.0.0.1:8101 --examples 200

Examples are derandomized: the same ones every run, as the real-vLLM test sends.
``examples.soak --fuzz-examples`` runs this against the soak's deployment after its load.
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from tests.openapi_fuzz import ROUTES, error_shape_problem, request_bodies, send


@dataclass
class Tally:
    examples: Counter[str] = field(default_factory=Counter)  # per route
    statuses: Counter[tuple[str, int, int]] = field(default_factory=Counter)  # route, proxy, vLLM
    proxy_5xx: int = 0
    bad_4xx_shape: list[str] = field(default_factory=list)  # the proxy's
    vllm_bad_4xx_shape: list[str] = field(default_factory=list)  # vLLM's own, for reference
    class_differs: list[str] = field(default_factory=list)
    not_ended: int = 0
    transport_errors: list[str] = field(default_factory=list)  # no answer at all

    @property
    def ok(self) -> bool:
        return not (self.proxy_5xx or self.bad_4xx_shape or self.class_differs
                    or self.not_ended or self.transport_errors)

    def lines(self) -> list[str]:
        out = [f"{route}: {n} examples" for route, n in self.examples.items()]
        for (route, got, want), n in sorted(self.statuses.items()):
            out.append(f"  {route} proxy {got} / vLLM {want}: {n}")
        proxy_4xx = sum(n for (_, got, _), n in self.statuses.items() if 400 <= got < 500)
        out += [f"proxy 5xx: {self.proxy_5xx}",
                f"proxy 4xx: {proxy_4xx}, not in vLLM's error shape: {len(self.bad_4xx_shape)}"
                f" (vLLM's own 4xx not in it: {len(self.vllm_bad_4xx_shape)})",
                f"status class differs from vLLM's: {len(self.class_differs)}",
                f"answers not read to their end: {self.not_ended}",
                f"no answer (connection or timeout): {len(self.transport_errors)}"]
        out += [f"  shape: {s}" for s in self.bad_4xx_shape[:5]]
        out += [f"  vLLM's shape: {s}" for s in self.vllm_bad_4xx_shape[:5]]
        out += [f"  class: {s}" for s in self.class_differs[:5]]
        out += [f"  no answer: {s}" for s in self.transport_errors[:5]]
        return out


def fuzz(proxy: str, vllm: str, model: str, examples: int, timeout_s: float = 60) -> Tally:
    """Send ``examples`` generated requests per route to ``proxy`` and ``vllm``; tally all
    (no stop at the first failure, no shrinking: the figures cover every example)."""
    from hypothesis import HealthCheck, Phase, given, settings

    openapi = httpx.get(f"{vllm}/openapi.json", timeout=30).json()
    tally = Tally()
    def one_route(route: str) -> Callable[[], None]:
        @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                  phases=[Phase.explicit, Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(request_bodies(openapi, route, model))
        def one(body: object) -> None:
            try:
                got, want = (send(proxy, route, body, timeout_s),
                             send(vllm, route, body, timeout_s))
            except httpx.HTTPError as e:
                # Counted, not raised: the figures cover every example.
                tally.transport_errors.append(f"{route}: {e!r} for {str(body)[:120]}")
                return
            tally.examples[route] += 1
            tally.statuses[route, got.status, want.status] += 1
            tally.proxy_5xx += got.status >= 500
            tally.not_ended += not (got.ended and want.ended)
            if got.status // 100 != want.status // 100:
                tally.class_differs.append(f"{route} proxy {got.status} vLLM {want.status}: "
                                           f"{str(body)[:120]}")
            if 400 <= got.status < 500 and (problem := error_shape_problem(got)):
                tally.bad_4xx_shape.append(f"{route} {got.status}: {problem}")
            if 400 <= want.status < 500 and (problem := error_shape_problem(want)):
                tally.vllm_bad_4xx_shape.append(f"{route} {want.status}: {problem}")

        return one

    for route in ROUTES:
        one_route(route)()
    return tally


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--proxy", required=True, help="the proxy's URL")
    parser.add_argument("--vllm", required=True, help="a worker's URL, to compare with")
    parser.add_argument("--model", default="tiny", help="the served model name")
    parser.add_argument("--examples", type=int, default=200, help="per route")
    args = parser.parse_args()
    tally = fuzz(args.proxy.rstrip("/"), args.vllm.rstrip("/"), args.model, args.examples)
    print("\n".join(tally.lines()))
    print(f"fuzz {'passed' if tally.ok else 'FAILED'}")
    return 0 if tally.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
