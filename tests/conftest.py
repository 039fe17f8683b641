"""Shared test fixtures.

Every test session gets its own XDG directories, so runs, history and the demo model
never touch the user's real data, cache or config.
"""
import os
import tempfile

_XDG_ROOT = tempfile.mkdtemp(prefix="ds4f-test-xdg-")
for _var in ("XDG_DATA_HOME", "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "XDG_STATE_HOME"):
    os.environ[_var] = os.path.join(_XDG_ROOT, _var.lower())
