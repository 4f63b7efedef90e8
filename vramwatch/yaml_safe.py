"""YAML from a file the user names, bounded: a size cap, and no aliases.

``yaml.safe_load`` constructs no arbitrary objects, but it still expands aliases: a few hundred bytes of
nested anchors (the "billion laughs", or merge keys ``<<: *a`` that copy mappings) cost gigabytes and
seconds, or end in a MemoryError. Configuration files have no need for aliases, so they are refused,
as is a file larger than any configuration needs.
"""

from __future__ import annotations

from typing import Any

import yaml

__all__ = ["MAX_YAML_BYTES", "UnsafeYaml", "load_bounded_yaml"]

MAX_YAML_BYTES = 256 * 1024


class UnsafeYaml(ValueError):
    """A file refused before or while parsing; the message says why, in one line."""


class _NoAliasLoader(yaml.SafeLoader):
    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark
            raise UnsafeYaml(f"YAML aliases (*name) are not allowed (line {mark.line + 1})")
        return super().compose_node(parent, index)


def load_bounded_yaml(path: str, max_bytes: int = MAX_YAML_BYTES) -> Any:
    """The document in ``path``. Raises OSError (unreadable), :class:`UnsafeYaml` (too large, an alias,
    nested too deeply, a number too long to convert) or ``yaml.YAMLError`` / UnicodeDecodeError (not YAML)."""
    with open(path, "rb") as fh:
        raw = fh.read(max_bytes + 1)
    if len(raw) > max_bytes:
        raise UnsafeYaml(f"larger than {max_bytes} bytes")
    try:
        return yaml.load(raw.decode("utf-8"), Loader=_NoAliasLoader)  # a SafeLoader that also refuses aliases
    except RecursionError:
        raise UnsafeYaml("nested too deeply") from None
    except ValueError as e:  # int() of a 5000-digit number, among others; UnsafeYaml passes through as is
        if isinstance(e, (UnsafeYaml, UnicodeDecodeError)):
            raise
        raise UnsafeYaml(" ".join(str(e).split())) from None
