"""Imported by `late_helper` only: a module the task reaches as it runs, one import away."""

OFFSET = 1
