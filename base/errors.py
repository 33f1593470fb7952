"""The one error type users see.

A HipcError is a user-facing mistake or condition (bad file, bad flag, unsupported
model): the CLI prints its message as one line and exits non-zero, the server turns it
into a 4xx. Anything else escaping is a bug in hipc and keeps its traceback.
"""


class HipcError(Exception):
    """A clear, one-line error about the user's input or environment."""

    exit_code = 2
