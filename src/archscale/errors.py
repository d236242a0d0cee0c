"""User-facing errors.

`UserError` is for bad input a person can fix (a missing file, a wrong flag). The CLI prints its message on
one line and exits with code 2, without a traceback; anything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """Bad input: the message names the file or flag and says what to do."""
