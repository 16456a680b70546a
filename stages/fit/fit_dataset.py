"""`eldr fit` as a function: a stored signature dataset in, a new artifact version out, with
what it predicts told to the user as it goes."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

from stages.errors import EldrError
from stages.fit.artifact import Artifact, ArtifactStore
from stages.fit.dial import DialRunner
from stages.fit.gain import StepTimeModel
from stages.fit.pipeline import FitConfig, fit_artifact
from stages.fit.prompt_tokens import PromptTokens, model_encoder, prompt_texts, prompt_tokens
from stages.signature.dataset import SignatureArrays, SignatureDataset


def dataset_prompt_tokens(dataset: SignatureDataset, arrays: SignatureArrays) -> PromptTokens:
    """Every row's prefilled token ids, or why they are unknown (no text, no tokenizer)."""
    texts = prompt_texts(arrays, dataset.traffic()["prompt"])
    return prompt_tokens(arrays, texts, partial(model_encoder, dataset.identity.name))


# The step-time model ``cost`` names, for a model of (layers, experts): the routing's
# ``cost_model_for``, passed in by the caller because the routing builds on the fit.
CostModelFor = Callable[[str, int, int], StepTimeModel]


def fit_dataset(data: Path, store: Path, config: FitConfig, cost: str, plot: bool,
                echo: Callable[[str], None], warn: Callable[[str], None],
                cost_model_for: CostModelFor, dial: DialRunner | None = None) -> Artifact:
    """Fit ``config`` on the dataset at ``data`` into ``store``; ``cost`` names the step-time
    model of the predicted TPOT change ('gpu', 'cpu' or a fitted JSON file), which
    ``cost_model_for`` builds; ``dial``, given the dataset's arrays, places them on the
    locality dial."""
    from stages.fit.dial import dial_line
    from stages.fit.fit_plot import plot_fit
    from stages.fit.gain_report import gain_lines

    k = config.k
    dataset = SignatureDataset.open(data)
    arrays = dataset.read()
    if len(arrays) < 2 * k:
        raise EldrError(
            f"{dataset.path} holds {len(arrays)} signatures; fitting k={k} clusters needs at"
            f" least {2 * k} (capture more prompts or lower --k)"
        )
    identity = dataset.identity
    try:
        step_cost = cost_model_for(cost, identity.num_layers, identity.num_experts)
    except EldrError as exc:
        if cost != "gpu":
            raise
        # The default preset cannot describe every model (it needs 8+ experts): estimate the
        # expert counts anyway and say why there is no TPOT column.
        warn(f"no TPOT estimate: {exc} (pass --cost cpu or a fitted JSON)")
        step_cost = None
    artifact_store = ArtifactStore(store)
    echo(f"fitting k={k} ({'balanced' if config.balanced else 'unbalanced'}) on {len(arrays)}"
         f" signatures of {identity.describe()}")
    artifact = fit_artifact(
        arrays.prefill_counts, arrays.decode_counts, identity, dataset.content_hash(), config,
        artifact_store, progress=echo, cost=step_cost,
        dial=None if dial is None else partial(dial, arrays),
        prompt_tokens=dataset_prompt_tokens(dataset, arrays),
    )
    echo(f"artifact {artifact.version} saved in {artifact_store.root} (now 'latest')")
    for key, value in artifact.metrics.items():
        if isinstance(value, (int, float, str)):
            echo(f"  {key}: {value}")
    for warning in artifact.metrics["warnings"]:
        warn(f"warning: {warning}")
    if step_cost is not None:
        default = ", the preset `eldr bench --simulate` uses by default" if cost == "gpu" else ""
        echo(f"TPOT from the {step_cost.name} cost model (--cost {cost}{default}), at a steady"
             " decode batch of each size")
    for line in gain_lines(artifact.metrics["expected_gain"], k):
        echo(line)
    if "dial" in artifact.metrics:
        echo(dial_line(artifact.metrics["dial"]))
    if plot:
        png = artifact_store.root / artifact.version / "fit.png"
        plot_fit(artifact, png)
        echo(f"  plot: {png}")
    return artifact
