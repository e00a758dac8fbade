"""VQA end to end on a small easy-vqa subset (real package, real shards): `mplug finetune vqa` and `mplug eval vqa`
through the CLI for a few steps, the submission file, and generation agreeing with answer-list ranking on a
trained toy."""
from __future__ import annotations

import json
import os

import pytest
import torch

import mplug_pretrain  # noqa: F401  (torchvision shim before timm / open_clip)
from mplug_pretrain.data.reading.loader_spec import LoaderSpec
from mplug_pretrain.data.reading.pipeline import build_vqa_loader
from mplug_pretrain.data.reading.urls import all_shards, expand_sources
from mplug_pretrain.data.tokenizer import load_tokenizer, tokenize
from mplug_pretrain.data.writers.easy_vqa import write_easy_vqa_shards
from mplug_pretrain.data.writers.shard_writer import shard_pattern
from mplug_pretrain.demo.vocab import shard_texts, vocab_size, write_demo_vocab
from mplug_pretrain.demo.vqa_stage import majority_baseline, read_vqa_answers
from mplug_pretrain.metrics.vqa_accuracy import vqa_accuracy
from mplug_pretrain.models.generation.settings import AnswerSettings
from mplug_pretrain.models.presets import build_model
from mplug_pretrain.tasks.vqa.evaluate import AnswerPredictor, answer_questions
from mplug_pretrain.tasks.vqa.finetune import answer_pairs, freeze_pretraining_heads, weighted_answer_loss
from tests.helpers import REPO_ROOT, call_mplug, read_log, run_mplug

CONFIG = os.path.join(REPO_ROOT, "configs", "vqa_demo.yaml")
MAX_ANSWER_LENGTH = 5


@pytest.fixture(scope="module")
def shards(module_mktemp) -> dict:
    root = str(module_mktemp("easy_vqa"))
    train = write_easy_vqa_shards(root, split="train", max_questions=320, seed=0, name="train")
    val = write_easy_vqa_shards(root, split="test", max_questions=48, seed=1, name="val")
    return {"train": shard_pattern(root, "train", len(train["shards"])),
            "val": shard_pattern(root, "val", len(val["shards"])), "root": root}


@pytest.fixture(scope="module")
def cli_runs(shards, module_mktemp) -> dict:
    """A random-init tiny model fine-tuned for 3 steps by `mplug finetune vqa` (validated at steps 2 and 3,
    generation at the end), then evaluated by `mplug eval vqa` with ranking and the legacy normalisation."""
    root = module_mktemp("vqa_cli")
    init = str(root / "init")
    torch.manual_seed(0)
    build_model("tiny").save_pretrained(init)
    common = [f"vqa.val_shards={shards['val']}", f"data.train_shards={shards['train']}", "data.num_workers=0",
              "eval.batch_size=48"]
    finetune = run_mplug(["finetune", "vqa", "--config", CONFIG, f"init_from={init}",
                          f"vqa.train_shards={shards['train']}", "vqa.inference=generate", "data.batch_size=8",
                          "optim.max_steps=3", "optim.warmup_steps=1", "run.log_every=1", "run.eval_every_steps=2",
                          f"run.output_dir={root}", "run.name=ft", *common], timeout=600)
    assert finetune.returncode == 0, finetune.stderr[-3000:]
    evaluate = call_mplug(["eval", "vqa", "--config", CONFIG, "--checkpoint", str(root / "ft" / "model"),
                           "--out", str(root / "eval" / "metrics.json"), "vqa.inference=rank",
                           "vqa.normalization=legacy", *common])
    assert evaluate.returncode == 0, evaluate.stderr[-3000:]
    return {"run_dir": root / "ft", "eval_dir": root / "eval"}


def load(path) -> dict | list:
    with open(path) as f:
        return json.load(f)


