"""COCO caption metrics through pycocoevalcap, as the coco-caption toolkit computes them.

Inputs: ``predictions`` {image_id: caption} (or COCO results [{"image_id", "caption"}]) and
``references`` {image_id: [caption, ...]}, raw text. Both go through the Stanford PTBTokenizer
(lower-cased, punctuation removed), then BLEU-1..4, METEOR 1.5, ROUGE-L, CIDEr (= CIDEr-D: n=4,
sigma=6, clipped, x10, df from the evaluated references) and SPICE.

Java (tokenizer, METEOR, SPICE) must be on PATH. SPICE also needs the Stanford CoreNLP 3.6.0
jars in pycocoevalcap's ``spice/lib``; pycocoevalcap downloads them at first use, which fails
offline, so with ``spice="auto"`` SPICE is skipped (one log line) when they are absent.
pycocoevalcap writes its temporary files inside its own package folder.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Hashable, Mapping, Sequence
from typing import Literal

from mplug_pretrain.utils.atomic_files import write_json_atomic

ImageId = Hashable
Predictions = Mapping[ImageId, str] | Sequence[Mapping[str, object]]

log = logging.getLogger(__name__)

_SPICE_CORENLP_JARS = ("stanford-corenlp-3.6.0.jar", "stanford-corenlp-3.6.0-models.jar")


def predictions_as_dict(predictions: Predictions) -> dict[ImageId, str]:
    """{image_id: caption} from either form; a duplicated image id is an error."""
    if isinstance(predictions, Mapping):
        out = dict(predictions)
    else:
        out = {}
        for i, item in enumerate(predictions):
            if "image_id" not in item or "caption" not in item:
                raise ValueError(f"predictions[{i}]: needs 'image_id' and 'caption', got keys {sorted(item)}")
            if item["image_id"] in out:
                raise ValueError(f"predictions[{i}]: image_id {item['image_id']!r} appears twice")
            out[item["image_id"]] = item["caption"]
    for image_id, caption in out.items():
        if not isinstance(caption, str):
            raise TypeError(f"predictions[{image_id!r}]: caption must be a str, got {type(caption).__name__}")
    return out


def write_caption_results(predictions: Predictions, path: str) -> list[dict]:
    """Write the COCO results format ``[{"image_id": id, "caption": str}]`` (sorted by id)."""
    preds = predictions_as_dict(predictions)
    rows = [{"image_id": image_id, "caption": caption} for image_id, caption in sorted(preds.items(), key=lambda kv: str(kv[0]))]
    write_json_atomic(path, rows, indent=None)
    return rows


def _with_references(predictions: Predictions, references: Mapping[ImageId, Sequence[str]]) -> dict[ImageId, str]:
    """The predictions as a dict; none may be empty or lack references."""
    preds = predictions_as_dict(predictions)
    if not preds:
        raise ValueError("predictions: empty")
    missing_refs = [i for i in preds if not references.get(i)]
    if missing_refs:
        raise ValueError(f"references: no reference captions for {len(missing_refs)} predicted images, e.g. {missing_refs[0]!r}")
    return preds


def spice_jars_present() -> bool:
    from pycocoevalcap.spice import spice as spice_module

    lib = os.path.join(os.path.dirname(os.path.abspath(spice_module.__file__)), "lib")
    return all(os.path.isfile(os.path.join(lib, jar)) for jar in _SPICE_CORENLP_JARS)


def evaluate_captions(predictions: Predictions, references: Mapping[ImageId, Sequence[str]],
                      spice: Literal["auto", "on", "off"] = "auto", require_all: bool = True) -> dict[str, float]:
    """Corpus scores {"Bleu_1".."Bleu_4", "METEOR", "ROUGE_L", "CIDEr"[, "SPICE"]} on the predicted images.

    ``require_all``: every referenced image must have a prediction (a silent subset evaluation
    is a common way to report the wrong number). ``spice``: "auto" runs SPICE when its jars are
    present, "on" requires it, "off" skips it.
    """
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.meteor.meteor import Meteor
    from pycocoevalcap.rouge.rouge import Rouge
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

    if spice not in ("auto", "on", "off"):
        raise ValueError(f"spice: expected 'auto', 'on' or 'off', got {spice!r}")
    run_spice = spice != "off" and spice_jars_present()
    if spice == "on" and not run_spice:
        raise RuntimeError(f"SPICE requested but {' and '.join(_SPICE_CORENLP_JARS)} are missing from "
                           "pycocoevalcap/spice/lib (download Stanford CoreNLP 3.6.0 there)")
    preds = _with_references(predictions, references)
    if require_all:
        unpredicted = [i for i in references if i not in preds]
        if unpredicted:
            raise ValueError(f"predictions: {len(unpredicted)} referenced images have no prediction, e.g. "
                             f"{unpredicted[0]!r} (pass require_all=False to score the predicted subset)")
    if shutil.which("java") is None:
        raise RuntimeError("caption metrics need Java on PATH (PTBTokenizer, METEOR, SPICE); install a JRE 8+")

    # one tokenizer run for both sides: the tokenizer keeps one line per caption
    tokenized = PTBTokenizer().tokenize(
        {("ref", i): [{"caption": c} for c in references[i]] for i in preds}
        | {("res", i): [{"caption": preds[i]}] for i in preds})
    gts = {i: tokenized[("ref", i)] for i in preds}
    res = {i: tokenized[("res", i)] for i in preds}

    results: dict[str, float] = {}
    bleu, _ = Bleu(4).compute_score(gts, res)
    results.update({f"Bleu_{k + 1}": float(b) for k, b in enumerate(bleu)})
    results["METEOR"] = float(Meteor().compute_score(gts, res)[0])
    results["ROUGE_L"] = float(Rouge().compute_score(gts, res)[0])
    results["CIDEr"] = float(Cider().compute_score(gts, res)[0])
    if run_spice:
        from pycocoevalcap.spice.spice import Spice

        results["SPICE"] = float(Spice().compute_score(gts, res)[0])
    elif spice == "auto":
        log.warning("SPICE skipped: Stanford CoreNLP 3.6.0 jars are not in pycocoevalcap/spice/lib "
                    "(pycocoevalcap downloads them at first use, which needs network)")
    return results


# --- CIDEr without Java (eval.caption_metrics: cider) ---------------------------------------------------------
# The Stanford PTBTokenizer (-lowerCase) as pycocoevalcap runs it, followed by its punctuation removal, redone in
# Python for caption text: contractions split ("man's" -> "man 's", "don't" -> "do n't", "cannot" -> "can not"),
# brackets named (-lrb- -rrb- -lsb- -rsb- -lcb- -rcb-: with -lowerCase they escape pycocoevalcap's removal list),
# "%" "$" "#" split off, abbreviations (u.s., p.m., mr.) keep their periods, other punctuation dropped.
# tests/metrics/test_captions.py compares it with the Java tokenizer.
_BRACKETS = {"(": "-lrb-", ")": "-rrb-", "[": "-lsb-", "]": "-rsb-", "{": "-lcb-", "}": "-rcb-"}
_ABBREVIATIONS = {"mr", "mrs", "ms", "dr", "st", "jr", "sr", "vs", "etc", "inc", "co", "ltd", "no", "mt", "ft"}
_TOKEN = re.compile(r"""(?:""" + "|".join(sorted(_ABBREVIATIONS)) + r""")\.(?=\s|$)  # mr.
                       |(?:[a-z0-9]\.){2,}           # u.s. / p.m.
                       |[a-z0-9]+(?:['&/:.,-][a-z0-9]+)*  # words, numbers, x-ray, 5:30, 3.5, o'neil
                       |n't|'(?:s|re|ve|ll|d|m)\b|'n'|''|``|\.\.\.|--
                       |\S""", re.VERBOSE)
_DROPPED = {"''", "'", "``", "`", ".", "?", "!", ",", ":", "-", "--", "...", ";", '"'}


def ptb_tokenize(caption: str) -> str:
    """One caption as pycocoevalcap's PTBTokenizer + punctuation removal gives it, without Java."""
    text = caption.replace("\n", " ").lower()
    text = re.sub(r"\bcannot\b", "can not", text)
    text = re.sub(r"\b(ca|wo|do|does|did|is|are|was|were|has|have|had|could|would|should|must|need|ai)n't\b",
                  r"\1 n't", text)
    text = re.sub(r"([a-z0-9])'(s|re|ve|ll|d|m)\b", r"\1 '\2", text)
    out = []
    for token in _TOKEN.findall(text):
        if token in _BRACKETS:
            out.append(_BRACKETS[token])
        elif token.endswith(".") and token.count(".") == 1 and token[:-1] in _ABBREVIATIONS:
            out.append(token)
        elif "." in token and not re.fullmatch(r"(?:[a-z0-9]\.){2,}|[0-9]+(?:\.[0-9]+)+|[a-z0-9]+(?:[.][a-z0-9]+)+",
                                               token):
            out.extend(part for part in re.split(r"(\.)", token) if part and part not in _DROPPED)
        elif token not in _DROPPED:
            out.append(token)
    return " ".join(out)


def cider_without_java(predictions: Predictions, references: Mapping[ImageId, Sequence[str]]) -> dict[str, float]:
    """{"CIDEr": pycocoevalcap's Cider (CIDEr-D) on ``ptb_tokenize``d captions}: what ``evaluate_captions`` reports
    as CIDEr, with no Java anywhere (pycocoevalcap's Cider itself is Python)."""
    from pycocoevalcap.cider.cider import Cider
    preds = _with_references(predictions, references)
    gts = {i: [ptb_tokenize(c) for c in references[i]] for i in preds}
    res = {i: [ptb_tokenize(preds[i])] for i in preds}
    return {"CIDEr": float(Cider().compute_score(gts, res)[0])}


def check_java(field: str = "eval.caption_metrics") -> None:
    """Before any generation: the 'coco' metrics (PTB tokenizer, METEOR, SPICE) need Java on PATH."""
    if shutil.which("java") is None:
        from mplug_pretrain.errors import ConfigError
        raise ConfigError(f"{field}: 'coco' (BLEU, METEOR, ROUGE-L, CIDEr) needs Java on PATH for the PTB tokenizer "
                          f"and METEOR; install a JRE 8+, or set {field}=cider (CIDEr-D without Java)")


def score_captions(predictions: Predictions, references: Mapping[ImageId, Sequence[str]],
                   caption_metrics: Literal["coco", "cider"]) -> dict[str, float]:
    """``eval.caption_metrics``: "coco" = ``evaluate_captions`` (Java), "cider" = ``cider_without_java``."""
    if caption_metrics == "cider":
        return cider_without_java(predictions, references)
    return evaluate_captions(predictions, references, spice="auto")
