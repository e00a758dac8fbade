"""Every `mplug ...` command written in a config comment (configs/*.yaml), README.md or a page of docs/ runs as
written (issue 20: `--image-root` instead of `--images`, a shards recipe missing `eval.image_root=null`); a command
written in several places runs once.

Extraction: a comment line `#   mplug ...` (with `\\` continuations) is a command; a comment line `#   ... k=v`
repeats the command above it with more overrides; in README.md and docs/*.md, indented code lines starting with `mplug `;
in both, an inline `mplug ...` in backticks that has an option (--x) and no elision (`...`, `a|b`).
Placeholders in capitals ending in _DIR and `<...>` stand for a model folder the test writes.
Each command runs in a fresh folder holding the repo's configs/ and data_shards/ and the tiny inputs the
commands name (a 3-image Karpathy COCO file with its images, VQA v2 questions and annotations, model folders):
make-shards, submit --dry-run and the evaluations on the embedded shards run for real; training commands and
evaluations on data sets that only exist at full size are parsed by the real `mplug` parser and their config
resolved (the step every command takes before any heavy work).
"""
from __future__ import annotations

import glob
import json
import os
import re
import shlex

import numpy as np
import pytest
import torch
from PIL import Image

from mplug_pretrain.cli import build_parser, main
from mplug_pretrain.config import load_config
from mplug_pretrain.demo.shards import ensure_demo_shards

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLACEHOLDER = re.compile(r"<[^>]+>|\b[A-Z][A-Z_]*_DIR\b")
MODEL_FOLDER = "placeholder_model"
# appended to the evaluations run for real: small sizes, the documented inputs unchanged
SMALL_EVAL = ["eval.num_workers=0", "eval.num_frames=2", "eval.batch_size=48", "eval.k_test=3", "eval.rank_k=3",
              "eval.generation.beam_size=2", "eval.generation.max_length=5",
              "eval.generation.min_length=1", "eval.caption_metrics=cider"]


def _join_continuations(lines: list[str]) -> list[str]:
    joined, current = [], ""
    for line in lines:
        if current:
            current += " " + line.strip()
        else:
            current = line.strip()
        if current.endswith("\\"):
            current = current[:-1].rstrip()
        else:
            joined.append(current)
            current = ""
    return joined + ([current] if current else [])


