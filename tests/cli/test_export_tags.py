"""`mplug export --tag` of a tag that is gone lists the tags that exist (issue 36, item 8)."""
from tests.helpers import call_mplug


def test_a_deleted_tag_lists_the_complete_tags(tmp_path):
    ckpt = tmp_path / "run" / "checkpoints"
    for tag in ("step00000002", "step00000004"):  # tags without markers: written before markers, trusted
        (ckpt / tag).mkdir(parents=True)
    (ckpt / "latest").write_text("step00000004\n")
    proc = call_mplug(["export", "--checkpoint", tmp_path / "run", "--tag", "step00000003", "--out", tmp_path / "m"])
    assert proc.returncode == 3
    assert proc.stderr == (f"mplug: data error: {ckpt / 'step00000003'}: cannot use this tag: no such folder; "
                           "complete tags here: step00000002, step00000004\n")
    assert not (tmp_path / "m").exists()
