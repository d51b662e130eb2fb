"""The documentation builds without a warning, lists every page in four groups, documents the Python
API from its docstrings, and the README stays short."""

import html
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README_LIMIT = 14 * 1024  # bytes: the README is a front door, read in five minutes; the manual is docs/


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


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The documentation built once, strictly, for the tests that read it."""
    for needed in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
        pytest.importorskip(needed)
    folder = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(folder)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    return folder, result


def test_the_docs_build_strictly(site):
    folder, result = site
    assert result.returncode == 0, result.stdout + result.stderr  # a broken link or anchor fails the build
    assert (folder / "index.html").is_file()


# What the API reference must document: its heading, a word of its signature, a phrase of its docstring.
API = [("accumcheck.compare", "case", "Report"),
       ("accumcheck.assert_faithful", "report", "AccumulationMismatch"),
       ("accumcheck.Report", "accum_steps", "comparison"),
       ("accumcheck.register_backend", "backend", "--framework"),
       ("accumcheck.torch.check", "accum_steps", "micro-batches"),
       ("accumcheck.torch.GradAccumulator", "compensated", "Neumaier"),
       ("accumcheck.torch.GradMonitor", "log_every", "clip_grad_norm_"),
       ("accumcheck.mxnet.check", "accum_steps", "grad_req"),
       ("accumcheck.jax.check", "loss_fn", "MultiSteps"),
       ("accumcheck.integrations.transformers.check", "trainer", "optimizer step"),
       ("accumcheck.integrations.transformers.check", "reference", "micro-batch by micro-batch"),
       ("accumcheck.torch.AccumulationCheck", "reference", "micro-batch by micro-batch"),
       ("accumcheck.integrations.accelerate.AccumulationCheck", "accelerator", "window"),
       ("accumcheck.integrations.lightning.AccumulationCheck", "steps", "window"),
       ("accumcheck.integrations.gluon.AccumulationCheck", "trainer", "window"),
       ("accumcheck.integrations.keras.check", "model", "optimizer steps"),
       ("accumcheck.integrations.keras.AccumulationCheck", "steps", "callback")]


# The public modules, each documented from its own docstring above the objects it exports.
API_MODULES = ["accumcheck", "accumcheck.torch", "accumcheck.mxnet", "accumcheck.jax",
               *(f"accumcheck.integrations.{stack}" for stack in ("transformers", "accelerate", "lightning", "gluon",
                                                                                "keras"))]


def _api_entries(page: str) -> dict[str, str]:
    """The rendered API page's objects by their heading, each with its text up to the next object (a
    class's members are objects of their own)."""
    entries = {}
    for block in re.split(r'<div class="doc doc-object ', page)[1:]:
        heading = re.search(r"<h\d[^>]*>(.*?)</h\d>", block, re.S)
        if heading:
            title = html.unescape(re.sub(r"<[^>]+>", "", heading.group(1))).split()[0]  # labels ("dataclass") after it
            entries[title] = html.unescape(re.sub(r"<[^>]+>", "", block))
    return entries


def test_the_api_reference_documents_the_public_functions(site):
    """The reference page is generated from the docstrings: a page that built empty, or lost an
    object's signature or text (a module griffe could not read), fails here."""
    folder, result = site
    assert result.returncode == 0, result.stdout + result.stderr
    page = folder / "reference" / "api" / "index.html"
    assert page.is_file(), "docs/reference/api.md was not built"
    entries = _api_entries(page.read_text())
    missing = [name for name in API_MODULES if name not in entries or len(entries[name].split()) < 10]
    assert not missing, f"the API reference lacks the modules {missing}"
    for name, argument, phrase in API:
        assert name in entries, f"the API reference has no {name} (it has {sorted(entries)})"
        text = " ".join(entries[name].split())
        assert argument in text and phrase in text, f"{name}: no signature or docstring: {text[:300]!r}"


def test_every_page_is_in_the_nav():
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    nav = _nav()
    assert len(nav) == len(set(nav)), nav
    assert pages == set(nav), {"not in the nav": pages - set(nav), "no such page": set(nav) - pages}


def test_the_readme_is_short():
    """The whole file counts: complete examples live in examples/ and whole outputs in docs/."""
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_LIMIT, f"README.md is {size} bytes; move reference material into docs/"


def test_the_nav_is_grouped_by_what_a_reader_came_for():
    yaml = pytest.importorskip("yaml")
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    assert [next(iter(entry)) for entry in nav] == ["Getting started", "How-to", "Reference", "Explanation"]


def test_the_readme_links_into_the_docs_resolve():
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    local = [link for link in links if "://" not in link]
    assert any(link.startswith("docs/") for link in local)
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, missing
