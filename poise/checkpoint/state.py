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
  differ per rank); under outer-step sync (local SGD, DiLoCo), whose ranks' optimizers differ,
  also this rank's optimizer state.

:func:`fit_problems` compares a saved state with the run about to use it (config settings
that shape the model, optimizer and data; parameter names and shapes) before anything is
loaded, so a mismatch is a one-line error and never a partial load.

A model sharded with FSDP2 is saved as its full tensors under the same keys, gathered and
put back by :mod:`poise.checkpoint.sharded` (collectives: every rank captures and restores).

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
from poise.runtime.fsdp import is_fsdp_module


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
    "emulate.speed_noise", "emulate.fail_at", "emulate.data_delay_s", "parallel.reshard_after_forward",
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
    # a setting added after the checkpoint was written ran at its default then
    then = {**{key: value for key, value in fit_config(RunConfig()).items() if key not in then}, **then}
    return [f"{key} is {then.get(key)!r} in the checkpoint but {now.get(key)!r} now"
            for key in sorted(set(now) | set(then)) if now.get(key) != then.get(key)]


class DoesNotFit(ValueError):
    """A checkpoint that is intact but was written by another run (config or model): the user's
    error, named in one line; an older checkpoint of the same directory would not fit either."""


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


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def shared_problem(shared: Any, step: int, world_size: int) -> str:
    """What is wrong with the structure of a checkpoint's ``state.pt`` for a manifest of
    ``step`` and ``world_size`` ('' when nothing): what :func:`restore` reads must be there, of
    the type it reads it as. A file that matches its checksum can still hold anything."""
    if not isinstance(shared, dict):
        return f"it holds a {type(shared).__name__}, not a table"
    kinds = {"step": int, "world_size": int, "scheduler": dict, "optim_groups": list, "optim_scalars": dict,
             "session": dict}
    for key, kind in kinds.items():
        value = shared.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            return f"{key} is {type(value).__name__}, not {kind.__name__}"
    if shared["step"] != step or shared["world_size"] != world_size:
        return (f"step {shared['step']} and world_size {shared['world_size']} are not the manifest's "
                f"{step} and {world_size}")
    if not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in shared["optim_groups"]):
        return "optim_groups is not a list of parameter groups"
    if not all(isinstance(k, str) and k.split("/", 1)[0].isdigit() and "/" in k for k in shared["optim_scalars"]):
        return "optim_scalars has a key that is not <parameter index>/<name>"
    if not isinstance(shared.get("in_window", False), bool):
        return "in_window is not true or false"
    return sync_problem(shared["session"].get("comm_shared"), "session.comm_shared")


# The step counters of a sync strategy's state (poise.sync: the outer-step strategies' rounds,
# torch's and torchft's local SGD, the comm hook's step) and the least each may be: every
# rank holds them alike, and a resume divides by, indexes with or waits for them. A checkpoint
# that matches its checksums may still hold any value; these are checked before a resume uses one.
_SYNC_COUNTERS = {"steps": 0, "outer_steps": 0, "inner_steps": 1, "warmup_left": 0, "local_step": 0,
                  "inner_steps_done": 0, "outer_steps_done": 0, "iter": 0, "averager_step": 0, "averages": 0,
                  "step": 0}
_MAX_COUNT = 1 << 53  # more steps than any run takes (and exact in a float)


def sync_problem(comm: Any, where: str) -> str:
    """What keeps a sync strategy's saved state ``comm`` (a rank's ``session.comm``, or the shared
    ``comm_shared``) from being resumed ('' when nothing): a counter that is not a count in
    range (an outer round of 0 inner steps divides by zero; a negative step count waits for
    steps no rank takes), outer parameters or momentum that are not finite, a pending outer
    all-reduce of a fragment the model does not have."""
    if comm is None:
        return ""
    if not isinstance(comm, dict):
        return f"{where} is a {type(comm).__name__}, not a table"
    for key, low in _SYNC_COUNTERS.items():
        if key in comm and not (_is_int(comm[key]) and low <= comm[key] <= _MAX_COUNT):
            return f"{where}.{key} is {str(comm[key])[:40]}: not a count from {low} to {_MAX_COUNT}"
    for key in ("global", "momenta", "local"):
        if key in comm:
            value = comm[key]
            if not isinstance(value, list) or not all(isinstance(t, torch.Tensor) for t in value):
                return f"{where}.{key} is not a list of tensors"
            if not all(bool(torch.isfinite(t).all()) for t in value if t.is_floating_point()):
                return f"{where}.{key} holds a value that is not finite (NaN or infinite)"
    fragments = len(comm["global"]) if isinstance(comm.get("global"), list) else 0
    pending = comm.get("pending", [])
    if not isinstance(pending, list):
        return f"{where}.pending is not a list"
    for entry in pending:
        if not isinstance(entry, dict) or not _is_int(entry.get("fragment")) \
                or not 0 <= entry["fragment"] < fragments:
            named = entry.get("fragment") if isinstance(entry, dict) else entry
            return f"{where}.pending names fragment {str(named)[:40]}: the state has {fragments}"
        if not _is_int(entry.get("apply_after")) or not 0 <= entry["apply_after"] <= _MAX_COUNT:
            return f"{where}.pending's apply_after {str(entry.get('apply_after'))[:40]} is not a count of steps"
        result = entry.get("result")
        if result is not None and (not isinstance(result, torch.Tensor)
                                   or (result.is_floating_point() and not bool(torch.isfinite(result).all()))):
            return f"{where}.pending holds a result that is not a finite tensor"
    tokens = comm.get("tokens", [])
    if not isinstance(tokens, list) or not all(isinstance(t, (int, float)) and not isinstance(t, bool)
                                               and 0 <= t < float("inf") for t in tokens):
        return f"{where}.tokens is not a list of token counts"
    return ""


