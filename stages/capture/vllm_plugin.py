"""vLLM general plugin (entry point ``vllm.general_plugins: eldr``), loaded in every process.

It registers the connector class by name and installs the construction hook that gives MoE
layers their graph-safe top-k buffer (:mod:`stages.capture.topk_sink`). Nothing is recorded
unless the engine's ``--kv-transfer-config`` names ``EldrSignatureConnector`` (directly or in
MultiConnector): the hook leaves every other engine's layers untouched.

Installing eldr must never break a plain vLLM engine in the same environment, so nothing here
checks the vLLM release or fails: the connector checks it when an engine that records starts
(``EldrSignatureConnector.__init__``), and refuses there with the reason.
"""

from __future__ import annotations

import logging

# One name for the connector: stages.engine writes it into every worker's
# --kv-transfer-config, the plugin registers it, topk_sink looks for it.
from stages.engine import SIGNATURE_CONNECTOR as CONNECTOR_NAME

log = logging.getLogger(__name__)


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    # Plugins load once per process, but a re-import (e.g. a test calling register()) must
    # neither fail on the second registration nor install the hook twice.
    if CONNECTOR_NAME in KVConnectorFactory._registry:
        return
    KVConnectorFactory.register_connector(
        CONNECTOR_NAME, "stages.capture.connector", "EldrSignatureConnector"
    )
    try:
        from stages.capture.topk_sink import install_construction_hook

        install_construction_hook()
    except ImportError as exc:
        # A vLLM release whose MoE internals moved: plain engines must still start. An engine
        # configured with eldr's connector refuses at start (release check, missing buffers).
        log.warning("eldr: cannot hook MoE layers in this vLLM release (%s); engines using"
                    " %s will refuse to start", exc, CONNECTOR_NAME)
    try:
        from stages.capture.nixl_progress import apply_progress_thread_choice

        apply_progress_thread_choice()  # only in workers eldr starts on CPU
    except ImportError as exc:
        log.warning("eldr: NIXL's progress thread stays on (%s)", exc)
