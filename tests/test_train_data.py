"""Training data: sources and their spec, evaluation-prompt exclusion, chat loss masks, the character tokenizer,
the Grain pipeline (packing, anchors, exact resume, process shards) and the draft vocabulary from counts."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hspec_jax.chat import tokenize_conversation
from hspec_jax.drafters import build_draft_vocab, draft_vocab_from_counts
from train.chat import normalize_text, to_messages
from train.data import (
    Conversation,
    LoadedSource,
    Source,
    exclude_eval_prompts,
    load_conversations,
    load_mixture,
    parse_sources,
    recover_json_array,
    sharegpt_records,
)
from train.jsonl import JsonlAppender
from train.pipeline import (
    BATCH_KEYS,
    anchor_candidates,
    document,
    make_train_iterator,
    supervised_token_counts,
)
from train.tokenizers import char_tokenizer

TINY = dict(seq_len=96, batch_size=4, max_anchors=8, block_size=4)


@pytest.fixture(scope="module")
def chars():
    return char_tokenizer()


def chat(i: int, turns: int = 1, tag: str = "q") -> Conversation:
    """A distinct small conversation (contents depend on i and start with `tag`)."""
    messages = []
    for t in range(turns):
        messages += [
            {"role": "user", "content": f"{tag}{i}.{t} " + "x" * (i % 5)},
            {"role": "assistant", "content": f"a{i}.{t} " + "y" * (i % 11)},
        ]
    return Conversation(str(i), "test", messages)


def test_normalize_text():
    assert normalize_text("  Hello,\n\t World!! ") == "hello, world"
    assert normalize_text("ＨＥＬＬＯ  world") == "hello world"  # NFKC folds full-width letters
    assert normalize_text("«Straße?»") == "strasse"  # casefold; quotes are punctuation edges
    assert normalize_text("...") == ""


def test_to_messages_forms_and_cleaning():
    sharegpt = {"conversations": [{"from": "gpt", "value": "orphan"}, {"from": "human", "value": "hi"}]}
    sharegpt["conversations"] += [{"from": "gpt", "value": "hello"}, {"from": "bing", "value": " "}]
    assert to_messages(sharegpt) == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    openai = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "u"}]}
    assert to_messages(openai) == openai["messages"]
    assert to_messages({"messages": [{"role": "assistant", "content": "no user"}]}) is None
    with pytest.raises(ValueError, match="neither"):
        to_messages({"text": "x"})


def test_parse_sources_grammar_and_errors():
    sources = parse_sources("sharegpt:0.6, synth=/d/magpie.jsonl:0.4,/d/chat.parquet,hf:org/set@train_sft:2")
    assert sources == [
        Source("sharegpt", "sharegpt", 0.6),
        Source("synth", "/d/magpie.jsonl", 0.4),
        Source("chat", "/d/chat.parquet", 1.0),
        Source("set", "hf:org/set@train_sft", 2.0),
    ]
    for spec, message in [
        ("", "empty"),
        ("sharegpt,,a.json", "empty entry"),
        ("sharegpt:0", "positive"),
        ("sharegpt:-1", "positive"),
        ("data.csv", "not 'sharegpt'"),
        ("a b=x.json", "source name"),
        ("a.json,a.jsonl", "distinct"),
        ("hf:bad name", "hf:OWNER"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_sources(spec)


def test_recover_json_array_cut_anywhere():
    records = [{"id": i, "text": "é" * i} for i in range(4)]
    data = json.dumps(records, indent=2, ensure_ascii=False).encode()
    assert recover_json_array(data) == (records, 0)
    cut = data[: data.index(b'"id": 3')]  # inside the fourth record
    got, dropped = recover_json_array(cut)
    assert got == records[:3]
    assert cut[: len(cut) - dropped].rstrip().endswith(b"}") and dropped > 0


def test_sharegpt_package_records():
    records = sharegpt_records()
    assert len(records) == 17671
    assert all("conversations" in r and "id" in r for r in records[:100] + records[-100:])


@pytest.mark.parametrize("fmt", ["json", "jsonl", "parquet"])
def test_local_files_json_jsonl_and_parquet(tmp_path, fmt):
    records = [
        {"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "no user turn"}]},
    ]
    path = tmp_path / f"chats.{fmt}"
    if fmt == "json":
        path.write_text(json.dumps(records))
    elif fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(records), path)
    (source,) = parse_sources(f"mine={path}:2")
    assert load_conversations(source) == [
        Conversation("a", "mine", [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])
    ]


def test_load_mixture_weights_and_exclusion(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": chat(i).messages}) + "\n" for i in range(5)))
    (loaded,) = load_mixture(f"{path}:0.5", exclude_texts=["q3.0 xxx"])
    assert loaded.source == Source("chats", str(path), 0.5) and loaded.num_excluded == 1
    assert [c.id for c in loaded.conversations] == ["chats:0", "chats:1", "chats:2", "chats:4"]


def test_exclude_eval_prompts():
    conversations = [chat(0), chat(1, turns=2), chat(2)]
    texts = ["  Q1.1 X ", "unrelated prompt"]  # matches the second user turn of chat(1) after normalisation
    kept, dropped = exclude_eval_prompts(conversations, texts)
    assert [c.id for c in kept] == ["0", "2"] and dropped == 1


def assert_assistant_supervision(tokenizer, messages, end_of_turn_text):
    ids, mask = tokenize_conversation(tokenizer, messages)
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(messages, tokenize=False)
    spans = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(int), [0]])))
    got = [tokenizer.decode(ids[a:b]) for a, b in zip(spans[::2], spans[1::2], strict=True)]
    assert got == [m["content"] + end_of_turn_text for m in messages if m["role"] == "assistant"]
    return ids, mask


MULTI_TURN = [
    {"role": "user", "content": "Name a prime."},
    {"role": "assistant", "content": "7 is prime.\n\n  Also 11."},
    {"role": "user", "content": "And an even one?"},
    {"role": "assistant", "content": " 2, the only one."},
]


def test_char_tokenizer_fits_tiny_and_masks(chars):
    from configs.tiny import get_config

    tiny = get_config()
    assert len(chars) == 96 == tiny.target.hf_config["vocab_size"]
    assert (chars.bos_token_id, chars.eos_token_id) == (tiny.target.hf_config["bos_token_id"], 2)
    assert chars.mask_token_id == tiny.drafter.mask_token_id == 3 and chars.pad_token_id == 2
    text = "Hi!\n  (x + y) = {z} ~ é"
    ids = chars(text, add_special_tokens=False)["input_ids"]
    assert max(ids) < 96 and len(ids) == len(text) and ids.count(chars.unk_token_id) == 2
    ids, mask = assert_assistant_supervision(chars, MULTI_TURN, "<|im_end|>")
    assert ids.max() < 96 and ids[np.flatnonzero(mask)[-1] + 1] == chars.convert_tokens_to_ids("\n")


@pytest.mark.slow
def test_smollm2_loss_mask(smollm2_tokenizer):
    """Supervised: each assistant content + <|im_end|>; not the template's newline after it nor any prompt."""
    tok = smollm2_tokenizer
    ids, mask = assert_assistant_supervision(tok, MULTI_TURN, "<|im_end|>")
    newline = tok.encode("\n", add_special_tokens=False)
    assert ids[-1] == newline[-1] and not mask[-1] and ids[-2] == tok.eos_token_id and mask[-2]
    system = [{"role": "system", "content": "Be brief."}, *MULTI_TURN[:2]]
    assert_assistant_supervision(tok, system, "<|im_end|>")


