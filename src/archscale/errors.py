"""User-facing errors and the exit codes of every command (the table in README.md, "Exit codes").

`UserError` is for bad input a person can fix (a missing file, a wrong flag). The CLI prints its message on
one line and exits with its `exit_code` (2), without a traceback; anything else is a bug and keeps its traceback.
"""

EXIT_OK = 0
EXIT_BUG = 1  # an uncaught exception: Python's own exit code, with its traceback
EXIT_BAD_INPUT = 2  # a UserError (a flag, a file, a request, a busy port, a full disk): one line on stderr
EXIT_NON_FINITE = 3  # training diverged (NonFiniteError): nothing of the bad step was applied or saved
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT)


class UserError(Exception):
    """Bad input: the message names the file or flag and says what to do."""

    exit_code = EXIT_BAD_INPUT


class NonFiniteError(UserError):
    """Training diverged: a step's loss or gradient norm was not finite (the update was not applied, nothing of it
    saved). Exit code 3, so a job script can tell divergence from bad flags."""

    exit_code = EXIT_NON_FINITE
