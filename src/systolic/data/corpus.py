"""Finding and reading documents, and the train/validation split.

Workload-neutral: `list_files` walks any folder (text here, images for the GAN); `read_documents` turns a text
file, a folder of text files, a `.jsonl` or a `.parquet` file into named documents. Names are relative to the
corpus root, so the hash-based split does not change when the corpus moves.
"""

from __future__ import annotations

import codecs
import dataclasses
import gzip
import hashlib
import json
import os
import stat
import sysconfig
import warnings
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path

from systolic.errors import UserError

_EXCLUDED_STDLIB_DIRS = frozenset({"site-packages", "dist-packages"})


@dataclasses.dataclass(frozen=True)
class Document:
    name: str  # stable identifier: a path relative to the corpus root, or `file.jsonl:line`
    text: str


def stdlib_dir() -> Path:
    """The Python standard library's directory: the default corpus."""
    return Path(sysconfig.get_paths()["stdlib"])


def list_files(root: Path, *, suffixes: Sequence[str] = (), exclude_dirs: Sequence[str] = ()) -> list[Path]:
    """Regular files below `root`, sorted by relative path; hidden files/folders and `exclude_dirs` skipped.

    `suffixes` (e.g. `(".py",)`, matched case-insensitively) keeps only those file types; empty keeps all.
    """
    wanted = tuple(s.lower() for s in suffixes)
    files = []
    # os.walk does not follow symlinked folders, so a link loop cannot hang the walk.
    for folder, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in exclude_dirs]
        for name in filenames:
            path = Path(folder, name)
            if name.startswith(".") or (wanted and not name.lower().endswith(wanted)) or not path.is_file():
                continue
            files.append(path)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def read_documents(path: str, *, max_bytes: int = 0) -> list[Document]:
    """Reads the corpus at `path` (empty: the standard library's `.py` files) as a list of non-empty documents.

    `max_bytes > 0` stops after that many UTF-8 bytes; the last document is cut to fit, so the result is
    the same on every run.
    """
    if not path:
        root = stdlib_dir()
        files = list_files(root, suffixes=(".py",), exclude_dirs=_EXCLUDED_STDLIB_DIRS)
        texts = _read_text_files(root, files)
        shown = f"the Python standard library ({root})"
    else:
        try:
            root = Path(path).expanduser()
        except RuntimeError:  # `~nosuchuser/...`: no such home directory; reported as a missing path below
            root = Path(path)
        shown = str(root)
        if not root.exists():
            raise UserError(
                f"data.path={path!r} does not exist (looked for {root}). Expected a text file, a folder of text "
                "files, a .jsonl file (field 'text') or a .parquet file (column 'text'). Fix: correct the path, or "
                "set data.path='' to train on the Python standard library."
            )
        if root.is_dir():
            texts = _read_text_files(root, list_files(root), max_bytes)
        else:
            check_regular(root, "data.path")
            if root.suffix.lower() == ".jsonl":
                texts = _read_jsonl(root)
            elif root.suffix.lower() == ".parquet":
                texts = _read_parquet(root)
            else:
                texts = _read_text_files(root.parent, [root], max_bytes)
    docs, skipped = _take_bytes(texts, max_bytes)
    if skipped and path:  # the stdlib's few Latin-1/KOI8-R test modules are expected; stay quiet about them
        warnings.warn(
            f"Skipped {len(skipped)} file(s) in {shown} that are unreadable, binary or not valid UTF-8 "
            f"(e.g. {', '.join(skipped[:3])}).",
            stacklevel=2,
        )
    if not docs:
        raise UserError(
            f"The corpus at {shown} contains no usable text: no non-empty UTF-8 documents were found"
            f"{f' ({len(skipped)} unreadable, binary or non-UTF-8 file(s) skipped)' if skipped else ''}. Expected UTF-8 text "
            "files, or .jsonl/.parquet rows with a non-empty 'text'. Fix: point data.path at a folder or file with "
            "text in it."
        )
    return docs


def _take_bytes(texts: Iterator[tuple[str, str | None]], max_bytes: int) -> tuple[list[Document], list[str]]:
    """Documents up to `max_bytes`, and the names of unreadable files (text None) met on the way."""
    # Pulling from a generator means files past the byte budget are never opened.
    docs, skipped, total = [], [], 0
    for name, text in texts:
        if text is None:
            skipped.append(name)
            continue
        if not text:
            continue
        if max_bytes > 0:
            data = text.encode("utf-8")
            if total + len(data) >= max_bytes:
                # errors="ignore" drops only a multi-byte character cut in half at the end.
                text = data[: max_bytes - total].decode("utf-8", errors="ignore")
                if text:
                    docs.append(Document(name, text))
                break
            total += len(data)
        docs.append(Document(name, text))
    return docs, skipped