@pytest.mark.slow  # cli_runs: `mplug finetune vqa` + `mplug eval vqa` in subprocesses
def test_finetune_cli_trains_saves_and_evaluates(cli_runs, shards):
    run_dir = cli_runs["run_dir"]
    steps = [r for r in read_log(run_dir) if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3] and all(r["loss"] > 0 for r in steps)
    assert os.path.isfile(run_dir / "model" / "model.safetensors")
    # the answer list of the training shards is kept with the model (issue 26)
    assert load(run_dir / "model" / "answer_list.json") == load(os.path.join(shards["root"], "train_answer_list.json"))
    metrics = load(run_dir / "metrics.json")
    assert metrics["inference"] == "generate" and metrics["num_questions"] == 48
    assert metrics["normalization"] == "official_2021" and 0.0 <= metrics["vqa_accuracy"] <= 100.0


@pytest.mark.slow  # cli_runs
def test_validation_while_fine_tuning_is_the_final_evaluation_at_the_last_step(cli_runs):
    """run.eval_every_steps=2 of 3: the task's metric on the live model at steps 2 and 3, logged as val_*; at the
    last step it equals the evaluation of the exported model after training (another load, the same questions)."""
    run_dir = cli_runs["run_dir"]
    records = [r for r in read_log(run_dir) if "val_vqa_accuracy" in r]
    assert [r["step"] for r in records] == [2, 3]
    assert all(r["val_num_questions"] == 48 and r["val_time_s"] > 0 for r in records)
    assert records[-1]["val_vqa_accuracy"] == pytest.approx(load(run_dir / "metrics.json")["vqa_accuracy"], abs=1e-9)
    best = max(records, key=lambda r: r["val_vqa_accuracy"])
    assert load(run_dir / "best" / "val_metrics.json")["step"] == best["step"]
    assert (run_dir / "best" / "model.safetensors").is_file()


@pytest.mark.slow  # cli_runs: `mplug finetune vqa` + `mplug eval vqa` in subprocesses
@pytest.mark.parametrize("which", ["run_dir", "eval_dir"])
def test_submission_answers_every_question_and_scores_as_reported(which, cli_runs, shards):
    folder = cli_runs[which]
    metrics = load(folder / "metrics.json")
    submission = load(folder / "metrics.vqa_submission.json")
    assert metrics["submission"] == str(folder / "metrics.vqa_submission.json")
    truth = read_vqa_answers(shards["val"])
    assert [row["question_id"] for row in submission] == sorted(truth)
    assert all(set(row) == {"question_id", "answer"} and isinstance(row["answer"], str) for row in submission)
    recount = 100.0 * sum(vqa_accuracy(row["answer"], truth[row["question_id"]], metrics["normalization"])
                          for row in submission) / len(submission)
    assert metrics["vqa_accuracy"] == pytest.approx(recount, abs=1e-9)


@pytest.mark.slow  # cli_runs: `mplug finetune vqa` + `mplug eval vqa` in subprocesses
def test_eval_cli_ranks_within_the_answer_list(cli_runs, shards):
    metrics = load(cli_runs["eval_dir"] / "metrics.json")
    assert metrics["inference"] == "rank" and metrics["normalization"] == "legacy"
    answer_list = load(os.path.join(shards["root"], "val_answer_list.json"))
    assert {row["answer"] for row in load(cli_runs["eval_dir"] / "metrics.vqa_submission.json")} <= set(answer_list)


def test_majority_baseline_counts_training_answers(shards):
    truth = read_vqa_answers(shards["train"])
    counts: dict[str, int] = {}
    for answers in truth.values():
        for a in answers:
            counts[a] = counts.get(a, 0) + 1
    majority, accuracy = majority_baseline(shards["train"], shards["val"], "official_2021")
    assert counts[majority] == max(counts.values())
    val = read_vqa_answers(shards["val"])
    # easy-vqa writes one answer ten times: accuracy is the share of questions whose answer is the majority one
    assert accuracy == pytest.approx(100.0 * sum(a[0] == majority for a in val.values()) / len(val))


