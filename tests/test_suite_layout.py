"""The test suite's own layout: test directories are not packages, so pytest imports each module by
its file name; two modules of one name anywhere under tests/ stop the whole suite at collection
(and a helper module imported by name would be the other directory's)."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_no_two_modules_under_tests_share_a_name():
    where = defaultdict(list)
    for path in TESTS.rglob("*.py"):
        rel = path.relative_to(TESTS)
        if rel.parts[0] in ("fixtures", "reference") or path.name == "conftest.py":
            continue
        where[path.name].append(str(rel))
    assert len(where) > 50
    twice = {name: paths for name, paths in where.items() if len(paths) > 1}
    assert not twice, twice