def batches(iterator, n):
    return [next(iterator) for _ in range(n)]


def test_pipeline_batches_packing_and_anchors(chars):
    conversations = [chat(i, turns=1 + i % 2) for i in range(40)]
    documents = {tuple(document(chars, c.messages, TINY["seq_len"])["tokens"]) for c in conversations}
    it = make_train_iterator(conversations, chars, seed=3, process_index=0, process_count=1, **TINY)
    for batch in batches(it, 5):
        assert sorted(batch) == sorted(BATCH_KEYS)
        assert batch["tokens"].shape == batch["doc_ids"].shape == (4, 96) and batch["anchors"].shape == (4, 8)
        assert batch["tokens"].dtype == batch["positions"].dtype == batch["anchors"].dtype == np.int32
        assert batch["loss_mask"].dtype == batch["anchor_valid"].dtype == bool
        for row in range(4):
            doc, pos, mask = batch["doc_ids"][row], batch["positions"][row], batch["loss_mask"][row]
            pad = doc < 0
            assert np.all(batch["tokens"][row][pad] == chars.pad_token_id)
            assert not mask[pad].any() and not pos[pad].any()
            for d in np.unique(doc[~pad]):
                where = np.flatnonzero(doc == d)
                assert np.array_equal(where, np.arange(where[0], where[-1] + 1))  # contiguous
                assert np.array_equal(pos[where], np.arange(len(where)))
                assert tuple(batch["tokens"][row][where]) in documents  # exactly one whole document
            anchors, valid = batch["anchors"][row], batch["anchor_valid"][row]
            candidates = set(anchor_candidates(mask, doc, TINY["block_size"]).tolist())
            chosen = anchors[valid]
            assert np.all(np.diff(chosen) > 0) and set(chosen.tolist()) <= candidates
            assert valid.sum() == min(8, len(candidates)) and np.all(anchors[~valid] == 0)
            assert np.all(valid[: valid.sum()])
            for a in chosen:
                assert a >= 1 and a < 96 - TINY["block_size"] and mask[a] and mask[a + 1] and doc[a] == doc[a + 1]
                assert doc[a - 1] == doc[a]  # the seed row a - 1 is in the anchor's document


