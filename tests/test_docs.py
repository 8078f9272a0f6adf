"""The documentation a user reads matches the code and the repository: README.md, CONTRIBUTING.md and CHANGELOG.md
link to files and headings that exist (as GitHub renders them), the site's headings have the same anchor on GitHub
and in MkDocs, every path the docs name exists, the option and release tables cover what the code declares, and the
changelog's versions are in order. Links inside docs/ are checked by `bash ci/docs.sh` (MkDocs, strict)."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest
from packaging.version import Version

import pytest_vllm_mem
from pytest_vllm_mem.settings import OPTIONS
from pytest_vllm_mem.versions import VERIFIED_RELEASES

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
TOP_PAGES = ["README.md", "CONTRIBUTING.md", "CHANGELOG.md"]
PAGES = [ROOT / name for name in TOP_PAGES] + sorted(DOCS.glob("*.md"))

_FENCE = re.compile(r"^```.*?^```", re.M | re.S)
_HEADING = re.compile(r"^#{1,6} (.+?)\s*$", re.M)
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """The text outside fenced code blocks (a `# comment` in a shell example is not a heading)."""
    return _FENCE.sub("", text)


def github_anchor(heading: str) -> str:
    """The id GitHub gives a heading: lower case, punctuation dropped, each space a hyphen."""
    text = heading.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def mkdocs_anchor(heading: str) -> str:
    """The id MkDocs gives a heading (Python-Markdown's toc slugify)."""
    text = unicodedata.normalize("NFKD", heading.replace("`", "")).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: Path) -> set[str]:
    return {github_anchor(heading) for heading in _HEADING.findall(_prose(page.read_text()))}


def test_the_readme_is_a_newcomers_page() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250
    text = "\n".join(lines)
    assert "bash ci/example-suite.sh" in text and "bash ci/test.sh" in text


@pytest.mark.parametrize("name", TOP_PAGES)
def test_links_of_the_top_level_pages_resolve(name: str) -> None:
    page = ROOT / name
    broken = []
    for target in _LINK.findall(_prose(page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # an external address
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no file {file}")
        elif anchor and anchor not in anchors(file):
            broken.append(f"{target}: no heading with the anchor #{anchor} in {file.name}")
    assert not broken, f"{name}: " + "; ".join(broken)


def test_every_docs_heading_has_the_same_anchor_on_github_and_on_the_site() -> None:
    """So a link written once works both in the repository browser and in the built site."""
    differ = [
        f"{page.name}: {heading!r} is #{github_anchor(heading)} on GitHub, #{mkdocs_anchor(heading)} in MkDocs"
        for page in sorted(DOCS.glob("*.md"))
        for heading in _HEADING.findall(_prose(page.read_text()))
        if github_anchor(heading) != mkdocs_anchor(heading)
    ]
    assert not differ, "; ".join(differ)


_REPO_PATH = re.compile(
    r"(?<![\w:./~-])((?:tests|benchmarks|ci|example_suite|pytest_vllm_mem|docs)/[\w./-]*\w)(?![\w*</])"
)


def test_every_repository_path_the_docs_name_exists() -> None:
    missing = sorted(
        {
            f"{page.relative_to(ROOT)}: {path}"
            for page in PAGES
            if page.name != "CHANGELOG.md"  # the changelog names files as they were in each release
            for path in _REPO_PATH.findall(page.read_text())
            if not (ROOT / path).exists()
        }
    )
    assert not missing, "; ".join(missing)


def test_the_options_page_lists_every_option_once() -> None:
    text = (DOCS / "options.md").read_text()
    rows = re.findall(r"^\| `(--vllm-[a-z-]+)` \| `(vllm_[a-z_]+)` \|", text, re.M)
    assert sorted(rows) == sorted((item.flag, item.name) for item in OPTIONS)


def test_the_readmes_options_are_real_options() -> None:
    shown = re.findall(r"^\| `(--vllm-[a-z-]+)` \|", (ROOT / "README.md").read_text(), re.M)
    assert shown and set(shown) <= {item.flag for item in OPTIONS}


def test_the_versions_page_names_every_verified_release() -> None:
    text = (DOCS / "versions.md").read_text()
    for package, releases in VERIFIED_RELEASES.items():
        for release in releases:
            assert f"| {package} {release}" in text, f"{package} {release} is verified but not in docs/versions.md"


def documented_modules() -> set[str]:
    """The modules CONTRIBUTING.md's layout tables name: `| `config.py` |` at the top level, `| `plan/` | `x.py` |`
    in a package, and `| | `y.py` |` for the next module of the same package."""
    modules, package = set(), ""
    layout = (ROOT / "CONTRIBUTING.md").read_text().split("## Layout", 1)[1].split("\n## ", 1)[0]
    for row in re.findall(r"^\|(.*)\|$", layout, re.M):
        cells = [cell.strip() for cell in row.split("|")]
        if len(cells) == 2 and re.fullmatch(r"`[\w]+\.py`", cells[0]):
            modules.add(cells[0].strip("`"))
        elif len(cells) == 3 and re.fullmatch(r"`[\w]+\.py`", cells[1]):
            package = cells[0].strip("`") or package
            modules.add(package + cells[1].strip("`"))
    return modules


def test_the_contributing_layout_names_every_module_of_the_package() -> None:
    package = ROOT / "pytest_vllm_mem"
    modules = {
        path.relative_to(package).as_posix()
        for path in package.rglob("*.py")
        if "__pycache__" not in path.parts and not (path.name == "__init__.py" and path.parent != package)
    }
    documented = documented_modules() - {name for name in documented_modules() if name.endswith("/__init__.py")}
    assert sorted(modules - documented) == [], "modules without a row in CONTRIBUTING.md's layout"
    assert sorted(documented - modules) == [], "rows in CONTRIBUTING.md's layout for modules that do not exist"


def test_the_changelog_has_unreleased_on_top_then_released_versions_newest_first() -> None:
    headings = re.findall(r"^## (.+)$", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert headings[0] == "Unreleased"
    released = [re.fullmatch(r"(\d+\.\d+\.\d+) - \d{4}-\d{2}-\d{2}", heading) for heading in headings[1:]]
    assert all(released), headings
    versions = [Version(match.group(1)) for match in released if match]
    assert versions == sorted(versions, reverse=True)
    assert Version(pytest_vllm_mem.__version__) > versions[0], "the package version is the next release's"
