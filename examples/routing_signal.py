"""Measure whether a MoE model's prefill expert usage predicts its decode expert usage.

ELDR's premise: a request's prefill top-k expert counts (a [layers, experts] table) resemble
its own decode counts and those of same-domain requests more than those of other domains, so
grouping similar requests on a decode worker cuts the distinct experts each decode step reads.
This script checks that premise on a Hugging Face MoE checkpoint (default: the bundled tiny
Mixtral) with held-out prompts of ``examples/prompts/evaluation.jsonl``: prefill plus greedy
decode per request, top-k of the router logits of every layer, and then:

- mean cosine of a request's prefill histogram vs its own decode histogram, vs decode
  histograms of other same-domain requests, and vs those of other-domain requests;
- domain accuracy of the nearest prefill-histogram domain centroid to a decode histogram;
- mean distinct experts per layer per decode step for batches of 8 same-domain requests vs
  8 requests drawn at random from all domains (what a domain-blind balancer produces).

    python examples/routing_signal.py --per-domain 30 --decode-tokens 32
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.utils import logging as hf_logging

HERE = Path(__file__).resolve().parent


def top_k_picks(router_logits: tuple[torch.Tensor, ...], k: int) -> np.ndarray:
    """[tokens, layers, k] expert ids picked by each layer's router."""
    return torch.stack([lg.topk(k, -1).indices for lg in router_logits], 1).numpy()


def counts(picks: np.ndarray, num_experts: int) -> np.ndarray:
    """[layers, experts] table: how many tokens picked each expert in each layer."""
    layers = picks.shape[1]
    table = np.zeros((layers, num_experts), dtype=np.int64)
    for layer in range(layers):
        np.add.at(table[layer], picks[:, layer].ravel(), 1)
    return table


@torch.no_grad()
def run_request(
    model: PreTrainedModel, ids: torch.Tensor, steps: int, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """Prefill picks [T, L, k] and greedy-decode picks [steps, L, k] (EOS ignored)."""
    out = model(input_ids=ids, use_cache=True, output_router_logits=True)
    prefill = top_k_picks(out.router_logits, k)
    decode = []
    for _ in range(steps):
        nxt = out.logits[:, -1:].argmax(-1)
        out = model(
            input_ids=nxt,
            past_key_values=out.past_key_values,
            use_cache=True,
            output_router_logits=True,
        )
        decode.append(top_k_picks(out.router_logits, k))
    return prefill, np.concatenate(decode)


def unit(rows: np.ndarray) -> np.ndarray:
    rows = rows.reshape(len(rows), -1).astype(np.float64)
    return rows / np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-12)


def distinct_experts(decode: list[np.ndarray], batch: list[int]) -> float:
    """Mean over decode steps and layers of |union of the batch's picks|."""
    picks = np.stack([decode[i] for i in batch])  # [B, steps, L, k]
    _, steps, layers, _ = picks.shape
    sizes = [len(np.unique(picks[:, s, la])) for s in range(steps) for la in range(layers)]
    return float(np.mean(sizes))


def analyse(
    domains: list[str],
    prefill: list[np.ndarray],
    decode: list[np.ndarray],
    e: int,
    seed: int,
    batch: int = 8,
) -> dict:
    p = unit(np.stack([counts(x, e) for x in prefill]))
    d = unit(np.stack([counts(x, e) for x in decode]))
    sim = p @ d.T  # sim[i, j] = cos(prefill_i, decode_j)
    dom = np.array(domains)
    same = dom[:, None] == dom[None, :]
    eye = np.eye(len(dom), dtype=bool)
    names = sorted(set(domains))
    correct = []
    for j in range(len(dom)):  # leave-one-out centroids of prefill histograms
        cents = [p[(dom == c) & (np.arange(len(dom)) != j)].mean(0) for c in names]
        scores = [float(c @ d[j]) / max(np.linalg.norm(c), 1e-12) for c in cents]
        correct.append(names[int(np.argmax(scores))] == dom[j])
    rng = random.Random(seed)
    by_dom = defaultdict(list)
    for i, name in enumerate(domains):
        by_dom[name].append(i)
    size = min(batch, *map(len, by_dom.values()))
    same_b = [rng.sample(by_dom[rng.choice(names)], size) for _ in range(200)]
    mixed_b = [rng.sample(range(len(dom)), size) for _ in range(200)]
    per_domain = {
        c: {
            "cosine_own": round(float(np.diag(sim)[dom == c].mean()), 3),
            "cosine_same_domain": round(float(sim[(dom == c)[:, None] & same & ~eye].mean()), 3),
            "cosine_other_domain": round(float(sim[(dom == c)[:, None] & ~same].mean()), 3),
            "accuracy": round(float(np.mean([correct[i] for i in by_dom[c]])), 3),
        }
        for c in names
    }
    return {
        "cosine_own": round(float(np.diag(sim).mean()), 3),
        "cosine_same_domain": round(float(sim[same & ~eye].mean()), 3),
        "cosine_other_domain": round(float(sim[~same].mean()), 3),
        "domain_accuracy": round(float(np.mean(correct)), 3),
        "chance_accuracy": round(1 / len(names), 3),
        "batch_size": size,
        "distinct_experts_same_domain_batch": round(
            float(np.mean([distinct_experts(decode, b) for b in same_b])), 2
        ),
        "distinct_experts_mixed_batch": round(
            float(np.mean([distinct_experts(decode, b) for b in mixed_b])), 2
        ),
        "per_domain": per_domain,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=HERE / "models" / "tiny")
    ap.add_argument("--prompts", type=Path, default=HERE / "prompts" / "evaluation.jsonl")
    ap.add_argument("--per-domain", type=int, default=30)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=8, help="requests per decode batch")
    ap.add_argument("--seed", type=int, default=0, help="batch sampling (and --random-init)")
    ap.add_argument("--random-init", action="store_true", help="same config, random weights")
    ap.add_argument("--out", type=Path, default=None, help="write the JSON result here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    hf_logging.disable_progress_bar()
    dtype = getattr(torch, args.dtype)
    tok = AutoTokenizer.from_pretrained(args.model)
    if args.random_init:
        torch.manual_seed(args.seed)
        config = AutoConfig.from_pretrained(args.model)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    model.eval()
    k, e = model.config.num_experts_per_tok, model.config.num_local_experts

    taken: dict[str, int] = defaultdict(int)
    rows = []
    for line in args.prompts.open(encoding="utf-8"):
        row = json.loads(line)
        if taken[row["domain"]] < args.per_domain:
            taken[row["domain"]] += 1
            rows.append(row)
    t0 = time.time()
    prefill, decode = [], []
    for row in rows:
        ids = tok(row["prompt"], return_tensors="pt").input_ids
        pre, dec = run_request(model, ids, args.decode_tokens, k)
        prefill.append(pre)
        decode.append(dec)
    result = {
        "model": str(args.model),
        "weights": "random-init" if args.random_init else "trained",
        "prompts": str(args.prompts),
        "requests": len(rows),
        "per_domain_requests": args.per_domain,
        "decode_tokens": args.decode_tokens,
        "dtype": args.dtype,
        "seconds": round(time.time() - t0, 1),
        **analyse([r["domain"] for r in rows], prefill, decode, e, args.seed, args.batch),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
