"""The tests marked slow by measurement: tests/slow_tests.txt, one node id a line, its time in a comment (the tests
over ~20 s on a 2-core CPU in a full `make test`). tests/conftest.py marks them as if marked in their files, so
`make test` stays under 15 minutes and `make test-all` still runs them."""

from pathlib import Path

SLOW_LIST = Path(__file__).with_name("slow_tests.txt")


def slow_node_ids(path: Path = SLOW_LIST) -> set[str]:
    lines = (line.split("#")[0].strip() for line in path.read_text().splitlines())
    return {line for line in lines if line}
