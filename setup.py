"""The one build step pyproject.toml cannot say: deploy/ goes into the wheel as vramwatch/_deploy.

The rules, PrometheusRule, alertmanager.yml, dashboards, manifests and the Helm chart are generated into
(or written in) deploy/ and checked there; the build copies that tree, so the wheel carries no second,
hand-kept copy. :mod:`vramwatch.shipped` reads vramwatch/_deploy when installed, deploy/ in a source tree
(and in an editable install, which copies nothing).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
DEPLOY = ROOT / "deploy"
PACKAGE_DIR = Path("vramwatch") / "_deploy"  # vramwatch.shipped.PACKAGE_DATA


def shipped_files() -> list[Path]:
    """Every file under deploy/, caches left out."""
    return sorted(
        p
        for p in DEPLOY.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".pyo")
    )


class BuildPyWithDeploy(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        target = Path(self.build_lib) / PACKAGE_DIR
        shutil.rmtree(target, ignore_errors=True)  # a file removed from deploy/ must not linger in build/
        for src in shipped_files():
            dst = target / src.relative_to(DEPLOY)
            self.mkpath(str(dst.parent))
            self.copy_file(str(src), str(dst), preserve_mode=False)


setup(cmdclass={"build_py": BuildPyWithDeploy})
