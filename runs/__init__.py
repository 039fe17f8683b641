"""A run: a measured experiment on the engine and its artifacts (the report, the state dump and
its diff, the snapshot a front end polls, the history, the memory plan)."""
