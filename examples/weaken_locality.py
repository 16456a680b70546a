"""A copy of a signature dataset with less locality: a share of its requests decode as another
request did (their decode counts and output length taken whole from a seeded other row).

For trying where `eldr fit`'s dial places data weaker than a capture, on data of the same
model: the locality dial blends every request's decode profile by s, which a dataset cannot
hold (its counts are integers); swapping a share of the requests whole can, and a share of one
half lands near s = 0.5 (docs/results.md).

    python examples/weaken_locality.py .eldr/signatures.zarr half.zarr --share 0.5
    eldr fit --k 20 --balanced --data half.zarr --store half-artifacts
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from stages.signature.dataset import CaptureRecord, SignatureDataset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="signature dataset to copy")
    parser.add_argument("out", type=Path, help="new dataset (must not exist)")
    parser.add_argument("--share", type=float, default=0.5,
                        help="share of the requests whose decode is another's, in [0, 1]")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not 0.0 <= args.share <= 1.0:
        parser.error(f"--share must be in [0, 1], got {args.share}")
    if args.out.exists():
        parser.error(f"{args.out} exists: pick a new path")
    source = SignatureDataset.open(args.source)
    arrays = source.read()
    rng = np.random.default_rng(args.seed)
    swapped = rng.random(len(arrays)) < args.share
    donor = np.where(swapped, rng.permutation(len(arrays)), np.arange(len(arrays)))
    out = SignatureDataset.create_or_open(args.out, source.identity, "weaken_locality")
    out.append([
        CaptureRecord(
            id=str(arrays.ids[i]), domain=str(arrays.domains[i]),
            prompt_sha256=str(arrays.prompt_sha256[i]),
            prompt_tokens=int(arrays.prompt_tokens[i]),
            output_tokens=int(arrays.output_tokens[d]),
            prefill_counts=arrays.prefill_counts[i], decode_counts=arrays.decode_counts[d],
        )
        for i, d in enumerate(donor.tolist())
    ])
    print(f"{args.out}: {int(swapped.sum())} of {len(arrays)} requests decode as another did")


if __name__ == "__main__":
    main()