def test_anchor_candidates_rules():
    mask = np.array([1, 1, 1, 0, 1, 1, 1, 1, 1, 1], bool)
    doc = np.array([0, 0, 0, 0, 1, 1, 1, 2, 2, -1])
    # index 0 excluded, 2 (next unsupervised), 4 (first token of its document: the seed row 3 is in another
    # document), 6 (next in another document), >= 10 - 3 excluded.
    assert anchor_candidates(mask, doc, block_size=3).tolist() == [1, 5]


def test_held_out_batches_are_the_same_whatever_the_training_seed(chars):
    """`train.loop.fixed_batches` packs the held-out conversations with a fixed seed: runs that draw their training
    data in another order (`data.seed`) measure the same held-out rows, while their training streams differ."""
    import ml_collections

    from hspec_jax.parallel import make_mesh
    from train.loop import fixed_batches, recipe_iterator

    conversations = [chat(i, turns=1 + i % 2) for i in range(30)]
    mesh = make_mesh("data=1,model=1")

    def recipe(seed):
        data = dict(seq_len=TINY["seq_len"], max_anchors=TINY["max_anchors"], seed=seed, held_out_batches=3)
        return ml_collections.ConfigDict({"data": data, "train": {"batch_size": TINY["batch_size"]}})

    held_out = [fixed_batches(conversations, chars, recipe(seed), TINY["block_size"], mesh) for seed in (0, 1)]
    for a, b in zip(*held_out, strict=True):
        for key in BATCH_KEYS:
            np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]))
    streams = [batches(recipe_iterator(conversations, chars, recipe(seed), TINY["block_size"]), 3) for seed in (0, 1)]
    assert not all(np.array_equal(a["tokens"], b["tokens"]) for a, b in zip(*streams, strict=True))


