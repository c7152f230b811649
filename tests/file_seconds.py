"""How long each test file takes, for the order ``make test`` runs them in.

``tests/file_seconds.json`` holds each file's seconds (its tests' setup,
call and teardown) from a full run with two workers. ``conftest.py`` sorts
the files heaviest first, and ``make test`` (``--dist loadfile
--no-loadscope-reorder``) hands them to its workers in that order, so the
long files start early and the last to run are short. Otherwise xdist
orders files by how many tests they hold, which puts the files of one or
two engine tests last, each alone on one worker while the other idles.

Refresh after a full run::

    pytest -n 2 --dist loadfile --junitxml=/tmp/suite.xml
    python -m tests.file_seconds /tmp/suite.xml
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

SECONDS = Path(__file__).with_name("file_seconds.json")


def load() -> dict[str, float]:
    """File name -> seconds; empty when the table is missing."""
    if not SECONDS.is_file():
        return {}
    return json.loads(SECONDS.read_text())


def order_key(seconds: dict[str, float]):
    """Sort key for test items: heaviest file first. A file the table does
    not know goes first of all (it may start engines; starting it early
    costs little)."""
    return lambda item: -seconds.get(item.path.name, float("inf"))


def from_junit(xml: Path) -> dict[str, float]:
    """File name -> seconds summed over its test cases in a JUnit XML report
    (pytest records setup, call and teardown in each case's time)."""
    totals: dict[str, float] = defaultdict(float)
    for case in ET.parse(xml).getroot().iter("testcase"):
        module = case.get("classname", "").split(".")
        name = next((m for m in module if m.startswith("test_")), None)
        if name:
            totals[f"{name}.py"] += float(case.get("time") or 0)
    return {k: round(v, 1) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m tests.file_seconds JUNIT_XML", file=sys.stderr)
        return 2
    table = from_junit(Path(argv[0]))
    SECONDS.write_text(json.dumps(table, indent=1) + "\n")
    print(f"{SECONDS}: {len(table)} files, {sum(table.values()):.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
