"""Decoding settings, defined once: the run config holds them as sub-sections (``caption.generation``,
``eval.generation``, ``vqa.generation``), the inference helpers (``models/inference.py``) read them from the
files a model folder keeps beside its weights.

GenerationSettings   captioning: the prompt the decoder continues ("a picture of") and beam search limits;
                     a caption fine-tuning run saves its ``caption.generation`` as ``caption_generation.json``
                     in its model folder.
AnswerSettings       VQA generation: beam search over at most ``max_length`` answer tokens ([SEP] included);
                     length_penalty 0 keeps the answer's log-probability (what VQA fine-tuning trains). Every
                     training run saves its ``vqa.generation`` as ``answer_generation.json``.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass

import torch
from torch import nn

from mplug_pretrain.errors import ConfigError
from mplug_pretrain.models.generation.beam_official import mplug_official_beam_search
from mplug_pretrain.models.generation.decoding import LENGTH_PENALTY_FORMS, BeamOutput, beam_search
from mplug_pretrain.utils.atomic_files import write_json_atomic
from mplug_pretrain.utils.typed_dataclass import read_json_dataclass
from mplug_pretrain.utils.value_checks import check_choice, check_positive

BEAM_RULES = ("ours", "mplug_official")

GENERATION_FILE = "caption_generation.json"  # written into fine-tuned model folders
ANSWER_FILE = "answer_generation.json"  # written into every training run's model/ folder (vqa.generation)


class _SavedBesideWeights:
    """A settings dataclass stored as ``FILE`` (JSON) in a model folder."""
    FILE = ""

    @classmethod
    def from_model_dir(cls, directory: str):
        """The settings saved beside the weights (type-checked and validated), else the defaults."""
        path = os.path.join(directory, cls.FILE)
        return read_json_dataclass(cls, path) if os.path.isfile(path) else cls()

    def save(self, directory: str) -> None:
        write_json_atomic(os.path.join(directory, self.FILE), asdict(self))


@dataclass
class GenerationSettings(_SavedBesideWeights):
    FILE = GENERATION_FILE
    prompt: str = "a picture of"  # through text encoder + fusion with the image; the decoder writes the rest
    beam_size: int = 5
    max_length: int = 20  # generated tokens incl. [SEP] (caption fine-tuning also samples SCST captions this long)
    min_length: int = 3
    length_penalty: float = 1.0  # beam score = log p / length ** length_penalty (the "power" form)
    length_penalty_form: str = "power"  # or "gnmt": log p / ((5 + length) / 6) ** length_penalty
    early_stopping: bool = False  # stop an input when its best normalized beam ended (else: when all ended)
    # "ours": generation.beam_search with the three settings above; "mplug_official": the official mPLUG
    # TextGenerator rule (beam_official.py), which needs length_penalty_form gnmt and early_stopping true
    # (length_penalty 0.6 is the official value): what reproduces the paper's caption numbers
    rule: str = "ours"

    def validate(self, prefix: str = "") -> None:
        """Raises ConfigError naming the dotted field (``prefix``: the section, e.g. "caption.generation")."""
        at = f"{prefix}." if prefix else ""
        check_positive(self.beam_size, f"{at}beam_size")
        check_positive(self.max_length, f"{at}max_length")
        if not 0 <= self.min_length <= self.max_length:
            raise ConfigError(f"{at}min_length: expected in [0, {at}max_length={self.max_length}], "
                              f"got {self.min_length}")
        check_positive(self.length_penalty, f"{at}length_penalty", allow_zero=True)
        check_choice(self.length_penalty_form, LENGTH_PENALTY_FORMS, f"{at}length_penalty_form")
        check_choice(self.rule, BEAM_RULES, f"{at}rule")
        if self.rule == "mplug_official" and (self.length_penalty_form != "gnmt" or not self.early_stopping):
            raise ConfigError(f"{at}rule: mplug_official divides by the GNMT penalty and stops early; set "
                              f"{at}length_penalty_form: gnmt and {at}early_stopping: true (and "
                              f"{at}length_penalty: 0.6, the official alpha)")

    def beam_search(self, decoder: nn.Module, memory: torch.Tensor, memory_mask: torch.Tensor) -> BeamOutput:
        """Captions over memory = fuse(visual states, prompt) [B, M, D] (mask [B, M])."""
        if self.rule == "mplug_official":
            return mplug_official_beam_search(decoder, memory, memory_mask, beam_size=self.beam_size,
                                              max_length=self.max_length, min_length=self.min_length,
                                              alpha=self.length_penalty)
        return beam_search(decoder, memory, memory_mask, beam_size=self.beam_size, max_length=self.max_length,
                           min_length=self.min_length, length_penalty=self.length_penalty,
                           length_penalty_form=self.length_penalty_form, early_stopping=self.early_stopping)


@dataclass
class AnswerSettings(_SavedBesideWeights):
    FILE = ANSWER_FILE
    beam_size: int = 5
    max_length: int = 10  # answer tokens incl. [SEP]; VQA fine-tuning truncates its training answers to it
    # beam score = log p / length ** length_penalty; 0 keeps the answer's log-probability, the quantity the
    # loss trains and ranking scores (1.0 averages per token, which favours answers of more word pieces)
    length_penalty: float = 0.0

    def validate(self, prefix: str = "") -> None:
        """Raises ConfigError naming the dotted field (``prefix``: the section, e.g. "vqa.generation")."""
        at = f"{prefix}." if prefix else ""
        check_positive(self.beam_size, f"{at}beam_size")
        check_positive(self.length_penalty, f"{at}length_penalty", allow_zero=True)
        if self.max_length < 2:
            raise ConfigError(f"{at}max_length: expected >= 2 (one word and [SEP]), got {self.max_length}")

    def beam_search(self, decoder: nn.Module, memory: torch.Tensor, memory_mask: torch.Tensor) -> BeamOutput:
        """Answers (at least one token) over memory = fuse(image, question) [B, M, D] (mask [B, M])."""
        return beam_search(decoder, memory, memory_mask, beam_size=self.beam_size, max_length=self.max_length,
                           min_length=1, length_penalty=self.length_penalty)
