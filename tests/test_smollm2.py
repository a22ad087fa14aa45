"""The embedded real model (SmolLM2-135M-Instruct, GGUF Q4_1 dequantized) against transformers."""

import os
import subprocess
import sys

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import CHAT_PROMPT, hf_logits

from hspec_jax.chat import chat_prompt_ids
from hspec_jax.checkpoints import load_tokenizer, resolve
from hspec_jax.checkpoints.gguf import file_stamp, parse_gguf
from hspec_jax.checkpoints.sources import _gguf_tokenizer
from hspec_jax.decoding import generate
from hspec_jax.models import forward, init_cache

pytestmark = pytest.mark.slow


def test_config_read_from_gguf(smollm2):
    config, _ = smollm2
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (30, 576, 9, 3)
    assert (config.head_dim, config.intermediate_size, config.vocab_size) == (64, 1536, 49152)
    assert config.rope_theta == 100000.0 and config.tie_word_embeddings and config.model_type == "llama"


def test_our_gguf_parser_reads_what_the_gguf_package_reads():
    """`parse_gguf` (a `struct` read of the header, ~10x faster) gives the gguf package's reader's metadata and
    the same memory-mapped tensor bytes, quantized or not, for the embedded file."""
    path = resolve("smollm2")
    ours, theirs = parse_gguf(path), gguf.GGUFReader(path)
    fields = {key: field.contents() for key, field in theirs.fields.items() if not key.startswith("GGUF.")}
    assert list(ours.metadata) == list(fields)
    for key, value in fields.items():
        np.testing.assert_array_equal(ours.metadata[key], value, err_msg=key)
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    assert {t.tensor_type for t in ours.tensors} == {
        gguf.GGMLQuantizationType.F32,
        gguf.GGMLQuantizationType.Q4_1,
        gguf.GGMLQuantizationType.Q8_0,
    }
    for mine, reference in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.shape == tuple(int(d) for d in reference.shape) and mine.tensor_type == reference.tensor_type
        assert mine.data.dtype == reference.data.dtype
        np.testing.assert_array_equal(mine.data, reference.data)


def test_chat_prompt_logits_match_transformers(smollm2, smollm2_hf, chat_prompt):
    config, params = smollm2
    ids = np.asarray([chat_prompt])
    out = forward(params, config, jnp.asarray(ids), init_cache(config, 1, ids.shape[1]))
    ref = hf_logits(smollm2_hf, ids).logits.numpy()
    np.testing.assert_allclose(np.asarray(out.logits), ref, atol=1e-3, rtol=0)


def test_64_greedy_tokens_are_transformers_greedy_choices(smollm2, smollm2_hf, chat_prompt):
    """Our 64 greedy tokens, fed to transformers after the prompt in one forward pass, are its argmax at every
    position: what its own greedy `generate` would produce, token by token, without 64 sequential calls."""
    config, params = smollm2
    ids = np.asarray([chat_prompt])
    out = generate(
        params,
        config,
        jnp.asarray(ids),
        jnp.asarray([ids.shape[1]]),
        max_new_tokens=64,
        eos_ids=config.eos_token_ids,
        rng=jax.random.key(0),
    )
    ours = np.asarray(out.tokens[0])
    assert int(out.num_tokens[0]) == 64 and config.eos_token_ids[0] not in ours  # a full answer, no early stop
    logits = hf_logits(smollm2_hf, np.concatenate([ids, ours[None, :-1]], axis=1)).logits[0, ids.shape[1] - 1 :]
    np.testing.assert_array_equal(logits.argmax(-1).numpy(), ours)


def test_smollm2_long_prompt_matches_transformers(smollm2, smollm2_hf):
    """A 700-token prompt through the blocked attention gives transformers' logits (the real model)."""
    config, weights = smollm2
    ids = np.random.default_rng(2).integers(10, 40000, (1, 700))
    ours = jax.jit(lambda w, t: forward(w, config, t, init_cache(config, 1, 704)).logits)(weights, jnp.asarray(ids))
    with torch.no_grad():
        theirs = smollm2_hf(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(ours)[0, ::50], theirs[0, ::50], atol=2e-3)


def test_the_gguf_tokenizer_saved_in_the_user_cache_is_the_one_built_from_the_file(chat_prompt, tmp_path, monkeypatch):
    """The first process builds the tokenizer from the GGUF file's metadata and saves it in the user cache; the next
    one reads it from there. Both are the tokenizer transformers' `AutoTokenizer` builds from the same file: the
    same backend (vocabulary, merges, pre-tokenizer, decoder, added tokens), special tokens, chat template and
    encodings. A cached copy that no longer loads is built again and replaced. Neither building nor reading needs
    `AutoTokenizer` or torch (whose imports cost every process over a second)."""
    from transformers import AutoTokenizer

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = resolve("smollm2")
    reference = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    stamp = file_stamp(path)
    built = _gguf_tokenizer.__wrapped__(*stamp)
    (saved,) = (tmp_path / "hspec_jax" / "tokenizers").iterdir()
    read = _gguf_tokenizer.__wrapped__(*stamp)
    assert read.name_or_path == str(saved) and built.name_or_path != str(saved)
    check = "import sys; from hspec_jax.checkpoints import load_tokenizer; load_tokenizer('smollm2'); "
    check += "print(sorted({'torch', 'transformers.models.auto'} & set(sys.modules)))"
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "empty")}
    assert subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True).stdout == "[]\n"
    env["XDG_CACHE_HOME"] = str(tmp_path)
    assert subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True).stdout == "[]\n"
    (saved / "tokenizer.json").write_text("{")  # damaged
    rebuilt = _gguf_tokenizer.__wrapped__(*stamp)
    assert rebuilt.name_or_path != str(saved) and _gguf_tokenizer.__wrapped__(*stamp).name_or_path == str(saved)
    texts = [
        "Hello world!  Two spaces, a tab\tand\nnew lines.\n\n",
        "def f(x):\n    return x ** 2  # 123456 digits",
        "Übersetze ins Französische: « Où est la gare ? » 東京は日本の首都です。 🙂",
        "<|im_start|>user\nHi<|im_end|>\n<|endoftext|>",
    ]
    for tokenizer in (built, read, rebuilt):
        assert tokenizer.backend_tokenizer.to_str() == reference.backend_tokenizer.to_str()
        assert tokenizer.get_vocab() == reference.get_vocab()
        assert tokenizer.chat_template == reference.chat_template
        assert tokenizer.all_special_tokens == reference.all_special_tokens
        assert [tokenizer(t)["input_ids"] for t in texts] == [reference(t)["input_ids"] for t in texts]
        ids = (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id)
        assert ids == (reference.bos_token_id, reference.eos_token_id, reference.pad_token_id, reference.unk_token_id)
        assert chat_prompt_ids(tokenizer, CHAT_PROMPT) == chat_prompt == chat_prompt_ids(reference, CHAT_PROMPT)
        assert tokenizer.decode(chat_prompt) == reference.decode(chat_prompt)


def test_the_gguf_tokenizer_is_built_once_and_handed_out_as_copies(smollm2_tokenizer):
    again = load_tokenizer("smollm2")
    assert again is not smollm2_tokenizer and again.get_vocab() == smollm2_tokenizer.get_vocab()
    assert again.chat_template == smollm2_tokenizer.chat_template
    again.add_tokens(["<only-in-this-copy>"])
    assert "<only-in-this-copy>" not in load_tokenizer("smollm2").get_vocab()
