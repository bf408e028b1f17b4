"""Omni's ``ray`` executor: every rank a Ray actor, so one engine spans the nodes of a Ray cluster."""
