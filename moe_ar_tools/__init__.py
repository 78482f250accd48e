"""Measurement tools that run on a GPU machine (not part of the installed runtime)."""
