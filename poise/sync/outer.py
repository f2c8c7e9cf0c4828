"""Outer-step synchronization: local SGD, DiLoCo and Streaming DiLoCo, as :class:`Outer`.

Per-step gradient all-reduce cannot run faster than its link: on a slow one the ranks wait for
the network every step. Synchronizing rarely changes the trade. Each rank trains alone for H
inner steps (its own optimizer on its own batches: DDP's ``no_sync``, no all-reduce), then the
ranks meet once in an *outer step* on the change of their parameters since the last one::

    delta_r  = global - local_r                        (rank r's pseudo-gradient)
    avg      = sum_r w_r delta_r                       (w_r: rank r's share of the round's tokens)
    m        = mu m + avg                              (outer SGD, Nesterov momentum mu)
    global  -= lr (avg + mu m)
    local_r  = global

With ``lr=1, mu=0`` that is parameter averaging (local SGD; with H=1 and an SGD inner optimizer
it is exactly DDP's step). With Nesterov ``lr=0.7, mu=0.9`` it is DiLoCo (Douillard et al.
2023: inner AdamW, H in the hundreds, hundreds of times less traffic at matched perplexity).
Streaming DiLoCo (Douillard et al. 2025) cuts the model into F fragments synchronized in turn,
one every H/F steps, so the traffic is spread out; each fragment's all-reduce runs in the
background for ``delay_steps`` (tau) inner steps and its result is then *mixed* into the
parameters the rank has trained meanwhile: ``local = alpha local + (1 - alpha) global``.

Unequal workers: with ``weighting=tokens`` the average weighs each rank by the loss terms it
trained in the round, so a rank given fewer samples (poise's balancing gives a slow rank a
smaller share of each step, and the same number of steps) counts for less, and every sample
counts once. A rank that trained nothing in a round sends a zero change with weight 0, and no
rank waits on it beyond the all-reduce itself.

With ``inner_scope=node`` a node's ranks are one replica (:mod:`poise.sync.nodes`): DDP
all-reduces their gradients every step within the node, and the outer step above runs between
nodes only (``r`` is then a node, ``w_r`` its share of the round's tokens), each rank sending
the piece of the change its local rank owns.

Outer changes can be compressed with poise's codecs (``fp16``, ``bf16``, ``int8``, ``topk``),
always with error feedback: what a round fails to send is added to the next round's change.

``auto`` times DDP's steps, then, if their exposed communication is too large, fully
synchronized ones, and chooses every-step synchronization or outer steps every H inner steps
(:mod:`poise.sync.auto`). The choice and its figures go into the report (``sync`` key).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from poise.comm.codecs import ErrorFeedback, make
from poise.comm.reducers import make_reducer
from poise.comm.state import Counters, StepStats
from poise.comm.trial import CodecTrial
from poise.config import CommConfig, SyncConfig
from poise.runtime.clock import Clock
from poise.sync.allreduce import AllReduce, HookWrapper
from poise.sync.auto import AutoTrial, choose_inner_steps, per_step_pays
from poise.sync.base import LossScope
from poise.sync.fragments import fragments, launch_step
from poise.sync.nodes import assemble, average_across_nodes, make_nodes, piece

log = logging.getLogger(__name__)

@dataclass
class Pending:
    """An outer all-reduce in flight: its fragment, the step after which it is applied, and the
    future of the weighted average change (None when no rank trained anything in the round)."""

    fragment: int
    apply_after: int
    result: torch.futures.Future[torch.Tensor] | None


class Outer:
    """Local SGD, DiLoCo or Streaming DiLoCo (see module doc); a :class:`~poise.sync.Sync`.

    Composed over an :class:`AllReduce` on the same DDP model: inner steps run under DDP's
    ``no_sync`` (no gradient leaves the rank), or, with ``inner_scope=node``, all-reduce within
    the node (DDP over the node's ranks); ``auto`` may hand every step back to it.

    Args:
        model, comm, clock, backend, compression_start, outer: as :class:`AllReduce`'s.
        config: the ``[sync]`` settings (mode, H, outer optimizer, fragments, codec).
        world_size: ranks in the default group.
        last_step: the run's optimizer steps, if known: after the last, every fragment is
            synchronized and applied, so every rank ends with the same model (None: the ranks
            end with their own parameters since the last outer step).
        ranks_per_node: ranks of a node (None: ``LOCAL_WORLD_SIZE``, else the world); it makes
            the nodes of ``inner_scope=node`` and says which outer collectives cross nodes.
    """

    replicas_agree = False

    def __init__(self, model: nn.Module, comm: CommConfig, config: SyncConfig, *, clock: Clock, backend: str,
                 compression_start: int, world_size: int, last_step: int | None = None,
                 outer: Sequence[HookWrapper] = (), ranks_per_node: int | None = None) -> None:
        self.config = config
        self.last_step = last_step
        if last_step is None:  # said once: a model saved from one rank would silently be that rank's alone
            log.warning("sync.mode=%r without Data(total_steps=...): the ranks end with their own parameters since "
                        "the last outer step; give total_steps so the last step synchronizes every fragment",
                        config.mode)
        self.nodes = make_nodes(config.inner_scope, dist.get_rank(), world_size, ranks_per_node)
        self.inner = AllReduce(model, comm, clock=clock, backend=backend, compression_start=compression_start,
                               outer=outer, process_group=self.nodes.node_group)
        self.model, self.probe = self.inner.model, self.inner.probe
        self.world_size = world_size
        # local SGD is the outer step with lr 1 and no momentum; auto's trial steps are too
        plain = config.mode in ("local_sgd", "auto")
        self.lr, self.momentum = (1.0, 0.0) if plain else (config.outer_lr, config.outer_momentum)
        self.inner_steps = 1 if config.mode == "auto" else config.inner_steps
        self.per_step = False  # auto chose to synchronize every step through the inner all-reduce
        # optimizer steps synchronized every step before the first round: the warm-up, and auto's DDP trial
        self.lead = max(config.warmup_steps, config.auto_trial_steps if config.mode == "auto" else 0)
        self.warmup_left = self.lead  # of those, still to run
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        # where the small all-reduces' tensors live: NCCL reduces only device tensors
        self.device = self.params[0].device if backend == "nccl" and self.params else torch.device("cpu")
        count = config.fragments if config.mode == "streaming" else 1
        self.groups = fragments([p.numel() for p in self.params], count)
        with torch.no_grad():
            self.global_ = [self._flat(g).clone() for g in self.groups]  # the parameters at the last outer step
        self.momenta = [torch.zeros_like(g) for g in self.global_]
        self.tokens = [0.0] * len(self.groups)  # this rank's loss terms since each fragment's last outer step
        self.steps = 0  # optimizer steps done
        self.outer_steps = 0  # outer reductions applied (all fragments)
        # per fragment: every rank holds the same values (no optimizer step since its last outer step, applied unmixed)
        self.in_sync = [True] * len(self.groups)
        self.concluded = False  # finish() ran the final synchronization (the loop ended before last_step)
        self.pending: list[Pending] = []
        self.counters = Counters()  # bytes of the outer collectives (they cross nodes, if there are several)
        self.node_counters = Counters()  # bytes of collectives within a node (inner_scope=node's gathers)
        codec = make("none") if config.codec == "none" else ErrorFeedback(make(config.codec, **self._options()))
        self.reducer = make_reducer(codec, self.nodes.cross_group, self.counters)
        self.codec = codec
        self.auto = AutoTrial(config, world_size, self.device)  # auto's timings and choice (idle in other modes)
        self._step_began = 0.0
        self._across_s = 0.0  # inner_scope=node: seconds this step's gradients took between the nodes
        self._origin: Any = 0.0  # a mark of the probe's clock at the step's start (auto's DDP trial)
        self._last = True  # the micro-batch in hand ends the step's accumulation

    def _options(self) -> dict[str, Any]:
        return {"ratio": self.config.topk_ratio} if self.config.codec == "topk" else {}

    @property
    def every_step(self) -> bool:
        """Whether this step's gradients are all-reduced (the warm-up, or ``auto``'s choice)."""
        return self.per_step or self.warmup_left > 0

    @property
    def loss_scope(self) -> LossScope:
        """Each rank trains on its own mean loss between outer steps (the outer step weighs the
        ranks by their tokens); under ``inner_scope=node`` the node's ranks (DDP averages the
        node's weighted losses: ``L n_r / N_node``, :mod:`poise.sync.nodes`); while every step
        synchronizes, every rank's (DDP's)."""
        if self.every_step:
            return LossScope()
        if self.nodes.by_node:
            return LossScope(self.nodes.node_ranks, self.nodes.node_group)
        return LossScope.alone(dist.get_rank())

    @property
    def trial(self) -> CodecTrial | None:
        """The inner all-reduce's ``comm.codec=auto`` decision (per-step sync only)."""
        return self.inner.trial

    def _flat(self, group: list[int]) -> torch.Tensor:
        return torch.cat([self.params[i].detach().reshape(-1).float() for i in group])

    def _write(self, group: list[int], flat: torch.Tensor) -> None:
        offset = 0
        with torch.no_grad():
            for i in group:
                p = self.params[i]
                p.copy_(flat[offset: offset + p.numel()].view_as(p))
                offset += p.numel()

    # -- the call points -------------------------------------------------------------------

    def begin_step(self, index: int) -> None:
        self.inner.begin_step(index)
        self.counters.reset()
        self.node_counters.reset()
        self._step_began = time.perf_counter()
        self._across_s = 0.0
        if self.config.mode == "auto" and self.auto.timing_ddp:
            self._origin = self.probe.clock.mark()  # where auto's DDP trial reads the probe's marks from

    def micro_batch(self, last: bool) -> None:
        """Per-step sync and ``inner_scope=node``: as the inner all-reduce. Otherwise every
        forward runs under ``no_sync`` (entered before the forward, left at the step's end)."""
        self._last = last
        self.inner.micro_batch(last if self.every_step or self.nodes.by_node else False)

    def backward(self, run: Callable[[], None]) -> None:
        self.inner.backward(run)
        if self.nodes.by_node and self.every_step and self._last:  # the node's gradients, then the world's
            began = time.perf_counter()
            average_across_nodes([p.grad for p in self.params if p.grad is not None], self.nodes, self.counters,
                                 self.node_counters)
            self._across_s += time.perf_counter() - began

    def end_step(self, index: int, *, tokens: float, optimizer_step: bool) -> None:
        self.inner.micro_batch(True)  # leave no_sync: the step is over
        self.inner.end_step(index, tokens=tokens, optimizer_step=optimizer_step)
        if self.per_step:
            return
        if self.warmup_left > 0:
            if optimizer_step:
                if self.config.mode == "auto" and self.auto.timing_ddp:
                    self._time_ddp_step()
                    if self.per_step:
                        return
                self.warmup_left -= 1
                if self.warmup_left == 0:  # the ranks agree (DDP's steps): the first round starts here
                    self._restart_rounds()
            return
        self.tokens = [t + float(tokens) for t in self.tokens]
        if not optimizer_step:
            return
        compute_s = time.perf_counter() - self._step_began
        self.steps += 1  # (after the warm-up's: those are counted from here on)
        self.in_sync = [False] * len(self.groups)
        final = self.last_step is not None and self.steps >= self.last_step
        self._apply_due(everything=final)
        sync_began = time.perf_counter()
        for fragment in range(len(self.groups)):
            if final or (self.steps - self.lead) % self.inner_steps == launch_step(
                    fragment, len(self.groups), self.inner_steps):
                self._launch(fragment, delay=0 if final else None)
        self._apply_due(everything=final, mix=not final)  # the run's last: every rank takes the global model
        if self.config.mode == "auto" and self.auto.choice is None:
            left = self.last_step - self.steps if self.last_step is not None else None
            choice = self.auto.synchronized_step(compute_s, time.perf_counter() - sync_began, left)
            if choice is not None:
                self._take(choice)

    def _restart_rounds(self) -> None:
        """Outer rounds start from the parameters every rank now holds alike."""
        self.steps = self.lead
        with torch.no_grad():
            self.global_ = [self._flat(g).clone() for g in self.groups]
        self.tokens = [0.0] * len(self.groups)
        self.in_sync = [True] * len(self.groups)

    def _launch(self, fragment: int, delay: int | None = None) -> None:
        """Start the outer all-reduce of ``fragment``'s weighted change (see module doc), to be
        applied after ``delay`` more inner steps (None: streaming's tau, else 0)."""
        tokens, self.tokens[fragment] = self.tokens[fragment], 0.0
        nodes = self.nodes
        if nodes.lone and self.lr == 1.0 and not self.momentum:  # one node averaging with itself: exactly
            with torch.no_grad():  # what it holds (DDP's parameters, not global - (global - local))
                self.global_[fragment] = self._flat(self.groups[fragment])
            self.outer_steps += 1
            return
        if self.config.weighting == "tokens":
            counts = torch.zeros(nodes.replicas, dtype=torch.float64, device=self.device)
            counts[nodes.replica] = tokens  # a replica's terms: a rank's, or its node's ranks' summed
            dist.all_reduce(counts)  # so every rank knows each replica's tokens in the round
            total = float(counts.sum().item())
            if total <= 0:  # no rank trained anything since this fragment's last outer step
                self.pending.append(Pending(fragment, self.steps, None))
                return
            weight = float(counts[nodes.replica].item()) / total
        else:
            weight = 1.0 / nodes.replicas
        delta = self.global_[fragment] - self._flat(self.groups[fragment])
        if delay is None:
            delay = self.config.delay_steps if self.config.mode == "streaming" else 0
        # inner_scope=node: this rank's piece, reduced with the same local rank on the other nodes
        result = _done(delta.mul_(weight)) if nodes.lone else self.reducer.reduce(piece(delta, nodes), key=fragment,
                                                                                   weight=weight)
        self.pending.append(Pending(fragment, self.steps + delay, result))

    def _apply_due(self, everything: bool = False, mix: bool = True) -> None:
        due: list[Pending] = []
        waiting: list[Pending] = []
        for p in self.pending:
            (due if everything or p.apply_after <= self.steps else waiting).append(p)
        self.pending = waiting
        for p in due:
            avg = p.result.wait() if p.result is not None else None
            if avg is not None and not self.nodes.lone:  # the node's pieces, gathered (a no-op for one piece)
                avg = assemble(avg, self.global_[p.fragment].numel(), self.nodes, self.node_counters)
            self._apply(p.fragment, avg, mix)

    def _apply(self, fragment: int, avg: torch.Tensor | None, mix: bool = True) -> None:
        """The outer optimizer step on ``fragment`` with the ranks' average change ``avg``, and
        the rank's parameters set to the result (streaming: mixed into them, if ``mix``)."""
        group, global_ = self.groups[fragment], self.global_[fragment]
        if avg is not None:
            avg = avg.to(global_.device)  # a result restored from a checkpoint is on the CPU
            momentum = self.momenta[fragment]
            if self.momentum:
                momentum.mul_(self.momentum).add_(avg)
                global_.sub_(avg.add(momentum, alpha=self.momentum), alpha=self.lr)
            else:
                global_.sub_(avg, alpha=self.lr)
        alpha = self.config.mixing if self.config.mode == "streaming" and mix else 0.0
        local = global_ if alpha == 0.0 else self._flat(group).mul_(alpha).add_(global_, alpha=1.0 - alpha)
        self._write(group, local)
        self.in_sync[fragment] = alpha == 0.0
        self.outer_steps += 1

    def _time_ddp_step(self) -> None:
        """``auto``: time one of DDP's steps for the trial (:mod:`poise.sync.auto`)."""
        step_s = time.perf_counter() - self._step_began
        exposed = self._across_s
        if self.probe.last_ready is not None:  # busy minus hidden: what backward waited for after its compute
            busy, hidden = self.probe.comm_overlap(self.probe.last_ready, self._origin)
            exposed += busy - hidden
        if self.auto.ddp_step(step_s - exposed, exposed):
            self.per_step = True

    def _take(self, choice: dict[str, Any]) -> None:
        """``auto``'s choice after its fully synchronized steps: every step, or H inner steps
        (DiLoCo's Nesterov outer step, or plain averaging)."""
        if choice["mode"] == "step":
            self.per_step = True
            return
        self.inner_steps = int(choice["inner_steps"])
        if choice["mode"] == "diloco":
            self.lr, self.momentum = self.config.outer_lr, self.config.outer_momentum

    def between_steps(self) -> bool:
        return self.inner.between_steps()

    def conclude(self) -> bool:
        """The loop ended before ``last_step`` (an early stop, a ``break``, no ``total_steps``):
        the run's final synchronization now, as the last step would have run it (every
        fragment's change averaged and applied, every rank given the global parameters), so
        the replicas agree whatever stopped the loop. Nothing when they already do (DDP's
        warm-up, per-step sync, the last step synchronized, no outer round trained yet)."""
        if self.per_step or self.warmup_left > 0 or self.nodes.lone or (all(self.in_sync) and not self.pending):
            return True
        self._apply_due(everything=True)
        for fragment in range(len(self.groups)):
            self._launch(fragment, delay=0)
        self._apply_due(everything=True, mix=False)
        self.concluded = True
        log.info("sync %s: the loop ended after %d optimizer steps, before the run's last: the ranks' changes were "
                 "averaged once more at finish(), so every rank holds the same parameters", self.config.mode,
                 self.steps)
        return True

    def traffic(self) -> tuple[StepStats, StepStats]:
        """The inner all-reduce's bytes (every step within a node, or the warm-up's), the outer
        collectives' (inter-node too when there are several nodes) and the gathers within a node."""
        inner, inner_between = self.inner.traffic()
        outer, local = self.counters.snapshot(), self.node_counters.snapshot()
        between = _plus(inner_between, outer) if self.nodes.spans_nodes else inner_between
        return _plus(_plus(inner, outer), local), between

    def settle(self, forward_backward: Callable[[], None]) -> None:
        """``inner_scope=node``: as the inner all-reduce's; else nothing (inner steps hand no bucket to a hook)."""
        if self.nodes.by_node:
            self.inner.settle(forward_backward)

    # -- state -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """This rank's state: its parameters (they differ from the other ranks' inside a round),
        the global parameters and outer momentum, tokens per fragment, residuals, and the result
        of any outer all-reduce still to be applied (waited for here: every rank launched it)."""
        pending = [{"fragment": p.fragment, "apply_after": p.apply_after,
                    "result": p.result.wait().clone() if p.result is not None else None} for p in self.pending]
        self.pending = [Pending(p["fragment"], p["apply_after"], _done(p["result"])) for p in pending]
        return {"inner": self.inner.state_dict(), "steps": self.steps, "outer_steps": self.outer_steps,
                "inner_steps": self.inner_steps, "per_step": self.per_step, "choice": self.auto.choice,
                "warmup_left": self.warmup_left, "auto_trial": self.auto.state_dict(),
                "local": [self._flat(g) for g in self.groups], "global": [g.clone() for g in self.global_],
                "momenta": [m.clone() for m in self.momenta], "tokens": list(self.tokens), "pending": pending,
                "in_sync": list(self.in_sync),
                "codec": self.codec.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["global"]) != len(self.groups) or any(
                g.shape != mine.shape for g, mine in zip(state["global"], self.global_, strict=True)):
            raise ValueError("sync state does not fit the model: its fragments have other sizes")
        self.inner.load_state_dict(state["inner"])
        self.steps, self.outer_steps = int(state["steps"]), int(state["outer_steps"])
        self.inner_steps, self.per_step = int(state["inner_steps"]), bool(state["per_step"])
        self.warmup_left = int(state["warmup_left"])
        # auto's timings so far (none in an older poise's checkpoint) and its choice
        self.auto.load_state_dict(state.get("auto_trial", {}), state["choice"])
        if self.auto.choice is not None and self.auto.choice["mode"] == "diloco":
            self.lr, self.momentum = self.config.outer_lr, self.config.outer_momentum
        for i, group in enumerate(self.groups):
            self._write(group, state["local"][i])
            self.global_[i].copy_(state["global"][i])
            self.momenta[i].copy_(state["momenta"][i])
        self.tokens = [float(t) for t in state["tokens"]]
        self.in_sync = [bool(v) for v in state.get("in_sync", [False] * len(self.groups))]  # (older poise: unknown)
        self.pending = [Pending(int(p["fragment"]), int(p["apply_after"]), _done(p["result"]))
                        for p in state["pending"]]
        self.codec.load_state_dict(state["codec"])

    def shared_state_dict(self) -> dict[str, Any]:
        return {**self.inner.shared_state_dict(), "outer_steps_done": self.steps}

    def load_shared_state_dict(self, state: dict[str, Any]) -> None:
        """On another rank or world size: the inner step count only; the global parameters start
        from the loaded model's, the momentum from zero (said in the log)."""
        self.inner.load_shared_state_dict(state)
        self.steps = int(state.get("outer_steps_done", 0))
        with torch.no_grad():
            self.global_ = [self._flat(g).clone() for g in self.groups]
        log.info("sync %s: resumed on another rank or world size: outer momentum starts from zero", self.config.mode)

    def summary(self) -> dict[str, Any]:
        choice = self.auto.choice
        mode = self.config.mode if choice is None else f"auto: {choice['mode']}"
        return {"mode": mode, "inner_steps": self.inner_steps, "warmup_steps": self.config.warmup_steps,
                "fragments": len(self.groups), "inner_scope": self.config.inner_scope,
                "ranks_per_node": self.nodes.ranks_per_node,
                "outer_steps": self.outer_steps, "final_sync_at_finish": self.concluded,
                "codec": self.config.codec, "weighting": self.config.weighting,
                "outer_lr": self.lr, "outer_momentum": self.momentum, "auto": choice}


def _plus(a: StepStats, b: StepStats) -> StepStats:
    return StepStats(a.raw_bytes + b.raw_bytes, a.wire_bytes + b.wire_bytes, a.encode_s + b.encode_s,
                     a.decode_s + b.decode_s, a.buckets + b.buckets)


def _done(value: torch.Tensor | None) -> torch.futures.Future[torch.Tensor] | None:
    """A completed future of ``value`` (a restored or already waited-for outer result)."""
    if value is None:
        return None
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(value)
    return fut


__all__ = ["Outer", "choose_inner_steps", "fragments", "launch_step", "per_step_pays"]