def test_pipeline_resume_determinism_and_shards(chars):
    conversations = [chat(i) for i in range(30)]
    kw = dict(process_index=0, process_count=1, **TINY)
    it = make_train_iterator(conversations, chars, seed=5, **kw)
    batches(it, 3)
    state = json.loads(json.dumps(it.get_state()))  # JSON round trip, as the Orbax handler stores it
    expected = batches(it, 12)  # past the end of the first epoch (30 documents)
    restored = make_train_iterator(conversations, chars, seed=5, **kw)
    restored.set_state(state)
    for a, b in zip(expected, batches(restored, 12), strict=True):
        for key in BATCH_KEYS:
            np.testing.assert_array_equal(a[key], b[key])
    fresh = batches(make_train_iterator(conversations, chars, seed=5, **kw), 4)
    other = batches(make_train_iterator(conversations, chars, seed=6, **kw), 4)
    again = batches(make_train_iterator(conversations, chars, seed=5, **kw), 4)
    assert all(np.array_equal(a["tokens"], b["tokens"]) for a, b in zip(fresh, again, strict=True))
    assert not all(np.array_equal(a["tokens"], b["tokens"]) for a, b in zip(fresh, other, strict=True))
    shards = [
        batches(make_train_iterator(conversations, chars, seed=5, **{**kw, "process_index": p, "process_count": 2}), 4)
        for p in range(2)
    ]
    for whole, first, second in zip(fresh, *shards, strict=True):
        for key in BATCH_KEYS:
            np.testing.assert_array_equal(whole[key], np.concatenate([first[key], second[key]]))


def test_pipeline_epochs_and_mixture(chars):
    conversations = [chat(i) for i in range(24)]
    seen = []
    for batch in make_train_iterator(conversations, chars, num_epochs=1, process_index=0, process_count=1, **TINY):
        seen += [tuple(batch["tokens"][r][batch["doc_ids"][r] == d]) for r in range(4) for d in range(8)]
    seen = [s for s in seen if s]
    assert len(seen) == len(set(seen)) and len(seen) > 12  # one pass: nothing twice, the last partial batch dropped
    a = LoadedSource(Source("a", "memory", 3.0), [chat(i) for i in range(10)], 0)
    b = LoadedSource(Source("b", "memory", 1.0), [chat(i, tag="B") for i in range(10)], 0)
    it = make_train_iterator([a, b], chars, process_index=0, process_count=1, **TINY)
    users = [
        chars.decode(batch["tokens"][r][batch["doc_ids"][r] == d])
        for batch in batches(it, 10)
        for r in range(4)
        for d in range(8)
    ]
    from_a, from_b = sum("user\nq" in u for u in users), sum("user\nB" in u for u in users)
    assert from_a + from_b == sum(bool(u) for u in users) > 60
    assert 2.5 < from_a / from_b < 3.5


def test_supervised_counts_feed_draft_vocab(chars):
    conversations = [chat(i, turns=2) for i in range(12)]
    counts = supervised_token_counts(conversations, chars, 96)
    pairs = [tokenize_conversation(chars, c.messages) for c in conversations]
    stream = np.concatenate([ids[mask] for ids, mask in pairs])
    np.testing.assert_array_equal(counts, np.bincount(stream, minlength=96))
    assert counts[chars.eos_token_id] == 24  # one end-of-turn per assistant turn
    vocab = draft_vocab_from_counts(counts, 20, always=(2,))
    expected = build_draft_vocab(stream, 96, 20, always=(2,))
    np.testing.assert_array_equal(vocab.d2t, expected.d2t)


def test_jsonl_appender_cuts_partial_line(tmp_path):
    path = str(tmp_path / "out.jsonl")
    with JsonlAppender(path) as out:
        out.append([{"id": 1}, {"id": 2}])
    with open(path, "ab") as f:
        f.write(b'{"id": 3, "mess')  # a write cut by kill -9
    with JsonlAppender(path) as out:
        assert out.records == [{"id": 1}, {"id": 2}] and out.cut_bytes == 15
        out.append([{"id": 3}])
    with open(path) as f:
        assert [json.loads(line) for line in f] == [{"id": 1}, {"id": 2}, {"id": 3}]


