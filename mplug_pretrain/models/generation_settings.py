"""Decoding settings of the inference helpers (``models/inference.py``), kept beside the weights.

GenerationSettings   captioning: the prompt the decoder continues ("a picture of") and beam search limits;
                     a caption fine-tuning run saves them as ``caption_generation.json`` in its model folder.
AnswerSettings       VQA generation: beam search over at most ``max_length`` answer tokens ([SEP] included);
                     length_penalty 0 keeps the answer's log-probability (what VQA fine-tuning trains).
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

from mplug_pretrain.utils.typed_dataclass import read_json_dataclass

GENERATION_FILE = "caption_generation.json"  # written into fine-tuned model folders
ANSWER_FILE = "answer_generation.json"  # written into every training run's model/ folder (vqa.* settings)


class _SavedBesideWeights:
    """A settings dataclass stored as ``FILE`` (JSON) in a model folder."""
    FILE = ""

    @classmethod
    def from_model_dir(cls, directory: str):
        """The settings saved beside the weights, else the defaults."""
        path = os.path.join(directory, cls.FILE)
        return read_json_dataclass(cls, path) if os.path.isfile(path) else cls()

    def save(self, directory: str) -> None:
        with open(os.path.join(directory, self.FILE), "w") as f:
            json.dump(asdict(self), f, indent=2)


@dataclass
class GenerationSettings(_SavedBesideWeights):
    FILE = GENERATION_FILE
    prompt: str = "a picture of"
    beam_size: int = 5
    max_length: int = 20
    min_length: int = 3
    length_penalty: float = 1.0

    @classmethod
    def from_config(cls, cfg) -> GenerationSettings:
        """From a run ``Config``'s ``caption`` section."""
        c = cfg.caption
        return cls(c.prompt, c.beam_size, c.max_length, c.min_length, c.length_penalty)


@dataclass
class AnswerSettings(_SavedBesideWeights):
    FILE = ANSWER_FILE
    beam_size: int = 5
    max_length: int = 10
    length_penalty: float = 0.0

    @classmethod
    def from_config(cls, cfg) -> AnswerSettings:
        """From a run ``Config``'s ``vqa`` section."""
        v = cfg.vqa
        return cls(v.beam_size, v.max_answer_length, v.length_penalty)
