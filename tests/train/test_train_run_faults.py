"""Faults and untrusted input on real runs (DeepSpeed on CPU, 2 ranks, the demo shards), all from one finished
3-step ZeRO-1 run with a checkpoint at every step, copied per test:
- a copied run folder whose checkpoint holds a ``__reduce__`` payload: resume and export refuse it by file and
  object, and the payload never runs;
- the newest tag damaged: resume falls back to the previous one and ends with the uninterrupted run's weights;
  export falls back too, or names a damaged tag asked for;
- a rerun into the finished folder without --resume is refused and its tags survive; a second live run into a
  run's folder is refused;
- resume with another batch size or on fewer ranks is refused before any work, config.yaml unchanged;
- a full (real, tmpfs) filesystem while checkpointing: the error names the folder and the free space, the
  partial tag is removed, ``latest`` still names a complete tag;
- `mplug export` of caption fine-tuning stages (cached features, then images) equals the stages' model folders;
- issue 37: export of a tag whose model_config.json names a crafted TorchScript archive runs nothing; pruning
  keeps a user's step1/, a copied tag and another run's folder behind a symlink; --resume <older tag> is refused
  while a newer complete tag exists (run.discard_newer=true deletes it); an accepted data.batch_size change states
  the samples of the epoch it skips.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from mplug_pretrain.train import checkpoint as ckpt
from tests.helpers import REPO_ROOT, call_mplug, read_log, run_mplug, tiny_pretrain_args
from tests.models.weights.torchscript_payloads import save_trapped_archive
from tests.train.test_train_safe_loading import Payload
from tests.train.test_train_schedule import reference_lr

pytestmark = pytest.mark.slow

STEPS = 3
EXTRA = ["run.checkpoint_every_steps=1", "run.keep_last=3", "distributed.zero_stage=1"]
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def finished(module_mktemp, demo_shards):
    """The finished 2-rank run's folder (3 tags, model/)."""
    root = module_mktemp("faults")
    proc = run_mplug(["pretrain", "--nproc", "2", *tiny_pretrain_args(root, demo_shards, "done", STEPS, EXTRA)],
                     env=ONE_THREAD)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root / "done"


def _copy(finished, tmp_path, demo_shards, name="run", extra=()):
    """A copy of the finished run under ``tmp_path/name`` and the arguments that continue it."""
    shutil.copytree(finished, tmp_path / name, ignore=shutil.ignore_patterns(".lock"))
    return tmp_path / name, tiny_pretrain_args(tmp_path, demo_shards, name, STEPS, [*EXTRA, *extra])


def _newest(run_dir):
    return run_dir / "checkpoints" / ckpt.tag_for(STEPS)


def _plant(path, marker):
    """Our own file (trusted here) rewritten with a payload beside its content, and the tag's marker made to
    match, as someone preparing a malicious run folder would."""
    state = torch.load(path, weights_only=False)
    state["note"] = Payload(str(marker))
    torch.save(state, path)
    ckpt._write_marker(str(path.parent), STEPS, 2, "pretrain")


def _snapshot(folder):
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in folder.rglob("*") if p.is_file() and p.name != ".lock"}


@pytest.mark.parametrize("victim", ["mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"])
def test_malicious_checkpoint_is_refused_by_resume_and_export(finished, tmp_path, demo_shards, victim):
    run_dir, args = _copy(finished, tmp_path, demo_shards)
    marker = tmp_path / "payload_ran"
    _plant(_newest(run_dir) / victim, marker)
    config_before = (run_dir / "config.yaml").read_bytes()

    proc = run_mplug(["pretrain", "--nproc", "2", *args, "--resume", "latest"], env=ONE_THREAD)
    assert proc.returncode != 0
    assert f"{_newest(run_dir) / victim}: refused" in proc.stderr and "builtins.exec" in proc.stderr
    assert "[train] step" not in proc.stdout
    exported = call_mplug(["export", "--checkpoint", str(run_dir), "--out", str(tmp_path / "out")])
    assert exported.returncode == 3, exported.stderr[-2000:]
    assert f"{_newest(run_dir) / victim}: refused" in exported.stderr and "builtins.exec" in exported.stderr
    assert not marker.exists(), "the payload ran"
    assert (run_dir / "config.yaml").read_bytes() == config_before


