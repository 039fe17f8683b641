"""The user's directories for ds4f (platformdirs: XDG on Linux): the config file, the data
(the run history, runs' state dumps and reports) and the cache (the demo and bench checkpoints,
the measured disk floors)."""
from __future__ import annotations

from pathlib import Path

import platformdirs


def user_config_path() -> Path:
    return Path(platformdirs.user_config_dir("ds4f")) / "ds4f.toml"


def user_data_dir() -> Path:
    return Path(platformdirs.user_data_dir("ds4f"))


def user_cache_dir() -> Path:
    return Path(platformdirs.user_cache_dir("ds4f"))
