"""Build the bundled multi-domain prompt sets (calibration and evaluation).

ELDR's signatures only mean something if requests differ the way real traffic does, so the
examples ship prompts from seven domains: Python code, prose in English / French / Russian /
Chinese, math word problems and structured records. Every source is redistributable (see
``examples/prompts/SOURCES.md``) and every generator is seeded, so the files are reproducible
for a given Python version (the code and English prose come from the running interpreter's
standard library) and ``faker`` version.

The same generators feed ``build_corpus.py``; ``split_of`` keeps stdlib files of the
evaluation, calibration and training splits disjoint, and the generated domains use a
different seed per split.

    python examples/build_prompts.py            # writes examples/prompts/*.jsonl
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import random
import sysconfig
from datetime import datetime
from functools import cache
from pathlib import Path

from faker import Faker

DOMAINS: tuple[str, ...] = (
    "code",
    "prose-en",
    "prose-fr",
    "prose-ru",
    "prose-zh",
    "math",
    "records",
)
SPLITS: tuple[str, ...] = ("evaluation", "calibration", "train")
MIN_CHARS, MAX_CHARS = 200, 1200
SKIP_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__", "encodings"}
PROMPTS_DIR = Path(__file__).resolve().parent / "prompts"


def split_of(key: str) -> str:
    """Deterministic 10% / 10% / 80% split of a source file by its relative path."""
    bucket = int(hashlib.sha256(key.encode()).hexdigest(), 16) % 10
    return SPLITS[bucket] if bucket < 2 else "train"


def stable_seed(*parts: object) -> int:
    """A seed that does not depend on PYTHONHASHSEED."""
    return int(hashlib.sha256(":".join(map(str, parts)).encode()).hexdigest()[:12], 16)


@cache
def stdlib_files() -> tuple[tuple[str, str], ...]:
    """(relative path, source) of the interpreter's pure-Python stdlib, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out: list[tuple[str, str]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for name in sorted(filenames):
            if name.endswith(".py"):
                path = Path(dirpath) / name
                try:
                    text = path.read_text(encoding="utf-8")
                except (UnicodeDecodeError, OSError):
                    continue
                out.append((path.relative_to(root).as_posix(), text))
    return tuple(sorted(out))


def files_of(split: str) -> list[tuple[str, str]]:
    return [(rel, text) for rel, text in stdlib_files() if split_of(rel) == split]


