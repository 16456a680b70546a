"""``eldr bench --simulate --workload conversations``: the conversation workload on a
simulated PD cluster, on the captured signatures (or synthetic ones when none are captured),
printed as the conversation table and saved per policy."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from stages import paths
from stages.bench.sim.conversation_workload import SimConversationSpec
from stages.errors import EldrError
from stages.routing.policies import needs_centroids
from stages.routing.policy_config import PolicyConfig

CONVERSATION_POLICIES = ("eldr-kv", "eldr-union", "rr", "jsq", "random", "p2c")


@dataclass(frozen=True)
class ConversationSimOptions:
    policies: tuple[str, ...]
    workload: SimConversationSpec
    result_dir: Path
    data: Path | None = None  # default: $ELDR_HOME/signatures.zarr, else synthetic
    store: Path | None = None
    prefill: int = 8
    decode: int = 16
    cost: str = "gpu"
    block_size: int = 16
    cache_blocks: int = 8192
    seed: int = 0
    policy_config: PolicyConfig = field(default_factory=PolicyConfig)


def _signatures(o: ConversationSimOptions, echo: Callable[[str], None]
                ) -> tuple[object, object | None, int, int, int, str]:
    """(arrays, artifact, layers, experts, top_k, what they are)."""
    dataset_path = o.data or paths.default_dataset()
    wants_centroids = any(needs_centroids(p) for p in o.policies)
    if o.data is not None or dataset_path.exists():
        from stages.fit.artifact import load_for_serving
        from stages.signature.dataset import SignatureDataset

        dataset = SignatureDataset.open(dataset_path)
        identity = dataset.identity
        artifact = (load_for_serving(o.store or paths.default_artifact_store(), "latest",
                                     identity, o.decode) if wants_centroids else None)
        return (dataset.read(), artifact, identity.num_layers, identity.num_experts,
                identity.top_k, identity.describe())
    from stages.bench.sim.synthetic import SyntheticSpec, stand_in_artifact, synthetic_signatures

    spec = SyntheticSpec(seed=o.seed)
    echo(f"no captured signatures at {dataset_path}: synthetic ones in Qwen3-30B-A3B's shape"
         f" ({spec.num_layers} layers, {spec.num_experts} experts, top-{spec.top_k})")
    arrays = synthetic_signatures(spec)
    artifact = stand_in_artifact(arrays, o.decode, seed=o.seed) if wants_centroids else None
    return (arrays, artifact, spec.num_layers, spec.num_experts, spec.top_k,
            "synthetic signatures")


def run_conversation_sim(o: ConversationSimOptions, echo: Callable[[str], None]
                         ) -> dict[str, dict[str, object]]:
    from stages.bench.report import format_conversations
    from stages.bench.sim.conversation_sim import ConversationSimConfig, simulate_conversations
    from stages.provenance import provenance
    from stages.routing.cost_model import cost_model_for

    if not o.policies:
        raise EldrError("give at least one policy")
    arrays, artifact, layers, experts, top_k, what = _signatures(o, echo)
    cost = cost_model_for(o.cost, layers, experts)
    config = ConversationSimConfig(
        cost=cost, workload=o.workload, num_prefill=o.prefill, num_decode=o.decode,
        policies=o.policies, block_size=o.block_size, prefill_cache_blocks=o.cache_blocks,
        decode_cache_blocks=o.cache_blocks, seed=o.seed, policy_config=o.policy_config)
    metrics = simulate_conversations(config, arrays, top_k, artifact)  # type: ignore[arg-type]
    w = o.workload
    title = (f"simulated {o.prefill}P{o.decode}D, {cost.name} cost, {what}: {w.conversations}"
             f" conversations x {w.turns} turns at {w.conversation_rate:g} conversations/s,"
             f" think {w.think_time_s:g} s, {w.output_tokens} output tokens, caches of"
             f" {o.cache_blocks} blocks of {o.block_size}")
    echo(format_conversations(metrics, title))
    o.result_dir.mkdir(parents=True, exist_ok=True)
    for name, m in metrics.items():
        path = o.result_dir / f"sim-{name}-conversations.json"
        doc = {"policy": name, "source": title, "seed": o.seed, **provenance(), **m}
        path.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))
        echo(f"results: {path}")
    return metrics
