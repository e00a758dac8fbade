"""The package's import graph, read from the source with ``ast`` (every import statement, also those inside
functions): no cycle between modules; layers only import downwards (metrics never import the training engine or a
task, the engine never imports a task); a task never imports another task (shared steps sit beside the task folders
in ``tasks/*.py``, and those import no task folder)."""
import ast
import pathlib

import mplug_pretrain

PACKAGE_ROOT = pathlib.Path(mplug_pretrain.__file__).parent



def _module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: pathlib.Path = PACKAGE_ROOT) -> dict[str, set[str]]:
    """{module: the package modules it imports}; ``from pkg import name`` counts as importing ``pkg.name``
    when that is a module, else ``pkg``."""
    files = {_module_name(p, root): p for p in root.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                candidates = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - node.level + 1]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module
                candidates = [f"{module}.{alias.name}" for alias in node.names]
                candidates = [c for c in candidates if c in files] or [module]
            else:
                continue
            for candidate in candidates:
                while candidate and candidate not in files:  # `import a.b.c` imports a.b.c
                    candidate = candidate.rpartition(".")[0]
                if candidate and candidate != name:
                    targets.add(candidate)
        graph[name] = targets
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle [a, b, ..., a] by depth-first search, or None."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state:
                found = visit(target)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 else ""


def test_the_graph_sees_imports_inside_functions_and_relative_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("def f():\n    from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("from . import c\n")
    (pkg / "sub" / "c.py").write_text("import pkg.sub.a\n")
    graph = import_graph(pkg)
    assert graph["pkg.sub.a"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.sub.c"}
    assert find_cycle(graph) == ["pkg.sub.a", "pkg.sub.b", "pkg.sub.c", "pkg.sub.a"]
    (pkg / "sub" / "c.py").write_text("import os\n")
    assert find_cycle(import_graph(pkg)) is None


def test_no_import_cycle_in_the_package():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_metrics_never_import_train_or_tasks():
    graph = import_graph()
    edges = sorted((a, b) for a, targets in graph.items() for b in targets
                   if _layer(a) == "metrics" and _layer(b) in ("train", "tasks"))
    assert edges == [], f"metrics -> train/tasks imports: {edges}"


def test_models_and_data_never_import_train_metrics_or_tasks():
    graph = import_graph()
    edges = sorted((a, b) for a, targets in graph.items() for b in targets
                   if _layer(a) in ("models", "data") and _layer(b) in ("train", "metrics", "tasks"))
    assert edges == [], f"model/data code imports training, metric or task code: {edges}"


def test_the_training_engine_never_imports_a_task():
    graph = import_graph()
    edges = sorted((a, b) for a, targets in graph.items() for b in targets if _layer(a) == "train" and _layer(b) == "tasks")
    assert edges == [], f"train/ (the engine) imports a task: {edges}"


def _task(module: str) -> str | None:
    """``mplug_pretrain.tasks.caption.scst`` -> "caption"; a shared module beside the task folders -> ""."""
    parts = module.split(".")
    if len(parts) < 3 or parts[1] != "tasks":
        return None
    return parts[2] if len(parts) > 3 else ""


def test_no_task_imports_another_task():
    graph = import_graph()
    edges = sorted((a, b) for a, targets in graph.items() for b in targets
                   if _task(a) is not None and _task(b) and _task(b) != _task(a))
    assert edges == [], f"imports between task folders (move the shared part beside them, into tasks/*.py): {edges}"


def test_the_task_rule_sees_a_cross_task_import(tmp_path):
    pkg = tmp_path / "mplug_pretrain"
    for folder in ("tasks/caption", "tasks/vqa"):
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "tasks" / "__init__.py").write_text("")
    (pkg / "tasks" / "shared.py").write_text("")
    (pkg / "tasks" / "vqa" / "finetune.py").write_text("from mplug_pretrain.tasks import shared\n")
    (pkg / "tasks" / "caption" / "finetune.py").write_text("from mplug_pretrain.tasks.vqa.finetune import x\n")
    graph = import_graph(pkg)
    crossing = sorted((a, b) for a, targets in graph.items() for b in targets
                      if _task(a) is not None and _task(b) and _task(b) != _task(a))
    assert crossing == [("mplug_pretrain.tasks.caption.finetune", "mplug_pretrain.tasks.vqa.finetune")]


# Layers, bottom up; a module may import its own layer and those below, never above. The package root's own
# modules (config, errors, compat, factory) sit beside utils; __main__ is the top.
LAYERS = [{"utils", ""}, {"models", "data"}, {"metrics"}, {"train"}, {"tasks"}, {"bench", "demo", "slurm"}, {"cli"}]


def _rank(module: str) -> int:
    if module == "mplug_pretrain.__main__":
        return len(LAYERS)
    parts = module.split(".")
    layer = parts[1] if len(parts) > 1 and (PACKAGE_ROOT / parts[1]).is_dir() else ""  # a package's __init__ too
    return next(i for i, names in enumerate(LAYERS) if layer in names)


def test_every_subpackage_has_a_layer():
    layers = {_layer(m) for m in import_graph()}
    assert layers <= set().union(*LAYERS), f"add these folders to LAYERS: {layers - set().union(*LAYERS)}"


def test_no_module_imports_a_layer_above_its_own():
    graph = import_graph()
    upward = sorted((a, b) for a, targets in graph.items() for b in targets
                    if _rank(b) > _rank(a) and not (_layer(a) == "" and _layer(b) in ("models", "data")))
    assert upward == [], f"imports of a higher layer (cli > bench/demo/slurm > tasks > train > metrics > models/data): {upward}"


def test_only_the_command_line_parses_arguments():
    parsers = sorted(p.relative_to(PACKAGE_ROOT).as_posix() for p in PACKAGE_ROOT.rglob("*.py")
                     if any(word in p.read_text() for word in ("ArgumentParser(", "add_argument(", "add_parser("))
                     and p.relative_to(PACKAGE_ROOT).parts[0] not in ("cli", "bench"))
    # bench/ keeps the entry points of its own worker subprocesses (python -m mplug_pretrain.bench.X --worker)
    assert parsers == [], f"argument parsing outside cli/: {parsers}"
