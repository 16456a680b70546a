"""Build the training corpus of the bundled tiny MoE (not shipped; regenerate it locally).

The tiny Mixtral in ``examples/models/tiny`` must route tokens of different domains to
different experts, or ELDR has nothing to exploit. It is trained on the seven domains of the
prompt sets (``build_prompts.DOMAINS``), from the same kinds of sources plus text that is fine
to train on but not to redistribute: gettext catalogs (``/usr/share/locale``, mostly GPL/LGPL)
and man pages (``/usr/share/man``, English and translated).

Held out from the shipped prompts: code and docstrings come only from stdlib files of the
``train`` split of ``build_prompts.split_of``; generated text (faker prose, math, records) uses
seeds of its own. Template sentences of the generated domains do recur by design. About 2% of
each domain's documents go to ``<domain>.valid.jsonl`` for a validation loss.

    python examples/build_corpus.py --out examples/corpus --chars 2500000
"""

from __future__ import annotations

import argparse
import json
import os
import random
import struct
import subprocess
from collections.abc import Iterable, Iterator
from pathlib import Path

import build_prompts as bp

LOCALE_DIR = Path("/usr/share/locale")
MAN_DIR = Path("/usr/share/man")
DOC_CHARS = 20_000  # longer sources are cut into documents of at most this size
LANGS: dict[str, tuple[str, ...]] = {
    "prose-en": ("man1", "man5", "man7", "man8"),
    "prose-fr": ("fr",),
    "prose-ru": ("ru",),
    "prose-zh": ("zh_CN", "zh_TW"),
}


def read_mo(path: Path) -> list[tuple[str, str]]:
    """(msgid, msgstr) pairs of a GNU .mo catalog; plural forms are split into entries."""
    data = path.read_bytes()
    if len(data) < 28:
        return []
    magic = struct.unpack("<I", data[:4])[0]
    end = "<" if magic == 0x950412DE else ">"
    n, orig, trans = struct.unpack(end + "3I", data[8:20])
    pairs = []
    for i in range(n):
        olen, ooff = struct.unpack(end + "2I", data[orig + 8 * i : orig + 8 * i + 8])
        tlen, toff = struct.unpack(end + "2I", data[trans + 8 * i : trans + 8 * i + 8])
        msgid = data[ooff : ooff + olen].decode("utf-8", "replace")
        msgstr = data[toff : toff + tlen].decode("utf-8", "replace")
        if msgid:  # the empty msgid is the header
            pairs.extend(zip(msgid.split("\x00"), msgstr.split("\x00"), strict=False))
    return pairs


def gettext_docs(lang: str, source_side: bool = False) -> list[str]:
    """One document per catalog: its translations (or English msgids), one per line."""
    docs = []
    seen: set[str] = set()
    for path in sorted((LOCALE_DIR / lang / "LC_MESSAGES").glob("*.mo")):
        lines = []
        for msgid, msgstr in read_mo(path):
            text = (msgid if source_side else msgstr).strip()
            if len(text) >= 15 and text not in seen:
                seen.add(text)
                lines.append(text)
        if lines:
            docs.append("\n".join(lines))
    return docs


def man_pages(section_dirs: Iterable[Path]) -> list[Path]:
    """Page files under the given dirs; the thousands of near-identical gcloud pages are skipped."""
    return sorted(
        p
        for d in section_dirs
        if d.is_dir()
        for p in d.rglob("*")
        if p.is_file() and not p.name.startswith("gcloud")
    )


def render_man(path: Path) -> str:
    """Plain text of a man page (``man -l`` | ``col -bx``), blank-line runs squeezed."""
    env = dict(os.environ, MANWIDTH="80", LC_ALL="C.UTF-8", MAN_KEEP_FORMATTING="")
    try:
        raw = subprocess.run(
            ["man", "-l", str(path)], env=env, capture_output=True, timeout=20, check=False
        ).stdout
        out = subprocess.run(
            ["col", "-bx"], input=raw, env=env, capture_output=True, timeout=20, check=False
        ).stdout.decode("utf-8", "replace")
    except subprocess.TimeoutExpired:
        return ""
    lines = [ln.rstrip() for ln in out.splitlines()[1:-1]]  # drop running header/footer
    return "\n".join(ln for i, ln in enumerate(lines) if ln or (i and lines[i - 1])).strip()


