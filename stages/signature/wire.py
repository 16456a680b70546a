"""How a prefill signature travels inside ``kv_transfer_params`` (prefill -> proxy).

A signature is the ``[L, E]`` table of prompt tokens whose top-k picked expert ``e`` in MoE
layer ``l``. It is sent as little-endian int16, base64, next to its shape, so the proxy can
validate it before use (non-negative, right size) and never trusts a malformed one.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import pybase64

SIGNATURE_KEY = "eldr_signature"
SHAPE_KEY = "eldr_signature_shape"
# Transformer layer index of each of the L rows, as the engine built its MoE layers.
MOE_LAYERS_KEY = "eldr_moe_layers"
MAX_COUNT = np.iinfo(np.int16).max
# The entries that make up a signature (without the layer indices, which only a recording
# proxy reads).
SIGNATURE_KEYS = frozenset((SIGNATURE_KEY, SHAPE_KEY))


def encode(counts: np.ndarray, moe_layers: tuple[int, ...] = ()) -> dict[str, Any]:
    """Pack ``[L, E]`` counts for ``kv_transfer_params`` (saturating at int16 max)."""
    if counts.ndim != 2:
        raise ValueError(f"signature must be [L, E], got shape {counts.shape}")
    packed = np.clip(counts, 0, MAX_COUNT).astype("<i2")
    params: dict[str, Any] = {
        SIGNATURE_KEY: base64.b64encode(packed.tobytes()).decode("ascii"),
        SHAPE_KEY: [int(counts.shape[0]), int(counts.shape[1])],
    }
    if moe_layers:
        params[MOE_LAYERS_KEY] = [int(i) for i in moe_layers]
    return params


def entries(params: dict[str, Any] | None, with_layers: bool = False) -> dict[str, Any] | None:
    """The signature's entries of ``params`` as they are (not decoded), or ``None``;
    ``with_layers``: the MoE layer indices too."""
    if not params or SIGNATURE_KEY not in params:
        return None
    keys = (*SIGNATURE_KEYS, MOE_LAYERS_KEY) if with_layers else SIGNATURE_KEYS
    return {k: params[k] for k in keys if k in params}


def empty_layers(counts: np.ndarray) -> np.ndarray:
    """Indices of the MoE layers (rows) with no count at all.

    Every prompt token picks top_k experts in every MoE layer, so a prompt with tokens never has
    one: an empty row means the engine ran a forward without eldr's recording hook.
    """
    return np.flatnonzero(counts.sum(axis=1) == 0)


def decode_moe_layers(params: dict[str, Any] | None) -> tuple[int, ...] | None:
    """The engine's MoE layer indices sent beside a signature, or ``None``."""
    layers = (params or {}).get(MOE_LAYERS_KEY)
    if not isinstance(layers, list) or not all(isinstance(i, int) for i in layers):
        return None
    return tuple(layers)


def decode(params: dict[str, Any] | None, expected_shape: tuple[int, int] | None = None) -> (
    np.ndarray | None
):
    """Return the ``[L, E]`` int16 counts, or ``None`` when absent or malformed."""
    if not params or SIGNATURE_KEY not in params:
        return None
    try:
        shape = tuple(map(int, params[SHAPE_KEY]))
        # The stdlib's decoder takes ~45 us for a 48 x 128 signature, most of a routing
        # decision; pybase64 (SIMD) takes ~1.5 us and validates the same way.
        # A bytearray, so the counts below are a writable view of it: no copy.
        raw = pybase64.b64decode_as_bytearray(params[SIGNATURE_KEY], validate=True)
    except (KeyError, TypeError, ValueError):
        return None
    # Negative sizes whose product fits the bytes (-1 x -1) would make reshape fail.
    if len(shape) != 2 or min(shape) < 0 or shape[0] * shape[1] * 2 != len(raw):
        return None
    if expected_shape is not None and shape != tuple(expected_shape):
        return None
    # Kept in the wire's int16 (every consumer reads counts as floats, and numpy sums small
    # ints in int64): widening them cost a routing decision an extra pass over the table.
    counts = np.frombuffer(raw, dtype="<i2").reshape(shape)
    if counts.size and counts.min() < 0:
        return None
    return counts
