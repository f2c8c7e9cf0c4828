"""What a training state is, taken from and put back into the live objects of a worker.

A state has three parts, by who owns them:

- ``tensors``: the model's and the optimizer's tensors (the same on every rank under DDP;
  rank 0 writes them), keyed ``model/<name>`` and ``optim/<param index>/<key>``;
- ``shared``: plain values every rank shares: step, scheduler, optimizer hyper-parameters,
  and the session's shared part (the data schedule's position and plan, the re-planner's
  shares);
- ``per_rank``: what differs per rank: RNG states (torch, CUDA, numpy, python), the session's
  per-rank part (:data:`RANK_KEYS`: the comm hook's state with its error-feedback residuals,
  the re-planner's window of this rank's measurements), and, for a checkpoint inside a
  gradient-accumulation window, this rank's gradients summed so far (not yet reduced: they
  differ per rank).

:func:`fit_problems` compares a saved state with the run about to use it (config settings
that shape the model, optimizer and data; parameter names and shapes) before anything is
loaded, so a mismatch is a one-line error and never a partial load.

The session is seen only through :class:`SessionState` (its ``state_dict`` and
``load_state_dict``), so checkpointing sits below the session in the layers and imports
nothing of it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from poise import config as config_mod
from poise.config import RunConfig


class SessionState(Protocol):
    """What a checkpoint needs of the session: its state as plain values and tensors, and a
    way to put such a state back (:class:`poise.Session` is one).

    ``state_dict()`` has the keys of :data:`RANK_KEYS`, which belong to the rank that made it,
    and others that every rank shares. ``load_state_dict`` takes the shared keys with either a
    rank's own ones or, on another number of ranks, ``{"rank": -1, "window": None, "comm": None}``.
    """

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


# The keys of a session state that belong to one rank (saved in its own file): the rank, the
# re-planner's window of this rank's measurements, the comm hook's state with its residuals.
RANK_KEYS = ("rank", "window", "comm")

# Settings a checkpoint does not fix: where and how long the run goes, how it is launched,
# measured, checkpointed and failed on purpose. Everything else must match to resume.
_FREE = {
    "out_dir", "dist", "diagnostics", "checkpoint", "train.steps", "train.epochs",
    "task.eval_max_samples", "task.cache_dir", "emulate.rank_speed", "emulate.slowdown_method",
    "emulate.speed_noise", "emulate.fail_at", "emulate.data_delay_s",
}
# Keys that checkpoints written before the [emulate] section hold under their former names.
_FORMER_KEYS = {f"{section}.{name}": f"emulate.{name}" for name, section in config_mod.FORMER_SECTIONS.items()}


def fit_config(config: RunConfig) -> dict[str, Any]:
    """The settings a checkpoint must agree with, flattened to ``section.field`` keys."""
    flat: dict[str, Any] = {}
    for key, value in config_mod.to_dict(config).items():
        if key in _FREE:
            continue
        if isinstance(value, dict):
            flat.update({f"{key}.{k}": v for k, v in value.items() if f"{key}.{k}" not in _FREE})
        else:
            flat[key] = value
    return flat


def param_shapes(model: nn.Module) -> dict[str, list[int]]:
    """Name -> shape of every entry of the model's state dict."""
    return {k: list(v.shape) for k, v in model.state_dict().items()}


def config_problems(saved: dict[str, Any], config: RunConfig) -> list[str]:
    """The settings in which a checkpoint's manifest differs from this run's config."""
    now = fit_config(config)
    then = {_FORMER_KEYS.get(key, key): value for key, value in saved["config"].items()}
    return [f"{key} is {then.get(key)!r} in the checkpoint but {now.get(key)!r} now"
            for key in sorted(set(now) | set(then)) if now.get(key) != then.get(key)]


