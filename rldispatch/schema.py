"""Former home of the config schema builder, now :mod:`protocol.config`; kept so existing imports resolve."""
from __future__ import annotations

from protocol.config import ConfigError, build_dataclass, to_plain

__all__ = ["ConfigError", "build_dataclass", "to_plain"]
