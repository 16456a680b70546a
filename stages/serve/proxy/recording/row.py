"""A recorded request as the proxy hands it over, and how the writer makes it a dataset row.

The proxy keeps what it was sent as it was sent (the signature's base64 entries, the prompt's
bytes) and the writer process decodes, hashes and checks it: a recording proxy's event loop
spends about 14 us a request on recording instead of about 26 (4 us to file the request, 4 to
read its finish from a batch message, 5 to pickle the row; decoding both signatures, hashing the
prompt and building the row, about 11 us, moved to the writer). Both functions below run in
the writer (``DatasetAppender``); each is a plain module function so it can be sent there.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from stages.signature import wire
from stages.signature.dataset import CaptureRecord, ModelIdentity

DOMAIN = "traffic"  # the dataset's domain column for recorded rows


@dataclass(frozen=True)
class RecordedRow:
    id: str
    prefill: dict[str, Any]  # the prefill's signature entries (``wire.recorded_entries``)
    decode: dict[str, Any]  # the decode worker's counts, as ``wire.encode`` sent them
    prompt: bytes  # the prompt as the client sent it
    keep_prompt: bool  # store its text, not only its sha256
    prompt_tokens: int
    output_tokens: int
    arrival_unix_s: float
    ttft_s: float
    latency_s: float


def build_record(row: RecordedRow) -> CaptureRecord:
    """The dataset row; raises ValueError on counts that do not decode or do not match."""
    prefill, decode = wire.decode(row.prefill), wire.decode(row.decode)
    if prefill is None or decode is None:
        raise ValueError(f"request {row.id}: its {'prefill' if prefill is None else 'decode'}"
                         " counts are malformed")
    if prefill.shape != decode.shape:
        raise ValueError(f"request {row.id}: prefill counts {prefill.shape} and decode counts"
                         f" {decode.shape} differ in shape")
    return CaptureRecord(
        id=row.id, domain=DOMAIN, prompt_sha256=hashlib.sha256(row.prompt).hexdigest(),
        prompt_tokens=row.prompt_tokens, output_tokens=row.output_tokens,
        prefill_counts=prefill.astype(np.int32), decode_counts=decode.astype(np.int32),
        arrival_unix_s=row.arrival_unix_s, ttft_s=row.ttft_s, latency_s=row.latency_s,
        prompt=row.prompt.decode(errors="replace") if row.keep_prompt else "",
    )


def identity_of(model_name: str, served: ModelIdentity | None, row: RecordedRow,
                record: CaptureRecord) -> ModelIdentity:
    """The model a new dataset is created for: the served model's when the proxy knows it (as
    `eldr capture` writes it), else read from the first row (its shape, its MoE layer indices,
    and top-k as picks per prompt token)."""
    if served is not None:
        return served
    num_layers, num_experts = record.prefill_counts.shape
    picks = int(record.prefill_counts[0].sum())
    top_k = round(picks / record.prompt_tokens) if record.prompt_tokens else 0
    return ModelIdentity(model_name, num_layers, num_experts, max(top_k, 1),
                         wire.decode_moe_layers(row.prefill) or ())
