"""The console's colour themes, as Textual Theme objects.

Besides Textual's own variables ($primary, $success, ...), each theme sets the colours of
the four threshold levels every dashboard panel uses (see ds4f.console.core.thresholds) and of
the plots. Keep these names in step with LEVEL_VARIABLE_DEFAULTS below and console.tcss.
"""
from __future__ import annotations

from textual.theme import Theme

DARK = Theme(
    name="ds4f-dark",
    primary="#4FB3FF",
    secondary="#7AA2F7",
    accent="#E0AF68",
    foreground="#D8DEE9",
    background="#0E1116",
    surface="#151A21",
    panel="#1D2430",
    success="#73D13D",
    warning="#E5C07B",
    error="#F7768E",
    dark=True,
    variables={
        "level-fine": "#73D13D",
        "level-careful": "#E5C07B",
        "level-warning": "#FF9E40",
        "level-critical": "#FF4D5E",
        "plot-bar": "#4FB3FF",
        "plot-floor": "#E0AF68",
        "plot-axis": "#5C6773",
        "footer-key-foreground": "#4FB3FF",
        "block-cursor-text-style": "bold",
    },
)

LIGHT = Theme(
    name="ds4f-light",
    primary="#0B62C4",
    secondary="#5A32A3",
    accent="#9A6700",
    foreground="#1B1F23",
    background="#F6F6F2",
    surface="#ECECE6",
    panel="#E0E0D8",
    success="#1A7F37",
    warning="#9A6700",
    error="#CF222E",
    dark=False,
    variables={
        "level-fine": "#1A7F37",
        "level-careful": "#9A6700",
        "level-warning": "#BC4C00",
        "level-critical": "#CF222E",
        "plot-bar": "#0B62C4",
        "plot-floor": "#BC4C00",
        "plot-axis": "#8C959F",
        "footer-key-foreground": "#0B62C4",
    },
)

# High contrast, flat: pure black and white with saturated level colours, no shaded surfaces
# and no translucent text, so every cell is legible and the screen diff that goes over a slow
# SSH link stays small (fewer distinct styles, fewer escape sequences).
CONTRAST = Theme(
    name="ds4f-contrast",
    primary="#FFFF00",
    secondary="#00FFFF",
    accent="#FF00FF",
    foreground="#FFFFFF",
    background="#000000",
    surface="#000000",
    panel="#000000",
    boost="#000000",
    success="#00FF00",
    warning="#FFFF00",
    error="#FF0000",
    dark=True,
    luminosity_spread=0.0,
    text_alpha=1.0,
    variables={
        "level-fine": "#00FF00",
        "level-careful": "#FFFF00",
        "level-warning": "#FF8700",
        "level-critical": "#FF0000",
        "plot-bar": "#00FFFF",
        "plot-floor": "#FFFF00",
        "plot-axis": "#FFFFFF",
        "text-muted": "#FFFFFF",
        "border": "#FFFFFF",
        "border-blurred": "#FFFFFF",
        "footer-background": "#000000",
        "footer-key-foreground": "#FFFF00",
        "footer-description-foreground": "#FFFFFF",
        "block-cursor-background": "#FFFF00",
        "block-cursor-foreground": "#000000",
        "block-cursor-text-style": "bold",
        "scrollbar": "#FFFFFF",
        "scrollbar-background": "#000000",
    },
)

THEMES: tuple[Theme, ...] = (DARK, LIGHT, CONTRAST)
THEME_NAMES: tuple[str, ...] = tuple(t.name for t in THEMES)
DEFAULT_THEME = DARK.name

# Fallbacks for themes that do not set our variables (Textual's built-in themes).
LEVEL_VARIABLE_DEFAULTS: dict[str, str] = {
    "level-fine": "#4EBF71",
    "level-careful": "#E5C07B",
    "level-warning": "#FFA62B",
    "level-critical": "#E0435B",
    "plot-bar": "#0178D4",
    "plot-floor": "#FFA62B",
    "plot-axis": "#808080",
}