def test_jsonl_readers_keep_unicode_line_separators_inside_strings(tmp_path):
    """U+2028, U+2029 and U+0085 stay unescaped in a record the appender writes; both readers keep it whole."""
    path = str(tmp_path / "out.jsonl")
    record = {
        "id": "s",
        "messages": [{"role": "user", "content": "a\u2028b\u2029c\x85d"}, {"role": "assistant", "content": "e"}],
    }
    with JsonlAppender(path) as out:
        out.append([record])
    with JsonlAppender(path) as out:
        assert out.records == [record]
    (source,) = parse_sources(path)
    assert [c.messages for c in load_conversations(source)] == [record["messages"]]


def run_tool(module: str, *args: str):
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.getcwd(), "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, "-m", module, *args], env=env, stderr=subprocess.PIPE, text=True)


def read_jsonl(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_regenerate_resumes_after_kill(tmp_path):
    """kill -9 mid-run, then a partial last line on top: the rerun keeps what was written, cuts the partial line,
    and answers every remaining conversation exactly once, turn by turn."""
    import signal
    import time

    source = tmp_path / "chats.jsonl"
    # Short prompts (one shape bucket, one compile), and enough of them that the run cannot end between two polls
    # even on a loaded machine (with 9 it sometimes finished before the kill).
    count = 200
    asked = {i: [f"u{i}", f"v{i}"] for i in range(count)}
    lines = [
        {
            "id": f"c{i}",
            "messages": [{"role": r, "content": t} for u in asked[i] for r, t in (("user", u), ("assistant", "x"))],
        }
        for i in range(count)
    ]
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "regen.jsonl"
    args = ["--target", "tiny", "--sources", f"mine={source}", "--out", str(out), "--batch-size", "2"]
    args += ["--max-new-tokens", "4", "--max-turns", "2", "--shuffle"]
    first = run_tool("train.regenerate", *args)
    deadline = time.time() + 120
    while not (out.exists() and out.read_text().count("\n") >= 2) and first.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    first.send_signal(signal.SIGKILL)
    first.wait()
    written = read_jsonl(out)
    assert 2 <= len(written) < count
    with open(out, "ab") as f:
        f.write(b'{"id": "c8", "source": "mi')
    from train.regenerate import main

    assert main(args) == 0
    records = read_jsonl(out)
    assert records[: len(written)] == written
    assert sorted(r["id"] for r in records) == sorted(f"c{i}" for i in range(count))
    for r in records:
        i = int(r["id"][1:])
        assert [m["role"] for m in r["messages"]] == ["user", "assistant"] * 2
        assert [m["content"] for m in r["messages"][::2]] == asked[i]
        assert r["source"] == "mine" and isinstance(r["complete"], bool)


def test_synthesize_dedup_min_length_and_resume(tmp_path):
    from train.synthesize import accepted, main, user_turn_prefix

    seen = {"hello"}
    assert accepted(["Hello!", "a new one", "A  NEW one.", "tiny", "another"], seen, min_length=5) == [
        "a new one",
        "another",
    ]
    assert user_turn_prefix(char_tokenizer()) == char_tokenizer()("<|im_start|>user\n")["input_ids"]
    out = tmp_path / "synth.jsonl"
    args = ["--target", "tiny", "--out", str(out), "--batch-size", "8", "--max-new-tokens", "32", "--min-length", "3"]
    assert main([*args, "--num", "4"]) == 0
    first = read_jsonl(out)
    with open(out, "ab") as f:
        f.write(b'{"id": "synth-0-4", "mess')
    assert main([*args, "--num", "9"]) == 0
    records = read_jsonl(out)
    assert records[:4] == first and [r["id"] for r in records] == [f"synth-0-{i}" for i in range(9)]
    texts = [r["messages"][0]["content"] for r in records]
    assert len({normalize_text(t) for t in texts}) == 9 and min(len(t) for t in texts) >= 3


def test_regenerate_skips_repeated_prompts():
    from train.regenerate import new_prompts

    conversations = [chat(0, turns=2), chat(1), chat(2)]
    conversations.append(Conversation("3", "test", [{"role": "user", "content": " Q1.0  X!"}]))  # repeats chat(1)
    conversations.append(Conversation("4", "test", chat(0, turns=2).messages[:2]))  # chat(0)'s first turn only
    records = [{"id": "2", "messages": chat(2).messages}]
    todo, repeats = new_prompts(conversations, records, max_turns=None)
    assert [c.id for c in todo] == ["0", "1", "4"] and repeats == 1
    todo, repeats = new_prompts(conversations, records, max_turns=1)
    assert [c.id for c in todo] == ["0", "1"] and repeats == 2


def test_committed_smollm2_data_matches_its_record_and_holds_no_evaluation_prompt():
    """The files of the SmolLM2 training mix and its held-out set (configs/smollm2.py) are recorded in
    data/README.md (conversation count, sha256), each a user turn answered by the target, with no evaluation prompt
    in them; the ShareGPT file holds the 64 held-out conversations (the held-out set was cut from its run), and
    those, and only those, are dropped from training."""
    import os
    import re

    from hspec_jax.recipes import load_config
    from train.data import evaluation_texts, exclude_held_out, source_fingerprint

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "data", "README.md")) as f:
        rows = re.findall(r"^\| `([\w.]+\.jsonl)` \| ([\d,]+) \|.*\| `([0-9a-f]{64})` \|$", f.read(), re.MULTILINE)
    recorded = {name: (int(count.replace(",", "")), sha) for name, count, sha in rows}
    config = load_config("smollm2")
    training = parse_sources(config.data.sources)
    held_out = Source("held_out", config.data.held_out)
    assert all(s.location != "sharegpt" for s in training)  # target-written text only
    assert {os.path.basename(s.location) for s in [*training, held_out]} <= set(recorded)
    texts = evaluation_texts()
    assert len(texts) > 400
    loaded = []
    for source in [*training, held_out]:
        count, sha = recorded[os.path.basename(source.location)]
        assert source_fingerprint(source)["sha256"] == sha
        conversations = load_conversations(source)
        assert len(conversations) == count
        roles = {tuple(m["role"] for m in c.messages if m["role"] != "system") for c in conversations}
        assert roles == {("user", "assistant")}
        assert exclude_eval_prompts(conversations, texts)[1] == 0
        loaded.append(LoadedSource(source, conversations, 0))
    held_out_ids = {c.id for c in loaded[-1].conversations}
    assert len(held_out_ids) >= 64
    contains = [len(held_out_ids & {c.id for c in s.conversations}) for s in loaded[:-1]]
    assert sorted(contains) == [0, len(held_out_ids)]  # all of them in the ShareGPT file, none in Magpie's
    assert [s.num_held_out for s in exclude_held_out(loaded[:-1], loaded[-1].conversations)] == contains


