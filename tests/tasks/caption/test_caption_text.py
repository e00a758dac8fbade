"""Caption cleaning equals ExpansionNet v2's preprocessing (lower-case + rstrip, space around every
non-word character, split on ' ', drop '' and the punctuation tokens), re-derived here character by character."""
import pytest

from mplug_pretrain.tasks.caption.text import caption_tokens, clean_caption

OFFICIAL_PUNCTUATION = ["''", "'", "``", "`", ".", "?", "!", ",", ":", "-", "--", "...", ";"]


def expansionnet_tokens(caption: str) -> list[str]:
    """Independent re-statement of the official steps, without regular expressions."""
    text = caption.lower().rstrip()
    spaced = "".join(ch if (ch.isalnum() or ch == "_") else f" {ch} " for ch in text)
    return [w for w in spaced.split(" ") if w != "" and w not in OFFICIAL_PUNCTUATION]


@pytest.mark.parametrize("caption, expected", [
    ("A Man's red-shirt, outside.", "a man s red shirt outside"),
    ("  Two   dogs!! ", "two dogs"),
    ("...", ""),
    ('A "big" dog (brown) & a cat/kitten', 'a " big " dog ( brown ) & a cat / kitten'),
    ("People at the 5th   street; cafe's patio?", "people at the 5th street cafe s patio"),
])
def test_clean_caption_worked_examples(caption, expected):
    assert clean_caption(caption) == expected
    assert clean_caption(caption) == " ".join(expansionnet_tokens(caption))


def test_clean_caption_matches_official_steps_on_varied_text():
    captions = ["Man's dog isn't here.", "two--men... on a `boat`", "a tab\there", "Café crème, s'il vous plaît!",
                "under_score and 3.5 km/h", "It's 10 o'clock; the kids' toys: blocks, balls & cars"]
    for caption in captions:
        assert caption_tokens(caption) == expansionnet_tokens(caption), caption