def config_comment_commands(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        comments = [line[1:] for line in f if line.startswith("#")]
    commands: list[str] = []
    block: list[str] = []
    base = ""  # the last full command: a `... k=v` line extends it
    for line in comments + [""]:
        text = line.strip()
        if block and (block[-1].endswith("\\")):
            block.append(text)
            continue
        if block:
            for command in _join_continuations(block):
                if command.startswith("... "):
                    commands.append(base + command[3:])
                else:
                    commands.append(command)
                    base = command
            block = []
        if text.startswith("mplug ") or (text.startswith("... ") and commands):
            block = [text]
    return commands


def readme_commands(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    commands, i = [], 0
    while i < len(lines):
        if lines[i].startswith("    mplug "):
            block = [lines[i]]
            while block[-1].rstrip().endswith("\\"):
                i += 1
                block.append(lines[i])
            commands += _join_continuations(block)
        i += 1
    return commands


def inline_commands(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        spans = re.findall(r"`(mplug [^`]*)`", f.read())
    return [s for s in spans if " --" in s and "..." not in s and "|" not in s]


def documented_commands(distinct: bool = True) -> list[tuple[str, str]]:
    """(source, command) for every command of configs/*.yaml, README.md and docs/*.md; ``distinct``: each command
    once, under the first file that writes it (a command repeated in several pages runs once)."""
    found: dict[str, str] = {}
    every: list[tuple[str, str]] = []
    paths = (sorted(glob.glob(os.path.join(REPO_ROOT, "configs", "*.yaml"))) + [os.path.join(REPO_ROOT, "README.md")]
             + sorted(glob.glob(os.path.join(REPO_ROOT, "docs", "*.md"))))
    for path in paths:
        source = os.path.relpath(path, REPO_ROOT)
        listed = config_comment_commands(path) if path.endswith(".yaml") else readme_commands(path)
        for command in listed + inline_commands(path):
            found.setdefault(command, source)
            every.append((source, command))
    return [(source, command) for command, source in found.items()] if distinct else every


COMMANDS = documented_commands()


def test_the_documents_hold_the_commands_this_test_knows():
    """The extraction itself: a reworded recipe must still be found (counts per source)."""
    sources = {}
    for source, _ in documented_commands(distinct=False):
        sources[source] = sources.get(source, 0) + 1
    assert sources["configs/caption_coco.yaml"] == 3 and sources["configs/retrieval_coco.yaml"] == 5
    assert sources["configs/vqa.yaml"] == 2 and sources["configs/pretrain_tiny.yaml"] == 1
    assert sources["README.md"] >= 3 and sources["docs/tasks.md"] >= 7 and sources["docs/slurm.md"] >= 2
    assert sources["docs/data.md"] >= 1 and sources["docs/models.md"] >= 2 and sources["docs/configuration.md"] >= 2
    assert all(c.startswith("mplug ") and "\\" not in c and "\n" not in c for _, c in COMMANDS)
    assert len({c for _, c in COMMANDS}) == len(COMMANDS)


def _write_jpeg(path: str, seed: int) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    pixels = np.random.default_rng(seed).integers(0, 255, (48, 64, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path, quality=90)


def _write_json(path: str, data) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f)


def _karpathy(images: list[tuple[str, str, int, str]]) -> dict:
    return {"images": [{"filepath": folder, "filename": name, "cocoid": cid, "split": split,
                        "sentences": [{"raw": f"a photo number {cid} of {w}"} for w in ("a cat", "a dog")]}
                       for folder, name, cid, split in images]}


@pytest.fixture(scope="module")
def workspace(module_mktemp):
    """A folder with the inputs the documented commands name, written tiny. Not data/coco/ (retrieval_coco.yaml's
    full-size default): a recipe that swaps it for shards must not depend on it."""
    from mplug_pretrain.models.presets import build_model
    root = module_mktemp("documented")
    demo = ensure_demo_shards(os.path.join(REPO_ROOT, "data_shards"))
    os.symlink(os.path.join(REPO_ROOT, "configs"), root / "configs")
    os.makedirs(root / "data_shards")
    for entry in os.listdir(os.path.join(REPO_ROOT, "data_shards")):  # vqa_v2/ is written by a recipe here
        os.symlink(os.path.join(REPO_ROOT, "data_shards", entry), root / "data_shards" / entry)
    images = [("train2014", "COCO_train2014_000000000001.jpg", 1, "train"),
              ("val2014", "COCO_val2014_000000000002.jpg", 2, "restval"),
              ("val2014", "COCO_val2014_000000000003.jpg", 3, "test")]
    for folder, name, cid, _ in images:
        _write_jpeg(str(root / "COCO" / folder / name), cid)
        _write_jpeg(str(root / "train2014" / name), cid)
    _write_json(str(root / "dataset_coco.json"), _karpathy(images))
    questions = [{"question_id": cid * 10, "image_id": cid, "question": "what is it?"} for _, _, cid, _ in images]
    answers = [{"question_id": cid * 10, "image_id": cid, "answer_type": "other", "question_type": "what",
                "multiple_choice_answer": "cat", "answers": [{"answer": "cat", "answer_id": k} for k in range(10)]}
               for _, _, cid, _ in images]
    _write_json(str(root / "v2_OpenEnded_mscoco_train2014_questions.json"), {"questions": questions})
    _write_json(str(root / "v2_mscoco_train2014_annotations.json"), {"annotations": answers})
    _write_json(str(root / "answer_list.json"), ["cat", "dog"])
    _write_jpeg(str(root / "flickr30k-images" / "1000.jpg"), 7)  # SNLI-VE: the original jsonl over Flickr30K
    with open(root / "snli_ve_train.jsonl", "w") as f:
        f.write(json.dumps({"Flickr30K_ID": "1000", "sentence2": "A photo.", "gold_label": "entailment"}) + "\n")
    for side in ("img0", "img1"):  # NLVR2: the release's JSON-lines train.json and numbered image folders
        _write_jpeg(str(root / "nlvr2" / "images" / "train" / "3" / f"train-10-0-{side}.png"), 8)
    os.makedirs(root / "nlvr2" / "data")
    with open(root / "nlvr2" / "data" / "train.json", "w") as f:
        f.write(json.dumps({"identifier": "train-10-0-0", "sentence": "Two photos.", "label": "True"}) + "\n")
    from tests.data.formats.test_manifest_img2dataset import write_img2dataset_folder
    write_img2dataset_folder(str(root / "laion_shards"), [3, 2])  # README, img2dataset shards
    # RefCOCO: the refer toolkit's refs (as JSON) and COCO instances over the train2014 images above
    _write_json(str(root / "refcoco" / "instances.json"), {
        "images": [{"id": 1, "file_name": "COCO_train2014_000000000001.jpg", "width": 64, "height": 48}],
        "annotations": [{"id": 5, "image_id": 1, "bbox": [4, 6, 20, 30], "category_id": 1}]})
    _write_json(str(root / "refcoco" / "refs.json"), [
        {"ref_id": 0, "ann_id": 5, "image_id": 1, "split": split, "sentences": [{"sent": "the left thing"}]}
        for split in ("train", "val", "testA", "testB")])
    torch.manual_seed(0)
    model = build_model("tiny")
    for folder in (MODEL_FOLDER, "runs/pretrain_base/model", "runs/demo/pretrain/model", "runs/pretrain_a/model",
                   "runs/pretrain_b/model", "runs/snli_ve_base/model", "runs/grounding_refcoco/model"):
        model.save_pretrained(str(root / folder))
    cwd = os.getcwd()
    os.chdir(root)
    yield {"root": root, "demo": demo}
    os.chdir(cwd)


def _argv(command: str) -> list[str]:
    return shlex.split(PLACEHOLDER.sub(MODEL_FOLDER, command))[1:]


def _runs_for_real(argv: list[str]) -> bool:
    """make-shards and submit --dry-run always; evaluations whose inputs are the embedded shards."""
    if argv[0] == "make-shards" or argv[0] == "submit":  # submit: --dry-run added where missing
        return True
    return argv[0] == "eval" and any(a.startswith("eval.shards=data_shards/") for a in argv)


def unquoted_brace_ranges(command: str) -> list[str]:
    """The ``{a..b}`` ranges of ``command`` outside quotes: a shell expands each into one word per value
    (``k=a-{0..1}.tar`` -> ``k=a-0.tar k=a-1.tar``), which shlex.split, used below, does not do."""
    found, quote = [], None
    for i, char in enumerate(command):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "{":
            match = re.match(r"\{\d+\.\.\d+\}", command[i:])
            if match:
                found.append(match.group(0))
    return found


def test_unquoted_brace_ranges_are_found():
    assert unquoted_brace_ranges("mplug x k=a-{000..001}.tar 'j=b-{0..9}.tar' \"m={1..2}\"") == ["{000..001}"]


@pytest.mark.parametrize("source, command", COMMANDS, ids=[f"{s}:{c[:60]}" for s, c in COMMANDS])
def test_a_shard_range_is_quoted(source, command):
    """Pasted into a shell, an unquoted range becomes several overrides of one key (refused since: a key given
    twice, config_loader.refuse_expanded_brace_ranges); the documents quote each one."""
    assert not unquoted_brace_ranges(command), f"{source}: quote the override holding the range: {command}"


# make-shards first: later recipes read what they write
ORDERED = sorted(COMMANDS, key=lambda sc: not sc[1].startswith("mplug make-shards"))


@pytest.mark.parametrize("source, command", ORDERED, ids=[f"{s}:{c[:60]}" for s, c in ORDERED])
def test_documented_command_runs_as_written(source, command, workspace, tmp_path, capsys):
    argv = _argv(command)
    args = build_parser().parse_args(argv)  # the real parser: a wrong flag exits here (SystemExit 2)
    if _runs_for_real(argv):
        if argv[0] == "eval":
            argv += ["--out", str(tmp_path / "metrics.json"), *SMALL_EVAL]
        if argv[0] == "submit" and "--dry-run" not in argv:
            argv += ["--dry-run"]  # render the script, call no sbatch
        assert main(argv) == 0, capsys.readouterr().err
        return
    # training / full-size data: what the command does before any heavy work
    if argv[0] == "bench":  # the benchmark names parse; `mplug bench` itself is tested in tests/bench
        return
    if argv[0] == "demo":  # the flags parse; tests/demo/test_demo.py runs `mplug demo --quick` for real
        return
    if argv[0] in ("export", "convert"):  # need a DeepSpeed run / an official file: run for real in
        return  # tests/models/folder/test_model_folder.py and tests/models/weights/test_convert_expansionnet.py; the flags parse here
    if argv[0] in ("pretrain", "finetune", "eval"):
        cfg = load_config(args.config, args.overrides, check_paths=argv[0] == "pretrain")
        for path in [cfg.init_from, getattr(args, "checkpoint", None)]:
            if path is not None:
                assert os.path.isfile(os.path.join(path, "config.json")), f"{source}: {command}: {path}"
        return
    pytest.fail(f"{source}: {command}: no way to check this command here")
