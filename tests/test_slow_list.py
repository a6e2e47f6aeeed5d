"""tests/slow_tests.txt names tests that exist: an entry left behind by a renamed test would quietly put the new
name back into `make test`'s time."""

import re
from pathlib import Path

from slow_list import SLOW_LIST, slow_node_ids

ROOT = Path(__file__).parent.parent


def missing_tests(path: Path) -> list[str]:
    missing = []
    for node_id in sorted(slow_node_ids(path)):
        file, _, name = node_id.partition("::")
        function = re.sub(r"\[.*\]$", "", name)
        source = ROOT / file
        if not source.is_file() or not re.search(rf"^\s*def {re.escape(function)}\(", source.read_text(), re.M):
            missing.append(node_id)
    return missing


def test_every_listed_slow_test_exists():
    assert not missing_tests(SLOW_LIST), f"tests/slow_tests.txt lists tests that do not exist: {missing_tests(SLOW_LIST)}"


def test_the_check_sees_a_missing_test(tmp_path):
    listed = tmp_path / "slow_tests.txt"
    listed.write_text("# a comment\ntests/test_slow_list.py::test_not_here[a-1]  # 99 s\n"
                      "tests/test_slow_list.py::test_every_listed_slow_test_exists  # 1 s\n")
    assert missing_tests(listed) == ["tests/test_slow_list.py::test_not_here[a-1]"]
