"""The view of the workers: their loads, the KV and expert events they publish, their batches."""
