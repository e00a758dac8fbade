"""Inference helpers of MPLUG: ``caption``, ``similarity`` and ``answer`` on PIL images and strings.

    images  one PIL image, a list of PIL images (any mode; converted to RGB and passed through the eval
            transform), or a float tensor [3, H, W] / [B, 3, H, W] that already went through it
    caption(images)              -> B strings: beam search continuing the prompt ("a picture of") over
                                    memory = fuse(image, prompt)        (GenerationSettings)
    similarity(images, texts)    -> [B, N] cosine similarities of the ITC features f_v = itc.image_features(V[:,0]),
                                    f_l = itc.text_features(L[:,0]) (no temperature; softmax over texts with
                                    ``model.itc.temp`` gives ITC's probabilities)
    answer(images, questions)    -> B strings: beam search over memory = fuse(image, question)  (AnswerSettings)
The tokenizer, eval transform and text length come from ``attach_inference`` (done by
``mplug_pretrain.create_model_and_transforms``). Nothing here imports training code.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from mplug_pretrain.data.tokenizer import tokenize
from mplug_pretrain.models.generation.decoding import token_mask
from mplug_pretrain.models.generation.settings import AnswerSettings, GenerationSettings

PROMPT_MAX_TOKENS = 512  # prompts are short; only BERT's position limit bounds them


def decode_generated(tokenizer, sequences: torch.Tensor) -> list[str]:
    """Generated rows [N, L] (first [SEP] included, PAD after) -> strings."""
    kept = (sequences * token_mask(sequences)).tolist()
    return [text.strip() for text in tokenizer.batch_decode(kept, skip_special_tokens=True)]


@torch.no_grad()
def caption_images(model, images: torch.Tensor, tokenizer, settings: GenerationSettings,
                   decoder: torch.nn.Module | None = None) -> list[str]:
    """images [B, 3, H, W] (eval transform) -> B captions by beam search with ``decoder`` (default
    ``model.decoder``; an evaluation pass gives ``packed_decoding.packed_for_decoding(model.decoder)``)."""
    ids, mask = tokenize(tokenizer, [settings.prompt], PROMPT_MAX_TOKENS)
    ids, mask = ids.to(images.device).expand(images.shape[0], -1), mask.to(images.device).expand(images.shape[0], -1)
    memory, memory_mask = model.memory(images, ids, mask)
    decoder = model.decoder if decoder is None else decoder
    return decode_generated(tokenizer, settings.beam_search(decoder, memory, memory_mask).sequences[:, 0])


class InferenceMixin:
    """Mixed into MPLUG; needs ``encode_image``, ``encode_text``, ``memory``, ``decoder`` and ``itc``."""

    def attach_inference(self, tokenizer, eval_transform, max_text_len: int,
                         generation: GenerationSettings | None = None, answering: AnswerSettings | None = None):
        """Give the helpers their tokenizer, eval transform (PIL -> [3, H, W]) and decoding settings."""
        self.inference_tokenizer, self.inference_transform = tokenizer, eval_transform
        self.inference_max_text_len = max_text_len
        self.generation_settings = generation or GenerationSettings()
        self.answer_settings = answering or AnswerSettings()
        return self

    def _inference_parts(self):
        tokenizer = getattr(self, "inference_tokenizer", None)
        if tokenizer is None:
            raise RuntimeError("caption/similarity/answer need a tokenizer and transform: load the model with "
                               "mplug_pretrain.create_model_and_transforms(...) or call model.attach_inference(...)")
        return tokenizer, self.inference_transform

    def _image_batch(self, images) -> torch.Tensor:
        """PIL image(s) or tensor [3, H, W] / [B, 3, H, W] -> [B, 3, H, W] on the model's device."""
        _, transform = self._inference_parts()
        device = next(self.parameters()).device
        if isinstance(images, torch.Tensor):
            batch = images[None] if images.dim() == 3 else images
            if batch.dim() != 4 or batch.shape[1] != 3:
                raise ValueError(f"images: expected a tensor [3, H, W] or [B, 3, H, W], got {tuple(images.shape)}")
            return batch.to(device=device, dtype=torch.float32)
        if not isinstance(images, (list, tuple)):
            images = [images]
        if not images:
            raise ValueError("images: empty")
        for i, image in enumerate(images):
            if not hasattr(image, "convert"):
                raise TypeError(f"images[{i}]: expected a PIL image or a tensor, got {type(image).__name__}")
        return torch.stack([transform(image.convert("RGB")) for image in images]).to(device)

    def _texts(self, texts: str | Sequence[str], name: str) -> tuple[torch.Tensor, torch.Tensor]:
        tokenizer, _ = self._inference_parts()
        texts = [texts] if isinstance(texts, str) else list(texts)
        if not texts or not all(isinstance(t, str) for t in texts):
            raise TypeError(f"{name}: expected a string or a non-empty list of strings")
        ids, mask = tokenize(tokenizer, texts, self.inference_max_text_len)
        device = next(self.parameters()).device
        return ids.to(device), mask.to(device)

    @torch.no_grad()
    def caption(self, images, **settings) -> list[str]:
        """One caption per image; ``settings`` override GenerationSettings fields (prompt, beam_size, ...)."""
        tokenizer, _ = self._inference_parts()
        chosen = GenerationSettings(**{**vars(self.generation_settings), **settings})
        return caption_images(self, self._image_batch(images), tokenizer, chosen)

    @torch.no_grad()
    def similarity(self, images, texts: str | Sequence[str]) -> torch.Tensor:
        """-> [B_images, N_texts] cosine similarity of the ITC features (float32, on the model's device)."""
        image_feat = self.itc.image_features(self.encode_image(self._image_batch(images))[:, 0])
        ids, mask = self._texts(texts, "texts")
        text_feat = self.itc.text_features(self.encode_text(ids, mask)[:, 0])
        return (image_feat @ text_feat.t()).float()

    @torch.no_grad()
    def answer(self, images, questions: str | Sequence[str], **settings) -> list[str]:
        """One answer per (image, question) pair; a single question is asked of every image."""
        tokenizer, _ = self._inference_parts()
        image = self._image_batch(images)
        ids, mask = self._texts(questions, "questions")
        if ids.shape[0] == 1 and image.shape[0] > 1:
            ids, mask = ids.expand(image.shape[0], -1), mask.expand(image.shape[0], -1)
        if ids.shape[0] != image.shape[0]:
            raise ValueError(f"answer: {image.shape[0]} images but {ids.shape[0]} questions")
        chosen = AnswerSettings(**{**vars(self.answer_settings), **settings})
        memory, memory_mask = self.memory(image, ids, mask)
        return decode_generated(tokenizer, chosen.beam_search(self.decoder, memory, memory_mask).sequences[:, 0])
