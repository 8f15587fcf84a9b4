"""Prefect tasks: one per stage (``tasks/stages.py``), each a thin adapter that sends one typed
request to its DP group's engine host and returns the host's typed result. No sample data
passes through here."""