def test_training_conversations_sharing_a_user_turn_with_the_held_out_set_are_dropped():
    from train.data import exclude_held_out

    first = LoadedSource(Source("a", "memory"), [chat(0), chat(1, turns=2), chat(2)], 0)
    second = LoadedSource(Source("b", "memory"), [chat(3), chat(4)], 0)
    held_out = [Conversation("h", "held_out", [{"role": "user", "content": " Q1.1 X!"}]), chat(4)]
    a, b = exclude_held_out([first, second], held_out)  # chat(1)'s second turn and chat(4) are held out
    assert [c.id for c in a.conversations] == ["0", "2"] and a.num_held_out == 1
    assert [c.id for c in b.conversations] == ["3"] and b.num_held_out == 1
    with pytest.raises(ValueError, match="data source 'b' has no conversation left beside the held-out set"):
        exclude_held_out([second], [chat(3), chat(4)])


def test_near_duplicates_drop_reworded_prompts_and_keep_distinct_ones():
    from train.dedup import NearDuplicates, jaccard, shingles

    index = NearDuplicates(threshold=0.7)
    base = "Write a detailed essay about the history of the Roman empire and its fall in the fifth century"
    assert index.add(base)
    assert not index.add(base.upper() + "!!")  # the same words after normalisation
    assert not index.add(base.replace("century", "centuries"))  # the last word changed: Jaccard 15/17
    assert index.seen(base + " please") and not index.seen("Explain how photosynthesis works in plants")
    assert index.add("Write a detailed essay about the history of the Ottoman empire and its rise to power")
    assert index.add("Continue") and not index.add("continue.") and index.add("Continue the story")
    assert len(index.kept) == 4
    assert jaccard(shingles("a b c d"), shingles("a b c d")) == 1.0
    with pytest.raises(ValueError, match="threshold"):
        NearDuplicates(0)


