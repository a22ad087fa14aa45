"""Task-shaped training prompts for the eight evaluation families, built offline (JSONL out; no model needed).

    python -m train.task_prompts --out-dir prompts/ [--per-family 3000 --held-out 40 --seed 0]

writes `<family>.jsonl` (training prompts) and `<family>_heldout.jsonl` (held-out prompts; no training prompt of any
family shares a user turn with any family's held-out prompt) for every family of `hspec_jax.prompts.TASKS`. Each
line is `{"id", "messages"}` with the user turns (and, for tool_use, the system message listing the tools) and no
answer: `train.regenerate` writes the target's answers, dropping any prompt that equals or nearly repeats an
evaluation prompt. None of the texts is an evaluation prompt:

| family | prompts from |
|---|---|
| math | templated word problems (rates, shares, change, ages, areas, ...) with random names and numbers |
| qa | questions in ShareGPT messages (6-25 words, a question word first, `?` last) |
| dialogue | a ShareGPT first user turn, then one of `FOLLOW_UPS` (MT-bench-shaped: rewrite, shorten, critique, ...) |
| rag | a ShareGPT passage (a ChatGPT answer) followed by a question about it |
| summarization | "Summarize: " and other instructions before a ShareGPT passage |
| translation | German, French or Spanish sentences of ShareGPT to English, English ones to those languages |
| code | Python standard-library functions: complete (HumanEval's instruction), explain, document, test |
| tool_use | `TOOLS` (function schemas written here), one to four shown, a request needing one or two calls |

ShareGPT conversations already answered in `--exclude` files (by id; default the committed SmolLM2 training and
held-out files) are not used again, so the answers are new tokens. Deterministic: the same arguments and packages
give the same files. Provenance and licences: `data/README.md`.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import re
import sys
import sysconfig

from hspec_jax.chat import TOOLS_SYSTEM
from hspec_jax.cli import ArgumentParser, non_negative_int, positive_int, run
from hspec_jax.prompts import CODE_INSTRUCTION, TASKS
from train.chat import normalize_text, to_messages, user_texts
from train.data import sharegpt_records

DEFAULT_EXCLUDE = ("data/smollm2_sharegpt_v2.jsonl", "data/smollm2_heldout.jsonl", "data/smollm2_regen_sharegpt.jsonl")

NAMES = [
    "Ada",
    "Ben",
    "Carla",
    "Dev",
    "Emma",
    "Farid",
    "Gia",
    "Hugo",
    "Ines",
    "Jonas",
    "Kiko",
    "Liam",
    "Mara",
    "Nils",
    "Omar",
    "Priya",
    "Quinn",
    "Rosa",
    "Sami",
    "Tara",
]
ITEMS = [
    "apples",
    "pencils",
    "stickers",
    "cookies",
    "marbles",
    "books",
    "tickets",
    "cupcakes",
    "shirts",
    "plants",
    "coins",
    "cards",
    "bottles",
    "eggs",
]


def _math_problem(rng: random.Random) -> str:
    """One word problem with small whole numbers, from one of a dozen shapes."""
    a, b = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    n, m, k = rng.randint(3, 60), rng.randint(2, 12), rng.randint(2, 9)
    price, pct = rng.choice([0.5, 1.25, 2, 3.5, 4, 7.5, 12]), rng.choice([10, 15, 20, 25, 30, 40, 50])
    shapes = [
        f"{a} has {n} {item}. {b} has {k} times as many. How many {item} do they have together?",
        f"{a} buys {m} packs of {item} with {k} in each pack and gives {n % (m * k) + 1} away. How many are left?",
        f"A shop sells {item} for ${price} each. {a} buys {n} of them and pays with a $"
        f"{int(n * price) + rng.choice([5, 10, 20])} bill. How much change does {a} get?",
        f"{a} reads {m} pages on Monday and {k} more pages each day than the day before. How many pages has "
        f"{a} read after {k + 2} days?",
        f"A train travels at {n + 30} miles per hour for {k} hours and then at {n + 10} miles per hour for {m} "
        "hours. How far does it travel in total?",
        f"{a} is {m + 20} years old and {b} is {k} years younger. How old will {b} be in {n % 15 + 1} years?",
        f"A rectangle is {n} meters long and {m} meters wide. What are its area and its perimeter?",
        f"{a} earns ${n + 10} a day and saves {pct}% of it. How much does {a} save in {m} weeks of 5 working days?",
        f"A recipe uses {k} cups of flour for {m} cookies. How many cups are needed for {m * (n % 7 + 2)} cookies?",
        f"There are {n + 40} students in a school trip and each bus holds {m + 10}. How many buses are needed, and "
        "how many seats are empty?",
        f"{a} and {b} share {n * k} {item} in the ratio {k}:{m}. How many does each get?",
        f"The price of a {item[:-1]} rose from ${m} to ${m + k}. By what percent did it rise?",
        f"{a} runs {k} km every weekday and {m} km on each weekend day. How many km does {a} run in {k} weeks?",
        f"A tank holds {n * 10} liters. It is {pct}% full and {m} liters are added. How full is it now, in percent?",
    ]
    return rng.choice(shapes)


FOLLOW_UPS = (
    "Can you shorten your answer to three sentences?",
    "Now rewrite it in a more formal tone.",
    "Explain the same thing to a ten-year-old.",
    "Put the main points into a bulleted list.",
    "What are the weaknesses of your answer?",
    "Give one concrete example for each point you made.",
    "Rewrite your answer as a short poem.",
    "Can you translate your answer into French?",
    "Which part of your answer is the most important, and why?",
    "Turn your answer into a short email to a colleague.",
    "Add a title and a one-line summary at the top.",
    "What would someone who disagrees with you say?",
    "Make it more detailed, please.",
    "Write it again without using the letter e where you can.",
    "Summarize our conversation so far in two sentences.",
    "Can you give me three follow-up questions I could ask about this?",
    "Now write the opposite argument.",
    "Rewrite it as a dialogue between two people.",
    "Are there any mistakes in what you wrote? Fix them.",
    "Give me a version that fits in a tweet.",
)
HELD_OUT_FOLLOW_UPS = (  # the held-out dialogues' second turns, never in a training prompt
    "Now say it again in the style of a news report.",
    "Which of your points would an expert question first?",
    "Rewrite your answer for a busy manager in five lines.",
    "Add a short conclusion to what you wrote.",
)

QUESTIONS_ON_PASSAGE = (
    "What is the main point of this text?",
    "According to the text, what are the key steps or parts?",
    "Which facts in the passage support its conclusion?",
    "What does the text say about the first topic it mentions?",
    "Based only on the passage above, who or what is it mainly about?",
    "List three things the passage tells us.",
    "What problem does the text describe, and what solution does it give?",
    "Using the passage, answer: why does this matter?",
)

SUMMARY_INSTRUCTIONS = (
    "Summarize: {text}",
    "Summarize the following text in a few sentences.\n\n{text}",
    "{text}\n\nWrite a short summary of the text above.",
    "Give a one-paragraph summary of this article: {text}",
    "TL;DR: {text}",
)

LANGUAGES = {"de": "German", "fr": "French", "es": "Spanish", "en": "English"}
_MARKERS = {
    "de": re.compile(r"\b(und|der|die|das|nicht|ist|ich|mit|für|auf|eine|sich)\b", re.I),
    "fr": re.compile(r"\b(le|la|les|et|est|une|des|pour|dans|que|pas|vous)\b", re.I),
    "es": re.compile(r"\b(el|los|las|y|es|una|para|que|con|por|del|como)\b", re.I),
    "en": re.compile(r"\b(the|and|is|of|to|in|that|it|for|you|with)\b", re.I),
}
_SENTENCE = re.compile(r"(?<=[.!?])\s+")
_QUESTION = re.compile(r"^(What|Who|When|Where|Which|Why|How|Is|Are|Does|Do|Can|Could|Should|Would|Will)\b.*\?$")


def language(text: str) -> str:
    """The most likely of de, fr, es, en by common-word counts (a rough but adequate guess on whole messages)."""
    counts = {code: len(pattern.findall(text)) for code, pattern in _MARKERS.items()}
    return max(counts, key=counts.get)


def sentences(text: str, low: int = 6, high: int = 40) -> list[str]:
    """Prose sentences of `text` with `low`..`high` words (no code, lists or markup)."""
    out = []
    for line in text.splitlines():
        for s in _SENTENCE.split(line.strip()):
            if low <= len(s.split()) <= high and s[-1:] in ".!?" and not re.search(r"[`{}<>|#*=_\\]", s):
                out.append(s)
    return out


def _param(kind: str, description: str, enum=None) -> dict:
    spec = {"type": kind, "description": description}
    return {**spec, "enum": list(enum)} if enum else spec


def _tool(name: str, description: str, required: dict, optional: dict | None = None) -> dict:
    return {
        "name": name,
        "description": description,
        "parameters": {"type": "dict", "properties": {**required, **(optional or {})}, "required": list(required)},
    }


CITIES = [
    "Lisbon",
    "Osaka",
    "Nairobi",
    "Denver",
    "Krakow",
    "Lima",
    "Perth",
    "Oslo",
    "Hanoi",
    "Austin",
    "Porto",
    "Quebec",
    "Seville",
    "Tbilisi",
]
CURRENCIES = ["USD", "EUR", "JPY", "GBP", "INR", "BRL", "CAD", "CHF"]
TOPICS = [
    "solar panels",
    "electric bikes",
    "sourdough bread",
    "chess openings",
    "home composting",
    "jazz piano",
    "rock climbing",
]
# (schema, requests): a request's {slots} are filled from SLOTS; each request needs exactly this tool.
TOOLS = (
    (
        _tool(
            "weather.forecast",
            "Daily weather forecast for a city.",
            {"city": _param("string", "City name."), "days": _param("integer", "Number of days, 1 to 10.")},
            {"unit": _param("string", "Temperature unit.", ["celsius", "fahrenheit"])},
        ),
        ("What will the weather be like in {city} over the next {small} days?", "Forecast for {city}, {small} days."),
    ),
    (
        _tool(
            "currency.convert",
            "Convert an amount of money between two currencies at today's rate.",
            {
                "amount": _param("float", "Amount to convert."),
                "from_currency": _param("string", "ISO code of the currency held."),
                "to_currency": _param("string", "ISO code of the currency wanted."),
            },
        ),
        ("How much is {amount} {cur1} in {cur2}?", "Convert {amount} {cur1} to {cur2} please."),
    ),
    (
        _tool(
            "geometry.circle_area",
            "Area of a circle.",
            {"radius": _param("float", "Radius of the circle.")},
            {"units": _param("string", "Length unit of the radius.")},
        ),
        ("What is the area of a circle with radius {small} cm?", "Find the area of a circle of radius {amount}."),
    ),
    (
        _tool(
            "math.gcd",
            "Greatest common divisor of two integers.",
            {"a": _param("integer", "First integer."), "b": _param("integer", "Second integer.")},
        ),
        ("What is the greatest common divisor of {big} and {big2}?", "gcd of {big} and {big2}?"),
    ),
    (
        _tool(
            "finance.compound_interest",
            "Final balance of a deposit with compound interest.",
            {
                "principal": _param("float", "Initial deposit."),
                "rate": _param("float", "Yearly interest rate as a fraction."),
                "years": _param("integer", "Number of years."),
            },
            {"compounds_per_year": _param("integer", "Compounding periods per year. Default 1.")},
        ),
        ("If I deposit ${big} at {pct}% a year for {small} years, what will I have?",),
    ),
    (
        _tool(
            "restaurants.search",
            "Find restaurants in a city by cuisine.",
            {"city": _param("string", "City to search."), "cuisine": _param("string", "Kind of food.")},
            {"max_price": _param("integer", "Highest price level, 1 to 4.")},
        ),
        ("Find me a {cuisine} restaurant in {city}.", "Any good {cuisine} places in {city}, not too expensive?"),
    ),
    (
        _tool(
            "flights.search",
            "Search flights between two cities on a date.",
            {
                "origin": _param("string", "Departure city."),
                "destination": _param("string", "Arrival city."),
                "date": _param("string", "Date as YYYY-MM-DD."),
            },
            {"passengers": _param("integer", "Number of passengers.")},
        ),
        ("Look for flights from {city} to {city2} on {date}.", "I need {small} seats from {city} to {city2}, {date}."),
    ),
    (
        _tool(
            "calendar.create_event",
            "Add an event to the user's calendar.",
            {
                "title": _param("string", "Event title."),
                "date": _param("string", "Date as YYYY-MM-DD."),
                "time": _param("string", "Start time as HH:MM."),
            },
            {"duration_minutes": _param("integer", "Length of the event.")},
        ),
        ("Put a meeting about {topic} on my calendar for {date} at {time}.",),
    ),
    (
        _tool(
            "stocks.price",
            "Latest price of a stock by ticker symbol.",
            {"ticker": _param("string", "Ticker symbol.")},
            {"exchange": _param("string", "Exchange code.")},
        ),
        ("What is {ticker} trading at right now?", "Get me the current price of {ticker}."),
    ),
    (
        _tool(
            "units.convert_length",
            "Convert a length between units.",
            {
                "value": _param("float", "Length to convert."),
                "from_unit": _param("string", "Unit of the value.", ["m", "km", "mi", "ft", "in"]),
                "to_unit": _param("string", "Unit wanted.", ["m", "km", "mi", "ft", "in"]),
            },
        ),
        ("How many feet is {amount} meters?", "Convert {small} miles to kilometers."),
    ),
    (
        _tool(
            "library.find_books",
            "Search a library catalogue by topic.",
            {"topic": _param("string", "Subject of the books.")},
            {"limit": _param("integer", "Most results to return.")},
        ),
        ("Find {small} books about {topic}.", "Which books does the library have on {topic}?"),
    ),
    (
        _tool(
            "physics.kinetic_energy",
            "Kinetic energy of a moving body.",
            {"mass": _param("float", "Mass in kg."), "velocity": _param("float", "Speed in m/s.")},
        ),
        ("What is the kinetic energy of a {small} kg ball moving at {big} m/s?",),
    ),
    (
        _tool(
            "email.send",
            "Send an email.",
            {
                "to": _param("string", "Recipient address."),
                "subject": _param("string", "Subject line."),
                "body": _param("string", "Message text."),
            },
        ),
        ("Email {person}@example.com that the {topic} workshop moved to {date}.",),
    ),
    (
        _tool(
            "statistics.mean",
            "Arithmetic mean of a list of numbers.",
            {"numbers": {"type": "array", "items": {"type": "float"}, "description": "The numbers."}},
        ),
        ("What's the average of {small}, {big}, {amount} and {big2}?",),
    ),
    (
        _tool(
            "translate.text",
            "Translate text into another language.",
            {"text": _param("string", "Text to translate."), "target_language": _param("string", "Language wanted.")},
        ),
        ("Translate 'see you at the {topic} class' into {lang}.",),
    ),
    (
        _tool(
            "timezone.convert",
            "Convert a local time from one city's time zone to another's.",
            {
                "time": _param("string", "Time as HH:MM."),
                "from_city": _param("string", "City of the given time."),
                "to_city": _param("string", "City whose local time is wanted."),
            },
        ),
        ("If it is {time} in {city}, what time is it in {city2}?",),
    ),
)
SLOTS = {
    "city": CITIES,
    "city2": CITIES,
    "small": [str(i) for i in range(2, 10)],
    "big": [str(i) for i in range(12, 400, 7)],
    "big2": [str(i) for i in range(18, 300, 11)],
    "amount": ["12.5", "40", "75.25", "150", "999", "3.2"],
    "cur1": CURRENCIES,
    "cur2": CURRENCIES,
    "pct": ["2", "3.5", "4", "5", "7"],
    "cuisine": ["Thai", "Ethiopian", "Mexican", "Lebanese", "Korean", "vegan", "Georgian"],
    "date": [f"2027-{m:02d}-{d:02d}" for m in (1, 3, 5, 8, 11) for d in (4, 12, 19, 27)],
    "time": ["08:30", "10:00", "13:15", "16:45", "19:00"],
    "topic": TOPICS,
    "ticker": ["AAPL", "MSFT", "NVDA", "TSLA", "AMZN", "SAP", "ASML"],
    "person": [n.lower() for n in NAMES],
    "lang": ["German", "Spanish", "Japanese", "Italian", "Portuguese"],
}


def _fill(template: str, rng: random.Random) -> str:
    values = {}
    for slot in re.findall(r"{(\w+)}", template):
        choices = [v for v in SLOTS[slot] if v not in values.values()]
        values[slot] = rng.choice(choices)
    return template.format(**values)


def tool_use_prompt(rng: random.Random) -> list[dict]:
    """Messages of one tool-use prompt: the tools shown in the system message as `hspec_jax.chat` shows them to a
    template without native tools, and a request needing one tool (or two, one after the other)."""
    shown = rng.sample(range(len(TOOLS)), rng.randint(1, 4))
    asked = rng.sample(shown, min(len(shown), rng.choice([1, 1, 2])))
    requests = [_fill(rng.choice(TOOLS[i][1]), rng) for i in asked]
    request = requests[0] if len(requests) == 1 else f"{requests[0]} Also, {requests[1][0].lower()}{requests[1][1:]}"
    tools = json.dumps([TOOLS[i][0] for i in shown])
    return [{"role": "system", "content": TOOLS_SYSTEM.format(tools=tools)}, {"role": "user", "content": request}]


def stdlib_functions(max_lines: int = 40, root: str | None = None) -> list[tuple[str, str, str]]:
    """(signature with docstring, whole source, source without its docstring) of the documented functions and
    methods of at most `max_lines` lines in the Python files under `root` (default: the standard library), tests
    and private names excluded, sorted by module path."""
    root = root or sysconfig.get_paths()["stdlib"]
    skip = re.compile(r"(^|/)(test|tests|idlelib|lib2to3|site-packages|turtledemo|ensurepip|tkinter)(/|$)")
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not skip.search(os.path.relpath(os.path.join(folder, d), root)))
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            try:
                with open(path, encoding="utf-8") as f:
                    source = f.read()
                tree = ast.parse(source)
            except (SyntaxError, UnicodeDecodeError, OSError):
                continue
            lines = source.splitlines()
            for node in ast.walk(tree):
                if not isinstance(node, ast.FunctionDef) or node.name.startswith("_") or node.decorator_list:
                    continue
                doc = ast.get_docstring(node, clean=False)
                if not doc or len(doc) < 40 or not 4 <= node.end_lineno - node.lineno < max_lines:
                    continue
                body = lines[node.lineno - 1 : node.end_lineno]
                indent = len(body[0]) - len(body[0].lstrip())
                body = [line[indent:] for line in body]
                first = node.body[0]
                head = body[: first.end_lineno - node.lineno + 1]
                rest = body[first.end_lineno - node.lineno + 1 :]
                signature = body[: first.lineno - node.lineno]
                found.append(("\n".join(head) + "\n", "\n".join(body) + "\n", "\n".join(signature + rest) + "\n"))
    return found


CODE_TASKS = (
    lambda head, full, bare: CODE_INSTRUCTION.format(prompt=head),
    lambda head, full, bare: CODE_INSTRUCTION.format(prompt=head),
    lambda head, full, bare: f"Explain what this Python function does.\n\n```python\n{full}```",
    lambda head, full, bare: f"Write a docstring for this function.\n\n```python\n{bare}```",
    lambda head, full, bare: f"Write pytest unit tests for the following function.\n\n```python\n{full}```",
)


class Pools:
    """The real texts the templates are filled with, read once: ShareGPT questions, first turns, passages and
    sentences by language (from conversations not in `exclude_ids`), and standard-library functions."""

    def __init__(self, exclude_ids: set[str], code_root: str | None = None):
        self.questions, self.first_turns, self.passages = [], [], []
        self.sentences = {code: [] for code in LANGUAGES}
        for record in sharegpt_records():
            messages = to_messages(record)
            if not messages or str(record.get("id")) in exclude_ids:
                continue
            users = user_texts(messages)
            if 8 <= len(users[0].split()) <= 150 and language(users[0]) == "en":
                self.first_turns.append(users[0])
            for m in messages:
                text, words = m["content"], len(m["content"].split())
                if language(text) == "en":  # a short English question is still a question
                    self.questions += [s for s in sentences(text, 6, 25) if _QUESTION.match(s)]
                code = language(text) if words >= 20 else None  # a language guess needs some words
                if m["role"] == "assistant" and code == "en" and 150 <= words <= 450 and "```" not in text:
                    self.passages.append(text)
                if code is not None and (code != "en" or m["role"] == "assistant"):
                    self.sentences[code] += sentences(text)
        self.functions = stdlib_functions(root=code_root)


def family_prompts(family: str, pools: Pools, rng: random.Random, held_out: bool = False) -> list[dict]:
    """Messages of one prompt of `family` (a held-out dialogue takes its second turn from `HELD_OUT_FOLLOW_UPS`)."""
    if family == "math":
        return [{"role": "user", "content": _math_problem(rng)}]
    if family == "qa":
        return [{"role": "user", "content": rng.choice(pools.questions)}]
    if family == "dialogue":
        return [
            {"role": "user", "content": rng.choice(pools.first_turns)},
            {"role": "user", "content": rng.choice(HELD_OUT_FOLLOW_UPS if held_out else FOLLOW_UPS)},
        ]
    if family == "rag":
        return [{"role": "user", "content": f"{rng.choice(pools.passages)}\n{rng.choice(QUESTIONS_ON_PASSAGE)}"}]
    if family == "summarization":
        return [{"role": "user", "content": rng.choice(SUMMARY_INSTRUCTIONS).format(text=rng.choice(pools.passages))}]
    if family == "translation":
        source = rng.choice([c for c in ("de", "de", "fr", "es", "en") if pools.sentences[c]])
        target = rng.choice(["de", "fr", "es"]) if source == "en" else "en"
        sentence = rng.choice(pools.sentences[source])
        return [{"role": "user", "content": f"Translate {LANGUAGES[source]} to {LANGUAGES[target]}: {sentence}"}]
    if family == "code":
        return [{"role": "user", "content": rng.choice(CODE_TASKS)(*rng.choice(pools.functions))}]
    if family == "tool_use":
        return tool_use_prompt(rng)
    raise ValueError(f"unknown family {family!r}; choose from {', '.join(TASKS)}")


def normalized_turns(messages: list[dict]) -> tuple[str, ...]:
    """The user turns of a prompt's messages after `normalize_text`, in order: what makes two prompts the same."""
    return tuple(normalize_text(t) for t in user_texts(messages))


