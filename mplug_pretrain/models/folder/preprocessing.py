"""What a model folder needs besides its weights to be used elsewhere: ``preprocessing.json`` and the
tokenizer files (``vocab.txt``, ``tokenizer.json``, ...), written by ``mplug export`` and by training runs'
``model/`` folder, read by ``mplug_pretrain.create_model_and_transforms``.

preprocessing.json   image_size (the ViT's input), mean / std (per channel, after scaling to [0, 1]),
                     interpolation (resize filter), train_crop_scale (RandomResizedCrop's area range),
                     max_text_len (tokens per text incl. [CLS] and [SEP]), and eval_resize: the eval recipe in words.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

from mplug_pretrain.data.transforms import CLIP_MEAN, CLIP_STD, TRAIN_CROP_SCALE
from mplug_pretrain.utils.typed_dataclass import read_json_dataclass

PREPROCESSING_FILE = "preprocessing.json"
TOKENIZER_FILE = "vocab.txt"  # the file whose presence says "this folder holds its tokenizer"
DEFAULT_MAX_TEXT_LEN = 30  # the training default (config.DataConfig.max_text_len)
EVAL_RESIZE = "resize shorter side to image_size, center crop image_size x image_size"


@dataclass
class Preprocessing:
    image_size: int
    mean: tuple[float, float, float] = CLIP_MEAN
    std: tuple[float, float, float] = CLIP_STD
    interpolation: str = "bicubic"
    train_crop_scale: tuple[float, float] = TRAIN_CROP_SCALE
    max_text_len: int = DEFAULT_MAX_TEXT_LEN
    eval_resize: str = EVAL_RESIZE

    def transforms(self):
        """-> (train transform, eval transform): PIL RGB image -> float32 [3, image_size, image_size]."""
        from mplug_pretrain.data.transforms import build_eval_transform, build_train_transform
        train = build_train_transform(self.image_size, self.mean, self.std, self.interpolation, self.train_crop_scale)
        return train, build_eval_transform(self.image_size, self.mean, self.std, self.interpolation)

    def save(self, directory: str) -> None:
        with open(os.path.join(directory, PREPROCESSING_FILE), "w") as f:
            json.dump(asdict(self), f, indent=2)

    @classmethod
    def load(cls, directory: str) -> Preprocessing:
        return read_json_dataclass(cls, os.path.join(directory, PREPROCESSING_FILE))


def write_inference_files(directory: str, tokenizer_path: str | None, max_text_len: int) -> list[str]:
    """Complete a ``save_pretrained`` folder (its config.json gives the image size) with the tokenizer
    (``tokenizer_path``: a folder with vocab.txt; None = the default bert-base-uncased vocabulary) and
    ``preprocessing.json``. -> the file names written."""
    from mplug_pretrain.data.tokenizer import load_tokenizer, save_tokenizer
    from mplug_pretrain.models.folder.config_io import CONFIG_FILE, read_model_config
    image_size = read_model_config(os.path.join(directory, CONFIG_FILE)).vision.image_size
    written = save_tokenizer(load_tokenizer(tokenizer_path), directory)
    Preprocessing(image_size=image_size, max_text_len=max_text_len).save(directory)
    return [*written, PREPROCESSING_FILE]