def test_damaged_newest_tag_resume_falls_back_and_ends_as_uninterrupted(finished, tmp_path, demo_shards):
    run_dir, args = _copy(finished, tmp_path, demo_shards)
    victim = _newest(run_dir) / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])  # truncated while latest names it
    shutil.rmtree(run_dir / "model")

    exported = call_mplug(["export", "--checkpoint", str(run_dir), "--tag", ckpt.tag_for(STEPS),
                           "--out", str(tmp_path / "out")])
    assert exported.returncode == 3 and f"{ckpt.tag_for(STEPS)}: cannot use this tag" in exported.stderr
    exported = call_mplug(["export", "--checkpoint", str(run_dir), "--out", str(tmp_path / "out")])
    assert exported.returncode == 0, exported.stderr[-2000:]
    assert f"{ckpt.tag_for(STEPS)} is damaged" in exported.stdout

    proc = run_mplug(["pretrain", "--nproc", "2", *args, "--resume", "latest"], env=ONE_THREAD)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"checkpoint {ckpt.tag_for(STEPS)} is damaged" in proc.stdout
    assert f"resumed from {ckpt.tag_for(STEPS - 1)}" in proc.stdout
    assert [r["step"] for r in read_log(run_dir)] == list(range(1, STEPS + 1))
    assert ckpt.read_latest(str(run_dir / "checkpoints")) == ckpt.tag_for(STEPS)
    assert ckpt.tag_problem(str(run_dir / "checkpoints"), ckpt.tag_for(STEPS)) is None
    straight, resumed = (load_file(d / "model" / "model.safetensors") for d in (finished, run_dir))
    assert straight.keys() == resumed.keys() and all(torch.equal(straight[k], resumed[k]) for k in straight)


