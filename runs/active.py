"""The runs active in this process: started and not yet ended, oldest first."""
from __future__ import annotations

import threading

_active_lock = threading.Lock()
_active: list = []            # the runs started and not yet ended, oldest first


def active_run():
    """The oldest run still active (None: none)."""
    live = active_runs()
    return live[0] if live else None


def active_runs() -> list:
    with _active_lock:
        return [r for r in _active if not r.finished]
