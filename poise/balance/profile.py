"""Per-layer profiling: the numbers :func:`poise.balance.partition` consumes.

For a model given as an ``nn.Sequential`` or a list of layers applied one after the other,
:func:`profile_layers` measures, on a real sample batch, each layer's forward + backward
seconds (median of ``repeats`` after ``warmup`` untimed runs), its parameter bytes, the bytes
of the activations it saves for backward, and the bytes of the tensor it hands to the next
layer (what crosses a stage boundary cut after it). Layers run on deep copies (torchgpipe's
sandbox idea), so the user's modules, their gradients and their RNG-free state are untouched.
Profiling only measures; it decides nothing.
"""

from __future__ import annotations

import copy
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

log = logging.getLogger(__name__)

Activation = torch.Tensor | tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class LayerProfile:
    """Measured costs of a list of layers, one entry per layer.

    Attributes:
        names: a label per layer (its class name, or the name the user gave).
        time_s: median forward + backward seconds per layer for the sample batch.
        forward_s: median forward seconds per layer.
        param_bytes: bytes of each layer's parameters (and buffers).
        activation_bytes: bytes each layer saves for its backward (distinct storages).
        output_bytes: bytes of each layer's output; entry i crosses a cut after layer i.
    """

    names: list[str]
    time_s: list[float]
    forward_s: list[float]
    param_bytes: list[int]
    activation_bytes: list[int]
    output_bytes: list[int]

    @property
    def boundary_bytes(self) -> list[int]:
        """Bytes crossing each possible cut (``len − 1`` entries; entry i is after layer i)."""
        return self.output_bytes[:-1]

    def boundary_costs_s(self, link_bytes_per_s: float, latency_s: float = 0.0) -> list[float]:
        """Seconds per possible cut: activation forward + its gradient backward over the link.

        Raises:
            ValueError: the bandwidth is not positive or the latency negative.
        """
        if not link_bytes_per_s > 0 or latency_s < 0:
            raise ValueError(
                f"link_bytes_per_s={link_bytes_per_s} must be > 0 and latency_s={latency_s} >= 0"
            )
        return [2 * (latency_s + b / link_bytes_per_s) for b in self.boundary_bytes]

    def memory_bytes(self, *, state_bytes_per_param_byte: float = 3.0, micro_batches_in_flight: int = 1) -> list[float]:
        """Bytes each layer needs on its stage during training.

        Args:
            state_bytes_per_param_byte: gradient + optimizer state per parameter byte
                (3 for AdamW: one gradient, two moments).
            micro_batches_in_flight: activations kept at once (GPipe: all micro-batches;
                1F1B: up to the number of stages).
        """
        return [
            p * (1.0 + state_bytes_per_param_byte) + a * micro_batches_in_flight
            for p, a in zip(self.param_bytes, self.activation_bytes, strict=True)
        ]

    def as_dict(self) -> dict[str, list]:
        return {k: list(getattr(self, k)) for k in
                ("names", "time_s", "forward_s", "param_bytes", "activation_bytes", "output_bytes")}


def named_layers(model: nn.Module, names: Sequence[str]) -> list[nn.Module]:
    """The submodules of ``model`` at the dotted ``names`` (e.g. ``["embed", "blocks.0"]``).

    Raises:
        ValueError: a name that ``model`` does not have.
    """
    layers = []
    for name in names:
        try:
            layers.append(model.get_submodule(name))
        except AttributeError:
            raise ValueError(f"model has no submodule {name!r}") from None
    return layers


def _tensors(value: Activation) -> tuple[torch.Tensor, ...]:
    if isinstance(value, torch.Tensor):
        return (value,)
    if isinstance(value, tuple) and all(isinstance(v, torch.Tensor) for v in value):
        return value
    raise ValueError(f"a layer returned {type(value).__name__}; profiling needs a tensor or a tuple of tensors")


def _detached_input(value: Activation) -> Activation:
    """The value as a fresh graph leaf: float tensors require grad, so backward reaches the layer's input."""
    out = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in _tensors(value))
    return out[0] if isinstance(value, torch.Tensor) else out


def _call(layer: nn.Module, value: Activation) -> Activation:
    return layer(*value) if isinstance(value, tuple) else layer(value)


