"""Settings read from the environment (`SLUICE_*`), in one place at the bottom of the
package: every layer may import it, and it imports nothing of sluice."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Root of everything sluice writes: `$SLUICE_CACHE_DIR` or `~/.cache/sluice`."""
    env = os.environ.get("SLUICE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "sluice"
