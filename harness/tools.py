"""Where the stack's binaries come from: `make tools` unpacks them below the repository's .cache/."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from harness.procs import ROOT

# What `make tools` installs, relative to the repository root: Debian's prometheus packages (promtool,
# prometheus, prometheus-alertmanager, amtool) and kubectl/helm from the AWS CDK kubectl layer.
CACHE_BIN_DIRS = (Path(".cache") / "debian" / "usr" / "bin", Path(".cache") / "kubectl" / "bin")


class ToolMissing(LookupError):
    """A binary of the stack is not installed; the message says how to install it."""


def tool_dirs() -> list[Path]:
    """TEST_TOOLS_DIR (one directory or a PATH-style list; the Makefile sets it), then the repo's .cache/."""
    dirs = [Path(d) for d in os.environ.get("TEST_TOOLS_DIR", "").split(os.pathsep) if d]
    return dirs + [ROOT / d for d in CACHE_BIN_DIRS]


def find_tool(*names: str) -> str | None:
    """The first of ``names`` found in tool_dirs(), then on PATH; None when none is."""
    for name in names:
        for d in tool_dirs():
            if os.access(d / name, os.X_OK):
                return str(d / name)
        found = shutil.which(name)
        if found:
            return found
    return None


def tool(*names: str) -> str:
    """Like find_tool, but a missing binary raises ToolMissing."""
    found = find_tool(*names)
    if found is None:
        raise ToolMissing(f"{names[0]} not found: `make tools` installs it below .cache/")
    return found
