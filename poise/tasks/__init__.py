"""Training tasks (data, model, loss and metrics) behind the contract in :mod:`poise.tasks.base`."""