def test_export_reads_no_file_a_tags_model_config_names(finished, tmp_path, demo_shards):
    run_dir, _ = _copy(finished, tmp_path, demo_shards)
    marker, archive = tmp_path / "marker", tmp_path / "ViT-B-16.pt"
    save_trapped_archive(str(archive), str(marker))
    config_file = _newest(run_dir) / ckpt.MODEL_CONFIG
    config = json.loads(config_file.read_text())
    config["vision"]["checkpoint_path"] = str(archive)
    config_file.write_text(json.dumps(config))
    ckpt._write_marker(str(_newest(run_dir)), STEPS, 2, "pretrain")  # as someone preparing the folder would
    exported = call_mplug(["export", "--checkpoint", str(run_dir), "--out", str(tmp_path / "out")])
    assert exported.returncode == 0, exported.stderr[-2000:]
    assert not marker.exists()
    straight, out = load_file(finished / "model" / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert straight.keys() == out.keys() and all(torch.equal(straight[k], out[k]) for k in straight)


def test_pruning_deletes_only_the_runs_own_tags(finished, tmp_path, demo_shards):
    run_dir, args = _copy(finished, tmp_path, demo_shards, extra=[
        f"optim.max_steps={STEPS + 2}", "run.keep_last=1", "run.allow_config_change=[optim.max_steps]"])
    ckpt_dir = run_dir / "checkpoints"
    (ckpt_dir / "step1").mkdir()
    (ckpt_dir / "step1" / "notes.txt").write_text("my notes")
    shutil.copytree(_newest(run_dir), ckpt_dir / ckpt.tag_for(99))  # a complete tag copied from elsewhere
    other = tmp_path / "other_run" / "checkpoints" / ckpt.tag_for(50)
    shutil.copytree(_newest(run_dir), other)
    os.symlink(other, ckpt_dir / ckpt.tag_for(50))
    proc = run_mplug(["pretrain", "--nproc", "2", *args, "--resume", "latest"], env=ONE_THREAD)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (ckpt_dir / "step1" / "notes.txt").read_text() == "my notes"
    assert ckpt.tag_problem(str(ckpt_dir), ckpt.tag_for(99)) is None
    assert os.path.islink(ckpt_dir / ckpt.tag_for(50)) and ckpt.tag_problem(str(other.parent), ckpt.tag_for(50)) is None
    ours = sorted(p.name for p in ckpt_dir.iterdir() if p.name.startswith("step0") and not p.is_symlink())
    assert ours == [ckpt.tag_for(STEPS + 2), ckpt.tag_for(99)]  # keep_last=1 of the run's own
    assert sorted(ckpt.read_ledger(str(ckpt_dir))) == [ckpt.tag_for(STEPS + 2)]


def test_resume_from_an_older_tag_keeps_the_newer_one_unless_discarded(finished, tmp_path, demo_shards):
    run_dir, args = _copy(finished, tmp_path, demo_shards)
    ckpt_dir = run_dir / "checkpoints"
    proc = run_mplug(["pretrain", "--nproc", "2", *args, "--resume", ckpt.tag_for(STEPS - 1)], env=ONE_THREAD)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert f"{ckpt.tag_for(STEPS)} is newer and complete" in proc.stderr and "run.discard_newer=true" in proc.stderr
    assert ckpt.tag_problem(str(ckpt_dir), ckpt.tag_for(STEPS)) is None
    proc = run_mplug(["pretrain", "--nproc", "2", *args, "run.discard_newer=true", "--resume", ckpt.tag_for(STEPS - 1)],
                     env=ONE_THREAD)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"run.discard_newer: deleted {ckpt.tag_for(STEPS)} (newer than {ckpt.tag_for(STEPS - 1)})" in proc.stdout
    straight, resumed = (load_file(d / "model" / "model.safetensors") for d in (finished, run_dir))
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)  # the discarded step re-trained exactly


def test_an_accepted_batch_size_change_resplits_the_rest_of_the_epoch(finished, tmp_path, demo_shards):
    run_dir, args = _copy(finished, tmp_path, demo_shards, extra=[
        f"optim.max_steps={STEPS + 1}", "run.allow_config_change=[data.batch_size,optim.max_steps]"])
    state = ckpt.read_torch_file(str(_newest(run_dir) / "trainer_state_rank0.pt"))["trainer"]
    proc = run_mplug(["pretrain", "--nproc", "2", *args, "data.batch_size=8", "--resume", "latest"], env=ONE_THREAD)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert state["batch_in_epoch"] > 0
    assert (f"epoch {state['epoch']}: the {state['batch_in_epoch']} batch(es) per rank consumed by 2 rank(s) x 1 "
            "worker(s) stay consumed; the rest of the epoch is re-split over 2 x 1") in proc.stdout
    assert read_log(run_dir)[-1]["samples_seen"] == read_log(finished)[-1]["samples_seen"] + 16  # 8 x 2 ranks


def test_rerun_into_a_finished_run_is_refused_and_its_tags_survive(finished, tmp_path, demo_shards):
    run_dir, args = _copy(finished, tmp_path, demo_shards)
    before = _snapshot(run_dir)
    proc = run_mplug(["pretrain", *args], env=ONE_THREAD)
    assert proc.returncode == 2
    assert "already holds a run" in proc.stderr and "--resume latest" in proc.stderr
    assert _snapshot(run_dir) == before


