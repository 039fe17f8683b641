"""Every key of the console, in one place: the screens' BINDINGS, the key bar, the help
screen and the command palette are all made from these lists.

Conventions borrowed where they exist: q quits and ? helps (htop, btop, k9s); + and - change
the update period (btop); space freezes the display; ctrl+p or : opens the command palette
(k9s uses : for its command line;
the palette lists these actions only, not a focused widget's scroll keys); escape goes back (k9s); [ ] and { } step a number down/up.
The chat: i opens it (vi's insert); in the prompt line letters are typed, so what acts there is
enter, esc, ctrl+c (stops the answer, as in `ds4f chat` and a shell; with nothing live it copies,
as Textual's ctrl+c does) and ctrl+l (clears, as in a shell).
"""
from __future__ import annotations

from textual.binding import Binding

IO = Binding.Group("io", compact=True)
KERNEL = Binding.Group("krn", compact=True)
PERIOD = Binding.Group("period", compact=True)

APP_BINDINGS = [
    Binding("question_mark,f1", "help", "help", tooltip="Show every key of every screen"),
    Binding("t", "cycle_theme", "theme", tooltip="Cycle the colour theme: dark, light, high contrast (remembered)"),
    Binding("q", "quit", "quit", tooltip="Quit ds4f-console (a live run is stopped first)"),
    # Textual adds its own ctrl+p only when no binding opens the palette, so both keys are here;
    # ctrl+p takes priority (it works with an input focused), : does not (an input can take it)
    Binding("ctrl+p", "command_palette", "commands", show=False, priority=True,
            tooltip="Open the command palette: every action of the screen by name"),
    Binding("colon", "command_palette", "commands", show=False, tooltip="Open the command palette (k9s style)"),
]

DASHBOARD_BINDINGS = [
    Binding("r", "run", "run", tooltip="Start a run with the settings in the status line"),
    Binding("s", "stop", "stop", tooltip="Stop the live run (cancelled runs write no files)"),
    Binding("i", "chat", "chat",
            tooltip="Show the transcript (in the run and event panels' place) and put the cursor in the "
                    "prompt line"),
    Binding("p", "cycle_preset", "preset", tooltip="Cycle the preset for the next run"),
    Binding("g", "cycle_spec", "spec", tooltip="Speculative decoding for the next run: off, auto, 1, 2, 3 drafts"
                                               " per round (the MTP layer's; the same tokens)"),
    Binding("left_square_bracket", "io_threads(-1)", "I/O threads down", key_display="[", group=IO,
            tooltip="One I/O thread fewer: live at the next token, and for the next run"),
    Binding("right_square_bracket", "io_threads(1)", "I/O threads up", key_display="]", group=IO,
            tooltip="One I/O thread more: live at the next token, and for the next run"),
    Binding("left_curly_bracket", "kernel_threads(-1)", "kernel threads down", key_display="{", group=KERNEL,
            tooltip="One kernel thread fewer: live at the next token, and for the next run"),
    Binding("right_curly_bracket", "kernel_threads(1)", "kernel threads up", key_display="}", group=KERNEL,
            tooltip="One kernel thread more: live at the next token, and for the next run"),
    Binding("k", "toggle_simd", "simd",
            tooltip="Switch the kernels between SIMD and scalar: live at the next token, and for the next run"),
    Binding("n", "set_tokens", "tokens", tooltip="Set how many tokens the next run decodes"),
    Binding("h", "history", "history", tooltip="Open the run history"),
    Binding("d", "diff_last", "diff", tooltip="Diff the state dumps of the last two finished runs"),
    Binding("c", "compare_simd_scalar", "cmp",
            tooltip="Diff the newest SIMD run against the newest comparable scalar run"),
    Binding("plus", "refresh_period(1)", "longer refresh period", key_display="+", group=PERIOD,
            tooltip="Refresh the dashboard less often (less SSH traffic)"),
    Binding("minus", "refresh_period(-1)", "shorter refresh period", key_display="-", group=PERIOD,
            tooltip="Refresh the dashboard more often"),
    Binding("space", "freeze", "freeze", key_display="␣",
            tooltip="Freeze or unfreeze the panels (the run, and an answer in the transcript, go on)"),
]

# The dashboard's keys while the transcript is shown (i); only then are they active.
CHAT_BINDINGS = [
    Binding("m", "cycle_mode", "mode",
            tooltip="Prompt mode for the next prompt: chat, chat with thinking, plain completion (or /chat, "
                    "/think, /text)"),
    Binding("ctrl+l", "clear_chat", "clear",
            tooltip="Clear the conversation and the transcript (or /reset); works while typing"),
    Binding("ctrl+c", "interrupt", "stop", show=False, priority=True,
            tooltip="Stop the answer, also while typing; the partial answer stays, marked stopped "
                    "(with nothing live, ctrl+c copies as usual)"),
    Binding("escape", "back", "back", key_display="esc",
            tooltip="Back to the run and event panels (the conversation is kept)"),
]

