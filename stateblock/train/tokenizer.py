"""The reference model's tokenizer (prompt encoding for any tokenizer: stateblock.model.prompts).

The reference tokenizer: one token per character, plus the task keywords. Built with the
`tokenizers` library and saved as a fast tokenizer so that
`AutoTokenizer.from_pretrained(dir, local_files_only=True)` loads it like any other.
Encoding a prompt adds `<bos>` before and `<ans>` after it: the model answers after `<ans>`
and ends with `<eos>`; the chat template renders the same shape.
"""

from __future__ import annotations

import string
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from stateblock.train.tasks import FAMILIES

PAD, BOS, EOS, UNK, ANS = "<pad>", "<bos>", "<eos>", "<unk>", "<ans>"
SPECIALS = [PAD, BOS, EOS, UNK, ANS]
CHARS = string.digits + string.ascii_lowercase + " +=;?:,.-"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<ans>{% endif %}"
)


def build_tokenizer() -> Tokenizer:
    keywords = [f"{name}:" for name in FAMILIES]
    vocab = {tok: i for i, tok in enumerate(SPECIALS + keywords + list(CHARS))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    alternatives = "|".join(keywords) + "|."
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(alternatives), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A {ANS}",
        special_tokens=[(BOS, vocab[BOS]), (ANS, vocab[ANS])],
    )
    tok.add_special_tokens(SPECIALS)
    return tok


def save_tokenizer(out_dir: str | Path, tok: Tokenizer | None = None) -> None:
    """`tok` (default: the character-level reference tokenizer) in the `from_pretrained`
    layout, with the reference's special tokens and chat template."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok if tok is not None else build_tokenizer(),
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        pad_token=PAD,
        additional_special_tokens=[ANS],
        chat_template=CHAT_TEMPLATE,
        model_max_length=8192 + 512,
    )
    fast.save_pretrained(str(out_dir))
