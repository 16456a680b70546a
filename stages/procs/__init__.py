"""Processes eldr starts die with it: a keeper per started server, a watchdog for capture."""
