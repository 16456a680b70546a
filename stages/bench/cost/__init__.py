"""The engine's cost curve: decode step time against distinct experts, measured on live workers."""
