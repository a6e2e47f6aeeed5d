"""What every family's config.json import shares: the values a family requires and the one-paragraph refusal of a
setting systolic does not compute, which points the user at the list of what converts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from systolic.errors import UserError

# Where a user reads which families and settings convert; tests/workloads/lm/test_hf_unsupported.py checks the table
# there against ARCHITECTURES and ROPE_TYPES.
SUPPORTED_LIST = 'the table "Which models convert" in docs/porting-from-pytorch.md'


def require(hf: dict[str, Any], src: Path, expected: dict[str, Any]) -> None:
    for key, value in expected.items():
        if key in hf and hf[key] != value:
            raise unsupported(src, key, hf[key], repr(value))


def unsupported(src: Path, what: str, got: Any, expected: str) -> UserError:
    return UserError(
        f"{src}/config.json sets {what} = {got!r}, which the systolic model does not compute (expected {expected}); "
        f"converting would give a different model. The families and settings that convert are listed in "
        f"{SUPPORTED_LIST}. Fix: pass a checkpoint without this setting (another variant or size of the family)."
    )
