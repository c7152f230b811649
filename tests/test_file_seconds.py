"""The order ``make test`` hands test files to its workers in."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from tests import file_seconds

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest">
<testcase classname="tests.test_a" name="test_one" time="10.5" />
<testcase classname="tests.test_a" name="test_two[x]" time="2.0" />
<testcase classname="tests.test_b.TestGroup" name="test_three" time="30.0" />
</testsuite></testsuites>
"""


def test_a_junit_report_gives_each_files_seconds_heaviest_first(tmp_path):
    xml = tmp_path / "suite.xml"
    xml.write_text(JUNIT)
    table = file_seconds.from_junit(xml)
    assert table == {"test_b.py": 30.0, "test_a.py": 12.5}
    assert list(table) == ["test_b.py", "test_a.py"]


def test_items_sort_heaviest_file_first_keeping_each_files_order():
    def item(file: str, name: str) -> SimpleNamespace:
        return SimpleNamespace(path=Path("tests") / file, name=name)

    items = [
        item("test_light.py", "a1"),
        item("test_light.py", "a2"),
        item("test_heavy.py", "b1"),
        item("test_heavy.py", "b2"),
        item("test_new.py", "c1"),
    ]
    table = {"test_light.py": 1.0, "test_heavy.py": 100.0}
    items.sort(key=file_seconds.order_key(table))
    # A file the table does not know goes first.
    assert [i.name for i in items] == ["c1", "b1", "b2", "a1", "a2"]


def test_the_table_names_files_that_exist():
    table = file_seconds.load()
    assert table, "tests/file_seconds.json is missing or empty"
    here = Path(file_seconds.__file__).parent
    assert [f for f in table if not (here / f).is_file()] == []