def build(
    family: str, pools: Pools, count: int, seed: int, held_out: int, reserved: frozenset = frozenset()
) -> tuple[list[dict], list[dict]]:
    """(training prompts, held-out prompts) of `family`: `held_out` then `count` prompts, no two sharing a user turn
    (after `normalize_text`) across the two sets nor repeating one within a set, no training prompt with a user turn
    in `reserved` (other families' held-out turns, `held_out_turns`), ids `task-<family>-<seed>-<n>`; fewer when the
    family's pool runs out (20 times as many draws as wanted adding nothing; the held-out prompts, drawn first, stop
    at 20 times their number, so they are the same whatever `count` is)."""
    rng = random.Random(f"{family}-{seed}")
    held, seen, records, misses = set(), set(), [], 0
    while len(records) < held_out + count:
        is_held_out = len(records) < held_out
        if misses >= 20 * (held_out if is_held_out else held_out + count):
            break
        messages = family_prompts(family, pools, rng, held_out=is_held_out)
        key = normalized_turns(messages)
        turns = set(key)
        if key in seen or (not is_held_out and (turns & held or turns & reserved)):
            misses += 1
            continue
        seen.add(key)
        if is_held_out:
            held.update(turns)
        records.append({"id": f"task-{family}-{seed}-{len(records)}", "messages": messages})
    return records[held_out:], records[:held_out]


