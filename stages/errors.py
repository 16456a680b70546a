"""User-facing errors: the CLI prints their message and exits 2, never a traceback."""


class EldrError(Exception):
    """A problem the user can fix (bad input, missing file, wrong model...)."""
