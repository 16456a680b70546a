"""vLLM general plugin (entry point ``vllm.general_plugins: eldr``), loaded in every process.

It only registers the connector class by name; nothing is recorded unless a server is started
with ``--kv-transfer-config`` naming ``EldrSignatureConnector`` (directly or in MultiConnector).
"""

from __future__ import annotations

CONNECTOR_NAME = "EldrSignatureConnector"


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    # Plugins load once per process, but a re-import (e.g. a test calling register()) must
    # not fail on the second registration.
    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(
            CONNECTOR_NAME, "stages.capture.connector", "EldrSignatureConnector"
        )
