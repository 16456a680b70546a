"""vLLM engine arguments a user passes through ``eldr serve --vllm-arg``, checked first.

eldr owns the flags that wire its deployment together (ports, the kv-transfer config that
carries signatures and KV, the model and its served name, batch limits it routes by); a
pass-through that changed one of them would break routing silently, so it is refused with the
eldr option to use instead. Everything else goes to every started worker unchanged.
"""

from __future__ import annotations

import argparse
import json
import shlex
from collections.abc import Iterable, Sequence
from typing import Any

from stages.capture.parallel import ParallelLayout, describe_speculative
from stages.errors import EldrError

# vLLM flag -> what to use instead.
OWNED_BY_ELDR = {
    "--model": "--model",
    "--port": "--worker-port",
    "--host": "(workers listen on 127.0.0.1; the proxy's address is --host)",
    "--kv-transfer-config": "(eldr composes its connector with NixlConnector itself)",
    "--kv-events-config": "(eldr's workers publish KV events where its proxies listen)",
    "--served-model-name": "--served-model-name",
    "--max-num-seqs": "--max-num-seqs",
    "--max-model-len": "--max-model-len",
    "--enforce-eager": "--enforce-eager",
    "--seed": "--seed",
    "--uds": "(workers listen on TCP ports)",
    "--tensor-parallel-size": "--prefill-tp / --decode-tp",
    "-tp": "--prefill-tp / --decode-tp",
}


def engine_args(values: Iterable[str]) -> tuple[str, ...]:
    """Split each ``--vllm-arg`` value like a shell would and refuse eldr-owned flags."""
    args: list[str] = []
    for value in values:
        try:
            args.extend(shlex.split(value))
        except ValueError as exc:
            raise EldrError(f"--vllm-arg {value!r}: {exc}") from None
    for arg in args:
        flag = arg.split("=", 1)[0]
        instead = OWNED_BY_ELDR.get(flag)
        if instead is not None:
            raise EldrError(f"--vllm-arg {arg}: eldr sets {flag} itself; use {instead}")
    if args and not args[0].startswith("-"):
        raise EldrError(f"--vllm-arg {args[0]!r}: pass vLLM flags, e.g. --vllm-arg='--dtype=half'")
    return tuple(args)


def parallel_layout(args: Sequence[str], tensor: int, on_cpu: bool) -> ParallelLayout:
    """The parallel layout a worker started with ``args`` (and eldr's own TP size) gets, so
    a layout eldr cannot record is refused before any worker starts."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    parser.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    parser.add_argument("--data-parallel-size", "-dp", type=int, default=1)
    parser.add_argument("--decode-context-parallel-size", "-dcp", type=int, default=1)
    parser.add_argument("--prefill-context-parallel-size", "-pcp", type=int, default=1)
    parser.add_argument("--ubatch-size", type=int, default=1)
    parser.add_argument("--enable-dbo", action="store_true")
    parser.add_argument("--enable-expert-parallel", "-ep", action="store_true")
    parser.add_argument("--speculative-config", "-sc", type=_json_object, default=None)
    parser.add_argument("--spec-method", default=None)
    parser.add_argument("--spec-model", default=None)
    parser.add_argument("--spec-tokens", type=int, default=None)
    try:
        known, _ = parser.parse_known_args(list(args))
    except argparse.ArgumentError as exc:
        raise EldrError(f"--vllm-arg: {exc}") from None
    drafting = {**(known.speculative_config or {}),
                **{k: v for k, v in (("method", known.spec_method), ("model", known.spec_model),
                                     ("num_speculative_tokens", known.spec_tokens))
                   if v is not None}}
    return ParallelLayout(
        tensor=tensor, pipeline=known.pipeline_parallel_size, data=known.data_parallel_size,
        prefill_context=known.prefill_context_parallel_size,
        decode_context=known.decode_context_parallel_size,
        micro_batches=2 if known.enable_dbo else known.ubatch_size,
        expert=known.enable_expert_parallel, on_cpu=on_cpu,
        speculative=describe_speculative(drafting.get("method"), drafting.get("model"),
                                         drafting.get("num_speculative_tokens"))
        if drafting else "",
    )


def _json_object(text: str) -> dict[str, Any]:
    """``--speculative-config``'s value, as vLLM parses it (JSON)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc})") from None
    return value if isinstance(value, dict) else {}


def check_recordable(args: Sequence[str], tensor: int, on_cpu: bool, role: str) -> None:
    why = parallel_layout(args, tensor, on_cpu).refusal()
    if why is not None:
        raise EldrError(f"{role} workers: eldr cannot record expert signatures with {why}")
