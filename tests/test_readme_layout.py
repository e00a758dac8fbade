"""README.md's layout table stays true: every package folder has a row (or is named in its parent's row), every
folder a row names exists, and every docs/ page the README links to exists (issue 34)."""
import os
import re

from tests.helpers import REPO_ROOT

PACKAGE = os.path.join(REPO_ROOT, "mplug_pretrain")


def _layout_rows() -> dict[str, str]:
    with open(os.path.join(REPO_ROOT, "README.md"), encoding="utf-8") as f:
        section = f.read().split("## Layout", 1)[1].split("\n## ", 1)[0]
    return {m.group(1): m.group(2) for m in re.finditer(r"^\| `([^`]+/)` \| (.*) \|$", section, re.MULTILINE)}


def test_every_package_folder_has_a_layout_row_and_every_row_a_folder():
    rows = _layout_rows()
    assert len(rows) > 20
    for folder in rows:
        assert os.path.isdir(os.path.join(REPO_ROOT, folder)), f"README layout names {folder}, which does not exist"
    for root, _, files in os.walk(PACKAGE):
        if "__init__.py" not in files:
            continue
        folder = os.path.relpath(root, REPO_ROOT) + "/"
        parent = os.path.dirname(folder.rstrip("/")) + "/"
        named_in_parent = f"`{os.path.basename(folder.rstrip('/'))}/`" in rows.get(parent, "")
        assert folder in rows or named_in_parent, f"README layout has no row for {folder}"


def test_the_readme_links_only_to_docs_pages_that_exist():
    with open(os.path.join(REPO_ROOT, "README.md"), encoding="utf-8") as f:
        links = set(re.findall(r"\]\(((?:docs|bench)/[^)#]+)\)", f.read()))
    assert {"docs/configuration.md", "docs/faults.md", "docs/benchmarks.md"} <= links
    assert all(os.path.isfile(os.path.join(REPO_ROOT, link)) for link in links), links
