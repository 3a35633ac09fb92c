"""The documentation stays complete and its links stay valid (the strict site build itself runs in
`make docs`, which `make test` runs before the suite):

- every `p2ptrain` command and sub-command of the real parser has a heading on the CLI reference
  page, and every flag of each appears there;
- every relative link in README.md and docs/*.md points to a file that exists, and an anchor to a
  heading that exists, with the same slug on GitHub and in the mkdocs site;
- README.md stays short; mkdocs.yml's nav lists every page of docs/;
- the API page documents every public name of `import p2ptrain`, and each `::: module.Name` it
  lists imports.
"""
from __future__ import annotations

import importlib
import re
import unicodedata
from pathlib import Path

import pytest
import yaml

from p2ptrain.cli import build_parser, command_tree, option_strings

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
CLI_PAGE = DOCS / "cli.md"
API_PAGE = DOCS / "api.md"
README_MAX_LINES = 260

FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$", re.M)
LINK = re.compile(r"(?<!!)\[(?:[^\]\\]|\\.)*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"`+[^`\n]*`+")


def pages() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def prose(path: Path) -> str:
    """The page without fenced code blocks (a `# comment` in a bash block is not a heading)."""
    return FENCE.sub("", path.read_text(encoding="utf-8"))


def mkdocs_slug(text: str) -> str:
    """Python-Markdown's toc slug (what the mkdocs site uses)."""
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def github_slug(text: str) -> str:
    """GitHub's heading anchor (how README.md and docs/*.md links work on github.com)."""
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def heading_text(raw: str) -> str:
    raw = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", raw)  # a link in a heading: its text
    return raw.replace("`", "").replace("*", "")


def headings(path: Path) -> list[str]:
    return [heading_text(m.group(2)) for m in HEADING.finditer(prose(path))]


def leaf_commands():
    return [(path, sub) for path, sub, group in command_tree() if not group]


def test_every_command_has_a_heading_on_the_cli_page():
    titles = {" ".join(t.split()) for t in headings(CLI_PAGE)}
    missing = [" ".join(("p2ptrain", *path)) for path, _ in leaf_commands()
               if " ".join(("p2ptrain", *path)) not in titles]
    assert not missing, f"commands without a heading on {CLI_PAGE.relative_to(ROOT)}: {missing}"
    text = CLI_PAGE.read_text(encoding="utf-8")
    groups = [" ".join(("p2ptrain", *path)) for path, _, group in command_tree() if group]
    assert groups and all(group in text for group in groups), groups  # `p2ptrain bench`, `p2ptrain reproduce`


def test_the_parser_has_the_commands_the_page_was_written_for():
    names = {" ".join(path) for path, _ in leaf_commands()}
    assert {"node", "ps", "launch", "compose", "kubernetes", "report", "health", "bench transport",
            "bench algorithms", "bench peers", "reproduce relaysgd", "reproduce diloco", "reproduce gem"} <= names


@pytest.mark.parametrize("path,sub", [pytest.param(p, s, id=" ".join(p) or "p2ptrain")
                                      for p, s in [((), build_parser()), *leaf_commands()]])
def test_every_flag_is_on_the_cli_page(path, sub):
    text = CLI_PAGE.read_text(encoding="utf-8")
    missing = [option for option in option_strings(sub) if option.startswith("--") and option != "--help"
               and not re.search(r"`" + re.escape(option) + r"[ `=]", text)]
    assert not missing, f"p2ptrain {' '.join(path)}: flags missing on {CLI_PAGE.relative_to(ROOT)}: {missing}"


def links(path: Path) -> list[str]:
    text = CODE_SPAN.sub("", prose(path))
    return [m.group(1) for m in LINK.finditer(text)]


@pytest.mark.parametrize("page", [ROOT / "README.md", *pages()], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_existing_files_and_headings(page: Path):
    broken = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.is_file():
            broken.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
            continue
        if not dest.is_relative_to(ROOT):
            broken.append(f"{target}: outside the repository")
            continue
        if anchor:
            if dest.suffix != ".md":
                broken.append(f"{target}: an anchor into a file that is not Markdown")
                continue
            texts = headings(dest)
            if anchor not in {mkdocs_slug(t) for t in texts}:
                broken.append(f"{target}: no heading '#{anchor}' in {dest.relative_to(ROOT)}")
            elif anchor not in {github_slug(t) for t in texts}:
                broken.append(f"{target}: the heading's anchor differs on GitHub (avoid punctuation in it)")
    assert not broken, f"{page.relative_to(ROOT)}:\n" + "\n".join(broken)


def test_docs_links_stay_inside_docs():
    """mkdocs serves only docs/: a page linking to ../something breaks in the site."""
    outside = [(p.name, t) for p in pages() for t in links(p)
               if not re.match(r"^[a-z][a-z0-9+.-]*:", t) and t.split("#")[0]
               and not (p.parent / t.split("#")[0]).resolve().is_relative_to(DOCS)]
    assert not outside, outside


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}): move detail to docs/"


def nav_pages(nav) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [page for item in nav for page in nav_pages(item)]
    if isinstance(nav, dict):
        return [page for value in nav.values() for page in nav_pages(value)]
    return []


def test_mkdocs_nav_lists_every_page_and_only_pages_that_exist():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    assert config["docs_dir"] == "docs"
    listed = nav_pages(config["nav"])
    assert len(listed) == len(set(listed)), "a page is listed twice in mkdocs.yml's nav"
    on_disk = {p.name for p in pages()}
    assert set(listed) == on_disk, (f"missing from nav: {sorted(on_disk - set(listed))}; "
                                    f"in nav but not in docs/: {sorted(set(listed) - on_disk)}")


def api_targets() -> list[str]:
    return re.findall(r"^:::\s+([\w.]+)\s*$", API_PAGE.read_text(encoding="utf-8"), re.M)


def resolve(dotted: str):
    module, _, name = dotted.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except ModuleNotFoundError:  # a class member: module.Class.name
        return getattr(resolve(module), name)


def test_api_page_entries_import():
    targets = api_targets()
    assert targets
    for dotted in targets:
        resolve(dotted)  # an ImportError / AttributeError names the entry that moved


def test_api_page_documents_every_public_name():
    import p2ptrain

    documented = [resolve(dotted) for dotted in api_targets()]
    missing = [name for name in p2ptrain.__all__ if not name.startswith("__")
               and not any(getattr(p2ptrain, name) is obj for obj in documented)]
    assert not missing, f"public names not on {API_PAGE.relative_to(ROOT)}: {missing}"
    from p2ptrain.node import Node

    assert any(obj is Node for obj in documented), "the Node class (what p2ptrain.init() returns)"
