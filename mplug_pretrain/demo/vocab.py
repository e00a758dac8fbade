"""The demo's word-piece vocabulary: BERT's first 104 entries ([PAD] 0, [unused*], [UNK] 100, [CLS] 101,
[SEP] 102, [MASK] 103: the ids the decoders and MLM rely on, ``models.decoders.api``) followed by every word of
the demo's texts, then single characters and their ``##`` continuations so no other word becomes [UNK].

Why: the tiny preset is 128 wide, so with BERT's 30,522 words its LM heads (MLM, PrefixLM, captioning,
VQA) are most of its FLOPs and the softmax over 30,522 words most of the rest. The demo's texts use about
a hundred words; a ~300-row head makes every demo stage several times faster for the same steps.
A user's own data keeps the default BERT vocabulary (``data.tokenizer: null``).

    write_demo_vocab(folder, texts) -> folder (holds vocab.txt; ``data.tokenizer=<folder>`` loads it)
"""
from __future__ import annotations

import json
import os
import string
import tarfile
from collections.abc import Iterable

from tokenizers.normalizers import BertNormalizer
from tokenizers.pre_tokenizers import BertPreTokenizer

from mplug_pretrain.data.tokenizer import default_vocab_path
from mplug_pretrain.utils.atomic_files import atomic_write

SPECIAL_ROWS = 104  # [PAD] .. [MASK] of bert-base-uncased, ids unchanged
CHARACTERS = string.ascii_lowercase + string.digits


def demo_vocabulary(texts: Iterable[str]) -> list[str]:
    """-> the token list (row i = id i): BERT's special rows, the texts' lower-cased words, characters."""
    with open(os.path.join(default_vocab_path(), "vocab.txt"), encoding="utf-8") as f:
        tokens = [next(f).rstrip("\n") for _ in range(SPECIAL_ROWS)]
    normalizer, splitter = BertNormalizer(lowercase=True), BertPreTokenizer()
    words = sorted({word for text in texts
                    for word, _ in splitter.pre_tokenize_str(normalizer.normalize_str(text))})
    characters = list(CHARACTERS + string.punctuation) + [f"##{c}" for c in CHARACTERS]
    seen = set(tokens)
    for token in words + characters:
        if token not in seen:
            seen.add(token)
            tokens.append(token)
    return tokens


def write_demo_vocab(folder: str, texts: Iterable[str]) -> str:
    """Write ``folder``/vocab.txt from ``texts`` (see ``demo_vocabulary``) -> ``folder``."""
    os.makedirs(folder, exist_ok=True)
    with atomic_write(os.path.join(folder, "vocab.txt"), encoding="utf-8") as f:
        f.writelines(f"{token}\n" for token in demo_vocabulary(texts))
    return folder


def shard_texts(urls: Iterable[str]) -> Iterable[str]:
    """Every string in the ``.txt`` and ``.json`` members of the tar files ``urls`` (captions, questions,
    answers, scene words); images are not read."""
    for url in urls:
        with tarfile.open(url) as tar:
            for member in tar:
                if member.name.endswith(".txt"):
                    yield tar.extractfile(member).read().decode("utf-8")
                elif member.name.endswith(".json"):
                    yield from _strings(json.load(tar.extractfile(member)))


def _strings(value) -> Iterable[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def vocab_size(folder: str) -> int:
    """Rows of ``folder``/vocab.txt (the ``model.text.vocab_size`` a model trained with it needs)."""
    with open(os.path.join(folder, "vocab.txt"), encoding="utf-8") as f:
        return sum(1 for _ in f)