def man_docs(domain: str, rng: random.Random, budget: int) -> Iterator[str]:
    if domain == "prose-en":
        dirs = [MAN_DIR / s for s in LANGS[domain]]
    else:
        dirs = [MAN_DIR / lang for lang in LANGS[domain]]
    pages = man_pages(dirs)
    rng.shuffle(pages)
    used = 0
    for page in pages:
        if used >= budget:
            return
        text = render_man(page)
        if len(text) >= 300:
            used += len(text)
            yield text


def chunks(text: str, size: int = DOC_CHARS) -> Iterator[str]:
    """Cut at line boundaries into pieces of at most ``size`` characters."""
    start = 0
    while start < len(text):
        end = len(text) if len(text) - start <= size else text.rfind("\n", start, start + size)
        end = start + size if end <= start else end
        yield text[start:end].strip("\n")
        start = end


def take(docs: Iterable[str], budget: int) -> list[str]:
    out: list[str] = []
    used = 0
    for doc in docs:
        for piece in chunks(doc):
            if used >= budget:
                return out
            if piece.strip():
                out.append(piece)
                used += len(piece)
    return out


def generated(domain: str, rng: random.Random, seed: int) -> Iterator[str]:
    """Endless documents of a generated domain (faker prose, math, records)."""
    while True:
        target = rng.randint(800, 4000)
        if domain == "math":
            yield bp.math_text(rng, seed, target, open_end=False)
        elif domain == "records":
            yield bp.records_text(rng, seed, target)[1]
        else:
            yield bp.faker_paragraphs(rng, bp.LOCALE_OF[domain], seed, target)


def domain_docs(domain: str, budget: int, seed: int) -> list[str]:
    rng = random.Random(bp.stable_seed(seed, "corpus", domain))
    gseed = bp.stable_seed(seed, "corpus-faker", domain)
    if domain == "code":
        files = [f"# Lib/{rel}\n{text}" for rel, text in bp.files_of("train")]
        rng.shuffle(files)
        return take(files, budget)
    if domain in ("math", "records"):
        return take(generated(domain, rng, gseed), budget)
    docs: list[str] = []
    if domain == "prose-en":
        per_file = ["\n\n".join(bp.docstrings(text)) for _, text in bp.files_of("train")]
        docs += take(sorted(filter(None, per_file)), int(budget * 0.35))
        docs += take(gettext_docs("fr", source_side=True), int(budget * 0.10))
    else:
        for lang in LANGS[domain]:
            docs += take(gettext_docs(lang), int(budget * 0.45 / len(LANGS[domain])))
    docs += take(man_docs(domain, rng, int(budget * 0.3)), int(budget * 0.3))
    left = budget - sum(map(len, docs))
    return docs + take(generated(domain, rng, gseed), left)


def with_instruction(domain: str, doc: str, rng: random.Random) -> str:
    """Prefix some documents with the task line that the shipped prompts use."""
    if rng.random() >= 0.3:
        return doc
    if domain == "code":
        return "Continue this Python code:\n\n" + doc
    if domain == "records":
        fmt = "json" if doc.startswith("[") else "jsonl" if doc.startswith("{") else "csv"
        return bp.RECORD_INSTRUCTIONS[fmt] + doc
    return bp.INSTRUCTIONS[domain] + doc


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "corpus")
    ap.add_argument("--chars", type=int, default=2_500_000, help="characters per domain")
    ap.add_argument("--seed", type=int, default=20260)
    ap.add_argument("--valid-frac", type=float, default=0.02)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for domain in bp.DOMAINS:
        rng = random.Random(bp.stable_seed(args.seed, "mix", domain))
        docs = [
            with_instruction(domain, d, rng) for d in domain_docs(domain, args.chars, args.seed)
        ]
        rng.shuffle(docs)
        n_valid = max(1, int(len(docs) * args.valid_frac))
        for name, part in (("valid", docs[:n_valid]), ("train", docs[n_valid:])):
            with (args.out / f"{domain}.{name}.jsonl").open("w", encoding="utf-8") as fh:
                for doc in part:
                    fh.write(json.dumps(doc, ensure_ascii=False) + "\n")
        chars = sum(map(len, docs))
        print(f"{domain:9s} {len(docs):6d} docs {chars / 1e6:5.2f} M chars ({n_valid} valid)")


if __name__ == "__main__":
    main()
