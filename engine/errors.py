"""The one exception type a user may see: its message names the file or key and the problem."""


class Ds4fError(Exception):
    """A problem with the user's input or environment, reported as one clear line."""