def check_regular(path: Path, what: str) -> None:
    """A UserError unless `path` is a regular file (or a link to one): a device such as /dev/urandom or a FIFO
    never ends, so reading it would never return."""
    try:
        mode = path.stat().st_mode
    except OSError as e:
        raise UserError(f"{what}={str(path)!r} cannot be read ({e.strerror}). Fix: check the path and its "
                        "permissions.") from None
    if not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
        kind = ("a character device" if stat.S_ISCHR(mode) else "a block device" if stat.S_ISBLK(mode)
                else "a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
                else "not a regular file")
        raise UserError(
            f"{what}={str(path)!r} is {kind}, not a regular file: reading it might never end. Expected a text file, a "
            "folder of text files, a .jsonl or a .parquet file. Fix: save the data to a file first and pass that."
        )


def _read_text_files(root: Path, files: list[Path], max_bytes: int = 0) -> Iterator[tuple[str, str | None]]:
    """(name, text) per file; text is None for an unreadable, binary or non-UTF-8 file. With `max_bytes` > 0 no
    file is read past that many bytes (a longer one is cut, at a whole character)."""
    for file in files:
        text = None
        try:
            with open(file, "rb") as f:
                data = f.read(max_bytes) if max_bytes > 0 else f.read()
                cut = max_bytes > 0 and len(data) == max_bytes and f.read(1) != b""
        except OSError:  # e.g. no permission: skipped and counted like a binary file, not a crash
            data, cut = b"\0", False
        # NUL is valid UTF-8 but never appears in text files, while binaries almost always contain one.
        if b"\0" not in data:
            try:
                # A file cut at max_bytes may end inside a character: the incremental decoder leaves that tail out.
                text = codecs.getincrementaldecoder("utf-8")().decode(data, final=not cut)
            except UnicodeDecodeError:
                pass
        del data  # only the text stays alive while the next file is read
        yield file.relative_to(root).as_posix(), text


def iter_texts(root: Path, *, field: str = "text") -> Iterator[tuple[str, str | None]]:
    """Streams (name, text) of every document at `root` without holding the corpus: one record at a time.

    A folder is walked in name order: `.jsonl`, `.jsonl.gz`, `.parquet` and `.arrow` files (a Hugging Face
    `save_to_disk` folder holds `.arrow` files) are read as records with a string `field`, every other file as
    one text document. Text is None for an unreadable, binary or non-UTF-8 text file.
    """
    if not root.is_dir():
        check_regular(root, "the corpus")
        yield from _read_file(root.parent, root, field)
        return
    files = list_files(root)
    if any(f.suffix == ".arrow" for f in files):  # a save_to_disk folder's own metadata is not a document
        files = [f for f in files if f.name not in _HF_METADATA]
    for file in files:
        yield from _read_file(root, file, field)


_HF_METADATA = frozenset({"state.json", "dataset_info.json", "dataset_dict.json"})


def _read_file(root: Path, file: Path, field: str) -> Iterator[tuple[str, str | None]]:
    name, lower = file.relative_to(root).as_posix(), file.name.lower()
    if lower.endswith((".jsonl", ".jsonl.gz")):
        return _read_jsonl(file, field, name)
    if lower.endswith(".parquet"):
        return _read_parquet(file, field, name)
    if lower.endswith(".arrow"):
        return _read_arrow(file, field, name)
    return _read_text_files(root, [file])


def _not_a(file: Path, kind: str, error: Exception) -> UserError:
    return UserError(
        f"{file} is named like {kind} file but cannot be read as one ({type(error).__name__}: {str(error)[:200]}). "
        f"Expected a complete {kind} file with one document per record. Fix: re-export or re-download it, or rename "
        "it if it is plain text."
    )


def _read_jsonl(file: Path, field: str = "text", name: str = "") -> Iterator[tuple[str, str]]:
    gz = file.name.lower().endswith(".gz")
    try:
        yield from _jsonl_rows(file, field, name, gz)
    except (OSError, EOFError, zlib.error) as e:  # a damaged or truncated .gz (BadGzipFile is an OSError)
        raise _not_a(file, "a gzip-compressed JSON Lines" if gz else "a JSON Lines", e) from None


