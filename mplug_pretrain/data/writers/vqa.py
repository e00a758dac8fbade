"""``make-shards vqa``: VQA v2-style shards, one sample per question.

Inputs: questions JSON (``{"questions": [{question_id, image_id, question}]}`` or a plain list),
optional annotations JSON (``{"annotations": [{question_id, answers: [{answer, answer_confidence,
answer_id}] x 10, multiple_choice_answer, question_type, answer_type}]}``; test splits have none),
an image folder (images found by ``image_info``: a COCO-style JSON whose ``images`` list maps ``id`` to
``file_name`` (e.g. ``captions_val2014.json``, as ``make-shards coco`` reads it) or an object {image_id: file
name}; else by ``image_pattern`` such as ``COCO_val2014_{image_id:012d}.jpg``; else by the trailing digits of
the file names) and optionally an answer list (JSON list or one per line)
copied beside the shards as ``NAME_answer_list.json`` and named in the manifest.

Sample: ``KEY.jpg`` + ``KEY.json`` with question_id, question, image_id, answers (as given),
plus multiple_choice_answer / question_type / answer_type when present.
"""
from __future__ import annotations

import os
import re

from mplug_pretrain.data.writers.common import index_images_by_id, load_json, read_image_file
from mplug_pretrain.data.writers.shard_writer import ShardWriter, created_by
from mplug_pretrain.errors import DataError
from mplug_pretrain.utils.atomic_files import write_json_atomic

_UNSAFE_KEY = re.compile(r"[^A-Za-z0-9_\-]")
ANNOTATION_FIELDS = ("multiple_choice_answer", "question_type", "answer_type")
MODEL_ANSWER_LIST = "answer_list.json"  # in a VQA model folder: the answers it was fine-tuned to rank


def load_answer_list(path: str) -> list[str]:
    if path.endswith(".json"):
        answers = load_json(path)
        if not isinstance(answers, list):
            raise DataError(f"{path}: expected a JSON list of answers")
        return [str(a) for a in answers]
    with open(path, encoding="utf-8") as f:
        return [line.strip() for line in f if line.strip()]


def write_answer_list(out: str, name: str, answers: list[str]) -> str:
    file_name = f"{name}_answer_list.json"
    write_json_atomic(os.path.join(out, file_name), answers, indent=None)
    return file_name


def question_key(question_id) -> str:
    return _UNSAFE_KEY.sub("_", str(question_id))


def write_vqa_samples(questions: list[dict], image_paths: dict, out: str, *, name: str, description: str,
                      answer_list: list[str] | None = None, max_image_side: int | None = None,
                      skip_missing: bool = False, max_samples: int = 1000, max_bytes: int | None = None,
                      overwrite: bool = False) -> dict:
    """``questions``: dicts with question_id, question, image_id, answers (+ optional fields)."""
    os.makedirs(out, exist_ok=True)
    extra = {"layout": "question", "skipped_missing": 0}
    if answer_list is not None:
        extra["answer_list"] = write_answer_list(out, name, answer_list)
    with ShardWriter(out, name, kind="vqa", created_by=created_by(description), max_samples=max_samples,
                     max_bytes=max_bytes, overwrite=overwrite, extra=extra) as writer:
        for q in questions:
            path = image_paths.get(q["image_id"])
            if path is None or not os.path.exists(path):
                if not skip_missing:
                    raise DataError(f"question {q['question_id']}: no image file for image_id {q['image_id']} "
                                    f"({path}); skip with --skip-missing")
                writer.extra["skipped_missing"] += 1
                continue
            data, ext = read_image_file(path, max_image_side)
            writer.write({"__key__": question_key(q["question_id"]), ext: data, "json": q})
    return writer.entry


def load_vqa_questions(questions: str, annotations: str | None) -> list[dict]:
    data = load_json(questions)
    items = data.get("questions") if isinstance(data, dict) else data
    if not isinstance(items, list):
        raise DataError(f"{questions}: expected {{'questions': [...]}} or a list")
    by_qid = {}
    if annotations is not None:
        ann_data = load_json(annotations)
        anns = ann_data.get("annotations") if isinstance(ann_data, dict) else ann_data
        if not isinstance(anns, list):
            raise DataError(f"{annotations}: expected {{'annotations': [...]}} or a list")
        by_qid = {a.get("question_id"): a for a in anns}
    out = []
    for i, q in enumerate(items):
        try:
            record = {"question_id": q["question_id"], "question": str(q["question"]), "image_id": int(q["image_id"])}
        except (KeyError, TypeError, ValueError) as err:
            raise DataError(f"{questions}: questions[{i}]: missing or bad field {err}") from err
        ann = by_qid.get(q["question_id"])
        if annotations is not None and ann is None:
            raise DataError(f"{annotations}: no annotation for question_id {q['question_id']}")
        record["answers"] = list(ann.get("answers", [])) if ann else []
        record.update({k: ann[k] for k in ANNOTATION_FIELDS if ann and k in ann})
        out.append(record)
    return out


def image_file_names(path: str) -> dict[int, str]:
    """{image id: file name} from a COCO-style ``{"images": [{"id", "file_name"}]}`` or a ``{id: file name}``
    object."""
    data = load_json(path)
    try:
        if isinstance(data, dict) and isinstance(data.get("images"), list):
            return {int(img["id"]): str(img["file_name"]) for img in data["images"]}
        if isinstance(data, dict):
            return {int(k): str(v) for k, v in data.items()}
    except (KeyError, TypeError, ValueError) as err:
        raise DataError(f"{path}: an image without an integer id or a file_name ({err})") from err
    raise DataError(f"{path}: expected {{'images': [{{id, file_name}}]}} (COCO) or {{image_id: file name}}")


def write_vqa_shards(questions: str, image_root: str, out: str, *, annotations: str | None = None,
                     answer_list: str | None = None, image_pattern: str | None = None,
                     image_info: str | None = None, name: str = "vqa",
                     max_image_side: int | None = None, skip_missing: bool = False, max_samples: int = 1000,
                     max_bytes: int | None = None, overwrite: bool = False) -> dict:
    records = load_vqa_questions(questions, annotations)
    if image_info is not None:
        image_paths = {i: os.path.join(image_root, name) for i, name in image_file_names(image_info).items()}
    elif image_pattern is not None:
        image_paths = {r["image_id"]: os.path.join(image_root, image_pattern.format(image_id=r["image_id"]))
                       for r in records}
    else:
        image_paths = index_images_by_id(image_root)
    description = f"make-shards vqa --questions {questions} --annotations {annotations}"
    return write_vqa_samples(records, image_paths, out, name=name, description=description,
                             answer_list=load_answer_list(answer_list) if answer_list else None,
                             max_image_side=max_image_side, skip_missing=skip_missing,
                             max_samples=max_samples, max_bytes=max_bytes, overwrite=overwrite)
