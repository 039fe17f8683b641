"""The console's screens. Each renders what the app hands it (a Snapshot, RunRecords, a
StateDiff) and turns keys into messages the app acts on; none holds engine state.

    dashboard.py  the live panels over the current run (the panels are in ../widgets/panels.py)
    history.py    every recorded run, with marks for a diff
    diff.py       two runs' state dumps compared
    modals.py     help, token count, error and first-launch setup
"""
from .dashboard import DashboardScreen
from .diff import DiffScreen
from .history import HistoryScreen
from .modals import ErrorScreen, HelpScreen, SetupScreen, TokenCountScreen

__all__ = ["DashboardScreen", "DiffScreen", "ErrorScreen", "HelpScreen", "HistoryScreen", "SetupScreen",
           "TokenCountScreen"]
