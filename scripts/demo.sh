#!/usr/bin/env bash
# The main job on the embedded default, end to end on CPU vLLM:
#   capture (calibration split) -> fit (one centroid per decode worker, with its verdict) ->
#   serve tiny-wide with 1 prefill + 2 decode workers -> live bench (evaluation split) ->
#   a simulated 8P16D cluster -> plots.
# By default the live bench runs eldr-union, eldr and the two load balancers that usually do
# best (jsq, p2c), and the simulation one GPU-like cluster at 70% of its capacity.
# DEMO_FULL=1 runs the full study instead: every policy, the engine's cost curve measured
# before and after the bench (eldr-union routes with it), simulations on it and on the GPU-like
# cost, the locality dial, and the live bench replayed in the simulator (README: how long).
# Knobs: DEMO_CAPTURE (prompts to capture; default 400, all 1,000 with DEMO_FULL),
# DEMO_PROMPTS (requests per policy, default 40, 60 with DEMO_FULL), DEMO_ROUNDS (default one
# per 20 requests), DEMO_RATE (req/s), DEMO_CONCURRENCY (requests in flight at most),
# DEMO_TOKENS (output tokens). Results land in $ELDR_HOME/results (simulations in sim-*).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export ELDR_HOME=${ELDR_HOME:-$PWD/.eldr/demo}
ELDR=.venv/bin/eldr
FULL=${DEMO_FULL:-0}
CAPTURE_LIMIT=()
if [ -n "${DEMO_CAPTURE:-}" ]; then CAPTURE_LIMIT=(--limit "$DEMO_CAPTURE")
elif [ "$FULL" != 1 ]; then CAPTURE_LIMIT=(--limit 400); fi

# tiny and tiny-wide route identically (zero-widened experts), so signatures are captured on
# the faster tiny and the artifact serves tiny-wide.
$ELDR capture --model tiny "${CAPTURE_LIMIT[@]}"
$ELDR fit --k 2 --balanced

# Prefill runs on tiny itself: its KV cache is tiny-wide's (the extra expert units are zero),
# and it skips the zero units' compute, which would otherwise make one CPU core of prefill the
# bottleneck and keep decode batches near one request.
# eldr-union serves: live on two decode workers it stays within about the load balancers' own
# spread (TPOT p50 0.96-1.09 of the best one in six demo runs), and it is the policy that wins
# at scale in the simulations below without doing harm where prefill predicts nothing (README,
# "Which policy").
$ELDR serve --model tiny-wide --prefill-model tiny --prefill 1 --decode 2 --port 8000 \
  --policy eldr-union &
SERVE_PID=$!
stop_serve() { kill -TERM "$SERVE_PID" 2>/dev/null; wait "$SERVE_PID" 2>/dev/null || true; }
trap stop_serve EXIT
trap 'exit 130' INT TERM
for _ in $(seq 600); do
  curl -sf http://127.0.0.1:8000/health >/dev/null 2>&1 && break
  kill -0 $SERVE_PID 2>/dev/null || { echo "eldr serve exited" >&2; exit 1; }
  sleep 1
done
curl -sf http://127.0.0.1:8000/health >/dev/null || { echo "proxy not ready" >&2; exit 1; }

if [ "$FULL" != 1 ]; then
  # eldr-union weighs experts against batch slots with the CPU-like step-time preset here (the
  # full study measures the curve on these workers first).
  PROMPTS=${DEMO_PROMPTS:-40}
  $ELDR bench --url http://127.0.0.1:8000 --policies eldr-union,eldr,jsq,p2c \
    --num-prompts "$PROMPTS" --request-rate "${DEMO_RATE:-4}" \
    --max-concurrency "${DEMO_CONCURRENCY:-12}" --max-tokens "${DEMO_TOKENS:-64}" \
    --rounds "${DEMO_ROUNDS:-$(( PROMPTS >= 40 ? PROMPTS / 20 : 1 ))}" \
    --policy-config '{"eldr-union": {"cost": "cpu"}}'
  stop_serve
  trap - EXIT
  # 16 decode workers need 16 centroids; the cluster runs at 70% of its capacity (printed with
  # how it follows from the cost model), where batches are big enough for locality to matter.
  $ELDR fit --k 16 --balanced --no-plot
  $ELDR bench --simulate --prefill 8 --decode 16 --request-rate 70% --duration 60 \
    --output-tokens 512 --cost gpu --policies eldr-union,eldr,jsq,p2c \
    --result-dir "$ELDR_HOME/results/sim-gpu"
  echo "demo done: live results and plots in $ELDR_HOME/results, the simulated cluster's in" \
    "$ELDR_HOME/results/sim-gpu; DEMO_FULL=1 runs the full study"
  exit 0