def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _sync(device: torch.device) -> None:
    # CPU/GPU synchronisation point: CUDA kernels run asynchronously, so time only after them.
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _saved_bytes(layer: nn.Module, value: Activation) -> int:
    """Bytes of the distinct storages autograd saves for backward during one forward."""
    storages: dict[int, int] = {}
    # Weights saved for backward (a linear layer keeps its weight) are parameters, not activations.
    weights = {t.untyped_storage().data_ptr() for t in (*layer.parameters(), *layer.buffers())}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _call(layer, _detached_input(value))
    return sum(storages.values())


def _time_once(
    layer: nn.Module, value: Activation, loss_fn: Callable[[Activation], torch.Tensor] | None,
    grads: list[torch.Tensor] | None, device: torch.device,
) -> tuple[float, float, list[torch.Tensor]]:
    """One forward + backward of ``layer`` on ``value``: (total s, forward s, the upstream gradients used)."""
    x = _detached_input(value)
    _sync(device)
    t0 = time.perf_counter()
    out = _call(layer, x)
    if loss_fn is not None:
        out = loss_fn(out)
    _sync(device)
    t1 = time.perf_counter()
    outs = [t for t in _tensors(out) if t.requires_grad]
    if grads is None:  # the same upstream gradient every repeat, drawn once
        grads = [torch.randn_like(t) for t in outs]
    if outs:
        torch.autograd.backward(outs, grads)
    _sync(device)
    t2 = time.perf_counter()
    layer.zero_grad(set_to_none=True)
    return t2 - t0, t1 - t0, grads


def profile_layers(
    layers: nn.Sequential | Sequence[nn.Module],
    sample: Activation,
    *,
    names: Sequence[str] | None = None,
    loss_fn: Callable[[Activation], torch.Tensor] | None = None,
    repeats: int = 5,
    warmup: int = 2,
    device: torch.device | str = "cpu",
) -> LayerProfile:
    """Measure every layer on a real sample batch.

    Args:
        layers: an ``nn.Sequential`` or the layers in the order they are applied; each takes
            the previous layer's output (a tuple output is passed as positional arguments).
        sample: the first layer's input, e.g. a micro-batch of token ids.
        names: a label per layer (default: class names).
        loss_fn: maps the last layer's output to a scalar loss; when given, its forward and
            backward count as part of the last layer (the last stage computes the loss).
        repeats: timed runs per layer; the median is reported (>= 1).
        warmup: untimed runs before them (>= 0).
        device: where the copies run; ``sample`` is moved there.

    Raises:
        ValueError: no layers, bad repeat counts, or a layer output that is not tensors.
    """
    modules = list(layers)
    if not modules:
        raise ValueError("profile_layers needs at least one layer, got none")
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats={repeats} must be >= 1 and warmup={warmup} >= 0")
    if names is not None and len(names) != len(modules):
        raise ValueError(f"{len(names)} names for {len(modules)} layers")
    device = torch.device(device)
    labels = list(names) if names is not None else [type(m).__name__ for m in modules]
    value: Activation = tuple(t.to(device) for t in _tensors(sample))
    value = value[0] if isinstance(sample, torch.Tensor) else value
    # Sandbox: deep copies, so the user's layers, their gradients and buffers stay untouched.
    copies = [copy.deepcopy(m).to(device).train() for m in modules]
    inputs, params, saved, outputs = [], [], [], []
    for layer in copies:
        inputs.append(value)
        params.append(_nbytes([*layer.parameters(), *layer.buffers()]))
        saved.append(_saved_bytes(layer, value))
        with torch.no_grad():
            value = _call(layer, value)
        outputs.append(_nbytes(_tensors(value)))
    # Rounds over all layers rather than all repeats of one layer at a time: a passing
    # disturbance (another process, CPU throttling) then touches every layer alike instead of
    # making a few layers look slow.
    total: list[list[float]] = [[] for _ in copies]
    forward: list[list[float]] = [[] for _ in copies]
    grads: list[list[torch.Tensor] | None] = [None] * len(copies)
    for round_index in range(warmup + repeats):
        for i, layer in enumerate(copies):
            loss = loss_fn if i == len(copies) - 1 else None
            t, f, grads[i] = _time_once(layer, inputs[i], loss, grads[i], device)
            if round_index >= warmup:
                total[i].append(t)
                forward[i].append(f)
    time_s = [statistics.median(t) for t in total]
    forward_s = [statistics.median(f) for f in forward]
    for label, t in zip(labels, time_s, strict=True):
        log.debug("profiled %s: %.3f ms", label, t * 1e3)
    return LayerProfile(labels, time_s, forward_s, params, saved, outputs)
