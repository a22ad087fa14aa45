"""The record of target-written data files: the rows of data/README.md's tables, and the committed parts of a
growing generation.

    python -m train.data_table data/smollm2_tasks_heldout.jsonl data/smollm2_tasks_v1_part*.jsonl
    python -m train.data_table --split runs/tasks_v1.jsonl --prefix data/smollm2_tasks_v1_part --part-size 2000

Without `--split`: one Markdown row per file (conversations, conversations per source, user / assistant tokens by
the target's tokenizer on each message's text without special tokens, answers ended by EOS, bytes, sha256), and
a total row of assistant tokens per source with its share. With `--split`: a long generation's output cut into
parts of `--part-size` records (`<prefix>00.jsonl`, `<prefix>01.jsonl`, ...), lines copied verbatim, so that it
can be committed as it grows (a part, once full, never changes) and restored for the job to resume
(`cat <prefix>*.jsonl > out.jsonl`).
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import sys

from train.jsonl import jsonl_lines


def file_stats(path: str, count_tokens) -> dict:
    """Counts of one JSONL file of conversations: records, per source, user / assistant tokens
    (`count_tokens(text) -> int`), per-source assistant tokens, answers ended by EOS, bytes and sha256."""
    with open(path, "rb") as f:
        raw = f.read()
    records = [json.loads(line) for line in jsonl_lines(raw.decode("utf-8"))]
    sources, assistant_by_source = collections.Counter(), collections.Counter()
    user = assistant = complete = 0
    for record in records:
        sources[record["source"]] += 1
        complete += bool(record.get("complete"))
        for message in record["messages"]:
            n = count_tokens(message["content"])
            if message["role"] == "assistant":
                assistant += n
                assistant_by_source[record["source"]] += n
            elif message["role"] == "user":
                user += n
    return {
        "name": os.path.basename(path),
        "conversations": len(records),
        "sources": dict(sorted(sources.items())),
        "user_tokens": user,
        "assistant_tokens": assistant,
        "assistant_by_source": dict(sorted(assistant_by_source.items())),
        "complete": complete,
        "bytes": len(raw),
        "sha256": hashlib.sha256(raw).hexdigest(),
    }


def table(stats: list[dict]) -> list[str]:
    """Markdown rows of `file_stats` results, then the per-source share of assistant tokens over all of them."""
    lines = [
        "| file | conversations | per source | user / assistant tokens | ended by EOS | bytes | sha256 |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in stats:
        per_source = ", ".join(f"{name} {n}" for name, n in s["sources"].items())
        lines.append(
            f"| `{s['name']}` | {s['conversations']:,} | {per_source} | {s['user_tokens']:,} / "
            f"{s['assistant_tokens']:,} | {s['complete']:,} | {s['bytes']:,} | `{s['sha256']}` |"
        )
    total = collections.Counter()
    for s in stats:
        total.update(s["assistant_by_source"])
    whole = sum(total.values()) or 1
    shares = ", ".join(f"{name} {n:,} ({n / whole:.1%})" for name, n in sorted(total.items()))
    conversations = sum(s["conversations"] for s in stats)
    lines += ["", f"Together: {conversations:,} conversations, {whole:,} assistant tokens: {shares}."]
    return lines


def split(path: str, prefix: str, part_size: int) -> list[str]:
    """Cut `path` into parts of `part_size` records, `<prefix>NN.jsonl`, lines verbatim; the parts written."""
    with open(path, encoding="utf-8") as f:
        lines = jsonl_lines(f.read())
    written = []
    for i in range(0, len(lines), part_size):
        name = f"{prefix}{i // part_size:02d}.jsonl"
        with open(name, "w", encoding="utf-8") as out:
            out.write("".join(line + "\n" for line in lines[i : i + part_size]))
        written.append(name)
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.data_table", description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="*", help="JSONL files of conversations to describe")
    parser.add_argument("--target", default="smollm2", help="whose tokenizer counts the tokens")
    parser.add_argument("--split", help="a generation's output file to cut into parts")
    parser.add_argument("--prefix", help="with --split: the parts' path prefix")
    parser.add_argument("--part-size", type=int, default=2000, help="with --split: records per part")
    args = parser.parse_args(argv)
    if args.split:
        if not args.prefix or args.part_size < 1:
            parser.error("--split needs --prefix and a positive --part-size")
        print("\n".join(split(args.split, args.prefix, args.part_size)))
        return 0
    if not args.files:
        parser.error("name the files to describe (or --split)")
    from hspec_jax.checkpoints import load_tokenizer

    tokenizer = load_tokenizer(args.target)
    count = lambda text: len(tokenizer.encode(text, add_special_tokens=False))
    print("\n".join(table([file_stats(path, count) for path in args.files])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
