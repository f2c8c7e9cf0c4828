"""Starting a job's workers: what ``poise train``, ``poise pipeline`` and ``poise diagnose`` share.

- :mod:`poise.launch.elastic`: this machine's workers through torch's elastic launcher (the
  code behind ``torchrun``), and which rank's failure caused the others.
- :mod:`poise.launch.cluster_job`: one job across the nodes of an emulated cluster
  (:mod:`poise.cluster`), one elastic agent per node (:mod:`poise.launch.agent`, run inside the
  node's namespace).
- :mod:`poise.launch.job`: a recorded job on this machine, or across its emulated cluster.

Launching sits above :mod:`poise.cluster`: the cluster is where a job may run, not what
starts it. This ``__init__`` imports nothing: a node's agent needs only
:mod:`poise.launch.elastic`, and importing it should not load the cluster job's code too.
"""
