"""The cost model a client names through ``POST /admin/policy``: a preset, a cost model given
inline, or a file under the eldr home; never another path on the proxy's machine.

The CLI's ``--policy-config`` may name any file (whoever starts `eldr serve` may read it
anyway); a client of the admin API may not make the proxy open files of its choosing, nor fill
its disk: an inline cost model is at most ``MAX_INLINE_BYTES`` as saved, and at most
``MAX_INLINE_FILES`` of them are kept (one sent again reuses its file; past the count a new one
is refused until an operator removes some).
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
# A cost model is a few hundred bytes; the bounds leave room and no more.
MAX_INLINE_BYTES = 4096
MAX_INLINE_FILES = 64


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
        if len(body) > MAX_INLINE_BYTES:
            raise EldrError(f"cost: an inline cost model is at most {MAX_INLINE_BYTES} bytes"
                            f" as JSON, this one is {len(body)}")
        folder = home / INLINE_DIR
        path = folder / f"{hashlib.sha256(body).hexdigest()[:16]}.json"
        if not path.exists():
            kept = sum(1 for _ in folder.glob("*.json")) if folder.is_dir() else 0
            if kept >= MAX_INLINE_FILES:
                raise EldrError(f"cost: {kept} inline cost models are kept in {folder}, the most"
                                f" allowed ({MAX_INLINE_FILES}); name one of them, a preset,"
                                " or ask the operator to remove some")
            folder.mkdir(parents=True, exist_ok=True)
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