def _jsonl_rows(file: Path, field: str, name: str, gz: bool) -> Iterator[tuple[str, str]]:
    opener = gzip.open if gz else open
    with opener(file, "rb") as lines:
        for number, raw in enumerate(lines, start=1):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw)
            except (ValueError, RecursionError) as error:  # bad JSON or UTF-8, a 5,000-digit number, deep nesting
                raise _bad_row(file, number, f"is not valid JSON ({error})", field=field) from None
            if not isinstance(row, dict) or not isinstance(row.get(field), str):
                got = f"keys {sorted(row)}" if isinstance(row, dict) else type(row).__name__
                raise _bad_row(file, number, f"has no string field {field!r} (got {got})", field=field)
            yield f"{name or file.name}:{number}", row[field]


def _read_parquet(file: Path, field: str = "text", name: str = "") -> Iterator[tuple[str, str]]:
    try:
        import pyarrow.parquet as pq  # optional dependency; most users never read parquet
    except ImportError:
        raise UserError(
            f"data.path={str(file)!r} is a .parquet file, but pyarrow is not installed. Fix: "
            "pip install 'systolic[parquet]', or convert the file to .jsonl."
        ) from None
    import pyarrow as pa

    try:
        parquet = pq.ParquetFile(file)
        _check_column(file, field, parquet.schema_arrow.names)
        yield from _rows(file, field, name, (b.column(0) for b in parquet.iter_batches(columns=[field])))
    except (pa.ArrowException, OSError) as e:  # not Parquet at all, or damaged pages
        raise _not_a(file, "a Parquet", e) from None


def _read_arrow(file: Path, field: str, name: str) -> Iterator[tuple[str, str]]:
    try:
        import pyarrow as pa
    except ImportError:
        raise UserError(f"{file} is an .arrow file, but pyarrow is not installed. Fix: pip install 'systolic[parquet]'.") from None
    try:
        with pa.memory_map(str(file)) as source:
            try:
                reader = pa.ipc.open_stream(source)  # what `datasets` writes
            except pa.ArrowInvalid:
                reader = pa.ipc.open_file(source)
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            else:
                batches = iter(reader)
            _check_column(file, field, reader.schema.names)
            yield from _rows(file, field, name, (b.column(field) for b in batches))
    except (pa.ArrowException, OSError) as e:
        raise _not_a(file, "an Arrow", e) from None


def _check_column(file: Path, field: str, names: list[str]) -> None:
    if field not in names:
        raise UserError(
            f"{file} has no column {field!r} (columns: {names}). Expected one string column holding one document "
            "per row. Fix: name the column with --field (e.g. --field content), or rename it."
        )


def _rows(file: Path, field: str, name: str, columns) -> Iterator[tuple[str, str]]:
    row = 0
    for column in columns:
        for text in column.to_pylist():
            if text is not None and not isinstance(text, str):
                raise _bad_row(file, row, f"has a non-string {field!r} ({type(text).__name__})", unit="row", field=field)
            yield f"{name or file.name}:{row}", text or ""
            row += 1


def _bad_row(file: Path, number: int, problem: str, unit: str = "line", field: str = "text") -> UserError:
    return UserError(
        f"{file} {unit} {number} {problem}. Expected one JSON object per {unit} with a string field {field!r}, "
        f'e.g. {{"{field}": "some document"}}. Fix: repair or remove that {unit}.'
    )


def split_documents(docs: Sequence[Document], val_percent: float) -> tuple[list[Document], list[Document]]:
    """Splits by a stable hash of each name; both halves are non-empty, and validation never holds more than half of
    the text (a few documents of unequal size: the shortest is held out instead, `split_note` says so).

    A single document is cut instead: the last `val_percent` of its characters go to validation.
    """
    if len(docs) == 1:
        (doc,) = docs
        if len(doc.text) < 2:
            raise UserError(
                f"The corpus is one document, {doc.name!r}, of {len(doc.text)} character(s): too short to split into "
                "training and validation text. Fix: point data.path at more text."
            )
        cut = min(max(round(len(doc.text) * (1 - val_percent / 100)), 1), len(doc.text) - 1)
        return [Document(doc.name, doc.text[:cut])], [Document(doc.name, doc.text[cut:])]
    is_val = _held_out_at_most_half(docs, val_percent)
    train = [doc for doc, val in zip(docs, is_val, strict=True) if not val]
    val = [doc for doc, val in zip(docs, is_val, strict=True) if val]
    return train, val


