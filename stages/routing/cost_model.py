"""Engine step-time model the simulator runs on, its fit to measurements, and presets.

Decode step (continuous batching, memory-bound MoE decode)::

    step_s = base_s + per_token_s * batch + num_layers * (moe_fixed_s + per_expert_s * distinct)

``distinct`` is the mean over MoE layers of the experts the batch activates in that step:
decode must stream every activated expert's weights, so a layer's MoE time grows with it.
``batch`` carries per-sequence work (attention over the KV cache, sampling). ``moe_fixed_s`` is
the per-layer cost paid whatever the experts (gate, dispatch). A fit cannot tell it apart from
``base_s`` (``num_layers`` is constant), so fitted models fold it into ``base_s``; presets keep
it to state the per-layer MoE ratio they reproduce.

Prefill (one request at a time on a prefill worker): ``prefill_base_s + prefill_per_token_s *
prompt_tokens``, counting only the tokens its prefix cache lacks. KV hand-off: a decode worker
pulls the prompt tokens it lacks at ``kv_transfer_per_token_s`` each.

``core_sharing``: decode workers bound to the measured worker's cores while it was measured
(``eldr bench --engine-cost`` on workers sharing a core). vLLM's PD workers each keep their
share of a core busy or idle (their NIXL thread busy-polls), so the decode step times are at
``1/core_sharing`` of the core; ``on_own_core`` gives the model of a worker with its cores to
itself, which the simulator shares out again as its own cluster binds workers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import numpy as np
import orjson
from scipy.optimize import nnls

from stages.errors import EldrError

# One Qwen3-30B-A3B MoE layer is 4.7x slower with 128 active experts than with 16 at the same
# batch size (ELDR paper); the GPU preset reproduces that ratio over [E/8, E] active experts.
GPU_MOE_RATIO = 4.7


@dataclass(frozen=True)
class CostModel:
    num_layers: int
    base_s: float
    per_token_s: float
    per_expert_s: float
    moe_fixed_s: float = 0.0
    prefill_base_s: float = 0.010
    prefill_per_token_s: float = 0.0001
    # A decode worker pulling a prompt's KV from its prefill worker (NIXL), per token it lacks.
    kv_transfer_per_token_s: float = 5e-6
    name: str = "custom"
    core_sharing: int = 1  # decode workers bound to the measured worker's cores

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise EldrError(f"cost model needs num_layers >= 1, got {self.num_layers}")
        if not isinstance(self.core_sharing, int) or self.core_sharing < 1:
            raise EldrError(f"cost model core_sharing must be an integer >= 1, got"
                            f" {self.core_sharing!r}")
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not (np.isfinite(value) and value >= 0):
                raise EldrError(f"cost model {f.name} must be finite and >= 0, got {value}")

    def step_time(self, batch: float | np.ndarray, distinct: float | np.ndarray) -> np.ndarray:
        """Decode step seconds for ``batch`` sequences activating ``distinct`` experts per
        layer on average (scalars or arrays)."""
        layer = self.moe_fixed_s + self.per_expert_s * np.asarray(distinct, dtype=np.float64)
        return self.base_s + self.per_token_s * np.asarray(batch) + self.num_layers * layer

    def on_own_core(self) -> CostModel:
        """The decode steps of a worker with its cores to itself (prefill is measured apart)."""
        if self.core_sharing == 1:
            return self
        n = self.core_sharing
        return replace(
            self, base_s=self.base_s / n, per_token_s=self.per_token_s / n,
            per_expert_s=self.per_expert_s / n, moe_fixed_s=self.moe_fixed_s / n, core_sharing=1,
        )

    def prefill_time(self, prompt_tokens: float | np.ndarray) -> np.ndarray:
        return self.prefill_base_s + self.prefill_per_token_s * np.asarray(prompt_tokens)

    def to_json(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, object]) -> CostModel:
        known = {f.name for f in fields(cls)}
        unknown = set(doc) - known
        if unknown:
            raise EldrError(f"unknown cost model field(s): {', '.join(sorted(unknown))}")
        try:
            return cls(**doc)  # type: ignore[arg-type]
        except TypeError as exc:
            raise EldrError(f"incomplete cost model: {exc}") from exc

    def save(self, path: Path) -> None:
        Path(path).write_bytes(orjson.dumps(self.to_json(), option=orjson.OPT_INDENT_2))

    @classmethod
    def load(cls, path: Path) -> CostModel:
        path = Path(path)
        try:
            doc = orjson.loads(path.read_bytes())
        except FileNotFoundError as exc:
            raise EldrError(f"no cost model at {path}; run `eldr bench --engine-cost`") from exc
        except orjson.JSONDecodeError as exc:
            raise EldrError(f"{path} is not a JSON cost model: {exc}") from exc
        if not isinstance(doc, dict):
            raise EldrError(f"{path} is not a JSON cost model object")
        return cls.from_json(doc)


@dataclass(frozen=True)
class CostSample:
    """One measurement: mean batch and mean distinct experts per layer over some decode steps,
    and their mean step time."""

    batch: float
    distinct: float
    step_s: float
    steps: float = 1.0  # how many steps it averages (the fit's weight)


def fit_cost_model(
    samples: Sequence[CostSample],
    num_layers: int,
    prefill_base_s: float = CostModel.prefill_base_s,
    prefill_per_token_s: float = CostModel.prefill_per_token_s,
    core_sharing: int = 1,
) -> CostModel:
    """Least squares of ``step_s ~ base + per_token*batch + L*per_expert*distinct`` with
    non-negative coefficients (a negative cost is never physical; plain least squares would
    give one on noisy data), each sample weighted by sqrt of the steps it averages."""
    if len(samples) < 3:
        raise EldrError(f"need at least 3 cost samples to fit 3 parameters, got {len(samples)}")
    batch = np.array([s.batch for s in samples], dtype=np.float64)
    distinct = np.array([s.distinct for s in samples], dtype=np.float64)
    y = np.array([s.step_s for s in samples], dtype=np.float64)
    w = np.sqrt(np.array([max(s.steps, 1e-9) for s in samples], dtype=np.float64))
    if not (np.isfinite(batch).all() and np.isfinite(distinct).all() and np.isfinite(y).all()):
        raise EldrError("cost samples contain NaN/inf (a worker reported no decode steps?)")
    if np.ptp(batch) == 0 or np.ptp(distinct) == 0:
        raise EldrError(
            "cost samples must vary both batch size and distinct experts (mix same-domain and"
            " mixed batches of several sizes)"
        )
    design = np.column_stack([np.ones_like(batch), batch, num_layers * distinct])
    coef, _ = nnls(design * w[:, None], y * w)
    return CostModel(
        num_layers=num_layers,
        base_s=float(coef[0]),
        per_token_s=float(coef[1]),
        per_expert_s=float(coef[2]),
        prefill_base_s=prefill_base_s,
        prefill_per_token_s=prefill_per_token_s,
        name="fitted",
        core_sharing=core_sharing,
    )


def fit_quality(model: CostModel, samples: Sequence[CostSample]) -> dict[str, float]:
    """R^2 and RMSE (ms) of the model on the samples."""
    y = np.array([s.step_s for s in samples], dtype=np.float64)
    pred = model.step_time(
        np.array([s.batch for s in samples]), np.array([s.distinct for s in samples])
    )
    resid = y - pred
    total = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float((resid**2).sum()) / total if total > 0 else float("nan")
    return {"r2": r2, "rmse_ms": 1000.0 * float(np.sqrt((resid**2).mean()))}


def fit_prefill(prompt_tokens: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """``(base_s, per_token_s)`` of prefill time against prompt length, non-negative."""
    x = np.asarray(prompt_tokens, dtype=np.float64)
    y = np.asarray(seconds, dtype=np.float64)
    if x.size < 2 or np.ptp(x) == 0:
        raise EldrError("prefill fit needs prompts of at least two different lengths")
    coef, _ = nnls(np.column_stack([np.ones_like(x), x]), y)
    return float(coef[0]), float(coef[1])


def gpu_like(num_layers: int, num_experts: int) -> CostModel:
    """A datacenter-GPU decode worker in the shape of Qwen3-30B-A3B on one H100-class GPU.

    Per MoE layer, time = a + b * distinct with (a + E*b) / (a + E/8*b) = 4.7 (the paper's
    16-vs-128-of-128 ratio, carried to other expert counts) and 0.57 ms with all E active
    (128 experts of 9.4 MB streamed at ~2.4 TB/s effective); non-MoE per step: 1 ms plus 40 us
    per layer (attention/dense weights, LM head, scheduling), 50 us per sequence (KV reads,
    sampling). Prefill ~10 ms + 0.08 ms per prompt token. Absolute values are indicative; the
    expert/batch balance is what the comparison between policies depends on.
    """
    if num_experts < 8:
        raise EldrError(f"gpu_like needs at least 8 experts, got {num_experts}")
    ratio = GPU_MOE_RATIO
    # a + E b = ratio (a + E b / 8)  =>  a = E b (1 - ratio/8) / (ratio - 1)
    fixed_per_b = num_experts * (1 - ratio / 8) / (ratio - 1)
    full_layer_s = 0.57e-3
    per_expert = full_layer_s / (num_experts + fixed_per_b)
    return CostModel(
        num_layers=num_layers,
        base_s=1.0e-3 + 40e-6 * num_layers,
        per_token_s=50e-6,
        per_expert_s=per_expert,
        moe_fixed_s=fixed_per_b * per_expert,
        prefill_base_s=10e-3,
        prefill_per_token_s=80e-6,
        # Qwen3-30B-A3B's KV: 48 layers x 4 KV heads x 128 x 2 (K, V) x 2 bytes = 98 KB a
        # token, over RDMA at ~25 GB/s.
        kv_transfer_per_token_s=4e-6,
        name="gpu-like",
    )


def cpu_like(num_layers: int) -> CostModel:
    """A 2-core AVX-512 CPU running experts too large for its cache (hidden 1024 x
    intermediate 2816, bf16): vLLM's ``cpu_fused_moe`` measured 4.8 / 5.2 / 7.0 / 9.4 / 11.5 ms
    per layer for 2 / 4 / 8 / 12 / 16 distinct experts at 16 tokens, i.e. ~3.8 ms + 0.48 ms
    per expert. Non-MoE: 2 ms + 0.5 ms per layer, 0.3 ms per sequence; prefill 20 ms + 1 ms per
    prompt token. Far slower than a GPU: size request rates to it.
    """
    return CostModel(
        num_layers=num_layers,
        base_s=2e-3 + 0.5e-3 * num_layers,
        per_token_s=0.3e-3,
        per_expert_s=0.48e-3,
        moe_fixed_s=3.8e-3,
        prefill_base_s=20e-3,
        prefill_per_token_s=1e-3,
        kv_transfer_per_token_s=20e-6,
        name="cpu-like",
    )


COST_PRESETS = ("gpu", "cpu")


def cost_model_for(spec: str, num_layers: int, num_experts: int) -> CostModel:
    """``spec`` as the CLI takes it: ``gpu`` (GPU-like preset, the default of
    ``eldr bench --simulate``), ``cpu``, or a JSON file from ``eldr bench --engine-cost``."""
    if spec == "gpu":
        return gpu_like(num_layers, num_experts)
    if spec == "cpu":
        return cpu_like(num_layers)
    return CostModel.load(Path(spec))
