"""The default tokenizer equals transformers' pure-Python WordPiece (BertTokenizerLegacy) on the
same vocabulary, with bert-base-uncased's special ids, truncation and zero padding."""
import os
import shutil

import pytest
from transformers.models.bert.tokenization_bert_legacy import BertTokenizerLegacy

from mplug_pretrain.data.tokenizer import load_tokenizer, tokenize
from mplug_pretrain.errors import ConfigError

TEXTS = ["A large RED circle on the left.", "two shapes: a small blue square at the top and a triangle",
         "Café crème, naïve résumé!", "unaffable preprocessing tokenizers", ""]


def test_matches_python_wordpiece_and_special_ids(tokenizer):
    slow = BertTokenizerLegacy(os.path.join(tokenizer.name_or_path, "vocab.txt"), do_lower_case=True)
    assert slow.convert_tokens_to_ids(["[PAD]", "[CLS]", "[SEP]", "[MASK]"]) == [0, 101, 102, 103]
    ids, mask = tokenize(tokenizer, TEXTS, max_len=12)
    expected = [slow.encode(t, truncation=True, max_length=12) for t in TEXTS]
    assert ids.shape[1] == max(len(e) for e in expected) == 12
    for row, m, e in zip(ids.tolist(), mask.tolist(), expected):
        assert row[:len(e)] == e and set(row[len(e):]) <= {0}
        assert m == [1] * len(e) + [0] * (12 - len(e))
        assert e[0] == 101 and e[-1] == 102
    assert expected[-1] == [101, 102]
    assert len(expected[0]) < 12 and ids.shape[0] == len(TEXTS)


def test_folder_with_only_a_vocab_and_bad_paths(tmp_path, tokenizer):
    shutil.copy(os.path.join(tokenizer.name_or_path, "vocab.txt"), tmp_path / "vocab.txt")
    bare = load_tokenizer(str(tmp_path))
    assert tokenize(bare, TEXTS, 20)[0].tolist() == tokenize(tokenizer, TEXTS, 20)[0].tolist()
    with pytest.raises(ConfigError, match="vocab.txt"):
        load_tokenizer(str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match="max_text_len"):
        tokenize(tokenizer, TEXTS, 1)


def test_malformed_tokenizer_json_names_the_file(tmp_path, tokenizer):
    """Issue 37, item 5: a raw JSONDecodeError once, not naming the file."""
    shutil.copy(os.path.join(tokenizer.name_or_path, "vocab.txt"), tmp_path / "vocab.txt")
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    with pytest.raises(ConfigError, match=f"data.tokenizer: {tmp_path / 'tokenizer.json'}: not valid JSON"):
        load_tokenizer(str(tmp_path))


def test_too_small_vocab_names_the_file_and_the_missing_tokens(tmp_path):
    """Issue 37, item 5: a 50-word vocab.txt once failed later with 'every text must start with [CLS] (101)'."""
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"word{i}" for i in range(45)]
    (tmp_path / "vocab.txt").write_text("\n".join(words) + "\n")
    with pytest.raises(ConfigError) as err:
        load_tokenizer(str(tmp_path))
    message = str(err.value)
    assert message.startswith(f"data.tokenizer: {tmp_path / 'vocab.txt'}: 50 entries")
    assert "[UNK] (id 1, expected 100)" in message and "[CLS] (id 2, expected 101)" in message
    assert "[PAD] (" not in message  # at id 0 as expected
    (tmp_path / "vocab.txt").write_text("\n".join(words[5:]) + "\n")
    with pytest.raises(ConfigError, match=r"\[CLS\] \(id \d+, expected 101\)"):  # added at the end
        load_tokenizer(str(tmp_path))
