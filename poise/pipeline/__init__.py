"""Pipeline parallelism on torch.distributed.pipelining: split a model by a stage plan and train it.

``stage.py`` runs one rank's stage under torch's GPipe or 1F1B schedule and measures its
compute; ``worker.py`` is the per-rank entry that profiles, plans, trains and reports
(started by ``poise pipeline``). The plan itself comes from :mod:`poise.balance.partition`.
``replicas.py`` adds data parallelism (``--dp N``): N replicas of the pipeline, each stage in
DDP over its replicas with poise's comm hook, each replica on its share of a step's batch.
"""
