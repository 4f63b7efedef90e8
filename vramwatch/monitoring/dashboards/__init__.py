"""Grafana dashboards defined in Python with grafana-foundation-sdk (the ``dashboards`` extra).

:func:`build_all` returns the built dashboard models; :mod:`.render` turns them into
the JSON files under ``deploy/`` and the report walks the same models.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vramwatch.monitoring.config import DEFAULT, MonitoringConfig

if TYPE_CHECKING:
    from grafana_foundation_sdk.models.dashboard import Dashboard

__all__ = ["build_all", "MODULES"]

# one module per dashboard, each with UID, TITLE and build(cfg)
MODULES = (
    "vramwatch.monitoring.dashboards.memory",
    "vramwatch.monitoring.dashboards.health",
    "vramwatch.monitoring.dashboards.fleet",
)


def build_all(cfg: MonitoringConfig = DEFAULT) -> list[Dashboard]:
    """The built dashboard models (``grafana_foundation_sdk.models.dashboard.Dashboard``), in order."""
    import importlib

    from vramwatch.monitoring.dashboards.common import dashboard_links

    modules = [importlib.import_module(name) for name in MODULES]
    titles = {mod.UID: mod.TITLE for mod in modules}
    out = []
    for mod in modules:
        model = mod.build(cfg).links(dashboard_links(mod.UID, titles)).build()
        _number_panels(model)
        out.append(model)
    return out


def _number_panels(model: Dashboard) -> None:
    # Grafana wants unique panel ids; the builder leaves them unset (rows get 0)
    for i, p in enumerate(model.panels or (), start=1):
        p.id_val = i
