"""The locality dial: each request's decode blended with another request's at strength s.

Request ``i`` gets a partner ``p(i)``, another row by a seeded permutation of the rows. In the
simulator the rows are the simulated requests themselves (``blend_requests``): a dataset row
drawn twice gets two partners, so repeating a row cannot make its prefill predict the decode it
borrowed (on a 200-row dataset, per-row partners let centroid routing read 3-4% fewer experts
with the prefill made useless). At strength ``s`` in [0, 1]:

- its per-step inclusion probabilities (``stages.signature.inclusion``: what the simulator's
  expert union and the fit's gain estimate read of a decode profile) become
  ``(1 - s) pi_i + s pi_p(i)``: each decode token follows the request's own experts with
  probability ``1 - s`` and its partner's with probability ``s``. They are stored as decode
  pseudo-counts ``T_i / k x`` that blend (float64; ``T_i`` = the row's decode count per layer,
  ``k`` per layer where it has none), so everything that reads a dataset reads the blend;
- its output length becomes ``round((1 - s) n_i + s n_p(i))``;
- its prompt and prefill signature stay its own.

So ``s = 0`` is the dataset itself (returned unchanged, bit for bit) and at ``s = 1`` each
request decodes exactly as its partner: the prefill signature predicts nothing about decode
(today's no-locality control), while the set of decode profiles the cluster runs, and so a
load balancer's batches, stay the same. A uniform partner would have done the first but not
the second: flat profiles activate more experts per step, which would move every policy, not
only the ones that route on the prefill.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from stages.bench.sim.sim_workload import Workload, output_lengths
from stages.errors import EldrError
from stages.signature.dataset import SignatureArrays
from stages.signature.inclusion import decode_inclusion


def blend_partners(num_rows: int, seed: int) -> np.ndarray:
    """Row ``i``'s partner is row ``perm[i]`` (a stream apart from the simulator's others)."""
    return np.random.default_rng([seed, 3]).permutation(num_rows)


def check_strength(strength: float) -> float:
    if not 0.0 <= strength <= 1.0:
        raise EldrError(f"locality blend strength must be in [0, 1], got {strength}")
    return float(strength)


def blend_decode(
    arrays: SignatureArrays, strength: float, seed: int, top_k: int
) -> SignatureArrays:
    """``arrays`` with every row's decode profile and output length blended with its
    partner's at ``strength`` (the module docstring has the definition)."""
    s = check_strength(strength)
    if s == 0.0 or len(arrays) == 0:
        return arrays
    partner = blend_partners(len(arrays), seed)
    decode = arrays.decode_counts
    pi = decode_inclusion(decode, top_k, arrays.prefill_counts)
    totals = decode.sum(axis=-1, dtype=np.float64)[..., None]  # [N, L, 1]
    scale = np.where(totals > 0, totals, float(top_k)) / top_k
    blended = scale * ((1.0 - s) * pi + s * pi[partner])
    own = arrays.output_tokens.astype(np.float64)
    lengths = np.floor((1.0 - s) * own + s * own[partner] + 0.5)
    return replace(
        arrays,
        decode_counts=blended,
        output_tokens=lengths.astype(arrays.output_tokens.dtype),
    )


def take_rows(arrays: SignatureArrays, rows: np.ndarray) -> SignatureArrays:
    """``arrays`` with one row per entry of ``rows`` (repeats repeated)."""
    return SignatureArrays(
        ids=arrays.ids[rows], domains=arrays.domains[rows],
        prompt_sha256=arrays.prompt_sha256[rows], prompt_tokens=arrays.prompt_tokens[rows],
        output_tokens=arrays.output_tokens[rows], prefill_counts=arrays.prefill_counts[rows],
        decode_counts=arrays.decode_counts[rows],
    )


def blend_requests(
    arrays: SignatureArrays, workload: Workload, strength: float, seed: int, top_k: int,
    fixed_output: int | None, max_output: int,
) -> tuple[SignatureArrays, Workload]:
    """The simulated requests as rows of their own, each blended with another request's decode
    at ``strength``; the workload then reads request ``i`` from row ``i``. At strength 0 both
    come back unchanged."""
    s = check_strength(strength)
    if s == 0.0 or len(workload) == 0:
        return arrays, workload
    blended = blend_decode(take_rows(arrays, workload.rows), s, seed, top_k)
    own = np.arange(len(workload), dtype=np.int64)
    return blended, replace(workload, rows=own,
                            output_tokens=output_lengths(blended, own, fixed_output, max_output))
