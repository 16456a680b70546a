"""Train the bundled tiny Mixtral MoE (examples/models/tiny) on a CPU in minutes.

ELDR routes decode requests by their prefill expert usage, which only works with a model whose
experts specialise by domain. Random weights do not; ~15 minutes of single-thread CPU training
on the seven-domain corpus of ``build_corpus.py`` does. This script trains a byte-level BPE
tokenizer, then a 4-layer, 16-expert, top-2 ``MixtralForCausalLM`` with a per-layer router
load-balancing loss (Hugging Face's loss pools all layers, which balances only the sum over
layers), and saves a Hugging Face / vLLM checkpoint in bf16 safetensors shards under 20 MB.

    python examples/train_tiny_moe.py --threads 1 --minutes 15

Everything is seeded; only the number of steps of a ``--minutes`` run depends on the speed of
the machine (it is re-estimated while the first 80% of the budget runs). ``--steps N`` replays
a logged run's data order and initialisation with a plain N-step schedule.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from pathlib import Path

import build_corpus
import torch
import torch.nn.functional as F
from build_prompts import DOMAINS
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    MixtralConfig,
    MixtralForCausalLM,
    PreTrainedTokenizerFast,
)

HERE = Path(__file__).resolve().parent
SPECIALS = ("<s>", "</s>", "<unk>", "<pad>")  # ids 0..3
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def load_docs(corpus: Path, part: str) -> dict[str, list[str]]:
    return {
        d: [json.loads(line) for line in (corpus / f"{d}.{part}.jsonl").open(encoding="utf-8")]
        for d in DOMAINS
    }


def train_tokenizer(docs: dict[str, list[str]], vocab: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE with single-digit tokens; <s> is prepended by the post-processor."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        min_frequency=2,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((doc for d in DOMAINS for doc in docs[d]), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=2048,
        chat_template=CHAT_TEMPLATE,
    )


def encode(tok: PreTrainedTokenizerFast, docs: dict[str, list[str]]) -> dict[str, torch.Tensor]:
    """One token stream per domain: <s> doc </s> <s> doc </s> ..."""
    streams = {}
    for d in DOMAINS:
        ids: list[int] = []
        for enc in tok.backend_tokenizer.encode_batch(docs[d], add_special_tokens=False):
            ids += [tok.bos_token_id, *enc.ids, tok.eos_token_id]
        streams[d] = torch.tensor(ids, dtype=torch.int16)
    return streams


def batch_domains(step: int, batch: int) -> list[str]:
    """Every domain in every batch; the slots left over rotate over the domains."""
    per = batch // len(DOMAINS)
    extra = [DOMAINS[(step * (batch % len(DOMAINS)) + i) % len(DOMAINS)] for i in range(batch)]
    return [d for d in DOMAINS for _ in range(per)] + extra[: batch - per * len(DOMAINS)]


def sample(
    streams: dict[str, torch.Tensor], doms: list[str], seq: int, g: torch.Generator
) -> torch.Tensor:
    """[len(doms), seq + 1] random windows, row i from the stream of domain doms[i]."""
    rows = []
    for d in doms:
        s = streams[d]
        start = int(torch.randint(0, len(s) - seq - 1, (1,), generator=g))
        rows.append(s[start : start + seq + 1].long())
    return torch.stack(rows)


def per_layer_aux(router_logits: tuple[torch.Tensor, ...], top_k: int) -> torch.Tensor:
    """Switch-style balance loss E * sum_e f_e * P_e computed per layer, then averaged."""
    losses = []
    for logits in router_logits:
        probs = logits.float().softmax(-1)
        num_experts = probs.shape[-1]
        picks = F.one_hot(probs.topk(top_k, -1).indices, num_experts).float().sum(1)
        frac = picks.mean(0) / top_k
        losses.append(num_experts * (frac * probs.mean(0)).sum())
    return torch.stack(losses).mean()


def effective_experts(router_logits: tuple[torch.Tensor, ...], top_k: int) -> list[float]:
    """exp(entropy) of each layer's top-k pick distribution (16 = perfectly balanced)."""
    out = []
    for logits in router_logits:
        counts = torch.bincount(
            logits.topk(top_k, -1).indices.flatten(), minlength=logits.shape[-1]
        )
        p = counts.float() / counts.sum()
        out.append(round(float(torch.exp(-(p * p.clamp_min(1e-12).log()).sum())), 2))
    return out


def lr_at(step: int, total: int, args: argparse.Namespace) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    frac = min(1.0, (step - args.warmup) / max(1, total - args.warmup))
    low = args.lr * args.min_lr_ratio
    return low + 0.5 * (args.lr - low) * (1 + math.cos(math.pi * frac))


@torch.no_grad()
def valid_loss(model: MixtralForCausalLM, valid: dict[str, torch.Tensor], seq: int) -> dict:
    model.eval()
    g = torch.Generator().manual_seed(1234)
    out = {}
    for d in DOMAINS:
        x = sample(valid, [d] * 4, seq, g)
        logits = model(input_ids=x[:, :-1]).logits
        out[d] = round(float(F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())), 4)
    model.train()
    return out


def make_model(vocab: int, seed: int) -> MixtralForCausalLM:
    torch.manual_seed(seed)
    cfg = MixtralConfig(
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_local_experts=16,
        num_experts_per_tok=2,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        router_aux_loss_coef=0.02,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=3,
    )
    # grouped_mm is the fastest experts implementation on CPU; attention is SDPA.
    return MixtralForCausalLM._from_config(
        cfg, experts_implementation="grouped_mm", attn_implementation="sdpa"
    )


