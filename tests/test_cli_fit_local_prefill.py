"""`eldr fit` prints the default local_prefill_below its cost model gives (the fit mocked)."""

from pathlib import Path

import pytest
from typer.testing import CliRunner

from eldr_cli.app import app


def test_fit_prints_the_local_prefill_threshold_of_its_costs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import stages.fit.fit_dataset as fit_dataset

    calls = []
    monkeypatch.setattr(fit_dataset, "fit_dataset", lambda *a, **k: calls.append(a))
    result = CliRunner().invoke(app, ["fit", "--data", str(tmp_path / "sig.zarr"), "--no-dial",
                                      "--no-plot", "--decode-batch", "8,4"])
    assert result.exit_code == 0, result.output
    assert len(calls) == 1
    # gpu-like: prefill 10 ms + 80 us a token, a pull 2 ms + 4 us a token.
    assert ("from the gpu-like costs (--cost gpu): 38 at a decode batch of 4, 19 at a decode"
            " batch of 8; for decode batches up to 8: --policy-config"
            ' \'{"eldr-kv": {"local_prefill_below": 19}}\'') in result.output
