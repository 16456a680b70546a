# Everyday tasks. `just` comes with the dev install (.venv/bin/just, from the rust-just wheel).

# Create .venv with eldr and the vLLM engine for this machine
setup:
    bash scripts/setup.sh

# The main job on the bundled memory-bound model: capture, fit, serve, bench
demo:
    bash scripts/demo.sh

# Lint and run every test (real vLLM servers included)
test *ARGS:
    bash scripts/test.sh {{ARGS}}

# Fast tests only (no vLLM servers), on two processes: the development loop (about 2 minutes)
test-fast:
    .venv/bin/python -m pytest -q -m "not vllm" -n 2

lint:
    .venv/bin/ruff check .

# Benchmarks that print figures (run side by side in one process each)
bench:
    .venv/bin/python examples/bench_fit.py --quick
    .venv/bin/python examples/bench_routing.py
    .venv/bin/python examples/bench_simulator.py
    .venv/bin/python examples/bench_capture_overhead.py
