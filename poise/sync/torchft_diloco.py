"""torchft's DiLoCo, as a :class:`~poise.sync.Sync`, for comparison (``--sync torchft-diloco``).

``torchft.local_sgd.DiLoCo`` (PyPI ``torchft`` 0.2.0, the optional extra ``poise[bench]``;
Douillard et al., "DiLoCo", https://arxiv.org/abs/2311.08105) driven as torchft's own tests
drive it on CPU (``torchft/local_sgd_integ_test.py``, ``torchft/_test/diloco_trainer.py``):
a ``LighthouseServer``, one ``Manager`` per replica group over torchft's ``ProcessGroupGloo``
with ``use_async_quorum=False``, and an outer ``SGD(lr, momentum, nesterov=True)``. Here every
rank is a replica group of its own (world size 1), so the outer all-reduce spans all ranks:

- rank 0 runs the lighthouse (``min_replicas`` = the world) on its own address; every rank
  runs a TCPStore for its replica group and a manager server on its own address. The address
  is the one this host uses to reach ``MASTER_ADDR`` (on the emulated cluster, the node's
  link; alone, 127.0.0.1), so every node reaches it;
- the model is wrapped in DDP (which broadcasts rank 0's parameters: torchft's own step-0
  sync, ``init_sync``, would fetch the whole state over its HTTP checkpoint transport, so it
  is off) and every forward runs under DDP's ``no_sync``, as ``Outer``'s inner steps do: no
  gradient leaves the rank, and the training loop sees the same DDP model as elsewhere;
- torchft's DiLoCo counts inner steps with hooks on an optimizer's ``step``; the user's
  optimizer is not this object's to hook, so a parameterless trigger optimizer is stepped in
  :meth:`end_step` after each optimizer step: torchft's hooks run exactly when they would.
  Every ``sync.inner_steps`` of them it starts a quorum, all-reduces the parameter change
  (the pseudo-gradient, fp32, one all-reduce per parameter), restores the last global
  parameters and takes the outer step, waiting for every replica (the slowest sets the pace).

torchft's defaults: outer lr 0.7 and Nesterov momentum 0.9 (its tests), which are also
``sync.outer_lr`` and ``sync.outer_momentum``'s defaults (those are used); equal weighting of
the replicas (``sync.weighting`` has no say: ``loss_scope``: the rank alone, each rank's own mean
loss); no compression (``should_quantize`` needs Triton and CUDA, and on gloo sends plain fp32
anyway, so ``sync.codec`` must stay ``none``); one fragment. ``replicas_agree = False``.

Traffic: the pseudo-gradient's bytes at each outer step, all between nodes when the world
spans more than one; torchft's quorum and commit RPCs (a few hundred bytes) are not counted.
"""

from __future__ import annotations

import logging
import os
import socket
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from poise.comm.state import Counters, StepStats
from poise.comm.topology import default_group_timeout, spans_nodes
from poise.config import CommConfig
from poise.config.sync import SyncConfig
from poise.runtime.clock import Clock
from poise.sync.allreduce import AllReduce, HookWrapper
from poise.sync.base import LossScope

log = logging.getLogger(__name__)


def load_torchft() -> Any:
    """The ``torchft`` modules this needs, or a one-line ValueError quoting the import error."""
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs every quorum at info
    try:
        from torchft import local_sgd, manager, process_group
        from torchft._torchft import LighthouseServer
    except ImportError as exc:
        raise ValueError("sync.mode='torchft-diloco' needs torchft 0.2.0 (pip install torchft==0.2.0, poise's 'bench' "
                         f"extra): import failed: {type(exc).__name__}: {exc}") from None
    logging.getLogger("torchft").setLevel(logging.ERROR)  # a warning per quorum about NCCL's flight recorder
    return local_sgd, manager, process_group, LighthouseServer


