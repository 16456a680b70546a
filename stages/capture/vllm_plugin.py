"""vLLM general plugin (entry point ``vllm.general_plugins: eldr``), loaded in every process.

It registers the connector class by name and installs the construction hook that gives MoE
layers their graph-safe top-k buffer (:mod:`stages.capture.topk_sink`). Nothing is recorded
unless the engine's ``--kv-transfer-config`` names ``EldrSignatureConnector`` (directly or in
MultiConnector): the hook leaves every other engine's layers untouched.
"""

from __future__ import annotations

CONNECTOR_NAME = "EldrSignatureConnector"


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from stages.capture.topk_sink import install_construction_hook
    from stages.vllm_compat import check_vllm

    # Outside the tested releases vLLM's internals may differ: fail here, with the reason in
    # vLLM's log, rather than record wrong signatures.
    check_vllm()

    # Plugins load once per process, but a re-import (e.g. a test calling register()) must
    # neither fail on the second registration nor install the hook twice.
    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(
            CONNECTOR_NAME, "stages.capture.connector", "EldrSignatureConnector"
        )
        install_construction_hook()
