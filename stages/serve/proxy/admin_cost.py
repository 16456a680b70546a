"""The cost model a client names through ``POST /admin/policy``: a preset, a cost model given
inline, or a file under the eldr home; never another path on the proxy's machine.

The CLI's ``--policy-config`` may name any file (whoever starts `eldr serve` may read it
anyway); a client of the admin API may not make the proxy open files of its choosing.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import orjson

from stages.errors import EldrError
from stages.routing.cost_model import COST_PRESETS, CostModel

# Inline cost models are kept here, under the eldr home, named by their content.
INLINE_DIR = "admin-costs"


def client_cost(options: dict[str, Any], home: Path) -> dict[str, Any]:
    """``options`` with its ``cost`` made safe to load: an inline object is checked and saved
    under ``home``; a file must resolve (links followed) to one under ``home``. Raises
    ``EldrError`` (a 400 for the client) otherwise."""
    cost = options.get("cost")
    if cost is None or cost in ("", *COST_PRESETS):
        return options
    if isinstance(cost, dict):
        model = CostModel.from_json(cost)  # every field checked before anything is written
        body = orjson.dumps(model.to_json(), option=orjson.OPT_SORT_KEYS)
        path = home / INLINE_DIR / f"{hashlib.sha256(body).hexdigest()[:16]}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        model.save(path)
        return {**options, "cost": str(path)}
    if not isinstance(cost, str):
        raise EldrError(f"cost: {', '.join(COST_PRESETS)}, a cost model object, or a file under"
                        f" the eldr home, got {cost!r}")
    root = home.resolve()
    path = Path(cost)
    resolved = (path if path.is_absolute() else root / path).resolve()
    if not resolved.is_relative_to(root):
        raise EldrError(f"cost: the admin API reads cost files only under the eldr home"
                        f" ({root}); send the cost model inline as a JSON object instead")
    return {**options, "cost": str(resolved)}