def sync_disagreement(comms: list[Any]) -> str:
    """Where the ranks' saved sync states (``session.comm`` of rank 0, 1, ...) differ in what every
    rank holds alike ('' when nowhere): their step counters and pending outer all-reduces. A
    rank resumed with another round length would launch other collectives than its peers."""
    def alike(comm: Any) -> dict[str, Any]:
        if not isinstance(comm, dict):
            return {}
        out = {key: comm[key] for key in _SYNC_COUNTERS if key in comm}
        if isinstance(comm.get("pending"), list):
            out["pending"] = [(p.get("fragment"), p.get("apply_after")) for p in comm["pending"] if isinstance(p, dict)]
        return out

    first = alike(comms[0]) if comms else {}
    for rank, comm in enumerate(comms[1:], start=1):
        mine = alike(comm)
        for key in sorted(set(first) | set(mine)):
            if first.get(key) != mine.get(key):
                return (f"session.comm.{key} is {str(mine.get(key))[:40]} on rank {rank} but "
                        f"{str(first.get(key))[:40]} on rank 0 (every rank holds it alike)")
    return ""


# The sizes of the RNG states :func:`set_rng_state` puts back (torch's CPU generator; numpy's
# Mersenne Twister keys): a state of another size verifies by checksum and fails at restore.
_TORCH_RNG_BYTES = torch.get_rng_state().numel()
_MT_WORDS = 624


def rank_problem(per_rank: Any, step: int) -> str:
    """What is wrong with the structure of a checkpoint's per-rank file for ``step`` ('' when
    nothing): its step, RNG states, session part and accumulated gradients."""
    if not isinstance(per_rank, dict):
        return f"it holds a {type(per_rank).__name__}, not a table"
    if not _is_int(per_rank.get("step")) or per_rank["step"] != step:
        return f"step {per_rank.get('step')!r} is not the manifest's {step}"
    rng = per_rank.get("rng")
    if not isinstance(rng, dict) or not isinstance(rng.get("torch"), torch.Tensor) \
            or rng["torch"].dtype != torch.uint8 or rng["torch"].dim() != 1:
        return "rng.torch is not a generator state (a 1-d uint8 tensor)"
    if rng["torch"].numel() != _TORCH_RNG_BYTES:
        return f"rng.torch has {rng['torch'].numel()} bytes, a generator state {_TORCH_RNG_BYTES}"
    numpy_state, python_state = rng.get("numpy"), rng.get("python")
    if not isinstance(numpy_state, (list, tuple)) or len(numpy_state) != 5 \
            or not isinstance(numpy_state[1], torch.Tensor) or numpy_state[1].shape != (_MT_WORDS,):
        return "rng.numpy is not a numpy generator state"
    if not isinstance(python_state, (list, tuple)) or len(python_state) != 3 \
            or not isinstance(python_state[1], (list, tuple)) or len(python_state[1]) != _MT_WORDS + 1:
        return "rng.python is not a python generator state"
    session = per_rank.get("session")
    if not isinstance(session, dict) or not set(RANK_KEYS) <= set(session):
        return f"session lacks one of {', '.join(RANK_KEYS)}"
    problem = sync_problem(session["comm"], "session.comm")
    if problem:
        return problem
    own_optim = per_rank.get("optim")
    if own_optim is not None and (not isinstance(own_optim, dict) or not isinstance(own_optim.get("state"), dict)):
        return "optim is not an optimizer state"
    grads = per_rank.get("grads")
    if grads is not None and (not isinstance(grads, dict)
                              or not all(isinstance(g, torch.Tensor) for g in grads.values())):
        return "grads is not a table of tensors"
    return ""


