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