def test_regenerate_drops_near_duplicates_of_records_and_evaluation_prompts():
    from train.dedup import NearDuplicates
    from train.regenerate import new_prompts

    def one(i, text):
        return Conversation(str(i), "test", [{"role": "user", "content": text}])

    near = NearDuplicates(0.7)
    near.add("What is the capital of France and what is its population today")  # an evaluation prompt
    conversations = [
        one(0, "What is the capital of France and what is its population right now"),  # near the evaluation one
        one(1, "Tell me a story about a dragon who learns to read books in a library"),
        one(2, "Tell me a story about a dragon who learns to read books in a big library"),  # near 1
        one(3, "Summarise the plot of Hamlet in three sentences for a student"),  # near the record below
        one(4, "List five prime numbers"),
    ]
    hamlet = "Summarise the plot of Hamlet in three sentences for a student please"
    records = [{"id": "r", "messages": [{"role": "user", "content": hamlet}]}]
    todo, repeats = new_prompts(conversations, records, max_turns=1, near=near)
    assert [c.id for c in todo] == ["1", "4"] and repeats == 3


def test_committed_task_data_matches_its_record_and_covers_every_family():
    """The task-shaped files in data/README.md's table (held-out set and training parts) match their recorded
    count and sha256; the held-out set has every evaluation family and no evaluation prompt. A training part may hold
    a user turn of the held-out set (one does: a ShareGPT question that is a held-out qa prompt and a training
    dialogue prompt); `train.main` drops such conversations (`exclude_held_out`): at most one in 500 here."""
    import os
    import re

    from hspec_jax.prompts import TASKS
    from train.data import evaluation_texts, source_fingerprint

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "data", "README.md")) as f:
        rows = re.findall(
            r"^\| `(smollm2_tasks_[\w.]+\.jsonl)` \| ([\d,]+) \|.*\| `([0-9a-f]{64})` \|$", f.read(), re.M
        )
    recorded = {name: (int(count.replace(",", "")), sha) for name, count, sha in rows}
    assert "smollm2_tasks_heldout.jsonl" in recorded
    on_disk = {n for n in os.listdir(os.path.join(root, "data")) if n.startswith("smollm2_tasks_")}
    assert on_disk == set(recorded)
    loaded = {}
    for name, (count, sha) in recorded.items():
        source = Source(name, os.path.join(root, "data", name))
        assert source_fingerprint(source)["sha256"] == sha
        loaded[name] = load_conversations(source)
        assert len(loaded[name]) == count
    held_out = loaded.pop("smollm2_tasks_heldout.jsonl")
    with open(os.path.join(root, "data", "smollm2_tasks_heldout.jsonl")) as f:
        assert {json.loads(line)["source"] for line in f} == set(TASKS)
    assert exclude_eval_prompts(held_out, evaluation_texts())[1] == 0
    held_texts = [m["content"] for c in held_out for m in c.messages if m["role"] == "user"]
    for conversations in loaded.values():
        _, dropped = exclude_eval_prompts(conversations, held_texts)
        assert dropped <= max(1, len(conversations) // 500), dropped


def test_data_table_rows_and_parts(tmp_path):
    """`train.data_table` counts records, sources, tokens and EOS endings per file, and --split cuts a file into
    verbatim parts that concatenate back to it."""
    from pathlib import Path

    from train.data_table import file_stats, split, table

    records = [
        {
            "id": str(i),
            "source": "math" if i % 3 else "code",
            "complete": i % 2 == 0,
            "messages": [{"role": "user", "content": "a b"}, {"role": "assistant", "content": "c d e"}],
        }
        for i in range(5)
    ]
    path = tmp_path / "out.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    stats = file_stats(str(path), lambda text: len(text.split()))
    assert stats["conversations"] == 5 and stats["sources"] == {"code": 2, "math": 3}
    assert (stats["user_tokens"], stats["assistant_tokens"], stats["complete"]) == (10, 15, 3)
    rows = table([stats])
    assert rows[2].startswith("| `out.jsonl` | 5 | code 2, math 3 | 10 / 15 | 3 |")
    assert "code 6 (40.0%), math 9 (60.0%)" in rows[-1]
    parts = split(str(path), str(tmp_path / "part"), 2)
    assert [p.rsplit("/", 1)[-1] for p in parts] == ["part00.jsonl", "part01.jsonl", "part02.jsonl"]
    assert "".join(Path(p).read_text() for p in parts) == path.read_text()


def test_the_task_recipe_trains_on_every_committed_part_and_holds_out_the_task_set():
    """configs/smollm2_tasks.py: the chat mix and every committed task part, each weighted by its conversations
    (so each conversation is drawn about equally often), the task-shaped held-out set measured per family."""
    import glob
    import os

    from hspec_jax.recipes import load_config

    config = load_config("configs/smollm2_tasks.py")
    sources = parse_sources(config.data.sources)
    data = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
    parts = sorted(glob.glob(os.path.join(data, "smollm2_tasks_v1_part*.jsonl")))
    assert len(parts) >= 3
    assert [s.location for s in sources] == [
        os.path.join(data, "smollm2_sharegpt_v2.jsonl"),
        os.path.join(data, "smollm2_magpie.jsonl"),
        *parts,
    ]
    for source in sources:
        assert source.weight == len(load_conversations(source)), source.name
    assert config.data.held_out == os.path.join(data, "smollm2_tasks_heldout.jsonl")
    assert config.data.held_out_family_batches > 0
    assert config.train.init_from == "smollm2-hspec"


def test_the_cut_task_recipe_is_a_valid_cut_of_the_shipped_drafter():
    """configs/smollm2_tasks_cut.py: the task recipe, its drafter six sub-layers and 8192 draft tokens cut from the
    shipped one (the layer map checked against the shipped drafter's config, no weights read)."""
    from hspec_jax.recipes import drafter_from_recipe, load_config, target_config
    from train.warm_start import parse_layers, starting_drafter

    tasks, cut = load_config("smollm2_tasks"), load_config("configs/smollm2_tasks_cut.py")
    assert cut.data.sources == tasks.data.sources and cut.train.init_from == "smollm2-hspec"
    drafter = drafter_from_recipe(cut, target=target_config(cut))
    source, vocab = starting_drafter(cut.train.init_from, drafter, parse_layers(cut.train.init_layers))
    assert len(drafter.block_pattern) == 6 and len(source.block_pattern) == 11
    assert drafter.vocab_size == 8192 and vocab.size == 16384
