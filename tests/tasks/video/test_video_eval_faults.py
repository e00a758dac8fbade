"""`mplug eval video-qa` whose videos are not where the annotations say (issue 36, item 8): the error showed only
counts; it now shows the path it tried and names eval.video_name_format / eval.video_root."""
import json
import os

import pytest

from tests.helpers import REPO_ROOT, call_mplug

pytestmark = pytest.mark.usefixtures("one_thread")


def test_missing_videos_show_the_path_tried_and_the_naming_field(tmp_path, model_dir):
    videos = tmp_path / "videos"
    videos.mkdir()
    (videos / "7010.mp4").write_bytes(b"named without the 'video' prefix the config adds")
    (tmp_path / "test_qa.json").write_text(json.dumps([{"video_id": 7010, "question": "what is it?",
                                                         "answer": "a cat", "id": 0}]))
    proc = call_mplug(["eval", "video-qa", "--config", os.path.join(REPO_ROOT, "configs", "video_qa.yaml"),
                       "--checkpoint", model_dir, f"eval.annotations={tmp_path / 'test_qa.json'}",
                       f"eval.video_root={videos}", "eval.answer_list=null", "--out", tmp_path / "m.json"])
    assert proc.returncode == 3 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr == ("mplug: data error: no question could be answered (1 videos skipped: {'missing_video': 1});"
                           f" e.g. video7010: no file {videos / 'video7010'}[.mp4|.avi|...]; the file names come from "
                           f"eval.video_name_format 'video{{}}' under eval.video_root {videos}\n")
