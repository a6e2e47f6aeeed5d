"""The one YAML reader for recipes, run directories' config.yaml and override values: PyYAML's safe loader with
the limits a config file never needs to exceed.

A config is a small tree of scalars, so this reader refuses what only a mistake or a hostile file contains:
duplicate keys (a plain YAML reader keeps the last one silently), anchors and aliases (a 600-byte "billion laughs"
file expands past gigabytes), nesting deeper than `MAX_DEPTH` (PyYAML recurses once per level and dies with a
RecursionError near 1,000) and files over `MAX_FILE_BYTES`. Every refusal is a ConfigError naming the source.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import yaml

from systolic.errors import ConfigError

MAX_DEPTH = 32  # a config is section.key(.sub) deep; lists of lists inside a value add a few levels
MAX_FILE_BYTES = 1 << 20  # the largest bundled recipe is under 2 kB


class YamlSyntaxError(ConfigError):
    """Text that is not YAML at all (an override value may then be taken as plain text)."""


class _Refused(yaml.YAMLError):
    """A structure the config reader refuses; carries the paragraph to show."""


class ConfigLoader(yaml.SafeLoader):
    """SafeLoader without aliases or duplicate keys, with bounded nesting."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark
            raise _Refused(
                f"it uses a YAML alias (*{self.peek_event().anchor}) at line {mark.line + 1}. Anchors and aliases "
                "are refused: a config needs none, and a few nested aliases expand into gigabytes. Expected plain "
                "values. Fix: write the value out where the alias stands"
            )
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise _Refused(
                    f"it nests more than {MAX_DEPTH} levels deep (at line {mark.line + 1}). Expected a mapping of "
                    "sections of keys, a few levels deep. Fix: flatten the structure"
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                raise _Refused(
                    f"a key at line {key_node.start_mark.line + 1} is a {key_node.id}, not a name. Expected "
                    "'key: value' with a plain key. Fix: spell the key as a word"
                )
            if key_node.tag == "tag:yaml.org,2002:merge":
                raise _Refused(
                    f"it uses a YAML merge key (<<) at line {key_node.start_mark.line + 1}. Expected plain "
                    "'key: value' entries. Fix: write the merged keys out"
                )
            key = self.construct_object(key_node)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise _Refused(
                    f"the key '{key}' appears twice in one mapping (lines {seen[key]} and {line}); a plain YAML "
                    "reader would silently keep the last. Expected each key once. Fix: delete the one you did not mean"
                )
            seen[key] = line
        return super().construct_mapping(node, deep)



def load_text(text: str, source: str) -> Any:
    """The YAML in `text`; a ConfigError naming `source` (a path or 'override x=...') when it is refused or
    malformed."""
    loader = None
    try:
        loader = ConfigLoader(text)  # its reader already refuses non-printable characters
        return loader.get_single_data()  # what yaml.load does, with our loader
    except _Refused as e:
        raise ConfigError(f"{source} is not a usable config: {e}.") from None
    except yaml.YAMLError as e:
        raise YamlSyntaxError(f"Could not parse {source} as YAML ({_one_line(e)}). Expected a mapping of sections, "
                          "'section:\\n  key: value'. Fix the file's syntax.") from None
    finally:
        if loader is not None:
            loader.dispose()


def read_file(path: Path) -> Any:
    """The YAML of a config file (a recipe, a run's config.yaml): a regular file of at most MAX_FILE_BYTES of
    UTF-8 text."""
    try:
        info = os.stat(path)
    except OSError as e:
        raise ConfigError(f"Could not read the config file {path} ({e.strerror}). Fix: pass an existing, readable "
                          "YAML file.") from None
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(f"{path} is not a regular file (a directory, device or pipe). Expected a YAML config file. "
                          "Fix: pass the path of a .yaml file.")
    if info.st_size > MAX_FILE_BYTES:
        raise ConfigError(f"{path} is {info.st_size:,} bytes; a config file is expected to be under "
                          f"{MAX_FILE_BYTES:,} bytes (the bundled recipes are under 2 kB). Fix: pass the recipe "
                          "itself, not a data file.")
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path} is not UTF-8 text (byte {e.start}). Expected a YAML config file. Fix: pass the "
                          "recipe's .yaml file, saved as UTF-8.") from None
    except OSError as e:
        raise ConfigError(f"Could not read the config file {path} ({e.strerror}). Fix: check its permissions.") from None
    if "\x00" in text:
        raise ConfigError(f"{path} holds a NUL byte, so it is not a text file. Expected a YAML config file. Fix: pass "
                          "the recipe's .yaml file.")
    return load_text(text, str(path))


def _one_line(e: yaml.YAMLError) -> str:
    return " ".join(str(e).split())