def own_address() -> str:
    """The address this host uses to reach ``MASTER_ADDR`` (127.0.0.1 without one): on the
    emulated cluster, the node's own link address, which every node reaches."""
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((socket.gethostbyname(master), 9))  # UDP: no packet is sent
            return str(probe.getsockname()[0])
        except OSError:
            return "127.0.0.1"


class TorchftDiLoCo:
    """torchft's DiLoCo, each rank its own replica group (see module doc); a :class:`~poise.sync.Sync`.

    Args:
        model: a plain module (wrapped here in DDP, every forward under ``no_sync``).
        comm: its codec must be ``none`` (no gradient is reduced per step).
        sync: ``inner_steps`` (torchft's ``sync_every``), ``outer_lr``, ``outer_momentum``.
        clock, backend, compression_start, outer: as :class:`~poise.sync.AllReduce`'s (its
            DDP wrapping and probe; its all-reduce never runs).
        ranks_per_node: for the inter-node counters (None: ``LOCAL_WORLD_SIZE``, else the world).

    Raises:
        ValueError: one line: torchft is not installed, or a setting torchft cannot honour.
    """

    loss_scope: LossScope
    replicas_agree = False
    trial = None  # no comm.codec=auto trial: the recorder reads it

    def __init__(self, model: nn.Module, comm: CommConfig, sync: SyncConfig, *, clock: Clock, backend: str,
                 compression_start: int, outer: Sequence[HookWrapper] = (), ranks_per_node: int | None = None) -> None:
        if not comm.exact or comm.collective != "flat":
            raise ValueError(f"sync.mode='torchft-diloco' reduces no gradient per step: comm.codec={comm.codec!r} and "
                             f"comm.collective={comm.collective!r} must stay 'none' and 'flat'")
        if sync.codec != "none":
            raise ValueError(f"sync.mode='torchft-diloco' sends plain fp32 on gloo (its quantization needs Triton and "
                             f"CUDA): sync.codec={sync.codec!r} must stay 'none'")
        local_sgd, manager_mod, process_group, lighthouse_cls = load_torchft()
        rank, world = dist.get_rank(), dist.get_world_size()
        self.loss_scope = LossScope.alone(rank)
        per_node = ranks_per_node if ranks_per_node is not None else int(os.environ.get("LOCAL_WORLD_SIZE", world))
        self.sync = sync
        # DDP broadcasts rank 0's parameters (torchft's init_sync is off); its hook never runs
        self.inner = AllReduce(model, comm, clock=clock, backend=backend, compression_start=compression_start,
                               outer=outer)
        self.model = self.inner.model
        self.probe = self.inner.probe
        self._spans_nodes = spans_nodes(range(world), per_node)
        timeout = default_group_timeout() or timedelta(minutes=30)
        address = own_address()
        self._lighthouse = None
        url: list[Any] = [None]
        if rank == 0:
            self._lighthouse = lighthouse_cls(bind="0.0.0.0:0", min_replicas=world)
            url[0] = f"http://{address}:{self._lighthouse.address().rsplit(':', 1)[1]}"
        dist.broadcast_object_list(url, src=0)
        self._store = dist.TCPStore(address, 0, is_master=True, wait_for_workers=False, timeout=timeout)
        self.manager = manager_mod.Manager(
            pg=process_group.ProcessGroupGloo(timeout=timeout), load_state_dict=None, state_dict=None,
            min_replica_size=world, use_async_quorum=False, rank=0, world_size=1, store_addr=address,
            store_port=self._store.port, lighthouse_addr=url[0], replica_id=f"poise_{rank}", port=0,
            hostname=address, init_sync=False, timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout)
        self._trigger = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)
        module = self.model.module
        self.outer_optimizer = torch.optim.SGD(module.parameters(), lr=sync.outer_lr, momentum=sync.outer_momentum,
                                               nesterov=sync.outer_momentum > 0)
        self.diloco = local_sgd.DiLoCo(self.manager, [module], self._trigger, self.outer_optimizer,
                                       sync_every=sync.inner_steps)
        self.diloco.__enter__()
        self._closer = weakref.finalize(self, _close, self.manager, self._lighthouse)
        self._params = len(list(module.parameters()))
        self._param_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
        self._counters, self._inter = Counters(), Counters()
        self.inner_steps_done = 0  # optimizer steps since the run began
        self.outer_steps = 0

    # -- the call points -------------------------------------------------------------------

    def begin_step(self, index: int) -> None:
        self.probe.reset()
        self._counters.reset()
        self._inter.reset()

    def micro_batch(self, last: bool) -> None:
        """Every forward under DDP's ``no_sync`` (left when the step ends)."""
        self.inner.micro_batch(False)

    def backward(self, run: Callable[[], None]) -> None:
        self.inner.backward(run)

    def end_step(self, index: int, *, tokens: float, optimizer_step: bool) -> None:
        """After an optimizer step: torchft's hooks (via the trigger); every ``inner_steps``-th
        they all-reduce the pseudo-gradient and take the outer step, waiting for every replica."""
        self.inner.micro_batch(True)  # leave no_sync: the step is over
        if not optimizer_step:
            return
        self.inner_steps_done += 1
        if self.inner_steps_done % self.sync.inner_steps == 0:  # torchft's sync_every, one fragment
            self.outer_steps += 1
            self._counters.add(raw_bytes=self._param_bytes, wire_bytes=self._param_bytes,
                               buckets=self._params)
            if self._spans_nodes:
                self._inter.add(raw_bytes=self._param_bytes, wire_bytes=self._param_bytes)
        self._trigger.step()

    def between_steps(self) -> bool:
        return False

    def conclude(self) -> bool:
        """Whether the last optimizer step was torchft's outer step (it offers no final
        synchronization of its own: the ranks keep their parameters since the last one)."""
        return self.inner_steps_done % self.sync.inner_steps == 0

    def traffic(self) -> tuple[StepStats, StepStats]:
        return self._counters.snapshot(), self._inter.snapshot()

    def settle(self, forward_backward: Callable[[], None]) -> None:
        """Nothing to settle: no bucket is ever reduced, so no state is keyed by DDP's layout."""

    # -- state -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The outer optimizer's state, the last global parameters (torchft keeps them on the
        CPU) and the step counts."""
        fragment = self.diloco._fragments[0]  # torchft exposes its state only to its Manager
        return {"outer_optimizer": self.outer_optimizer.state_dict(),
                "original_parameters": {k: v.clone() for k, v in fragment.original_parameters.items()},
                "local_step": self.diloco._local_step, "manager": self.manager.state_dict(),
                **self.shared_state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
        for name, tensor in self.diloco._fragments[0].original_parameters.items():
            tensor.copy_(state["original_parameters"][name])
        self.diloco._local_step = int(state["local_step"])
        self.manager.load_state_dict(state["manager"])
        self.load_shared_state_dict(state)

    def shared_state_dict(self) -> dict[str, Any]:
        return {"inner_steps_done": self.inner_steps_done, "outer_steps": self.outer_steps}

    def load_shared_state_dict(self, state: dict[str, Any]) -> None:
        self.inner_steps_done = int(state.get("inner_steps_done", 0))
        self.outer_steps = int(state.get("outer_steps", 0))

    def summary(self) -> dict[str, Any]:
        return {"mode": "torchft-diloco", "inner_steps": self.sync.inner_steps, "outer_lr": self.sync.outer_lr,
                "outer_momentum": self.sync.outer_momentum, "weighting": "equal", "codec": "none",
                "outer_steps": self.outer_steps, "torchft_step": self.manager.current_step()}

    def close(self) -> None:
        """Stop torchft's manager server and (rank 0) the lighthouse; also run at exit."""
        self._closer()


def _close(manager: Any, lighthouse: Any) -> None:
    manager.shutdown(wait=False)
    if lighthouse is not None:
        lighthouse.shutdown()


__all__ = ["TorchftDiLoCo", "load_torchft", "own_address"]
