"""``make-shards vqa --easy-vqa``: the easy-vqa data set (PyPI ``easy-vqa``: 64x64 PNG shapes,
4000 train / 1000 test images, 38,575 / 9,673 questions, 13 answers) as VQA v2-format shards.

easy-vqa has one answer per question; it is written as ten identical annotator answers
(``answer_confidence: "yes"``), so the VQA accuracy ``min(#matches / 3, 1)`` is 1 for it and 0
otherwise. ``question_id`` is the question's index in the split's list; the answer list is
``easy_vqa.get_answers()``. ``max_questions`` keeps a seeded random subset (in original order).
"""
from __future__ import annotations

import numpy as np

from mplug_pretrain.data.writers.vqa import write_vqa_samples
from mplug_pretrain.errors import DataError

SPLITS = ("train", "test")


def easy_vqa_questions(split: str) -> tuple[list[dict], dict[int, str], list[str]]:
    try:
        import easy_vqa
    except ImportError as err:
        raise DataError("easy-vqa is not installed: pip install easy-vqa (extra 'data')") from err
    if split == "train":
        texts, answers, image_ids = easy_vqa.get_train_questions()
        paths = easy_vqa.get_train_image_paths()
    elif split == "test":
        texts, answers, image_ids = easy_vqa.get_test_questions()
        paths = easy_vqa.get_test_image_paths()
    else:
        raise DataError(f"easy-vqa split {split!r} not in {SPLITS}")
    questions = [{"question_id": i, "question": text, "image_id": int(image_id),
                  "answers": [{"answer": answer, "answer_confidence": "yes", "answer_id": j + 1} for j in range(10)],
                  "multiple_choice_answer": answer}
                 for i, (text, answer, image_id) in enumerate(zip(texts, answers, image_ids))]
    return questions, paths, easy_vqa.get_answers()


def write_easy_vqa_shards(out: str, *, split: str = "train", max_questions: int | None = None, seed: int = 0,
                          name: str | None = None, max_samples: int = 1000, max_bytes: int | None = None,
                          overwrite: bool = False) -> dict:
    questions, paths, answers = easy_vqa_questions(split)
    if max_questions is not None and max_questions < len(questions):
        keep = np.sort(np.random.default_rng(seed).choice(len(questions), size=max_questions, replace=False))
        questions = [questions[i] for i in keep]
    description = f"make-shards vqa --easy-vqa --split {split} --max-questions {max_questions} --seed {seed}"
    return write_vqa_samples(questions, paths, out, name=name or f"easy_vqa_{split}", description=description,
                             answer_list=answers, max_samples=max_samples, max_bytes=max_bytes, overwrite=overwrite)
