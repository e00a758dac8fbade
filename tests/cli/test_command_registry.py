"""One command list (cli/app.py COMMANDS) and one task registry (cli/registry.py) with no silent filter: the
`mplug` parser offers exactly the registered commands and tasks (those DESIGN names among them), every registered
task module imports, a command whose registration fails is an error rather than a vanished command, `mplug submit`
offers the registry's tasks, and a missing optional package is named, with its extra, when the command that needs
it runs."""
import argparse
import configparser
import os
import subprocess
import sys

import pytest

from mplug_pretrain.cli import app as cli_main
from mplug_pretrain.cli import build_parser, registry
from mplug_pretrain.cli.registry import MissingDependencyError, missing_dependency
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
    assert list(commands) == list(cli_main.COMMANDS)
    assert DESIGN_COMMANDS <= set(commands)
    assert set(_choices(commands["finetune"])) == set(registry.FINETUNE_TASKS) >= DESIGN_FINETUNE
    assert set(_choices(commands["eval"])) == set(registry.EVAL_TASKS) >= DESIGN_EVAL
    (bench_name,) = [a for a in commands["bench"]._actions if a.dest == "name"]
    assert set(bench_name.choices) == set(registry.BENCHES) | {"all"}
    assert DESIGN_BENCH <= set(registry.BENCHES)


def test_every_registered_task_module_imports_and_runs_something():
    for table in (registry.FINETUNE_TASKS, registry.EVAL_TASKS, registry.BENCHES):
        for name, load in table.items():
            assert callable(load().run), name


def test_one_row_per_command_and_name_and_the_fixed_arguments_reach_run():
    keys = [(command, name) for command, name, _, _ in registry.REGISTRY]
    assert len(keys) == len(set(keys))
    assert {c for c, _ in keys} == {"finetune", "eval", "bench"}
    for table, command in ((registry.FINETUNE_TASKS, "finetune"), (registry.EVAL_TASKS, "eval")):
        for task in ("snli-ve", "nlvr2"):
            run = table[task]().run
            assert run.keywords == {"task": task}, command
            assert run.func.__module__ == f"mplug_pretrain.tasks.classify.{'finetune' if command == 'finetune' else 'evaluate'}"
    assert registry.BENCHES["train-step"]().__name__ == "mplug_pretrain.bench.train_step"


def test_building_the_parser_imports_no_task_benchmark_or_deepspeed_module():
    """The registry's imports wait until a task runs: `mplug --help` stays quick and needs no optional package."""
    code = ("import sys\n"
            "from mplug_pretrain.cli import build_parser\n"
            "build_parser()\n"
            "print(sorted(m for m in sys.modules if m.startswith(('mplug_pretrain.tasks', 'mplug_pretrain.bench', "
            "'deepspeed', 'mplug_pretrain.data.reading'))))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                          check=True)
    assert proc.stdout.strip() == "[]", proc.stdout


def test_a_command_whose_registration_fails_is_an_error_not_a_vanished_command(monkeypatch):
    def broken(sub):
        raise ModuleNotFoundError("No module named 'mplug_pretrain.no_such_module'", name="mplug_pretrain.no_such_module")

    monkeypatch.setitem(cli_main.COMMANDS, "ghost", broken)
    with pytest.raises(ModuleNotFoundError, match="mplug_pretrain.no_such_module"):
        build_parser()


def test_submit_offers_every_registered_task():
    commands = _choices(build_parser())
    submit_kinds = _choices(commands["submit"])
    (task,) = [a for a in submit_kinds["finetune"]._actions if a.dest == "task"]
    assert set(task.choices) == set(registry.FINETUNE_TASKS)
    (tasks,) = [a for a in submit_kinds["eval"]._actions if a.dest == "tasks"]
    assert all(name in tasks.help for name in registry.EVAL_TASKS)


def test_optional_packages_are_the_extras_of_setup_cfg():
    setup = configparser.ConfigParser()
    setup.read(os.path.join(REPO_ROOT, "setup.cfg"))
    extras = {name: {line.strip() for line in value.splitlines() if line.strip()}
              for name, value in setup["options.extras_require"].items()}
    for module, (distribution, extra) in registry.OPTIONAL_PACKAGES.items():
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
