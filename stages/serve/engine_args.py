"""vLLM engine arguments a user passes through ``eldr serve --vllm-arg``, checked first.

eldr owns the flags that wire its deployment together (ports, the kv-transfer config that
carries signatures and KV, the model and its served name, batch limits it routes by); a
pass-through that changed one of them would break routing silently, so it is refused with the
eldr option to use instead. Everything else goes to every started worker unchanged.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable

from stages.errors import EldrError

# vLLM flag -> what to use instead.
OWNED_BY_ELDR = {
    "--model": "--model",
    "--port": "--worker-port",
    "--host": "(workers listen on 127.0.0.1; the proxy's address is --host)",
    "--kv-transfer-config": "(eldr composes its connector with NixlConnector itself)",
    "--served-model-name": "--served-model-name",
    "--max-num-seqs": "--max-num-seqs",
    "--max-model-len": "--max-model-len",
    "--enforce-eager": "--enforce-eager",
    "--seed": "--seed",
    "--uds": "(workers listen on TCP ports)",
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
