"""What a drafter's slot-1 agreement must beat: n-gram models of the training data on the held-out conversations.

    python -m benchmarks.ngram_baseline [--recipe configs/smollm2.py] [--out benchmarks/results/ngram_baseline.md]

A drafter's first draft slot predicts the token after the anchor (the token the target just produced). The n-gram
models here predict that same token from the anchor alone (bigram) or from the anchor and the token before it
(trigram, backing off to the bigram, then to the most frequent token), counted over the supervised (assistant)
transitions of the recipe's training mix and scored on its held-out conversations (`data.held_out`), both
tokenized as `train.main` tokenizes them; training conversations that share a user turn with the held-out set are
left out, as in training. A drafter whose held-out slot-1 agreement (`heldout_acc_1` in `metrics.jsonl`) is not
well above these numbers uses little of what the target's hidden states and KV cache tell it.
"""

from __future__ import annotations

import argparse
import collections
import os

from benchmarks.common import write_report
from hspec_jax.chat import tokenize_conversation
from hspec_jax.checkpoints import load_tokenizer
from hspec_jax.machine import cpu_model
from hspec_jax.recipes import load_config
from train.data import Source, exclude_held_out, load_conversations, load_mixture


def transitions(tokenizer, conversations):
    """Per conversation, (previous, anchor, next) token triples at every supervised next token (anchor index >= 1)."""
    for conversation in conversations:
        ids, mask = tokenize_conversation(tokenizer, conversation.messages)
        ids = ids.tolist()
        yield [(ids[p - 1], ids[p], ids[p + 1]) for p in range(1, len(ids) - 1) if mask[p + 1]]


def fit(rows):
    """(trigram, bigram, unigram) argmax tables from training triples."""
    tri, bi = collections.defaultdict(collections.Counter), collections.defaultdict(collections.Counter)
    counts = collections.Counter()
    for triples in rows:
        for prev, anchor, nxt in triples:
            tri[(prev, anchor)][nxt] += 1
            bi[anchor][nxt] += 1
            counts[nxt] += 1
    best = lambda table: {key: c.most_common(1)[0][0] for key, c in table.items()}
    return best(tri), best(bi), counts.most_common(1)[0][0]


def score(tables, rows) -> dict:
    """Held-out agreement of each model and the number of scored positions."""
    tri, bi, uni = tables
    hits = collections.Counter()
    n = 0
    for triples in rows:
        for prev, anchor, nxt in triples:
            n += 1
            bigram = bi.get(anchor, uni)
            hits["unigram"] += uni == nxt
            hits["bigram"] += bigram == nxt
            hits["trigram"] += tri.get((prev, anchor), bigram) == nxt
    return {"positions": n, **{name: hits[name] / max(n, 1) for name in ("unigram", "bigram", "trigram")}}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", default="configs/smollm2.py", help="its data.sources, data.held_out and target")
    parser.add_argument("--out", default="benchmarks/results/ngram_baseline.md")
    args = parser.parse_args(argv)
    recipe = load_config(args.recipe)
    if not recipe.data.held_out:
        parser.error(f"{args.recipe} has no data.held_out file to score on")
    tokenizer = load_tokenizer(recipe.target.path)
    held_out = load_conversations(Source("held_out", recipe.data.held_out))
    loaded = exclude_held_out(load_mixture(recipe.data.sources), held_out)
    train_rows = list(transitions(tokenizer, [c for s in loaded for c in s.conversations]))
    result = score(fit(train_rows), transitions(tokenizer, held_out))
    trained_on = sum(len(r) for r in train_rows)
    here = lambda text: text.replace(os.getcwd() + os.sep, "")  # the recipe's data paths, relative to the clone
    lines = [
        "# N-gram baselines for slot-1 agreement on the held-out conversations",
        "",
        f"Machine: {cpu_model()}, {os.cpu_count()} cores (counting only; no timing).",
        f"Command: `python -m benchmarks.ngram_baseline --recipe {args.recipe}`",
        "",
        f"Training mix: `{here(recipe.data.sources)}` ({sum(len(s.conversations) for s in loaded)} conversations, "
        f"{trained_on} supervised transitions); held out: `{here(recipe.data.held_out)}` "
        f"({len(held_out)} conversations, {result['positions']} scored positions).",
        "",
        "| model | held-out agreement on the token after the anchor |",
        "|---|---|",
        f"| most frequent token | {result['unigram']:.3f} |",
        f"| bigram (anchor) | {result['bigram']:.3f} |",
        f"| trigram (token before the anchor, anchor), backing off | {result['trigram']:.3f} |",
    ]
    write_report(args.out, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
