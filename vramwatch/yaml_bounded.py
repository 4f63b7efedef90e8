"""YAML from a file a user names, bounded: a size cap, no aliases, a nesting cap.

``yaml.safe_load`` builds no arbitrary objects, but it still expands aliases: a few hundred bytes of
nested anchors (the "billion laughs") cost gigabytes. A configuration file needs no aliases, so they are
refused while composing (before anything is expanded), as are files larger than any configuration
needs and nesting deeper than any configuration has.
"""

from __future__ import annotations

from typing import Any

import yaml

__all__ = ["MAX_DEPTH", "MAX_YAML_BYTES", "UnsafeYaml", "load_bounded_yaml"]

MAX_YAML_BYTES = 256 * 1024
MAX_DEPTH = 32


class UnsafeYaml(ValueError):
    """A file refused before or while parsing; the message says why, in one line."""


class _BoundedLoader(yaml.SafeLoader):
    """A SafeLoader that refuses aliases and nesting deeper than MAX_DEPTH."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark
            raise UnsafeYaml(f"YAML aliases (*name) are not allowed (line {mark.line + 1})")
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise UnsafeYaml(f"nested deeper than {MAX_DEPTH} levels (line {mark.line + 1})")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def load_bounded_yaml(path: str, max_bytes: int = MAX_YAML_BYTES) -> Any:
    """The one document in ``path``. Raises OSError (unreadable), :class:`UnsafeYaml` (too large, an
    alias, too deep, not UTF-8, not YAML)."""
    with open(path, "rb") as fh:
        raw = fh.read(max_bytes + 1)
    if len(raw) > max_bytes:
        raise UnsafeYaml(f"larger than {max_bytes} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UnsafeYaml(f"not UTF-8 (byte {e.start})") from None
    try:
        return yaml.load(text, Loader=_BoundedLoader)  # a SafeLoader subclass: no arbitrary objects
    except yaml.YAMLError as e:
        raise UnsafeYaml("not YAML: " + " ".join(str(e).split())) from None
    except UnsafeYaml:
        raise
    except (ValueError, RecursionError) as e:  # int() of a 5000-digit number, among others
        raise UnsafeYaml(" ".join(str(e).split()) or type(e).__name__) from None