def test_a_second_live_run_into_one_folder_is_refused(tmp_path, demo_shards):
    args = tiny_pretrain_args(tmp_path, demo_shards, "busy", 200, ["run.checkpoint_every_steps=1000",
                                                                   "distributed.zero_stage=0"])
    first = subprocess.Popen([sys.executable, "-m", "mplug_pretrain", "pretrain", *args], cwd=REPO_ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, **ONE_THREAD})
    try:
        deadline = time.time() + 300
        while not (tmp_path / "busy" / "log.jsonl").exists() or not read_log(tmp_path / "busy"):
            assert first.poll() is None and time.time() < deadline, first.stderr.read()[-3000:]
            time.sleep(0.2)
        second = run_mplug(["pretrain", *args, "--resume", "auto"], env=ONE_THREAD)
        assert second.returncode == 2
        assert f"in use by another run (pid {first.pid}" in second.stderr
        assert first.poll() is None  # the first run goes on
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=300)


def test_resume_with_another_batch_size_is_refused_before_work(finished, tmp_path, demo_shards):
    run_dir, args = _copy(finished, tmp_path, demo_shards)
    config_before = (run_dir / "config.yaml").read_bytes()
    proc = run_mplug(["pretrain", "--nproc", "2", *args, "data.batch_size=2", "--resume", "latest"], env=ONE_THREAD)
    assert proc.returncode != 0
    assert "data.batch_size: differs from the checkpoint's config" in proc.stderr and "4 -> 2" in proc.stderr
    assert "run.allow_config_change=[data.batch_size]" in proc.stderr
    assert "[train] step" not in proc.stdout
    assert (run_dir / "config.yaml").read_bytes() == config_before


def test_an_allowed_change_applies(finished, tmp_path, demo_shards):
    """run.allow_config_change accepts a new peak LR and length: the next step's LR follows the new schedule
    (the optimizer state saved in the checkpoint does not bring back the old peak)."""
    run_dir, args = _copy(finished, tmp_path, demo_shards, extra=[
        f"optim.max_steps={STEPS + 1}", "optim.lr_rest=1e-4", "run.allow_config_change=[optim]"])
    proc = run_mplug(["pretrain", "--nproc", "2", *args, "--resume", "latest"], env=ONE_THREAD)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = read_log(run_dir)[-1]
    assert last["step"] == STEPS + 1
    expected = reference_lr(STEPS + 1, 1e-4, 1, STEPS + 1, 1e-5)  # warm-up 1 step, cosine to min_lr 1e-5
    assert last["lr_rest_decay"] == pytest.approx(expected, rel=1e-9)
    assert last["lr_vision_decay"] == pytest.approx(reference_lr(STEPS + 1, 3e-4, 1, STEPS + 1, 1e-5), rel=1e-9)


def test_resume_on_a_rank_count_no_batch_fits_is_refused_before_work(finished, tmp_path, demo_shards):
    """2 ranks x batch 4 = a global batch of 8: no per-rank batch or accumulation gives 8 on 3 ranks (other
    counts resume: tests/train/test_resume_other_world.py)."""
    run_dir, args = _copy(finished, tmp_path, demo_shards)
    before = _snapshot(run_dir)
    started = time.time()
    proc = run_mplug(["pretrain", "--nproc", "3", *args, "--resume", "latest"], env=ONE_THREAD)
    assert proc.returncode == 2
    assert "written by 2 rank(s) with a global batch of 8" in proc.stderr
    assert "Resume on one of: 1, 2, 4, 8 rank(s)" in proc.stderr
    assert time.time() - started < 60  # no model, no engine
    assert _snapshot(run_dir) == before


def _mount_tmpfs(folder, size: int) -> bool:
    if os.geteuid() != 0:
        return False
    folder.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                          capture_output=True, check=False)
    return done.returncode == 0


