"""ds4f.themes: the console's Textual themes (palettes.py) and stylesheets (*.tcss, package data)."""
from __future__ import annotations

from importlib import resources
from pathlib import Path

from .palettes import DEFAULT_THEME, LEVEL_VARIABLE_DEFAULTS, THEME_NAMES, THEMES

__all__ = ["THEMES", "THEME_NAMES", "DEFAULT_THEME", "LEVEL_VARIABLE_DEFAULTS", "stylesheet_path",
           "stylesheet_text", "next_theme"]


def stylesheet_path(name: str = "console.tcss") -> Path:
    """Filesystem path of a packaged stylesheet (the package is installed as files, not zipped)."""
    return Path(str(resources.files(__name__).joinpath(name)))


def stylesheet_text(name: str = "console.tcss") -> str:
    return resources.files(__name__).joinpath(name).read_text(encoding="utf-8")


def next_theme(current: str) -> str:
    """The theme after `current` in the cycle (the first one if `current` is not ours)."""
    if current in THEME_NAMES:
        return THEME_NAMES[(THEME_NAMES.index(current) + 1) % len(THEME_NAMES)]
    return THEME_NAMES[0]