def save(model: MixtralForCausalLM, tok: PreTrainedTokenizerFast, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("model*.safetensors*"):
        old.unlink()
    model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=1, pad_token_id=3)
    model.to(torch.bfloat16).save_pretrained(out, max_shard_size="18MB")
    tok.save_pretrained(out)
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    # Older readers (and the brief of this repo) expect these top-level keys as well.
    cfg["torch_dtype"] = "bfloat16"
    cfg["rope_theta"] = cfg.get("rope_parameters", {}).get("rope_theta", 10000.0)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    # transformers 5 writes the template to chat_template.jinja; keep a copy in
    # tokenizer_config.json for readers that look only there.
    tc_path = out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=CHAT_TEMPLATE)
    tc_path.write_text(json.dumps(tc, indent=2, ensure_ascii=False) + "\n")


def smoke_check(out: Path) -> str:
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    ids = tok("Solve the following math problems step by step.\n\nProblem:", return_tensors="pt")
    gen = model.generate(**ids, max_new_tokens=24, do_sample=False)
    return tok.decode(gen[0], skip_special_tokens=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", type=Path, default=HERE / "corpus")
    ap.add_argument("--out", type=Path, default=HERE / "models" / "tiny")
    ap.add_argument("--log", type=Path, default=None, help="default: OUT/training_log.jsonl")
    ap.add_argument("--minutes", type=float, default=15.0, help="training time budget")
    ap.add_argument("--steps", type=int, default=None, help="fixed step count (overrides time)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--aux-coef", type=float, default=0.02)
    ap.add_argument("--eval-every", type=int, default=50)
    args = ap.parse_args(argv)

    os.environ["RAYON_NUM_THREADS"] = str(args.threads)  # tokenizers' thread pool
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    if not (args.corpus / f"{DOMAINS[-1]}.valid.jsonl").exists():
        build_corpus.main(["--out", str(args.corpus)])
    t0 = time.time()
    train_docs, valid_docs = load_docs(args.corpus, "train"), load_docs(args.corpus, "valid")
    tok = train_tokenizer(train_docs, args.vocab)
    train, valid = encode(tok, train_docs), encode(tok, valid_docs)
    chars = {d: sum(map(len, train_docs[d])) for d in DOMAINS}
    tpc = {d: round(len(train[d]) / chars[d], 3) for d in DOMAINS}
    print(f"tokenizer + encoding: {time.time() - t0:.0f}s; tokens/char {tpc}", flush=True)

    model = make_model(len(tok), args.seed)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    g = torch.Generator().manual_seed(args.seed)
    log_path = args.log or args.out / "training_log.jsonl"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = log_path.open("w")
    budget = args.minutes * 60
    total = args.steps or 10**9
    step_times: list[float] = []
    start = time.time()
    step = 0
    loss_ema = None
    while step < total:
        t = time.time()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, total, args)
        x = sample(train, batch_domains(step, args.batch), args.seq, g)
        out = model(input_ids=x[:, :-1], output_router_logits=True)
        lm = F.cross_entropy(out.logits.flatten(0, 1), x[:, 1:].flatten())
        aux = per_layer_aux(out.router_logits, model.config.num_experts_per_tok)
        (lm + args.aux_coef * aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step_times.append(time.time() - t)
        elapsed = time.time() - start
        if args.steps is None and step >= 11 and step % 10 == 1 and elapsed < 0.8 * budget:
            # Re-estimate the step count from recent speed (the CPU may be shared), then freeze
            # it for the last 20% of the budget so that the cosine reaches its floor.
            recent = sum(step_times[-10:]) / 10
            total = max(step + 2, step + 1 + int((budget - elapsed) / recent))
            print(f"step {step}: {recent:.2f}s/step -> {total} steps", flush=True)
        lm_val, aux_val = lm.detach().item(), aux.detach().item()
        loss_ema = lm_val if loss_ema is None else 0.95 * loss_ema + 0.05 * lm_val
        rec = {
            "step": step,
            "elapsed_s": round(time.time() - start, 1),
            "lr": round(opt.param_groups[0]["lr"], 6),
            "total_steps": total if total < 10**9 else None,
            "lm_loss": round(lm_val, 4),
            "aux_loss": round(aux_val, 4),
        }
        if step % args.eval_every == 0 or step == total - 1:
            rec["effective_experts"] = effective_experts(
                out.router_logits, model.config.num_experts_per_tok
            )
            rec["valid_loss"] = valid_loss(model, valid, args.seq)
            print(json.dumps(rec), flush=True)
        log.write(json.dumps(rec) + "\n")
        log.flush()
        step += 1
    train_s = time.time() - start
    summary = {
        "steps": step,
        "train_minutes": round(train_s / 60, 2),
        "tokens_seen": step * args.batch * args.seq,
        "final_lm_loss_ema": round(loss_ema or 0.0, 4),
        "final_valid_loss": valid_loss(model, valid, args.seq),
        "params": n_params,
        "threads": args.threads,
        "tokens_per_char": tpc,
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    log.write(json.dumps({"summary": summary}) + "\n")
    log.close()
    print(json.dumps(summary, indent=1))
    save(model, tok, args.out)
    print("saved", args.out, "| sample:", repr(smoke_check(args.out)))


if __name__ == "__main__":
    main()
