"""The exception the package raises on purpose, apart from every module that raises it."""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A setting is unknown or invalid; raised by ``start()`` before the job runs."""
