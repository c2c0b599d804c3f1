"""`make test` runs the suite on every core (pytest-xdist, whole files per worker) with the longest files
first (conftest.LONGEST_FIRST): a renamed or removed file must not drop out of that list unnoticed, and
the Makefile must keep the flags under which the order is the one the workers follow."""

import os
import types

from tests import conftest

TESTS = os.path.dirname(os.path.abspath(__file__))


def test_the_longest_first_files_exist_once_each():
    missing = [name for name in conftest.LONGEST_FIRST if not os.path.isfile(os.path.join(TESTS, name))]
    assert not missing, f"conftest.LONGEST_FIRST names files that are not in tests/: {missing}"
    assert len(set(conftest.LONGEST_FIRST)) == len(conftest.LONGEST_FIRST)


def test_the_longest_files_go_first_and_the_rest_keep_their_order():
    def item(name, test):
        return types.SimpleNamespace(path=types.SimpleNamespace(name=name), test=test)

    first, second = conftest.LONGEST_FIRST[:2]
    items = [item("test_a.py", 1), item(second, 1), item("test_b.py", 1), item(first, 1), item(second, 2),
             item("test_a.py", 2)]
    conftest.pytest_collection_modifyitems(items)
    assert [(i.path.name, i.test) for i in items] == [
        (first, 1), (second, 1), (second, 2), ("test_a.py", 1), ("test_b.py", 1), ("test_a.py", 2)]


def test_make_test_runs_whole_files_in_the_collected_order():
    with open(os.path.join(os.path.dirname(TESTS), "Makefile")) as f:
        command = next(line for line in f if "-m pytest" in line)
    for flag in ("-n auto", "--dist loadfile", "--no-loadscope-reorder"):
        assert flag in command, f"Makefile's test command lost {flag}: {command.strip()}"
