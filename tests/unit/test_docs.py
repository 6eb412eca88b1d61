"""The README is a front page, and what it copies from the code or points into the manual holds:
its exit-code table is the one trainpod.contract.EXIT_CODES renders (docs/hooks/reference.py), its
links lead to pages and headings that exist, and no page but docs/results.md holds a measured
figure's date. The manual's own links are checked by its strict build (make docs)."""

import importlib.util
import re
import unicodedata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = REPO / "docs"
MAX_README_LINES = 250
# Pages that may carry dates: the results, and the lab report of a reproducer, kept as it was run.
DATED_PAGES = {"results.md", "shutdown.md"}
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def reference():
    """docs/hooks/reference.py, the mkdocs hook that renders the generated parts of the manual."""
    spec = importlib.util.spec_from_file_location("docs_reference", DOCS / "hooks" / "reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def slug(heading: str) -> str:
    """A heading's anchor as the manual's build makes it (Python-Markdown's toc: GitHub's too, for these)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: Path) -> set:
    body = re.sub(r"^(```|    ).*$", "", page.read_text(), flags=re.MULTILINE)  # no headings in code
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", body, re.MULTILINE)}


def test_readme_is_a_front_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, (
        f"README.md has {len(lines)} lines, more than {MAX_README_LINES}: it is the front page; "
        "move the detail into a page of docs/ and link to it")


def test_readme_exit_codes_are_the_contracts():
    docs = reference()
    copy = docs.readme_table(README.read_text())
    assert copy is not None, "README.md has no <!-- exit-codes --> ... <!-- /exit-codes --> block"
    assert copy == docs.exit_code_table(), (
        "README.md's exit-code table differs from trainpod.contract.EXIT_CODES: "
        "run `python3 docs/hooks/reference.py readme` to write it again")


def test_readme_links_lead_somewhere():
    broken = []
    for target in LINK.findall(README.read_text()):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        page = (README.parent / path).resolve() if path else README
        if not page.exists():
            broken.append(f"{target}: no file {path}")
        elif anchor and page.suffix == ".md" and anchor not in anchors(page):
            broken.append(f"{target}: no heading #{anchor} in {path or 'README.md'}")
    assert not broken, "README.md links to what does not exist:\n" + "\n".join(broken)


@pytest.mark.parametrize("page", [README, *sorted(p for p in DOCS.glob("*.md") if p.name not in DATED_PAGES)],
                         ids=lambda p: p.name)
def test_no_dates_outside_the_results(page):
    dated = [line.strip() for line in page.read_text().splitlines() if DATE.search(line)]
    assert not dated, (f"{page.relative_to(REPO)} holds a date: a measured figure goes to docs/results.md "
                       "with its date, machine and command, and the page links there:\n" + "\n".join(dated))


def test_settings_reference_has_every_flag_of_the_cli():
    assert reference().missing_flags() == []


def test_every_benchmark_writes_a_section_of_the_results():
    """Each name a bench script records under has its section in docs/results.md (else record() adds
    one at the end of the page, out of the manual's order)."""
    page = (DOCS / "results.md").read_text()
    sections = set(re.findall(r"^<!-- results: ([a-z0-9-]+) -->$", page, re.MULTILINE))
    ends = set(re.findall(r"^<!-- /results: ([a-z0-9-]+) -->$", page, re.MULTILINE))
    assert sections == ends
    recorded = {name for script in (REPO / "bench").glob("*.py")
                for name in re.findall(r"results_page\.record\(\s*\"([a-z0-9-]+)\"", script.read_text())}
    assert recorded, "no bench script calls results_page.record()"
    assert recorded <= sections, f"docs/results.md has no section for {sorted(recorded - sections)}"