# The prompt line's keys, while it has the cursor (letters, space, : and the like are typed).
PROMPT_BINDINGS = [
    Binding("enter", "submit", "send",
            tooltip="Send the prompt (chat: with the conversation so far); a line starting with / is a command: "
                    "/reset, /chat, /think, /text, /seed N"),
    Binding("escape", "leave", "leave", key_display="esc",
            tooltip="Leave the prompt line: the dashboard's keys work again"),
]

HISTORY_BINDINGS = [
    Binding("escape,h", "back", "back", key_display="esc", tooltip="Back to the dashboard"),
    Binding("space", "mark", "mark", key_display="␣", tooltip="Mark or unmark the highlighted run (two marks: d diffs them)"),
    Binding("d", "diff_marked", "diff marked", tooltip="Diff the two marked runs (or the highlighted one and the one before)"),
    Binding("c", "compare_simd_scalar", "cmp simd/scalar",
            tooltip="Diff the newest SIMD run against the newest comparable scalar run"),
    Binding("m", "same_hash", "same hash", tooltip="Jump to the next run with the same state hash"),
]

DIFF_BINDINGS = [
    Binding("escape,h", "back", "back", key_display="esc", tooltip="Back to the history"),
    Binding("x", "swap", "swap A/B", tooltip="Swap the two runs"),
]

# The dashboard of a running `ds4f serve` (ds4f-console --attach): the same keys as a local run
# where they mean the same (threads, kernels, preset, stop, the refresh period, freeze), each
# an operator call to the server; r reconnects (there is no run to start).
SEQUENCE = Binding.Group("sequence", compact=True)
SERVER = Binding.Group("server", compact=True)
_LOCAL = {b.action: b for b in DASHBOARD_BINDINGS}

ATTACH_BINDINGS = [
    Binding("r", "reconnect", "reconnect", tooltip="Reconnect to the server now (after a failure; a live stream restarts)"),
    Binding("up", "select_sequence(-1)", "sequence up", key_display="↑", group=SEQUENCE,
            tooltip="Pick the sequence above: the run panels follow it and s cancels it"),
    Binding("down", "select_sequence(1)", "sequence down", key_display="↓", group=SEQUENCE,
            tooltip="Pick the sequence below (past the last: back to following the most active one)"),
    Binding("s", "cancel_sequence", "cancel",
            tooltip="Cancel the picked sequence (else the one the panels follow): POST /operator/cancel"),
    Binding("d", "drain", "drain",
            tooltip="Drain the server: it takes no new requests and the running ones finish (POST /operator/drain)"),
    Binding("u", "resume", "resume", tooltip="The server takes requests again after a drain (POST /operator/resume)"),
    Binding("p", "server_preset", "preset",
            tooltip="The server's next preset, for the requests that come next (POST /operator/preset)"),
    Binding("left_square_bracket", "server_io_threads(-1)", "I/O threads down", key_display="[", group=IO,
            tooltip="One I/O thread fewer on the server: live sequences at their next token, and the next requests"),
    Binding("right_square_bracket", "server_io_threads(1)", "I/O threads up", key_display="]", group=IO,
            tooltip="One I/O thread more on the server: live sequences at their next token, and the next requests"),
    Binding("left_curly_bracket", "server_kernel_threads(-1)", "kernel threads down", key_display="{", group=KERNEL,
            tooltip="One kernel thread fewer on the server: live sequences at their next token, and the next "
                    "requests"),
    Binding("right_curly_bracket", "server_kernel_threads(1)", "kernel threads up", key_display="}", group=KERNEL,
            tooltip="One kernel thread more on the server: live sequences at their next token, and the next "
                    "requests"),
    Binding("k", "server_toggle_simd", "simd",
            tooltip="Switch the server's kernels between SIMD and scalar: live sequences at their next token, and "
                    "the next requests (the kernels panel shows where it landed)"),
    _LOCAL["refresh_period(1)"],
    _LOCAL["refresh_period(-1)"],
    _LOCAL["freeze"],
    Binding("tab", "next_server(1)", "next server", group=SERVER, tooltip="The next server's tab (several --attach URLs)"),
    Binding("shift+tab", "next_server(-1)", "previous server", group=SERVER, show=False,
            tooltip="The previous server's tab"),
]

# The error screen of a server that cannot be attached (nothing answers, not ds4f, too old).
ATTACH_ERROR_BINDINGS = [
    Binding("r", "retry", "retry", tooltip="Try the server again now"),
    Binding("escape", "back_to_tabs", "back", key_display="esc",
            tooltip="Back to the servers' tabs (several --attach URLs); this one keeps its problem in its tab"),
]

