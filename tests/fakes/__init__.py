"""Test doubles: fake vLLM workers and stand-in artifacts (never imported by the product)."""
