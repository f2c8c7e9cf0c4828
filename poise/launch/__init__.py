"""Starting a job's workers: what ``poise train``, ``poise pipeline`` and ``poise diagnose`` share.

- :mod:`poise.launch.elastic`: this machine's workers through torch's elastic launcher (the
  code behind ``torchrun``), and which rank's failure caused the others.
- :mod:`poise.launch.job`: a recorded job on this machine, or across the nodes of its
  emulated cluster (:mod:`poise.cluster.job`, whose agents run :mod:`poise.launch.elastic`).

This ``__init__`` imports nothing on purpose: :mod:`poise.cluster.job` imports
:mod:`poise.launch.elastic`, which runs this file first, and :mod:`poise.launch.job` imports
:mod:`poise.cluster.job`; re-exporting it here would close that loop.
"""
