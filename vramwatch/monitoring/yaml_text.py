"""The YAML the generated rule files and ConfigMaps are written in (alerts and dashboards both use it)."""

from __future__ import annotations

from typing import Any

import yaml


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    if "\n" in value:
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|")
    return dumper.represent_scalar("tag:yaml.org,2002:str", value)


_Dumper.add_representer(str, _str)


def dump(doc: dict[str, Any]) -> str:
    """YAML with multi-line strings as literal blocks and no folding of long lines (the Helm chart finds the
    rules' config values in one line of each annotation)."""
    return yaml.dump(doc, Dumper=_Dumper, sort_keys=False, width=1 << 20, allow_unicode=True)
