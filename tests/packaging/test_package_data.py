"""A non-editable `pip install .` ships configs/ and deepspeed_configs/: installed into a fresh folder (no
network: --no-deps --no-build-isolation) and imported from outside the repository, the package resolves its
ZeRO templates and run configs to its own copies, equal to the repository's files."""
import json
import os
import shutil
import subprocess
import sys

from tests.helpers import REPO_ROOT

CHECK = """
import json, os, sys
import mplug_pretrain
from mplug_pretrain.config import deepspeed_config, load_config
from mplug_pretrain.utils.resources import config_file, deepspeed_template
site = sys.argv[1]
assert mplug_pretrain.__file__.startswith(site), mplug_pretrain.__file__
cfg = load_config(config_file("pretrain_tiny.yaml"), ["distributed.zero_stage=2"], check_paths=False)
print(json.dumps({"template": deepspeed_template("zero3.json"), "config": config_file("demo.yaml"),
                  "zero": deepspeed_config(cfg, 2)["zero_optimization"]["stage"],
                  "templates": sorted(os.listdir(os.path.dirname(deepspeed_template("zero1.json"))))}))
"""


def tracked_copy(destination: str) -> None:
    """The working tree's tracked files (symbolic links kept as links), as a fresh clone would have them."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO_ROOT, capture_output=True, check=True).stdout
    for name in files.decode().split("\0"):
        source = os.path.join(REPO_ROOT, name)
        if not name or not os.path.lexists(source):
            continue
        target = os.path.join(destination, name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if os.path.islink(source):
            os.symlink(os.readlink(source), target)
        else:
            shutil.copy2(source, target)


def test_pip_install_ships_the_zero_templates_and_configs(tmp_path):
    source, site, outside = tmp_path / "src", tmp_path / "site", tmp_path / "elsewhere"
    tracked_copy(str(source))
    outside.mkdir()
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                           "-q", "--target", str(site), str(source)], check=False, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not os.path.islink(site / "mplug_pretrain" / "deepspeed_configs"), "the wheel must hold copies"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    proc = subprocess.run([sys.executable, "-c", CHECK, str(site)], check=False, cwd=str(outside), env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["template"].startswith(str(site)) and report["config"].startswith(str(site))
    with open(report["template"]) as a, open(os.path.join(REPO_ROOT, "deepspeed_configs", "zero3.json")) as b:
        assert json.load(a) == json.load(b)
    repo_templates = sorted(f for f in os.listdir(os.path.join(REPO_ROOT, "deepspeed_configs")) if f.endswith(".json"))
    assert [f for f in report["templates"] if f.endswith(".json")] == repo_templates
    assert report["zero"] == 2