@pytest.fixture(scope="module")
def trained_toy(shards, module_mktemp):
    """A tiny model whose decoder is trained (fixed random encoders, memories computed once) until it answers
    colour, shape and yes/no questions differently. Its vocabulary is the shards' own words (demo.vocab: BERT's
    special ids, then every word of the questions and answers): a 30,522-word head made this fixture ~3x slower."""
    vocab = write_demo_vocab(str(module_mktemp("toy_vocab")), shard_texts(
        all_shards(expand_sources(f"{shards['train']}::{shards['val']}"))))
    torch.manual_seed(0)
    tokenizer = load_tokenizer(vocab)
    model = freeze_pretraining_heads(build_model("tiny", heads={"use_momentum": False},
                                                 text={"vocab_size": vocab_size(vocab)}))
    loader = build_vqa_loader(LoaderSpec.evaluation(shards["train"], 16), tokenizer, image_size=64, max_text_len=20,
                              augment=False)
    model.eval()
    cache = []
    with torch.no_grad():
        for batch in loader:
            memory, memory_mask = model.memory(batch["image"], batch["question_input_ids"],
                                               batch["question_attention_mask"])
            rows, texts, weights = answer_pairs(batch["answers"], batch["answer_weights"], batch["is_pad"],
                                                batch["question_id"])
            ids, mask = tokenize(tokenizer, texts, MAX_ANSWER_LENGTH + 1)
            cache.append((memory, memory_mask, rows, ids, mask, weights))
    model.decoder.train()
    epochs = 12
    optimizer = torch.optim.AdamW(model.decoder.parameters(), lr=2e-3, fused=True)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step / (epochs * len(cache)))
    for _ in range(epochs):  # over the cached memories
        for memory, memory_mask, rows, ids, mask, weights in cache:
            loss = weighted_answer_loss(model.decoder, memory, memory_mask, rows, ids, mask, weights)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            schedule.step()
    return model.eval(), tokenizer, float(loss.detach())


def test_generation_and_ranking_agree_on_a_trained_toy(trained_toy, shards):
    model, tokenizer, last_loss = trained_toy
    assert last_loss < 2.0
    loader = build_vqa_loader(LoaderSpec.evaluation(shards["val"], 48), tokenizer, image_size=64, max_text_len=20,
                              augment=False)
    device = torch.device("cpu")
    settings = AnswerSettings(beam_size=3, max_length=MAX_ANSWER_LENGTH)
    generated = answer_questions(AnswerPredictor(model, tokenizer, "generate", settings, 128), loader, device)
    ranked = answer_questions(AnswerPredictor(model, tokenizer, "rank", settings, 128, loader.answer_list), loader,
                              device)
    assert [r["question_id"] for r in generated] == [r["question_id"] for r in ranked]
    assert len({r["answer"] for r in ranked}) >= 3, "the toy should answer question types differently"
    agreement = sum(g["answer"] == r["answer"] for g, r in zip(generated, ranked)) / len(ranked)
    assert agreement >= 0.9, [(g["question"], g["answer"], r["answer"]) for g, r in zip(generated, ranked)]


def test_eval_ranks_over_the_answer_list_kept_in_the_model_folder(shards, tmp_path):
    """complete_model_folder keeps the training shards' answer list; evaluation takes it from the model folder
    when neither vqa.answer_list nor the question shards give one; vqa.answer_list still wins when given."""
    from types import SimpleNamespace

    from mplug_pretrain.config import load_config
    from mplug_pretrain.tasks.vqa.evaluate import resolve_answer_list
    from mplug_pretrain.train.export import complete_model_folder
    folder = tmp_path / "model"
    torch.manual_seed(0)
    build_model("tiny").save_pretrained(str(folder))
    cfg = load_config(CONFIG, [f"vqa.train_shards={shards['train']}"], check_paths=False)
    complete_model_folder(str(folder), cfg)
    train_list = load(os.path.join(shards["root"], "train_answer_list.json"))
    assert load(folder / "answer_list.json") == train_list
    no_list = SimpleNamespace(answer_list=None)
    assert resolve_answer_list(load_config(CONFIG, check_paths=False), no_list, str(folder)) == train_list
    assert resolve_answer_list(load_config(CONFIG, check_paths=False), no_list, str(tmp_path)) is None
    given = tmp_path / "given.json"
    given.write_text(json.dumps(["red", "blue"]))
    cfg = load_config(CONFIG, [f"vqa.answer_list={given}"], check_paths=False)
    assert resolve_answer_list(cfg, no_list, str(folder)) == ["red", "blue"]
