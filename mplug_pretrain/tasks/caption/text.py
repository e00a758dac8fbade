"""Caption text cleaning shared by caption training, SCST rewards and CIDEr-D evaluation.

``clean_caption`` follows ExpansionNet v2's caption preprocessing (jchenghu/ExpansionNet_v2,
data/coco_dataset.py with utils/language_utils.py) exactly, step by step:
    1. lower-case, strip trailing whitespace
    2. put a space on both sides of every character that is not a word character (``[^\\w]``, Unicode)
    3. split on single spaces, drop the empty tokens and the punctuation tokens
       ' ` . ? ! , : - ;   (and '' `` -- ..., which step 2 never leaves whole)
    4. join with single spaces
So "A Man's red-shirt, outside." -> "a man s red shirt outside". Other symbols stay as tokens of their own
('"', '(', ')', '/', '&', '#' ...: 'a "dog"' -> 'a " dog "'), as they do in the official vocabulary, and so
does any whitespace character other than the space (tab, newline), as in the official code.
"""
from __future__ import annotations

import re

PUNCTUATION_TOKENS = frozenset(["''", "'", "``", "`", ".", "?", "!", ",", ":", "-", "--", "...", ";"])
_NON_WORD = re.compile(r"([^\w])")


def caption_tokens(text: str) -> list[str]:
    """The ExpansionNet v2 token list of one caption (without SOS / EOS)."""
    spaced = _NON_WORD.sub(r" \1 ", text.lower().rstrip())
    return [t for t in spaced.split(" ") if t and t not in PUNCTUATION_TOKENS]


def clean_caption(text: str) -> str:
    """The ExpansionNet v2 tokens of ``text`` joined by single spaces ("Man's" -> "man s")."""
    return " ".join(caption_tokens(text))
