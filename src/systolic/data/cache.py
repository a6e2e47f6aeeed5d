"""systolic's data cache: where it lives, and the record of prepared shards that passed their SHA-256 check.

Location: `$SYSTOLIC_CACHE`, else `$XDG_CACHE_HOME/systolic`, else `~/.cache/systolic`. It holds only what can
be made again: `data/<key>/`, raw corpora prepared once (cached_corpus.py), and `verified/<root hash>.json`,
one record per prepared dataset of the shards already hashed, so a training start reads the index instead of
every shard. Deleting the folder costs one tokenization and one full check, nothing else.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from systolic import outfile

ENV = "SYSTOLIC_CACHE"


def cache_root() -> Path:
    """The cache folder (not created here)."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "systolic"


# VERIFIED SHARDS ----------------------------------------------------------------------------------------------
# A shard is trusted without reading it when its size, mtime (ns), inode and device are those it had when its
# SHA-256 last matched, and that SHA-256 is the one its index records now. A change that keeps all four (a
# same-size rewrite with the mtime set back) is caught only by the full check of `systolic data info`.


def shard_stat(path: Path) -> dict[str, int]:
    """What must not change for a checked shard to be trusted: size, mtime in ns, inode, device."""
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino, "dev": st.st_dev}


def _record_file(root: Path) -> Path:
    name = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:32]
    return cache_root() / "verified" / f"{name}.json"


def trusted_shards(root: Path, shards: dict[Path, str]) -> set[Path]:
    """Those of `shards` (file -> the SHA-256 the index records) that passed a full check and are unchanged since."""
    try:
        record = json.loads(_record_file(root).read_text())["shards"]
    except (OSError, ValueError, KeyError, TypeError):  # none yet, or unreadable: everything is hashed again
        return set()
    trusted = set()
    for file, sha256 in shards.items():
        seen = record.get(str(file.resolve())) if isinstance(record, dict) else None
        try:
            if seen == {**shard_stat(file), "sha256": sha256}:
                trusted.add(file)
        except OSError:
            pass  # missing: the size check reports it
    return trusted


def remember_shards(root: Path, checked: dict[Path, dict]) -> None:
    """Records the shards of the dataset at `root` that just passed: file -> its `shard_stat` taken before it was
    read, with its "sha256" (a change while it was being read then shows as a new mtime). Best effort: a cache that
    cannot be written (read-only home, full disk) costs the next start a full check, not this run."""
    record = {"root": str(root.resolve()), "shards": {str(f.resolve()): seen for f, seen in checked.items()}}
    try:
        write_atomic(_record_file(root), json.dumps(record, indent=1).encode())
    except OSError:
        pass


def write_atomic(path: Path, data: bytes) -> None:
    """Writes `path` whole (systolic.outfile.write_bytes), creating its folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    outfile.write_bytes(path, data)
