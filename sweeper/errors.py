"""The errors sweeper reports to its user, and the exit code each one ends a command with.

Every error a user can cause or fix (bad input, an unreachable cluster) is a :class:`SweeperError`: its message is
one line, and it carries the exit code. Library modules raise these; only ``sweeper.cli`` turns them into a line on
stderr and an exit status, so no library module imports the command line. Anything else that escapes a command is
a sweeper bug and keeps its traceback.
"""

from __future__ import annotations

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class SweeperError(Exception):
    """An error for the user: a one-line message and the exit code of the command that hit it."""

    exit_code: int = EXIT_FAILED

    def __init__(self, message: str, *, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class UsageError(SweeperError, ValueError):
    """Bad input (a YAML field, a command-line argument, an environment variable): exit 2, nothing written."""

    exit_code = EXIT_USAGE


class ClusterError(SweeperError, RuntimeError):
    """The cluster cannot be reached or does not match what the configuration asks for: exit 1.

    Not bad input as such: the same address may answer once the cluster is up.
    """

    exit_code = EXIT_FAILED
