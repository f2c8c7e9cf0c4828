"""The cost model and planner of data-parallel training (pure functions, no process group).

``costs.py``: α-β costs of the collectives; ``step_time.py``: one step with buckets, codecs and
overlap; ``model.py``: parameter tensors; ``calibrate.py``: α, β and compute from
measurements (apart from prediction); ``planner.py``: every configuration, the recommendation.
"""