def tensor_problems(tensors: dict[str, Any], params: dict[str, list[int]], dtypes: dict[str, str] | None) -> list[str]:
    """Where a checkpoint's model tensors differ from what its manifest records of the model
    (``params``: name -> shape; ``dtypes``: name -> dtype, in checkpoints that record them)."""
    model = {k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")}
    problems = [f"model tensors {sorted(set(model) ^ set(params))[:3]} are in one of the files and the "
                "manifest's parameters only"] if set(model) != set(params) else []
    for name in sorted(set(model) & set(params)):
        if list(model[name].shape) != params[name]:
            problems.append(f"model/{name} has shape {list(model[name].shape)}, the manifest says {params[name]}")
        elif dtypes is not None and str(model[name].dtype) != dtypes.get(name):
            problems.append(f"model/{name} is {model[name].dtype}, the manifest says {dtypes.get(name)}")
    for key in tensors:
        if not key.startswith("model/") and not (key.startswith("optim/") and key.split("/")[1].isdigit()
                                                  and key.count("/") >= 2):
            problems.append(f"tensor {key!r} is neither model/<name> nor optim/<index>/<name>")
    return problems


def live_problems(state: TrainingState, model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Where a loaded state does not fit the live model and optimizer it is about to go into
    (names, shapes, dtypes, parameter indices): checked before :func:`restore` changes anything,
    so that a checkpoint that cannot be restored is passed over whole."""
    live = model.state_dict()
    params = {k: list(v.shape) for k, v in live.items()}
    problems = tensor_problems(state.tensors, params, {k: str(v.dtype) for k, v in live.items()})
    flat = [p for group in optimizer.param_groups for p in group["params"]]
    for key, value in state.tensors.items():
        if key.startswith("optim/"):
            index = int(key.split("/")[1])
            if index >= len(flat):
                problems.append(f"{key}: the optimizer has {len(flat)} parameters")
            elif value.dim() > 0 and value.shape != flat[index].shape:
                problems.append(f"{key} has shape {list(value.shape)}, its parameter {list(flat[index].shape)}")
    groups = state.shared["optim_groups"]
    if [len(g["params"]) for g in groups] != [len(g["params"]) for g in optimizer.param_groups]:
        problems.append("the optimizer's parameter groups differ from the checkpoint's")
    named = dict(model.named_parameters())
    for name, grad in (state.grads or {}).items():
        if name not in named or grad.shape != named[name].shape:
            problems.append(f"accumulated gradient {name} does not fit the model's parameter")
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
    if is_fsdp_module(model):
        from poise.checkpoint import sharded  # FSDP2's state API: imported for a sharded model only

        if in_window:
            raise ValueError(f"step {step} is inside a gradient-accumulation window: FSDP2 holds the gradients "
                             "accumulated so far unsharded, so a sharded model is saved at a window's end")
        model_state, full_optim = sharded.full_state(model, optimizer)  # rank 0's; empty on the others
        tensors = {f"model/{k}": v for k, v in model_state.items()}
        optim = {"state": full_optim, "param_groups": optimizer.state_dict()["param_groups"]}
    else:
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
    # outer-step sync: each rank's optimizer state is its own (the parameters are in the session's part)
    own_optim = None if session_state.get("replicas_agree", True) else {"state": optim["state"]}
    per_rank = {"step": step, "rng": rng_state(), "session": {k: session_state[k] for k in RANK_KEYS},
                "grads": grads or None, "optim": own_optim}
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
    per_param: dict[int, dict[str, Any]] = {}
    for key, value in state.tensors.items():
        if key.startswith("optim/"):
            _, index, name = key.split("/", 2)
            per_param.setdefault(int(index), {})[name] = value
    for key, value in state.shared["optim_scalars"].items():
        index, name = key.split("/", 1)
        per_param.setdefault(int(index), {})[name] = value
    own = state.per_rank.get("optim") if state.per_rank else None
    if own is not None:  # outer-step sync: this rank's own optimizer state, not rank 0's
        per_param = own["state"]
    if is_fsdp_module(model):  # every rank keeps its shard of the full tensors
        from poise.checkpoint import sharded

        sharded.load_full_state(model, optimizer, model_state, per_param, state.shared["optim_groups"])
    else:
        model.load_state_dict(model_state, strict=True)
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
