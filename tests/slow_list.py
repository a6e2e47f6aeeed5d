"""The tests marked slow by measurement: tests/slow_tests.txt, one node id a line, its time in a comment (the tests
over ~20 s on a 2-core CPU in a full `make test`). tests/conftest.py marks them as if marked in their files, so
`make test` stays under 15 minutes and `make test-all` still runs them."""

from pathlib import Path

SLOW_LIST = Path(__file__).with_name("slow_tests.txt")


def slow_node_ids(path: Path = SLOW_LIST) -> set[str]:
    lines = (line.split("#")[0].strip() for line in path.read_text().splitlines())
    return {line for line in lines if line}


def pick(junit_xml: Path, keep_fraction: float) -> list[tuple[float, str]]:
    """(seconds, node id) of the slowest tests of a full run's junit xml, slowest first, until the rest take at most
    `keep_fraction` of the run's summed test time."""
    import xml.etree.ElementTree as ET

    times = sorted(((float(case.get("time")), f"{case.get('classname').replace('.', '/')}.py::{case.get('name')}")
                    for case in ET.parse(junit_xml).getroot().iter("testcase") if case.find("skipped") is None),
                   reverse=True)
    left, picked = sum(t for t, _ in times), []
    for seconds, node_id in times:
        if left <= keep_fraction * sum(t for t, _ in times):
            break
        picked.append((seconds, node_id))
        left -= seconds
    return picked


if __name__ == "__main__":
    # Refresh: .venv/bin/python -m pytest -q -n 2 --dist loadfile -m "not slow and not gpu and not tpu" \
    #   --junitxml=/tmp/run.xml; python tests/slow_list.py /tmp/run.xml 0.25 >> tests/slow_tests.txt
    import sys

    for seconds, node_id in pick(Path(sys.argv[1]), float(sys.argv[2])):
        print(f"{node_id}  # {seconds:.0f} s")
