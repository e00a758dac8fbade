"""A loader slot whose first batch is all corrupt gets a batch of blank pads (image_id -1): pretraining trains
through it (a zero-loss step) instead of ending, on real shards with corrupt images written here."""
import io
import os

from PIL import Image

import mplug_pretrain  # noqa: F401  (torchvision shim first)
from mplug_pretrain.data.writers.shard_writer import ShardWriter
from tests.helpers import REPO_ROOT, read_log, run_mplug

BATCH = 4


def _jpeg(i: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), ((40 * i) % 256, (90 * i) % 256, 200)).save(buf, format="JPEG")
    return buf.getvalue()


def write_shard_with_corrupt_head(folder: str, corrupt: int, good: int) -> str:
    """One shard: ``corrupt`` samples whose jpg is not an image, then ``good`` real ones."""
    with ShardWriter(folder, "head", kind="image-text", created_by="test") as writer:
        for i in range(corrupt + good):
            jpg = b"not a jpeg at all" if i < corrupt else _jpeg(i)
            writer.write({"__key__": f"s{i:05d}", "jpg": jpg, "txt": f"a picture number {i}",
                          "json": {"image_id": i}})
    return os.path.join(folder, "head-000000.tar")


def pretrain_args(tmp_path, shards: str, name: str, steps: int, extra=()) -> list[str]:
    return ["pretrain", "--config", os.path.join(REPO_ROOT, "configs", "pretrain_tiny.yaml"),
            f"data.train_shards={shards}", f"data.batch_size={BATCH}", "data.num_workers=1",
            "data.shuffle_buffer=1",  # keep the raw order: the corrupt samples stay batch 0 of the slot
            f"optim.max_steps={steps}", "optim.warmup_steps=1", f"run.output_dir={tmp_path}", f"run.name={name}",
            "run.tensorboard=false", "run.log_every=1", "model.heads.queue_size=16", "distributed.zero_stage=0",
            *extra]


def test_pretraining_goes_on_past_a_first_batch_of_corrupt_samples(tmp_path):
    shards = write_shard_with_corrupt_head(str(tmp_path / "shards"), corrupt=BATCH, good=2 * BATCH)
    proc = run_mplug(pretrain_args(tmp_path, shards, "blank", steps=3))
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = read_log(tmp_path / "blank")
    assert [r["step"] for r in log] == [1, 2, 3]
    assert log[0]["corrupt_skipped"] >= BATCH  # step 1 was the slot's all-corrupt batch ...
    assert log[0]["loss"] == 0.0  # ... trained with weight 0
    assert all(r["loss"] > 0 for r in log[1:])  # the real batches after it train
    assert os.path.isfile(tmp_path / "blank" / "model" / "model.safetensors")
