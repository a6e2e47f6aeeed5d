"""A model's generation settings, which travel with its tokenizer: Hugging Face's generation_config.json (the ids
that end generation, a list in chat models; bos; pad; the default sampling settings) and the bos/eos/pad ids of
the model's config.json.

`systolic convert from-hf` keeps both beside the run's tokenizer.json (GENERATION_FILE as the model ships it,
MODEL_IDS_FILE with config.json's ids), so they travel as the tokenizer's companions
(`data.tokenizer.COMPANION_FILES`) into a fine-tune, and `convert to-hf` writes them back: the export stops where
the imported model did. A run whose tokenizer brings neither (trained from scratch) exports the ids its tokenizer
defines: its end of text, and with a chat template the template's end-of-turn ids as the eos list. `systolic
generate` and the serving engine stop on every eos id the model declares (`eos_ids`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from systolic import safe_json
from systolic.data.tokenizer import RUN_FILE, Tokenizer
from systolic.errors import UserError

GENERATION_FILE = "generation_config.json"
MODEL_IDS_FILE = "model_token_ids.json"  # config.json's bos/eos/pad ids, as the imported model had them
ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
_MAX_BYTES = 1 << 20


def read_settings(path: Path, vocab: int | None = None) -> dict[str, Any] | None:
    """The JSON object in `path` (GENERATION_FILE, MODEL_IDS_FILE or a config.json), or None when there is no such
    file; a UserError when it is not an object, or when one of its ID_KEYS is not null, an id or a list of ids
    (ids below `vocab` when given)."""
    path = Path(path)
    if not path.is_file():
        return None
    expected = "an object of generation settings as transformers writes it (eos_token_id: an id or a list of ids)"
    fix = "restore the file from the model's source, or delete it to use the ids of the model's tokenizer."
    settings = safe_json.expect_object(safe_json.read_file(path, expected=expected, fix=fix, max_bytes=_MAX_BYTES),
                                       str(path), expected=expected, fix=fix)
    check_ids(settings, str(path), vocab)
    return settings


def check_ids(settings: dict[str, Any], source: str, vocab: int | None) -> None:
    """A UserError naming `source` when one of `settings`' ID_KEYS is not null, an id (below `vocab` when given) or
    a non-empty list of ids."""
    for key in ID_KEYS:
        value = settings.get(key)
        ids = value if isinstance(value, list) else [] if value is None else [value]
        if (isinstance(value, list) and not value) or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < (vocab or 2**63) for i in ids):
            limit = f" below the model's {vocab} ids" if vocab else ""
            raise UserError(
                f"{source} sets {key} = {value!r}; expected null, a token id (an integer >= 0{limit}) or a non-empty "
                "list of them. Fix: restore the file from the model's source, or set the id of the model's own "
                "special token."
            )


def token_ids(value: Any) -> tuple[int, ...]:
    """The ids of a checked `*_token_id` value: none for null, one for an id, each of a list's."""
    return () if value is None else tuple(value) if isinstance(value, list) else (value,)


def eos_ids(tokenizer: Tokenizer) -> tuple[int, ...]:
    """Every id that ends generation, sorted: the tokenizer's end of text and the eos ids that the model's files
    beside its tokenizer.json declare."""
    ids = {tokenizer.eot_id}
    folder = companion_folder(tokenizer)
    for name in (GENERATION_FILE, MODEL_IDS_FILE) if folder is not None else ():
        settings = read_settings(folder / name)
        ids.update(token_ids(settings.get("eos_token_id")) if settings else ())
    return tuple(sorted(ids))


def companion_folder(tokenizer: Tokenizer) -> Path | None:
    """The folder whose files travel with `tokenizer`'s tokenizer.json, or None: the byte tokenizer, one made in
    memory, or a file not named tokenizer.json (no Hugging Face folder's: `data.tokenizer.tokenizer_files`)."""
    path = Path(tokenizer.name)
    path = path / RUN_FILE if path.is_dir() else path
    return path.parent if path.name == RUN_FILE and path.is_file() else None


def imported(src: Path, config: dict[str, Any], vocab: int) -> dict[str, Any]:
    """What `convert from-hf` writes as MODEL_IDS_FILE: config.json's (`config`'s) bos/eos/pad ids, after checking
    them and the Hugging Face folder `src`'s generation_config.json (which travels as it is, a companion of the
    tokenizer.json beside it). A UserError when an id is not one of the model's `vocab` ids."""
    ids = {key: config[key] for key in ID_KEYS if key in config}
    check_ids(ids, f"{src}/config.json", vocab)
    read_settings(Path(src) / GENERATION_FILE, vocab)
    return ids


def exported(tokenizer: Tokenizer, chat_stop_ids: tuple[int, ...] | None
             ) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(config.json's bos/eos/pad ids, the generation_config.json to write) for an export of a run with `tokenizer`
    (and, for a chat model, its template's `ChatTemplate.stop_ids`). The ids are those kept beside its
    tokenizer.json, else the ids the tokenizer defines; the generation config is None when one is kept there (it
    travels as the tokenizer's companion file), else those ids, as transformers makes it for a folder without one
    (`GenerationConfig.from_model_config`)."""
    folder = companion_folder(tokenizer)
    kept_ids = read_settings(folder / MODEL_IDS_FILE) if folder is not None else None
    kept_generation = read_settings(folder / GENERATION_FILE) if folder is not None else None
    ids = own_ids(tokenizer, chat_stop_ids) if kept_ids is None else kept_ids
    return ids, dict(ids) if kept_generation is None else None


def own_ids(tokenizer: Tokenizer, chat_stop_ids: tuple[int, ...] | None) -> dict[str, Any]:
    """The ids a run trained from scratch exports: its end of text starts and ends a document (GPT-2's
    convention, which packing follows: every document comes after an end of text), a chat reply also ends at the
    template's end of turn (`ChatTemplate.stop_ids`), padding is the tokenizer's."""
    stops = chat_stop_ids if chat_stop_ids is not None else eos_ids(tokenizer)
    return {"bos_token_id": tokenizer.eot_id, "eos_token_id": stops[0] if len(stops) == 1 else list(stops),
            "pad_token_id": tokenizer.pad_id}