def _held_out_at_most_half(docs: Sequence[Document], val_percent: float) -> list[bool]:
    """`held_out` by name, unless that holds out more than half of the text: then the shortest document alone (a
    2-file folder must not validate on most of its tokens and train on the rest)."""
    is_val = held_out([doc.name for doc in docs], val_percent)
    if 2 * sum(len(doc.text) for doc, val in zip(docs, is_val) if val) <= sum(len(doc.text) for doc in docs):
        return is_val
    shortest = min(range(len(docs)), key=lambda i: len(docs[i].text))  # at most half the text: there are 2 or more
    return [i == shortest for i in range(len(docs))]


def split_note(docs: Sequence[Document], val_percent: float) -> str:
    """The start-up line about a small corpus's split (split_documents), or "" when the hash split by name stood."""
    if len(docs) == 1:
        return (f"validation: the last {val_percent:g}% of {docs[0].name} (the corpus is one document, so its tail is "
                "held out; data.val_percent sets the share)")
    is_val = _held_out_at_most_half(docs, val_percent)
    if is_val == held_out([doc.name for doc in docs], val_percent):
        return ""
    (name,) = [doc.name for doc, val in zip(docs, is_val) if val]
    share = len(next(doc.text for doc in docs if doc.name == name)) / sum(len(doc.text) for doc in docs)
    return (f"validation: {name}, the shortest document ({share:.0%} of the text): holding out documents by name "
            "would have taken more than half of the text")


# The held-out examples an SFT or DPO run evaluates on at least, where the data allows (held_out's at_least): with 10,
# a preference accuracy moves in steps of 10%. Only at the default share: a data.val_percent the user chose is taken
# as given (1% of 100 examples holds out one, as a run that memorises them all asks).
MIN_HELD_OUT_EXAMPLES = 50
DEFAULT_VAL_PERCENT = 5.0  # data.val_percent's default (lm/config.py)
MAX_TOPPED_UP_SHARE = 0.2  # ... but a top-up holds out at most this share of the examples


def held_out(names: Sequence[str], val_percent: float, at_least: int = 0) -> list[bool]:
    """Which of `names` (two or more) are held out: `is_validation` of each, except that both sides are kept
    non-empty: when none is held out the name nearest to the validation side moves over, when all are, the
    farthest moves back. With `at_least`, fewer held out than that are topped up, nearest first, to at most
    MAX_TOPPED_UP_SHARE of the names: the same names stay held out whatever the others are."""
    position = [_unit_hash(name) for name in names]
    is_val = [is_validation(name, val_percent) for name in names]
    wanted = min(at_least, int(len(names) * MAX_TOPPED_UP_SHARE)) - sum(is_val)
    if wanted > 0:
        for i in sorted((i for i in range(len(names)) if not is_val[i]), key=position.__getitem__)[:wanted]:
            is_val[i] = True
    if not any(is_val):
        is_val[min(range(len(names)), key=position.__getitem__)] = True
    elif all(is_val):
        is_val[max(range(len(names)), key=position.__getitem__)] = False
    return is_val


def held_out_minimum(val_percent: float) -> int:
    """held_out's at_least for SFT and DPO examples: MIN_HELD_OUT_EXAMPLES at the default share, else none."""
    return MIN_HELD_OUT_EXAMPLES if val_percent == DEFAULT_VAL_PERCENT else 0


def held_out_rule() -> str:
    """How held_out(..., at_least=held_out_minimum(...)) chose, for the start-up line that gives the sizes."""
    return (f"held out by name: data.val_percent, topped up to {MIN_HELD_OUT_EXAMPLES} where that leaves "
            f"{1 - MAX_TOPPED_UP_SHARE:.0%} to train on, at the default {DEFAULT_VAL_PERCENT:g}% only")


def is_validation(name: str, val_percent: float) -> bool:
    """Whether the document `name` is held out, by a stable hash of the name alone (so a corpus can stream)."""
    return _unit_hash(name) * 100 < val_percent


def _unit_hash(name: str) -> float:
    # hashlib, not hash(): Python salts str hashes per process, which would reshuffle the split every run.
    digest = hashlib.blake2b(name.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64
