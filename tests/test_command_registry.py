"""One command registry (command_registry.py) with no silent filter: the `mplug` parser offers exactly the
registered commands (those DESIGN names among them), every registered module imports, an entry whose module is
missing is an error rather than a vanished command, and a missing optional package is named, with its extra,
when the command that needs it runs."""
import argparse
import configparser
import os
import subprocess
import sys

import pytest

from mplug_pretrain import command_registry
from mplug_pretrain.cli import build_parser
from mplug_pretrain.command_registry import MissingDependencyError, missing_dependency
from tests.helpers import REPO_ROOT

# DESIGN.md "Command interface": the names users and acceptance checks rely on
DESIGN_COMMANDS = {"demo", "make-shards", "pretrain", "finetune", "eval", "caption", "export", "submit", "bench"}
DESIGN_FINETUNE = {"caption", "vqa"}
DESIGN_EVAL = {"caption", "vqa", "retrieval", "video-retrieval", "video-qa", "video-caption"}
DESIGN_BENCH = {"fusion", "train-step", "dataloader", "generate", "cider", "feature-cache"}


def _choices(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return action.choices


def test_the_parser_offers_exactly_the_registered_commands_and_tasks():
    commands = _choices(build_parser())
    assert list(commands) == list(command_registry.COMMANDS)
    assert DESIGN_COMMANDS <= set(commands)
    assert set(_choices(commands["finetune"])) == set(command_registry.FINETUNE_TASKS) >= DESIGN_FINETUNE
    assert set(_choices(commands["eval"])) == set(command_registry.EVAL_TASKS) >= DESIGN_EVAL
    (bench_name,) = [a for a in commands["bench"]._actions if a.dest == "name"]
    assert set(bench_name.choices) == set(command_registry.BENCHES) | {"all"}
    assert DESIGN_BENCH <= set(command_registry.BENCHES)


def test_every_registered_module_imports():
    for target in command_registry.COMMANDS.values():
        assert callable(command_registry.resolve(target)), target
    for registry in (command_registry.FINETUNE_TASKS, command_registry.EVAL_TASKS, command_registry.BENCHES):
        for name in registry:
            assert callable(command_registry.import_task(registry, name, name).run), name


def test_a_command_whose_module_is_missing_is_an_error_not_a_vanished_command(monkeypatch):
    monkeypatch.setitem(command_registry.COMMANDS, "ghost", "mplug_pretrain.no_such_module:register")
    with pytest.raises(ModuleNotFoundError, match="mplug_pretrain.no_such_module"):
        build_parser()


def test_optional_packages_are_the_extras_of_setup_cfg():
    setup = configparser.ConfigParser()
    setup.read(os.path.join(REPO_ROOT, "setup.cfg"))
    extras = {name: {line.strip() for line in value.splitlines() if line.strip()}
              for name, value in setup["options.extras_require"].items()}
    for module, (distribution, extra) in command_registry.OPTIONAL_PACKAGES.items():
        assert distribution in extras.get(extra, set()), f"{module}: {distribution} is not in the extra {extra!r}"


def test_the_missing_dependency_message_names_package_and_extra():
    err = missing_dependency(ModuleNotFoundError("No module named 'av'", name="av"), "mplug make-shards")
    assert isinstance(err, MissingDependencyError)
    assert "'av'" in str(err) and "mplug_pretrain[video]" in str(err) and "mplug make-shards" in str(err)


def test_running_a_command_without_its_optional_package_says_what_to_install(tmp_path):
    """A real run with ``av`` made unimportable (sys.modules entry None is how Python marks a failed import)."""
    code = ("import sys; sys.modules['av'] = None\n"
            "from mplug_pretrain.cli import main\n"
            f"sys.exit(main(['make-shards', 'synthetic', '--kind', 'video', '--num', '2', '--out', {str(tmp_path)!r}]))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 4, proc.stderr[-2000:]
    assert "mplug make-shards needs the optional package 'av'" in proc.stderr
    assert "pip install 'mplug_pretrain[video]'" in proc.stderr
