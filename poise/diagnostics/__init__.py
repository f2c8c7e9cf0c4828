"""Measuring only, no policy: per-rank timelines, reports, plots, scaling runs."""
