"""The documentation: the site builds in strict mode (no broken link or anchor), the README's links into
docs/ find their page and heading, and a command whose output a page shows still prints it."""

import re
import subprocess
import sys

import pytest
from conftest import ROOT
from docs_blocks import block_with


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr[-4000:]
    return out


def test_the_site_builds_in_strict_mode(site):
    assert (site / "index.html").exists()
    assert (site / "architecture" / "index.html").exists()


def test_strict_mode_fails_on_a_broken_anchor(tmp_path):
    """The check the build relies on: a link to a heading a page does not have stops it."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\n[there](other.md#no-such-heading)\n")
    (docs / "other.md").write_text("# Other\n")
    config = (ROOT / "mkdocs.yml").read_text().split("\nnav:")[0]  # the same validation, no nav
    (tmp_path / "mkdocs.yml").write_text(config)
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert build.returncode != 0
    assert "no-such-heading" in build.stderr


def test_readme_links_into_docs_find_their_page_and_heading(site):
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(docs/([^)#]+)(?:#([^)]+))?\)", readme)
    assert len(links) >= 10
    for page, anchor in links:
        assert (ROOT / "docs" / page).exists(), page
        if page.endswith(".md") and anchor:
            html = (site / page.removesuffix(".md") / "index.html").read_text()
            assert f'id="{anchor}"' in html, f"README links to docs/{page}#{anchor}, which has no such heading"


def test_readme_stays_one_screen_of_reading():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


def test_the_latency_prediction_prints_what_the_page_shows():
    page = ROOT / "docs" / "simulated-engine.md"
    command = block_with(page, "python -m sim.simulate").strip()
    shown = block_with(page, "python -m sim.simulate", offset=1)
    args = command.split()[3:]  # after "python -m sim.simulate"
    run = subprocess.run(
        [sys.executable, "-m", "sim.simulate", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == shown.split()
