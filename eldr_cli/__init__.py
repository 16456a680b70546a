"""The ``eldr`` command-line interface."""
