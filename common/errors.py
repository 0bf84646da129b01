"""The one exception type for user errors.

Bad configs, missing data, broken files and bad CLI input raise `MemexError` with a message
that says what to fix. The CLI prints it on one line and exits with status 2 (design.md,
"Conventions"). Tracebacks are kept for bugs.
"""


class MemexError(Exception):
    """A user error: the message tells the user what to do."""
