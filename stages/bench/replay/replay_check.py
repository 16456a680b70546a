"""`eldr bench --simulate --replay`: live runs replayed in the simulator and judged against
what they measured."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from stages import paths
from stages.errors import EldrError


def replay_and_validate(result_dirs: list[Path], data: Path | None, store: Path | None,
                        cost: str | None, result_dir: Path, seed: int, prompts: Path | None,
                        worker_cores: tuple[str, ...] | None,
                        echo: Callable[[str], None]) -> None:
    """Replay each live run in ``result_dirs`` in the simulator, print simulated against live
    per policy with a verdict, and write the numbers and the plot into ``result_dir``.
    ``cost`` defaults to each folder's measured ``cost-model.json``."""
    import orjson

    from stages.bench.replay.replay_run import replay_run, store_beside
    from stages.bench.replay.saved_run import results_folder
    from stages.bench.replay.validation import format_validation, validate, validation_json
    from stages.bench.replay.validation_plot import plot_validation
    from stages.routing.cost_model import cost_model_for
    from stages.signature.dataset import SignatureDataset

    dataset = SignatureDataset.open(data or paths.default_dataset())
    arrays = dataset.read()
    identity = dataset.identity
    compared = []
    names = set()
    shapes = []  # what each live run was, for the plot's title
    for folder in result_dirs:
        spec = cost or str(results_folder(folder) / "cost-model.json")
        if cost is None and not Path(spec).is_file():
            raise EldrError(f"{folder} has no cost-model.json (`eldr bench --engine-cost` on the"
                            " live workers writes it); give the cost model with --cost")
        model = cost_model_for(spec, identity.num_layers, identity.num_experts)
        names.add(model.name)
        for replayed in replay_run(folder, arrays, identity, model,
                                   store=store or store_beside(folder), seed=seed,
                                   prompts=prompts, worker_cores=worker_cores):
            for note in replayed.notes:
                echo(f"note: {note}")
            compared.append(replayed.compared)
            run = replayed.run
            shapes.append(f"{replayed.compared.name} {run.shape} live,"
                          f" {run.requests_per_policy} requests per policy")
    checks = validate(compared)
    echo(format_validation(checks))
    result_dir.mkdir(parents=True, exist_ok=True)
    numbers = result_dir / "replay-validation.json"
    numbers.write_bytes(orjson.dumps(validation_json(checks), option=orjson.OPT_INDENT_2))
    plot = plot_validation(checks, result_dir / "replay-validation.png",
                           title=f"simulated against live: replay of {'; '.join(shapes)};"
                           f" cost {', '.join(sorted(names))}")
    echo(f"plot: {plot}")
    echo(f"numbers: {numbers}")
