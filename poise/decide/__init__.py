"""What poise decides for a job given no settings, and why: the policy and its decisions.

- :mod:`poise.decide.policy`: how the no-settings split acts (balance ``auto``): the steps
  it keeps (plain DDP's), how often it re-plans from measured speeds; the codec of a run that
  names none.
- :mod:`poise.decide.decisions`: every choice in force, when it was taken, the figures it was
  taken on and the setting that pins it, built from what the parts recorded (the re-planner's
  history, the codec trial, the synchronization's choice). The report's ``decisions``, the
  console summary and ``poise diagnose run`` read them.
"""

from poise.decide.decisions import Decision, decisions, describe
from poise.decide.policy import default_codec, replan_schedule

__all__ = ["Decision", "decisions", "default_codec", "describe", "replan_schedule"]
