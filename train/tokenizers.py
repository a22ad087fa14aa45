"""A character-level chat tokenizer for the `tiny` recipe (a random target with a 96-token vocabulary).

Ids: 0 `<unk>` (any character outside the set), 1 `<|im_start|>` (BOS), 2 `<|im_end|>` (EOS and padding),
3 `<mask>` (the drafters' mask token, `mask_token_id=3` in configs/tiny.py), then 92 characters: newline,
space, ASCII letters, digits and the ASCII punctuation except ``` ` ^ | ~ ```. The chat template is ChatML,
as SmolLM2's without the default system message. Text is NFKC-normalised first, so e.g. full-width letters
map to ASCII ones. Built in code with the `tokenizers` library: no file, no download.
"""

from __future__ import annotations

import string

SPECIAL_TOKENS = ("<unk>", "<|im_start|>", "<|im_end|>", "<mask>")
CHARACTERS = "\n " + string.ascii_letters + string.digits + "".join(c for c in string.punctuation if c not in "`^|~")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def char_tokenizer(vocab_size: int = 96):
    """A `transformers.PreTrainedTokenizerFast` over SPECIAL_TOKENS + CHARACTERS (96 ids, all < `vocab_size`)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = list(SPECIAL_TOKENS) + list(CHARACTERS)
    if len(tokens) > vocab_size:
        raise ValueError(f"the character tokenizer needs {len(tokens)} ids, the target has {vocab_size}")
    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    backend.normalizer = normalizers.NFKC()
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        mask_token="<mask>",
        chat_template=CHAT_TEMPLATE,
    )
