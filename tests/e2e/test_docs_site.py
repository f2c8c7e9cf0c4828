"""``make docs``'s build, with ``--strict``: a broken link, anchor or API reference fails it (issue 47).

The site is built from docs/ (mkdocs.yml) into a temporary directory: MkDocs with the Material
theme, mkdocstrings rendering ``poise.Session``'s and ``poise.Data``'s docstrings. The built
pages must hold what the reference promises: every config field, every command, every session
parameter.
"""

from __future__ import annotations

import dataclasses
import html as _html
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

import poise
from poise import config as cfg
from tests.conftest import ROOT

pytestmark = pytest.mark.e2e

BUILD_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    assert done.returncode == 0, f"mkdocs build --strict failed (exit {done.returncode}):\n{done.stderr[-4000:]}"
    return out


@pytest.mark.timeout(BUILD_TIMEOUT_S + 60)
def test_the_site_builds_strict_with_every_page_of_the_nav(site: Path) -> None:
    for page in ("index.html", "balancing/index.html", "benchmarks/index.html", "reference/config/index.html",
                 "reference/cli/index.html", "reference/api/index.html", "design/index.html"):
        assert (site / page).is_file(), page
    assert (site / "images" / "demo-compare.png").is_file()


@pytest.mark.timeout(BUILD_TIMEOUT_S + 60)
def test_the_built_reference_holds_every_field_command_and_parameter(site: Path) -> None:
    config = (site / "reference/config/index.html").read_text()
    for name, section in cfg.SECTIONS.items():
        for field in dataclasses.fields(section):
            assert f"--{name}.{field.name}" in config, f"{name}.{field.name}"
    cli = (site / "reference/cli/index.html").read_text()
    for command in ("poise demo", "poise train", "poise bench balance", "poise diagnose run", "poise cluster up",
                    "poise checkpoint verify", "poise plan", "poise pipeline"):
        assert command in cli, command
    api = (site / "reference/api/index.html").read_text()
    for name in inspect.signature(poise.Session.__init__).parameters:
        if name != "self":
            assert name in api, f"Session({name}=...) is not in the API reference"
    for field in dataclasses.fields(poise.Data):
        assert field.name in api, f"Data({field.name}=...) is not in the API reference"


# A Sphinx role as the built page shows it when nothing rendered it (docs/hooks/sphinx_roles.py does)
UNRENDERED_ROLE = re.compile(r":(?:py:)?(?:class|meth|func|mod|data|attr|obj|exc|const|ref):`?\w")


def unrendered_roles(html: str) -> list[str]:
    """The Sphinx roles printed literally in a built page's text (tags and entities undone)."""
    text = _html.unescape(re.sub(r"<[^>]+>", "", html))
    return [text[max(0, m.start() - 40):m.end() + 40].replace("\n", " ") for m in UNRENDERED_ROLE.finditer(text)]


@pytest.mark.timeout(BUILD_TIMEOUT_S + 60)
def test_no_page_of_the_site_prints_a_sphinx_role(site: Path) -> None:
    found = [f"{page.relative_to(site)}: {hit}" for page in sorted(site.rglob("*.html"))
             for hit in unrendered_roles(page.read_text())]
    assert not found, "roles printed literally (a docstring role the griffe extension missed):\n" + "\n".join(found)


def test_an_unrendered_role_is_found_and_a_rendered_one_is_not() -> None:
    assert unrendered_roles("<p>what is trained on (:class:<code>poise.Data</code>: lengths)</p>")
    assert unrendered_roles("see :meth:`step`")
    assert not unrendered_roles('<p>see <a href="#poise.Session.step"><code>step</code></a> and 10:30</p>')
