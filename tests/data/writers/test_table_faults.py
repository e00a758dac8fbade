"""`mplug make-shards csv` on tables a user writes by hand (issue 36, items 4 and 8): a row with an unquoted comma
used to be stored cut short, a non-UTF-8 file gave a traceback, a missing image was reported as "image 1"."""
import tarfile

from PIL import Image

from tests.helpers import call_mplug


def _photos(tmp_path, names):
    for name in names:
        Image.new("RGB", (24, 16), (200, 120, 30)).save(tmp_path / name)


def _make(tmp_path, table):
    return call_mplug(["make-shards", "csv", "--table", table, "--image-column", "file", "--caption-column",
                       "caption", "--out", tmp_path / "out"])


def _one_line_error(proc, code=3):
    assert proc.returncode == code, proc.stderr
    assert proc.stderr.startswith("mplug: data error: ") and proc.stderr.count("\n") == 1, proc.stderr
    return proc.stderr


def test_a_row_with_an_unquoted_comma_is_refused_with_its_line(tmp_path):
    _photos(tmp_path, ["photo.jpg", "other.jpg"])
    (tmp_path / "t.csv").write_text("file,caption\nother.jpg,a plain photo\nphoto.jpg,an orange,extra\n")
    err = _one_line_error(_make(tmp_path, tmp_path / "t.csv"))
    assert f"{tmp_path / 't.csv'}: row 3: 3 fields where the header has 2" in err and "quote" in err
    assert not list(tmp_path.glob("out/*.tar"))


def test_a_short_row_is_refused_with_its_line(tmp_path):
    _photos(tmp_path, ["photo.jpg"])
    (tmp_path / "t.csv").write_text("file,caption\nphoto.jpg\n")
    err = _one_line_error(_make(tmp_path, tmp_path / "t.csv"))
    assert "row 2: 1 fields where the header has 2" in err


def test_a_quoted_comma_is_kept_in_the_caption(tmp_path):
    _photos(tmp_path, ["photo.jpg"])
    (tmp_path / "t.csv").write_text('file,caption\nphoto.jpg,"an orange, sliced"\n')
    proc = _make(tmp_path, tmp_path / "t.csv")
    assert proc.returncode == 0, proc.stderr
    (tar_path,) = (tmp_path / "out").glob("*.tar")
    with tarfile.open(tar_path) as tar:
        texts = [tar.extractfile(m).read().decode() for m in tar.getmembers() if m.name.endswith(".txt")]
    assert texts == ["an orange, sliced"]


def test_a_latin1_table_is_one_line_naming_the_line(tmp_path):
    _photos(tmp_path, ["cafe.jpg"])
    (tmp_path / "t.csv").write_bytes("file,caption\ncafe.jpg,a café terrace\n".encode("latin-1"))
    err = _one_line_error(_make(tmp_path, tmp_path / "t.csv"))
    assert f"{tmp_path / 't.csv'}: line 2: not UTF-8" in err and "iconv" in err


def test_a_missing_image_names_the_table_row(tmp_path):
    _photos(tmp_path, ["photo.jpg"])
    (tmp_path / "bad.csv").write_text("file,caption\nphoto.jpg,one\nmissing.jpg,two\n")
    err = _one_line_error(_make(tmp_path, tmp_path / "bad.csv"))
    assert f"{tmp_path / 'bad.csv'}: row 3: file not found: {tmp_path / 'missing.jpg'}" in err
    assert "image 1:" not in err