def held_out_turns(pools: Pools, seed: int, held_out: int) -> frozenset:
    """The normalised user turns of every family's held-out prompts (a family's held-out set is its first draws, so
    it is the same whichever families are built), which no family's training prompt may contain."""
    return frozenset(
        turn
        for family in TASKS
        for record in build(family, pools, 0, seed, held_out)[1]
        for turn in normalized_turns(record["messages"])
    )


def excluded_ids(paths) -> set[str]:
    """The ids of the records of JSONL files (missing files are skipped)."""
    ids = set()
    for path in paths:
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                ids |= {str(json.loads(line)["id"]) for line in f if line.strip()}
    return ids


def parse_args(argv=None) -> argparse.Namespace:
    parser = ArgumentParser(prog="python -m train.task_prompts", description=__doc__.split("\n")[0])
    parser.add_argument("--out-dir", required=True, help="folder for <family>.jsonl and <family>_heldout.jsonl")
    parser.add_argument("--per-family", type=positive_int, default=3000, help="training prompts per family")
    parser.add_argument("--held-out", type=non_negative_int, default=40, help="held-out prompts per family")
    parser.add_argument("--families", default=",".join(TASKS), help="comma-separated families (default all)")
    parser.add_argument("--seed", type=non_negative_int, default=0)
    parser.add_argument(
        "--exclude", nargs="*", default=list(DEFAULT_EXCLUDE), help="JSONL files whose record ids are not reused"
    )
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    families = [f.strip() for f in args.families.split(",")]
    unknown = [f for f in families if f not in TASKS]
    if unknown:
        raise ValueError(f"unknown families {unknown}; choose from {', '.join(TASKS)}")
    pools = Pools(excluded_ids(args.exclude))
    reserved = held_out_turns(pools, args.seed, args.held_out)
    os.makedirs(args.out_dir, exist_ok=True)
    for family in families:
        training, held_out = build(family, pools, args.per_family, args.seed, args.held_out, reserved)
        parts = {f"{family}_heldout.jsonl": held_out, f"{family}.jsonl": training}
        for name, part in parts.items():
            with open(os.path.join(args.out_dir, name), "w", encoding="utf-8") as f:
                f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in part)
        print(f"{family}: {len(parts[f'{family}.jsonl'])} training, {len(parts[f'{family}_heldout.jsonl'])} held out")
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