def test_disk_full_while_checkpointing_on_a_real_small_filesystem(finished, tmp_path, demo_shards):
    """The copy's newest tag and half of another fit; the next checkpoint does not."""
    tag_bytes = ckpt.tag_size(str(finished / "checkpoints"), ckpt.tag_for(STEPS))
    small = tmp_path / "small"
    if not _mount_tmpfs(small, tag_bytes * 3 // 2 + 2**20):
        pytest.skip("cannot mount a tmpfs here (needs root); tests/train/test_train_checkpoint_marker.py "
                    "simulates ENOSPC instead")
    try:
        run_dir = small / "run"
        shutil.copytree(finished, run_dir, ignore=shutil.ignore_patterns(".lock", "model", ckpt.tag_for(1),
                                                                          ckpt.tag_for(2)))
        args = tiny_pretrain_args(small, demo_shards, "run", STEPS + 1,
                                  [*EXTRA, "run.allow_config_change=[optim.max_steps]"])
        proc = run_mplug(["pretrain", "--nproc", "2", *args, "--resume", "latest"], env=ONE_THREAD)
        assert proc.returncode == 3, proc.stderr[-3000:]  # a rank's data error, also through the launcher
        ckpt_dir = run_dir / "checkpoints"
        assert f"{ckpt_dir}: writing checkpoint {ckpt.tag_for(STEPS + 1)} failed: the disk is full" in proc.stderr
        # issue 37: the rank that did not hit the full disk names the checkpoint and the disk too, not gloo
        errors = [line for line in proc.stderr.splitlines() if line.startswith("mplug:")]
        assert errors and all(f"{ckpt_dir}: " in line and "MiB free there" in line for line in errors), errors
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert " MiB free there" in proc.stderr and "--resume latest" in proc.stderr
        assert not (ckpt_dir / ckpt.tag_for(STEPS + 1)).exists(), "the partial tag was left"
        assert ckpt.read_latest(str(ckpt_dir)) == ckpt.tag_for(STEPS)
        assert ckpt.tag_problem(str(ckpt_dir), ckpt.tag_for(STEPS)) is None
    finally:
        subprocess.run(["umount", str(small)], check=False)


@pytest.fixture(scope="module")
def caption_run(module_mktemp):
    """A caption fine-tuning run: stage 1 on cached features of the frozen ViT, stage 2 on images."""
    from mplug_pretrain.data.writers.synthetic import write_synthetic_image_shards
    from mplug_pretrain.models.presets import build_model
    root = module_mktemp("caption_export")
    torch.manual_seed(0)
    build_model("tiny").save_pretrained(str(root / "tiny"))
    shards = write_synthetic_image_shards(str(root), num_scenes=16, captions_per_scene=2, layout="pair", seed=8,
                                          name="train")
    stages = ("caption.stages=[{name: xe, steps: 2, freeze_vision: true, cached_features: true}, "
              "{name: full, steps: 1}]")
    proc = run_mplug(["finetune", "caption", "--config", os.path.join(REPO_ROOT, "configs", "caption_demo.yaml"),
                      f"init_from={root / 'tiny'}", f"caption.train_shards={root / shards['shards'][0]['file']}",
                      "caption.val_shards=null", "caption.final_eval=none", stages, "data.batch_size=4",
                      f"run.output_dir={root}", "run.name=cap"], env=ONE_THREAD)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root / "cap"


@pytest.mark.parametrize("source, stage", [("cap/1_xe", "1_xe"), ("cap", "2_full")])
def test_caption_export_equals_the_stage_model(caption_run, tmp_path, source, stage):
    before = os.umask(0o022)
    try:
        proc = call_mplug(["export", "--checkpoint", str(caption_run.parent / source), "--out", str(tmp_path / "out")])
    finally:
        os.umask(before)
    assert proc.returncode == 0, proc.stderr[-3000:]
    exported, trained = (load_file(d / "model.safetensors") for d in (tmp_path / "out", caption_run / stage / "model"))
    assert exported.keys() == trained.keys() and all(torch.equal(exported[k], trained[k]) for k in exported)
    assert os.stat(tmp_path / "out" / "model.safetensors").st_mode & 0o777 == 0o644
    with open(tmp_path / "out" / "caption_generation.json") as f:
        assert json.load(f)["prompt"] == "a picture of"