def fit_problems(saved: dict[str, Any], config: RunConfig, model: nn.Module) -> list[str]:
    """Why a checkpoint's manifest does not fit this run (empty when it fits)."""
    problems = config_problems(saved, config)
    shapes = param_shapes(model)
    missing = sorted(set(saved["params"]) - set(shapes))
    unexpected = sorted(set(shapes) - set(saved["params"]))
    if missing:
        problems.append(f"parameters {missing[:3]} are in the checkpoint but not in the model")
    if unexpected:
        problems.append(f"parameters {unexpected[:3]} are in the model but not in the checkpoint")
    for name in sorted(set(shapes) & set(saved["params"])):
        if shapes[name] != saved["params"][name]:
            then_shape = saved["params"][name]
            problems.append(f"parameter {name} has shape {then_shape} in the checkpoint but {shapes[name]} now")
    return problems


@dataclass
class TrainingState:
    """One rank's view of the training state at a step boundary (see module doc)."""

    tensors: dict[str, torch.Tensor]
    shared: dict[str, Any]
    per_rank: dict[str, Any]
    # this rank's accumulated gradients inside an accumulation window (None outside one); on
    # another number of ranks, composed from the saved ranks' so that their reduction is unchanged
    grads: dict[str, torch.Tensor] | None = None


def rng_state() -> dict[str, Any]:
    """This process's RNG states, as tensors and plain values."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    random.setstate(tuple(v if not isinstance(v, list) else tuple(v) for v in state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def capture(
    *,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    session: SessionState,
    world_size: int,
    in_window: bool = False,
) -> TrainingState:
    """The live state, by reference (the caller copies what must not change under it).

    ``in_window``: the step boundary falls inside a gradient-accumulation window, so the
    gradients accumulated so far are part of the state.
    """
    tensors = {f"model/{k}": v for k, v in model.state_dict().items()}
    optim = optimizer.state_dict()
    optim_scalars: dict[str, Any] = {}
    for index, entries in optim["state"].items():
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim/{index}/{key}"] = value
            else:
                optim_scalars[f"{index}/{key}"] = value
    session_state = session.state_dict()
    shared = {
        "step": step,
        "world_size": world_size,
        "scheduler": scheduler.state_dict(),
        "optim_groups": optim["param_groups"],
        "optim_scalars": optim_scalars,
        "session": {k: v for k, v in session_state.items() if k not in RANK_KEYS},
    }
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None} if in_window else {}
    per_rank = {"step": step, "rng": rng_state(), "session": {k: session_state[k] for k in RANK_KEYS},
                "grads": grads or None}
    shared["in_window"] = bool(grads)
    return TrainingState(tensors, shared, per_rank)


def restore(
    state: TrainingState,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    session: SessionState,
) -> None:
    """Put ``state`` into the live objects. ``state.per_rank`` is empty when the run resumes on
    another number of ranks: then RNGs, comm state and speed windows start fresh."""
    model_state = {k.removeprefix("model/"): v for k, v in state.tensors.items() if k.startswith("model/")}
    model.load_state_dict(model_state, strict=True)
    per_param: dict[int, dict[str, Any]] = {}
    for key, value in state.tensors.items():
        if key.startswith("optim/"):
            _, index, name = key.split("/", 2)
            per_param.setdefault(int(index), {})[name] = value
    for key, value in state.shared["optim_scalars"].items():
        index, name = key.split("/", 1)
        per_param.setdefault(int(index), {})[name] = value
    optimizer.load_state_dict({"state": per_param, "param_groups": state.shared["optim_groups"]})
    scheduler.load_state_dict(state.shared["scheduler"])
    mine = state.per_rank["session"] if state.per_rank else {"rank": -1, "window": None, "comm": None}
    session.load_state_dict({**state.shared["session"], **mine})
    if state.per_rank:
        set_rng_state(state.per_rank["rng"])
    if state.grads:
        params = dict(model.named_parameters())
        for name, grad in state.grads.items():
            params[name].grad = grad.to(params[name].device).clone()
