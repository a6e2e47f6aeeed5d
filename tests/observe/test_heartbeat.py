"""observe/heartbeat.py: a long call is said every few seconds; nothing after it ends, nothing for a short one."""

import threading

from systolic.observe.heartbeat import heartbeat


def test_a_long_call_is_said_until_it_ends_and_a_short_one_not_at_all():
    said: list[str] = []
    two = threading.Event()

    def say(line: str) -> None:
        said.append(line)
        if len(said) == 2:
            two.set()

    with heartbeat(say, "plan: still compiling", every_s=0.01):
        assert two.wait(60)  # the block outlives two beats: a compile of minutes
    after = len(said)
    assert said[0].startswith("plan: still compiling: ") and said[0].endswith(" s so far")
    with heartbeat(say, "import: reading", every_s=3600):
        pass  # ends long before its first beat
    assert len(said) == after  # the thread stopped with the first block; the second never spoke
