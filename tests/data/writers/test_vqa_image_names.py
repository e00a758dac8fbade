"""`mplug make-shards vqa` finds images by the file names a COCO-style images list gives (issue 36, item 8): it
matched by trailing digits only, so a .png beside a .jpg of the same id, or names without the id, needed
renaming."""
import json
import tarfile

from PIL import Image

from tests.helpers import call_mplug


def _folder(tmp_path):
    images = tmp_path / "images"
    images.mkdir()
    Image.new("RGB", (20, 10), (255, 0, 0)).save(images / "kitchen_7.jpg")
    Image.new("RGB", (20, 10), (0, 0, 255)).save(images / "kitchen_7.png")  # a copy in another format, same digits
    Image.new("RGB", (20, 10), (0, 255, 0)).save(images / "garden.png")  # no id in the name
    questions = [{"question_id": 70, "image_id": 7, "question": "what colour?"},
                 {"question_id": 90, "image_id": 9, "question": "what colour?"}]
    (tmp_path / "q.json").write_text(json.dumps({"questions": questions}))
    return images


def test_images_are_found_by_the_coco_style_file_names(tmp_path):
    images = _folder(tmp_path)
    (tmp_path / "info.json").write_text(json.dumps({"images": [{"id": 7, "file_name": "kitchen_7.png"},
                                                               {"id": 9, "file_name": "garden.png"}]}))
    proc = call_mplug(["make-shards", "vqa", "--questions", tmp_path / "q.json", "--images", images,
                       "--image-info", tmp_path / "info.json", "--out", tmp_path / "out"])
    assert proc.returncode == 0, proc.stderr
    (tar_path,) = (tmp_path / "out").glob("*.tar")
    with tarfile.open(tar_path) as tar:
        stored = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    assert stored["70.png"] == (images / "kitchen_7.png").read_bytes()
    assert stored["90.png"] == (images / "garden.png").read_bytes()


def test_ambiguous_trailing_digits_point_to_the_image_info_option(tmp_path):
    images = _folder(tmp_path)
    proc = call_mplug(["make-shards", "vqa", "--questions", tmp_path / "q.json", "--images", images,
                       "--out", tmp_path / "out"])
    assert proc.returncode == 3 and proc.stderr.count("\n") == 1, proc.stderr
    assert "image id 7 matches both" in proc.stderr and "--image-info" in proc.stderr