fi

# The curve behind it all, measured first: decode step time against distinct experts on these
# workers, fitted into a cost model. eldr-union weighs experts against batch slots with it (the
# GPU preset it would use otherwise prices a batch slot far above what it costs here), and the
# simulations below run on it.
$ELDR bench --engine-cost --url http://127.0.0.1:8000
COST="$ELDR_HOME/results/cost-model.json"
# eldr-union routes on this first pass; the pass after the bench refits $COST over both.
UNION_COST="$ELDR_HOME/eldr-union-cost.json"
cp "$COST" "$UNION_COST"

# Poisson arrivals with at most 12 requests in flight: every policy decodes batches of ~6 at
# the same load (the regime where the experts a batch shares decide step time), and with 8
# batch slots per worker a locality policy still has room to choose. Rounds of 20 requests
# (shorter ones never reach the cap). One round's engine speed scatters 6-9% on this VM (the
# replay prints it); 120 requests in 6 rounds (DEMO_PROMPTS=120, a 46-minute demo) left the
# live comparison as noisy in two runs as 60 in 3, so the demo stays at 60.
PROMPTS=${DEMO_PROMPTS:-60}
ROUNDS=${DEMO_ROUNDS:-$(( PROMPTS >= 40 ? PROMPTS / 20 : 1 ))}
$ELDR bench --url http://127.0.0.1:8000 --policies eldr,eldr-bl,eldr-union,rr,jsq,random,p2c \
  --num-prompts "$PROMPTS" --request-rate "${DEMO_RATE:-4}" \
  --max-concurrency "${DEMO_CONCURRENCY:-12}" --max-tokens "${DEMO_TOKENS:-64}" --rounds "$ROUNDS" \
  --policy-config "{\"eldr-union\": {\"cost\": \"$UNION_COST\"}}"
# The engine's speed drifts on a shared VM (the same probe batches ran up to 20% apart between
# runs): a second pass after the bench brackets it, prints the drift, and the simulations below
# run on the fit over both passes.
$ELDR bench --engine-cost --another-pass --url http://127.0.0.1:8000
stop_serve
trap - EXIT
$ELDR fit --k 16 --balanced
# Rates at 50/70/85% of each cost model's capacity (printed with how it was computed): above
# it queues grow for as long as the run lasts, and TPOT measures the run's length, not routing.
# The fitted CPU cost decodes the live bench's answer length: a 512-token answer would take
# ~200 s on it, longer than the run, so the cluster would never settle.
$ELDR bench --simulate --prefill 8 --decode 16 --request-rate auto --duration 120 \
  --output-tokens "${DEMO_TOKENS:-64}" --cost "$COST" \
  --result-dir "$ELDR_HOME/results/sim-fitted-cpu"
$ELDR bench --simulate --prefill 8 --decode 16 --request-rate auto --duration 120 \
  --output-tokens 512 --cost gpu --result-dir "$ELDR_HOME/results/sim-gpu"
# The locality dial on the GPU-like cluster at half its capacity (batches not yet full, where
# locality decides step time): each request's decode blended with another's from s = 0 (the
# capture itself) to 1 (prefill predicts nothing), the capture marked by its fit's gain.
$ELDR bench --simulate --prefill 8 --decode 16 --request-rate 50% --duration 60 \
  --output-tokens 512 --cost gpu --locality-blend 0,0.25,0.5,0.75,1 \
  --result-dir "$ELDR_HOME/results/sim-gpu"

# Replay: the live bench above, simulated on the cost curve measured on its workers, with its
# arrivals, prompts, output lengths, concurrency cap, workers and core plan; simulated against
# live per policy (TPOT, ITL, distinct experts per layer). The simulator needs the signatures of
# the prompts the bench sent: the live bench samples them from the whole evaluation split, so
# it is captured whole (DEMO_CAPTURE would leave out prompts the bench used).
$ELDR capture --model tiny --prompts examples/prompts/evaluation.jsonl \
  --out "$ELDR_HOME/evaluation.zarr" --max-tokens "${DEMO_TOKENS:-64}"
$ELDR bench --simulate --replay "$ELDR_HOME/results" --data "$ELDR_HOME/evaluation.zarr" \
  --result-dir "$ELDR_HOME/results/replay"