# Command-palette titles (the key bar's labels are kept short to fit 80 columns).
TITLES = {
    "help": "Help: every key", "cycle_theme": "Cycle theme", "quit": "Quit",
    "run": "Run: start a run", "stop": "Stop the run", "cycle_preset": "Cycle preset",
    "cycle_spec": "Cycle speculative decoding (off, auto, 1-3 drafts)",
    "io_threads(-1)": "I/O threads down", "io_threads(1)": "I/O threads up",
    "kernel_threads(-1)": "Kernel threads down", "kernel_threads(1)": "Kernel threads up",
    "toggle_simd": "Toggle SIMD / scalar kernels", "set_tokens": "Set the token count",
    "history": "Open the run history", "diff_last": "Diff the last two runs",
    "compare_simd_scalar": "Compare SIMD vs scalar state hashes",
    "refresh_period(1)": "Refresh period longer", "refresh_period(-1)": "Refresh period shorter",
    "freeze": "Freeze / unfreeze the display", "back": "Back", "mark": "Mark run for diff",
    "diff_marked": "Diff the marked runs", "same_hash": "Next run with the same state hash",
    "swap": "Swap runs A and B",
    "chat": "Chat: type a prompt", "cycle_mode": "Prompt mode: chat, thinking, completion",
    "clear_chat": "Clear the conversation", "interrupt": "Stop the answer", "submit": "Send the prompt",
    "leave": "Leave the prompt line",
    "reconnect": "Reconnect to the server", "select_sequence(-1)": "Pick the sequence above",
    "select_sequence(1)": "Pick the sequence below", "cancel_sequence": "Cancel the picked sequence",
    "drain": "Drain the server (no new requests)", "resume": "Resume taking requests",
    "server_preset": "The server's next preset", "server_io_threads(-1)": "Server I/O threads down",
    "server_io_threads(1)": "Server I/O threads up", "server_kernel_threads(-1)": "Server kernel threads down",
    "server_kernel_threads(1)": "Server kernel threads up", "server_toggle_simd": "Toggle the server's SIMD / scalar kernels",
    "next_server(1)": "Next server", "next_server(-1)": "Previous server", "retry": "Retry the server",
    "back_to_tabs": "Back to the servers' tabs",
}

SCREENS_FOR_HELP = (
    ("Everywhere", APP_BINDINGS),
    ("Dashboard", DASHBOARD_BINDINGS),
    ("Dashboard with the transcript (i)", CHAT_BINDINGS),
    ("Prompt line (while typing)", PROMPT_BINDINGS),
    ("History", HISTORY_BINDINGS),
    ("Diff", DIFF_BINDINGS),
)

ATTACH_SCREENS_FOR_HELP = (
    ("Everywhere", APP_BINDINGS),
    ("Attached to a server (ds4f-console --attach)", ATTACH_BINDINGS),
    ("A server that cannot be attached", ATTACH_ERROR_BINDINGS),
)

KEY_NAMES = {
    "question_mark": "?", "colon": ":", "left_square_bracket": "[", "right_square_bracket": "]",
    "left_curly_bracket": "{", "right_curly_bracket": "}", "plus": "+", "minus": "-", "space": "space",
    "escape": "esc", "f1": "F1", "ctrl+p": "ctrl+p", "enter": "enter",
    "up": "↑", "down": "↓", "shift+tab": "shift+tab",
}


def keys_of(binding: Binding) -> str:
    return " ".join(KEY_NAMES.get(k.strip(), k.strip()) for k in binding.key.split(","))


def by_action(bindings: list[Binding]) -> list[tuple[str, str, Binding]]:
    """(action, every key for it, its first binding) in order: one row per action for the help."""
    rows: dict[str, tuple[list[str], Binding]] = {}
    for b in bindings:
        rows.setdefault(b.action, ([], b))[0].append(keys_of(b))
    return [(action, " or ".join(keys), b) for action, (keys, b) in rows.items()]


# (action, key) of every binding above: the command palette lists these and nothing else (not
# the scroll and cursor keys of whatever widget has focus)
OWN_KEYS: dict[tuple[str, str], Binding] = {
    (b.action, k.strip()): b
    for bindings in (APP_BINDINGS, DASHBOARD_BINDINGS, CHAT_BINDINGS, PROMPT_BINDINGS, HISTORY_BINDINGS,
                     DIFF_BINDINGS, ATTACH_BINDINGS, ATTACH_ERROR_BINDINGS)
    for b in bindings for k in b.key.split(",")
}

# keys that are not typed characters, whatever their name
NOT_TYPED = {"escape", "enter", "tab", "backspace", "delete", "insert", "home", "end", "pageup", "pagedown", "up",
             "down", "left", "right"}


def typed(key: str) -> bool:
    """Whether a text field takes this key as a character (r, space, :, +...), so that a binding
    on it does not act while the field has the cursor."""
    key = key.strip()
    if "+" in key.rstrip("+") or key in NOT_TYPED:   # ctrl+l, shift+tab, ...
        return False
    return not (key[0] == "f" and key[1:].isdigit())