def docstrings(source: str) -> list[str]:
    """Prose-like docstrings (>= 150 chars, few code markers) of one module."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, kinds):
            doc = ast.get_docstring(node)
            if doc and len(doc) >= 150 and doc.count(">>>") < 2 and doc.count("::") < 2:
                found.append(doc.strip())
    return found


@cache
def docstrings_of(split: str) -> tuple[str, ...]:
    return tuple(d for _, text in files_of(split) for d in docstrings(text))


def code_snippet(rng: random.Random, split: str, target: int) -> str:
    """A run of whole lines from a stdlib file of ``split``, starting at a def/class."""
    files = files_of(split)
    while True:
        rel, text = rng.choice(files)
        lines = text.splitlines()
        starts = [i for i, ln in enumerate(lines) if ln.lstrip().startswith(("def ", "class "))]
        if not starts:
            continue
        i = rng.choice(starts)
        out: list[str] = []
        size = 0
        while i < len(lines) and size + len(lines[i]) + 1 <= target:
            out.append(lines[i])
            size += len(lines[i]) + 1
            i += 1
        snippet = "\n".join(out).rstrip()
        if len(snippet) >= target // 2:
            return f"# Lib/{rel}\n{snippet}\n"


# Sentence templates written for this repository (same licence as the repository); fields are
# filled from faker's locale providers, and faker's lorem sentences are mixed in.
TEMPLATES: dict[str, tuple[str, ...]] = {
    "en_US": (
        "{name} lives in {city} and works as a {job_l} at {company}.",
        "According to a report published in {year}, about {pct} percent of the people in {city} "
        "take public transport every day.",
        "The meeting started on {weekday} at {h1} o'clock in the offices of {company}.",
        "We have received your request, and an adviser will contact you within {n} working days.",
        "The library in {city} is open from {h1} to {h2}, except on Sundays.",
        "To reach the station, follow {street} and keep walking straight for {n} minutes.",
        "It was cold that morning, and the whole town still seemed to be asleep.",
        "The project, run by {company}, is expected to cost about {amount} dollars.",
        "In {month}, energy prices rose by {pct} percent compared with the previous year.",
        "Every weekend {first} cooks for the neighbours and tells stories about growing up "
        "in {city}.",
        "Members of the association meet on {weekday} evenings to discuss local projects.",
        "The decision surprised everyone, because nobody had expected such a change.",
        "After {n} years at {company}, {first} decided to open a small bakery in {city}.",
        "The new bridge over the river will be finished in {year}, the city council said.",
    ),
    "fr_FR": (
        "{name} habite à {city} et travaille comme {job_l} chez {company}.",
        "Selon un rapport publié en {year}, environ {pct} % des habitants de {city} prennent "
        "les transports en commun chaque jour.",
        "La réunion a commencé le {weekday} à {h1} heures dans les bureaux de {company}.",
        "Nous avons bien reçu votre demande : un conseiller vous contactera dans les {n} jours "
        "ouvrables.",
        "La bibliothèque de {city} est ouverte de {h1} h à {h2} h, sauf le dimanche.",
        "Pour rejoindre la gare, suivez la {street} et continuez tout droit pendant {n} minutes.",
        "Il faisait froid ce matin-là, et toute la ville semblait encore endormie.",
        "Le projet, mené par {company}, devrait coûter environ {amount} euros.",
        "En {month}, les prix de l'énergie ont augmenté de {pct} % par rapport à l'année "
        "précédente.",
        "Chaque week-end, {first} cuisine pour ses voisins et raconte son enfance à {city}.",
        "Les membres de l'association se retrouvent le {weekday} soir pour parler des projets "
        "du quartier.",
        "Cette décision a surpris tout le monde, car personne ne s'attendait à un tel changement.",
        "Après {n} ans chez {company}, {first} a décidé d'ouvrir une petite boulangerie à {city}.",
        "Le nouveau pont sera terminé en {year}, a annoncé le conseil municipal.",
    ),
    "ru_RU": (
        "{name} работает в компании {company} уже {n5} лет.",
        "Место работы: {company}, должность: {job_l}, город: {city}.",
        "По данным отчёта за {year} год, около {pct} процентов жителей каждый день пользуются "
        "общественным транспортом.",
        "Мы получили вашу заявку, и консультант свяжется с вами в течение {n} рабочих дней.",
        "Библиотека открыта с {h1} до {h2} часов, кроме воскресенья.",
        "Чтобы дойти до вокзала, поверните на {street} и идите прямо {n5} минут.",
        "Утро было холодным, и весь город ещё спал.",
        "Проект компании {company} обойдётся примерно в {amount} рублей.",
        "Участники клуба собираются по вечерам, чтобы обсудить новости района.",
        "Это решение удивило всех, потому что никто не ожидал таких перемен.",
        "Новый мост через реку построят к {year} году, сообщили в городском совете.",
        "Каждые выходные {first} готовит обед для соседей и рассказывает истории о детстве.",
        "Цены на энергию выросли на {pct} процентов по сравнению с прошлым годом.",
    ),
    "zh_CN": (
        "{name}住在{city}，在{company}担任{job_l}。",
        "{year}年的一项调查显示，大约{pct}%的居民每天乘坐公共交通。",
        "会议于{weekday}上午{h1}点在{company}的办公室开始。",
        "我们已经收到您的申请，顾问将在{n}个工作日内与您联系。",
        "{city}图书馆每天{h1}点到{h2}点开放，星期日除外。",
        "要去火车站，请沿着{street}一直走{n}分钟。",
        "那天早上很冷，整个城市好像还在睡觉。",
        "这个项目由{company}负责，预计花费大约{amount}元。",
        "{month}，能源价格比去年上涨了{pct}%。",
        "每个周末，{name}都会给邻居做饭，讲述自己在{city}的童年故事。",
        "协会的成员每周见面一次，讨论社区的新计划。",
        "这个决定让大家都很意外，因为没有人预料到会有这样的变化。",
        "在{company}工作了{n}年以后，{name}决定在{city}开一家小面包店。",
        "市政府表示，新的大桥将在{year}年完工。",
    ),
}
# Faker's own day/month names depend on today's date, so they are listed here instead.
WEEKDAYS: dict[str, tuple[str, ...]] = {
    "en_US": ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"),
    "fr_FR": ("lundi", "mardi", "mercredi", "jeudi", "vendredi", "samedi", "dimanche"),
    "ru_RU": ("понедельник", "вторник", "среда", "четверг", "пятница", "суббота", "воскресенье"),
    "zh_CN": ("星期一", "星期二", "星期三", "星期四", "星期五", "星期六", "星期日"),
}
MONTHS: dict[str, tuple[str, ...]] = {
    "en_US": (
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ),
    "fr_FR": (
        "janvier",
        "février",
        "mars",
        "avril",
        "mai",
        "juin",
        "juillet",
        "août",
        "septembre",
        "octobre",
        "novembre",
        "décembre",
    ),
    "ru_RU": (
        "январь",
        "февраль",
        "март",
        "апрель",
        "май",
        "июнь",
        "июль",
        "август",
        "сентябрь",
        "октябрь",
        "ноябрь",
        "декабрь",
    ),
    "zh_CN": (*(f"{m}月" for m in "一二三四五六七八九十"), "十一月", "十二月"),
}
LOCALE_OF = {"prose-en": "en_US", "prose-fr": "fr_FR", "prose-ru": "ru_RU", "prose-zh": "zh_CN"}


@cache
def faker_for(locale: str, seed: int) -> Faker:
    fake = Faker(locale)
    fake.seed_instance(seed)
    return fake


def faker_sentence(fake: Faker, rng: random.Random, locale: str) -> str:
    if rng.random() < 0.35:
        return str(fake.sentence(nb_words=rng.randint(6, 14)))
    fields = {
        "name": fake.name(),
        "first": fake.first_name(),
        "city": fake.city(),
        "company": fake.company(),
        "job_l": str(fake.job()).lower(),
        "year": rng.randint(1960, 2030),
        "weekday": rng.choice(WEEKDAYS[locale]),
        "month": rng.choice(MONTHS[locale]),
        "street": fake.street_name(),
        "pct": rng.randint(3, 95),
        "n": rng.randint(2, 4),
        "n5": rng.randint(5, 20),
        "h1": rng.randint(7, 11),
        "h2": rng.randint(17, 21),
        "amount": f"{rng.randint(2, 900) * 1000:,}".replace(",", " "),
    }
    return rng.choice(TEMPLATES[locale]).format(**fields)


def faker_paragraphs(rng: random.Random, locale: str, seed: int, target: int) -> str:
    fake = faker_for(locale, seed)
    sep = "" if locale == "zh_CN" else " "
    paragraphs: list[str] = []
    size = 0
    while size < target:
        para = sep.join(faker_sentence(fake, rng, locale) for _ in range(rng.randint(3, 6)))
        paragraphs.append(para)
        size += len(para) + 2
    return "\n\n".join(paragraphs)


def prose(rng: random.Random, domain: str, split: str, target: int, seed: int) -> str:
    if domain == "prose-en" and rng.random() < 0.5:
        docs = docstrings_of(split)
        parts: list[str] = []
        while sum(map(len, parts)) < target * 0.6:
            parts.append(rng.choice(docs))
        return "\n\n".join(parts)
    return faker_paragraphs(rng, LOCALE_OF[domain], seed, target)


ITEMS = ("apples", "pencils", "books", "stickers", "marbles", "cookies", "tickets", "shells")
UNITS = ("boxes", "bags", "crates", "packs", "shelves", "baskets")


def math_problem(rng: random.Random, fake: Faker) -> tuple[str, str]:
    """One word problem and its worked solution."""
    name, other = fake.first_name(), fake.first_name()
    kind = rng.randrange(8)
    a, b, c = rng.randint(2, 60), rng.randint(2, 30), rng.randint(2, 12)
    item, unit = rng.choice(ITEMS), rng.choice(UNITS)
    if kind == 0:
        q = (
            f"{name} has {a} {item}. {other} gives {name} {b} more, and then {name} gives away "
            f"{c}. How many {item} does {name} have now?"
        )
        return q, f"{a} + {b} = {a + b}. {a + b} - {c} = {a + b - c}. Answer: {a + b - c}"
    if kind == 1:
        q = f"A shop has {c} {unit} with {b} {item} in each. How many {item} are there in all?"
        return q, f"{c} * {b} = {b * c}. Answer: {b * c}"
    if kind == 2:
        total = b * c
        q = f"{name} shares {total} {item} equally among {c} friends. How many does each get?"
        return q, f"{total} / {c} = {b}. Answer: {b}"
    if kind == 3:
        price, pct = rng.randint(10, 400), rng.choice((10, 15, 20, 25, 30, 40, 50))
        off = price * pct / 100
        q = f"A jacket costs ${price}. It is on sale for {pct}% off. What is the sale price?"
        return (
            q,
            f"{pct}% of {price} is {off:g}. {price} - {off:g} = {price - off:g}. "
            f"Answer: ${price - off:g}",
        )
    if kind == 4:
        speed, hours = rng.randint(30, 120), rng.randint(2, 9)
        q = f"A train travels at {speed} km/h for {hours} hours. How far does it travel?"
        return (
            q,
            f"distance = speed * time = {speed} * {hours} = {speed * hours}. "
            f"Answer: {speed * hours} km",
        )
    if kind == 5:
        q = f"A rectangular garden is {a} m long and {b} m wide. What are its area and perimeter?"
        return (
            q,
            f"area = {a} * {b} = {a * b} m^2. perimeter = 2 * ({a} + {b}) = "
            f"{2 * (a + b)} m. Answer: {a * b} m^2, {2 * (a + b)} m",
        )
    if kind == 6:
        x = rng.randint(-20, 40)
        rhs = c * x + b
        q = f"Solve for x: {c}x + {b} = {rhs}."
        return q, f"{c}x = {rhs} - {b} = {rhs - b}. x = {rhs - b} / {c} = {x}. Answer: x = {x}"
    age = rng.randint(5, 40)
    q = (
        f"{name} is {age} years old. {other} is {c} years older than twice {name}'s age. "
        f"How old will {other} be in {b} years?"
    )
    now = 2 * age + c
    return q, f"2 * {age} + {c} = {now}. {now} + {b} = {now + b}. Answer: {now + b}"


def math_text(rng: random.Random, seed: int, target: int, open_end: bool) -> str:
    fake = faker_for("en_US", seed)
    blocks: list[str] = []
    while sum(map(len, blocks)) < target:
        q, s = math_problem(rng, fake)
        blocks.append(f"Problem: {q}\nSolution: {s}")
    if open_end:
        blocks[-1] = blocks[-1].split("\nSolution:")[0] + "\nSolution:"
    return "\n\n".join(blocks)


def when(fake: Faker, first_year: int, last_year: int) -> datetime:
    """A timestamp in fixed bounds (faker's "this year" helpers depend on today)."""
    return fake.date_time_between(datetime(first_year, 1, 1), datetime(last_year, 12, 31))


def record(rng: random.Random, fake: Faker, schema: int) -> dict[str, object]:
    if schema == 0:
        return {
            "id": rng.randint(1000, 99999),
            "name": fake.name(),
            "email": fake.email(),
            "city": fake.city(),
            "birthdate": when(fake, 1940, 2008).date().isoformat(),
        }
    if schema == 1:
        qty, price = rng.randint(1, 9), round(rng.uniform(1, 300), 2)
        return {
            "order_id": f"ORD-{rng.randint(0, 10**6):06d}",
            "sku": fake.bothify("??-####"),
            "qty": qty,
            "unit_price": price,
            "total": round(qty * price, 2),
            "date": when(fake, 2018, 2025).date().isoformat(),
        }
    if schema == 2:
        return {
            "device": f"sensor-{rng.randint(1, 64):02d}",
            "ts": when(fake, 2024, 2025).isoformat(),
            "temp_c": round(rng.gauss(21, 4), 1),
            "humidity": rng.randint(20, 90),
            "ok": rng.random() > 0.1,
        }
    return {
        "ts": when(fake, 2024, 2025).isoformat() + "Z",
        "level": rng.choice(("INFO", "WARN", "ERROR", "DEBUG")),
        "host": fake.hostname(),
        "ip": fake.ipv4(),
        "status": rng.choice((200, 404, 500)),
        "path": fake.uri_path(),
    }


def records_text(rng: random.Random, seed: int, target: int) -> tuple[str, str]:
    """(format, text): JSON Lines, CSV or a pretty-printed JSON array of one schema."""
    fake = faker_for("en_US", seed)
    schema, fmt = rng.randrange(4), rng.choice(("jsonl", "csv", "json"))
    rows: list[dict[str, object]] = []
    size = 0
    while size < target:
        rows.append(record(rng, fake, schema))
        size += len(json.dumps(rows[-1])) + (30 if fmt == "json" else 1)
    if fmt == "jsonl":
        return fmt, "\n".join(json.dumps(r) for r in rows) + "\n"
    if fmt == "json":
        return fmt, json.dumps(rows, indent=2)[:-2].rstrip() + ",\n"
    header = ",".join(rows[0])
    return fmt, header + "\n" + "\n".join(",".join(str(v) for v in r.values()) for r in rows)


INSTRUCTIONS: dict[str, str] = {
    "prose-en": "Continue the following text:\n\n",
    "prose-fr": "Continuez le texte suivant :\n\n",
    "prose-ru": "Продолжите следующий текст:\n\n",
    "prose-zh": "请继续写下面的文字：\n\n",
    "math": "Solve the following math problems step by step.\n\n",
}
RECORD_INSTRUCTIONS = {
    "jsonl": "Continue this JSON Lines file with more records of the same schema:\n\n",
    "csv": "Continue this CSV file with more rows:\n\n",
    "json": "Continue this JSON array with more objects of the same shape:\n\n",
}


def make_prompt(domain: str, split: str, rng: random.Random, seed: int) -> str:
    target = rng.randint(260, 1000)
    if domain == "code":
        body = code_snippet(rng, split, target)
        text = "Continue this Python code:\n\n" + body
    elif domain == "math":
        text = INSTRUCTIONS[domain] + math_text(rng, seed, target - 60, open_end=True)
    elif domain == "records":
        fmt, body = records_text(rng, seed, target - 70)
        text = RECORD_INSTRUCTIONS[fmt] + body
    else:
        text = INSTRUCTIONS[domain] + prose(rng, domain, split, target - 40, seed)
    return clip(text)


def clip(text: str) -> str:
    """Cut to MAX_CHARS at a line (or sentence) boundary."""
    if len(text) <= MAX_CHARS:
        return text
    cut = text.rfind("\n", 0, MAX_CHARS)
    if cut < MIN_CHARS:
        cut = max(text.rfind(p, 0, MAX_CHARS) for p in (". ", "。", " "))
    return text[: cut + 1].rstrip() + ("\n" if text[cut] == "\n" else "")


def build_split(split: str, count: int, seed: int, taken: set[str]) -> list[dict[str, str]]:
    """``count`` prompts balanced over DOMAINS (counts differ by at most one)."""
    rows: list[dict[str, str]] = []
    for d, domain in enumerate(DOMAINS):
        want = count // len(DOMAINS) + (1 if d < count % len(DOMAINS) else 0)
        dseed = stable_seed(seed, split, domain)
        rng = random.Random(dseed)
        got = 0
        while got < want:
            prompt = make_prompt(domain, split, rng, dseed)
            if prompt in taken or not MIN_CHARS <= len(prompt) <= MAX_CHARS:
                continue
            taken.add(prompt)
            rows.append(
                {"id": f"{split[:4]}-{domain}-{got:04d}", "prompt": prompt, "domain": domain}
            )
            got += 1
    random.Random(stable_seed(seed, split, "order")).shuffle(rows)
    return rows


def write_jsonl(path: Path, rows: list[dict[str, str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=PROMPTS_DIR, help="output directory")
    ap.add_argument("--seed", type=int, default=20260, help="master seed")
    ap.add_argument("--calibration", type=int, default=1000, help="calibration prompts")
    ap.add_argument("--evaluation", type=int, default=1400, help="evaluation prompts")
    args = ap.parse_args(argv)
    taken: set[str] = set()
    for split, count in (("calibration", args.calibration), ("evaluation", args.evaluation)):
        rows = build_split(split, count, args.seed, taken)
        path = args.out / f"{split}.jsonl"
        write_jsonl(path, rows)
        print(f"{path}: {len(rows)} prompts, {path.stat().st_size / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
