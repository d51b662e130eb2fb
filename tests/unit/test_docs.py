"""The documentation builds without a warning, lists every page, and the README stays short."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README_LIMIT = 14 * 1024  # bytes shown: the README is read in five minutes; the reference is in docs/


def _nav_pages(nav):
    """Every page file named in mkdocs.yml's nav, sections included."""
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        if isinstance(value, list):
            yield from _nav_pages(value)
        else:
            yield value


def _nav():
    yaml = pytest.importorskip("yaml")  # PyYAML comes with mkdocs
    return list(_nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]))


def test_the_docs_build_strictly(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr  # a broken link or anchor fails the build
    assert (tmp_path / "index.html").is_file()


def test_every_page_is_in_the_nav():
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    nav = _nav()
    assert len(nav) == len(set(nav)), nav
    assert pages == set(nav), {"not in the nav": pages - set(nav), "no such page": set(nav) - pages}


def test_the_readme_is_short():
    """What a reader sees: folded <details> blocks (the complete examples, whole outputs) open
    on demand and do not count."""
    visible = re.sub(r"<details>.*?</details>", "", (ROOT / "README.md").read_text(), flags=re.S)
    size = len(visible.encode())
    assert size <= README_LIMIT, f"README.md shows {size} bytes; move reference material into docs/"


def test_the_readme_links_into_the_docs_resolve():
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    local = [link for link in links if "://" not in link]
    assert any(link.startswith("docs/") for link in local)
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, missing
