"""The README and docs/: the command CI runs is the whole suite, and every link leads somewhere."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(md: Path) -> set[str]:
    out, fence = set(), False
    for line in md.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def test_ci_runs_the_whole_suite_from_the_readme():
    # .ci/run takes the first line with `pytest` in the README's first code block, verbatim
    ci = (ROOT / ".ci" / "run").read_text()
    awk = re.search(r"test_cmd=\$\(awk '([^']+)' README.md\)", ci)
    assert awk, "the README's test command is no longer read by awk"
    cmd = subprocess.run(["awk", awk.group(1), "README.md"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    assert cmd.endswith(".venv/bin/python -m pytest -q"), cmd      # every test: no -m, no path, no -k
    fast = [line for line in (ROOT / "README.md").read_text().splitlines() if '-m "not slow"' in line]
    assert fast, "the README shows the one-minute loop"


def test_every_link_in_the_readme_and_docs_leads_somewhere():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    assert len(pages) > 10
    broken = []
    for page in pages:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, broken


def test_the_readme_names_every_page_of_docs():
    readme = (ROOT / "README.md").read_text()
    missing = [p.name for p in (ROOT / "docs").glob("*.md") if f"](docs/{p.name})" not in readme]
    assert not missing, missing
