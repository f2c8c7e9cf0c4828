"""Owns the run of a step: the Session facade, its builder, steps, records (see poise/run/session.py)."""
