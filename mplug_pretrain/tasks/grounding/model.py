"""Visual grounding by box generation, as the official mPLUG code does (``model_grounding_mplug.py``).

The referring expression goes through text encoder + fusion with the image (``MPLUG.memory``, as a VQA question
does); the decoder then reads a prefix token and generates the box as 4 coordinate tokens:

    decoder input   [unused339]  x  y  w                  (teacher forcing; greedy decoding at inference)
    decoder target               x  y  w  h               each one of the bins+1 tokens [unused340 .. unused340+R]
    coordinate c in [0, 1] (normalised by the image side) -> bin floor(clamp(c, 0, 1) * R), R = ``bins``

``bins`` is the model's input resolution (``vision.image_size``: one bin per pixel, R+1 = 337 tokens at 336 px as
in the official code), so a saved model folder needs no extra setting. The output softmax is restricted to the
coordinate tokens (the official code adds -10000 to every other logit; slicing the logits is the same, and the
decoder computes just that slice: ``vocab=tokens.ids``, a [B, 4, R+1] product instead of [B, 4, 30522]). The loss
and its L1 / GIoU re-weighting live in tasks/grounding/finetune.py; IoU in metrics/boxes.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mplug_pretrain.errors import ConfigError

PREFIX_TOKEN = "[unused339]"
FIRST_COORDINATE = 340  # [unused340] is bin 0
LAST_UNUSED = 993  # bert-base-uncased has [unused0] .. [unused993]
BOX_TOKENS = 4  # x, y, w, h


@dataclass(frozen=True)
class CoordinateTokens:
    """The prefix token id and the first coordinate token id (bins+1 consecutive ids) of a vocabulary."""
    prefix_id: int
    first_id: int
    bins: int

    @classmethod
    def from_tokenizer(cls, tokenizer, bins: int) -> CoordinateTokens:
        """Looks the reserved tokens up in ``tokenizer`` (a BERT WordPiece vocabulary) and checks that the bins+1
        coordinate tokens exist and have consecutive ids."""
        if bins < 1 or FIRST_COORDINATE + bins > LAST_UNUSED:
            raise ConfigError(f"grounding: {bins} coordinate bins (the image side) need [unused{FIRST_COORDINATE}] .. "
                              f"[unused{FIRST_COORDINATE + bins}], beyond the vocabulary's [unused{LAST_UNUSED}]: "
                              f"use an image size <= {LAST_UNUSED - FIRST_COORDINATE}")
        names = [PREFIX_TOKEN] + [f"[unused{FIRST_COORDINATE + i}]" for i in range(bins + 1)]
        ids = tokenizer.convert_tokens_to_ids(names)
        unknown = tokenizer.convert_tokens_to_ids(tokenizer.unk_token) if tokenizer.unk_token else None
        if any(i is None or i == unknown for i in ids) or ids[1:] != list(range(ids[1], ids[1] + bins + 1)):
            raise ConfigError(f"grounding: the tokenizer lacks the reserved tokens {names[0]}, {names[1]} .. "
                              f"{names[-1]} with consecutive ids (a bert-base-uncased vocabulary has them)")
        return cls(prefix_id=ids[0], first_id=ids[1], bins=bins)

    @property
    def ids(self) -> slice:
        """The coordinate tokens' slice of the vocabulary axis."""
        return slice(self.first_id, self.first_id + self.bins + 1)

    def encode(self, boxes: torch.Tensor) -> torch.Tensor:
        """Normalised boxes [..., 4] -> coordinate token ids [..., 4] (floor to the bin below)."""
        return (boxes.clamp(0, 1) * self.bins).floor().long() + self.first_id

    def decode(self, ids: torch.Tensor) -> torch.Tensor:
        """Coordinate token ids [..., 4] -> normalised boxes [..., 4] (bin / bins)."""
        return (ids - self.first_id).float() / self.bins


def coordinate_logits(model: nn.Module, memory: torch.Tensor, memory_mask: torch.Tensor, tokens: CoordinateTokens,
                      inputs: torch.Tensor) -> torch.Tensor:
    """Decoder inputs [B, L] (prefix then coordinate tokens) -> logits over the bins+1 coordinate tokens
    [B, L, bins+1] for the token after each input position."""
    mask = torch.ones_like(inputs)
    return model.decoder(inputs, mask, memory, memory_mask, vocab=tokens.ids).logits.float()


def teacher_forced_logits(model: nn.Module, images: torch.Tensor, input_ids: torch.Tensor,
                          attention_mask: torch.Tensor, boxes: torch.Tensor,
                          tokens: CoordinateTokens) -> torch.Tensor:
    """images [B, 3, H, W], expression ids / mask [B, T], normalised xywh boxes [B, 4] -> logits [B, 4, bins+1]
    of the 4 coordinate tokens given the true earlier ones."""
    memory, memory_mask = model.memory(images, input_ids, attention_mask)
    targets = tokens.encode(boxes)
    prefix = torch.full_like(targets[:, :1], tokens.prefix_id)
    return coordinate_logits(model, memory, memory_mask, tokens, torch.cat([prefix, targets[:, :-1]], dim=1))


@torch.no_grad()
def predict_boxes(model: nn.Module, images: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  tokens: CoordinateTokens) -> torch.Tensor:
    """Greedy decoding of 4 coordinate tokens -> normalised xywh boxes [B, 4] (the official code's inference)."""
    memory, memory_mask = model.memory(images, input_ids, attention_mask)
    inputs = torch.full((images.shape[0], 1), tokens.prefix_id, dtype=torch.long, device=images.device)
    for _ in range(BOX_TOKENS):
        logits = coordinate_logits(model, memory, memory_mask, tokens, inputs)
        inputs = torch.cat([inputs, logits[:, -1].argmax(-1, keepdim=True) + tokens.first_id], dim=1)
    return tokens.decode(inputs[:, 1:])
