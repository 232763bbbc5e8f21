"""User-facing errors: every bad input becomes one of these, with the numbers and the fix."""
from __future__ import annotations


class PtplanError(Exception):
    """A problem with the user's input (flag, file, cluster, plan). The CLI prints it and exits 2."""


class SchemaError(PtplanError):
    """A profile, plan, cluster or run-log file that does not match its schema.

    The message names the file and the offending field, e.g. ``layers[3].forward_s``.
    """

    def __init__(self, what: str, field: str, problem: str, fix: str = "") -> None:
        self.what, self.field, self.problem, self.fix = what, field, problem, fix
        msg = f"{what}: field '{field}': {problem}"
        if fix:
            msg += f". {fix}"
        super().__init__(msg)


class InfeasibleError(PtplanError):
    """No configuration satisfies the constraints (memory, batch divisibility, cluster size)."""
