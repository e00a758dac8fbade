"""utils/atomic_files.py: a write that fails half-way leaves the old file, the new file gets the umask's mode,
parent folders are made, two writers never share a temporary file, nothing temporary is left behind."""
import json
import os
import stat
import threading

import pytest

from mplug_pretrain.utils.atomic_files import AtomicFile, atomic_write, write_json_atomic, write_text_atomic


class Killed(Exception):
    pass


def test_a_write_killed_half_way_leaves_the_old_file_intact(tmp_path):
    path = tmp_path / "metrics.json"
    write_json_atomic(path, {"old": 1})
    with pytest.raises(Killed), atomic_write(path) as f:
        f.write('{"new": ')
        f.flush()
        raise Killed
    assert json.loads(path.read_text()) == {"old": 1}
    assert os.listdir(tmp_path) == ["metrics.json"]  # the temporary file is gone too


def test_a_failed_first_write_leaves_no_file(tmp_path):
    with pytest.raises(Killed), atomic_write(tmp_path / "a.txt") as f:
        f.write("half")
        raise Killed
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(("umask", "expected"), [(0o022, 0o644), (0o027, 0o640), (0o002, 0o664)])
def test_the_mode_follows_the_umask(tmp_path, umask, expected):
    previous = os.umask(umask)
    try:
        write_text_atomic(tmp_path / "a.txt", "x")
        with atomic_write(tmp_path / "b.bin", "wb") as f:
            f.write(b"\0")
    finally:
        os.umask(previous)
    assert stat.S_IMODE(os.stat(tmp_path / "a.txt").st_mode) == expected
    assert stat.S_IMODE(os.stat(tmp_path / "b.bin").st_mode) == expected


def test_parent_folders_are_created_and_content_replaced(tmp_path):
    path = tmp_path / "deep" / "er" / "out.json"
    write_json_atomic(path, [1, 2], indent=None)
    assert path.read_text() == "[1, 2]"
    write_json_atomic(path, {"b": 1, "a": 2}, indent=None, sort_keys=True)
    assert path.read_text() == '{"a": 2, "b": 1}'
    write_text_atomic(path, "plain")
    assert path.read_text() == "plain"


def test_two_open_writers_have_their_own_temporary_files_and_the_last_commit_wins(tmp_path):
    path = tmp_path / "latest"
    first, second = AtomicFile(path), AtomicFile(path)
    assert first.temporary != second.temporary
    assert f".{os.getpid()}." in os.path.basename(first.temporary)
    first.file.write("step10")
    second.file.write("step20")
    first.commit()
    assert path.read_text() == "step10"
    second.commit()
    assert path.read_text() == "step20"
    assert os.listdir(tmp_path) == ["latest"]


def test_concurrent_writers_never_mix_their_content(tmp_path):
    path = tmp_path / "shared.txt"
    texts = [str(i) * 10_000 for i in range(8)]
    threads = [threading.Thread(target=write_text_atomic, args=(path, text)) for text in texts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert path.read_text() in texts
    assert os.listdir(tmp_path) == ["shared.txt"]


def test_discard_keeps_the_target_as_it_was(tmp_path):
    path = tmp_path / "shard.tar"
    path.write_bytes(b"old")
    pending = AtomicFile(path, "wb")
    pending.file.write(b"new")
    pending.discard()
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["shard.tar"]


def test_only_whole_file_modes(tmp_path):
    with pytest.raises(ValueError, match="'a'"):
        AtomicFile(tmp_path / "log.jsonl", "a")
