"""User-facing errors.

`UserError` is for bad input a person can fix (a missing file, a wrong flag). The CLI prints its message on
one line and exits with its `exit_code` (2), without a traceback; anything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """Bad input: the message names the file or flag and says what to do."""

    exit_code = 2


class NonFiniteError(UserError):
    """Training diverged: a step's loss or gradient norm was not finite (the update was not applied, nothing of it
    saved). Exit code 3, so a job script can tell divergence from bad flags."""

    exit_code = 3
