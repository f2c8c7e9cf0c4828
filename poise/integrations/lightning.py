"""poise in PyTorch Lightning: :class:`PoiseStrategy`, a DDP strategy that runs a :class:`poise.Session`.

``Trainer(strategy=PoiseStrategy(lengths=..., batch_size=..., comm="fp16", out_dir=...))`` gets
what a session gives a hand-written loop, with no callback and no change to the LightningModule:

- the comm hook: the session is made on the DDP model Lightning wraps (``configure_ddp``), so
  poise's codec hook and timing probe see every bucket, on CPU too. (Lightning's own
  ``ddp_comm_hook=`` registers a hook only on CUDA; it is refused here.)
- balanced sampling: the *training* DataLoader is rebuilt with ``batch_sampler=session.sampler``
  (``process_dataloader``; the train loader is the one processed while the trainer's stage is
  ``TRAINING``), keeping its dataset, collate_fn, workers and the rest. Validation, test and
  predict loaders are left as they are, so ``use_distributed_sampler`` (True or False) only
  decides how those are sharded.
- exact weighting and timing: a step opens at ``on_train_batch_start``; ``backward`` runs
  Lightning's backward on the session-weighted loss; the step ends after the optimizer step
  (``optimizer_step``), or right after backward in a micro-batch that accumulates.
- ``accumulate_grad_batches=N``: Lightning divides the loss by N and runs DDP's ``no_sync``; the
  session is made with ``accum_steps=N`` (the weight divides by N: Lightning's division is
  undone) and ``step.sync`` is Lightning's decision for each batch.
- checkpoints: ``checkpoint["poise"]`` holds ``session.state_dict()``, restored before the first
  step. Lightning writes rank 0's checkpoint only, so after a resume rank 0 gets its own
  state back and the other ranks the shared part (data position and plan); their error-feedback
  residuals and speed measurements start fresh, while the comm hook's step count (when
  compression starts) is shared state and comes back on every rank (``Session.load_state_dict``).
- the report: ``session.finish()`` on every rank when ``fit`` ends (``on_train_end``), with the
  trainer's logged metrics added; ``report.json``, ``trace.json``, ``timeline.png`` in ``out_dir``.

Automatic optimization only: manual optimization is refused (its backward calls are the
user's, so a step could not know which one to weight).

FSDP2: :class:`PoiseFSDPStrategy` is the same over Lightning's ``ModelParallelStrategy``
(the strategy of Lightning 2.6 that runs FSDP2; its ``FSDPStrategy`` is FSDP1, refused here).
The LightningModule shards its model in ``configure_model`` with ``fully_shard`` on
``self.device_mesh["data_parallel"]`` (each block, then the model), and the session is made on
that sharded model (:class:`poise.sync.Sharded`: poise's reduce-scatter, exact weighting).
Lightning does not hold back FSDP2's reduction while it accumulates, so the step does
(``set_requires_gradient_sync``). It runs on CPU and gloo as on GPUs.
"""

from __future__ import annotations

import atexit
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.optim import Optimizer
from torch.utils.data import DataLoader, IterableDataset

try:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
    from lightning.pytorch.trainer.states import RunningStage, TrainerFn
except ImportError:
    raise ImportError("poise.integrations.lightning needs lightning: pip install lightning==2.6.6 "
                      "(poise's 'lightning' extra)") from None

from poise.comm import builder as comm_builder
from poise.config import CommConfig
from poise.config.former import CHANGES, FormerName, former_keywords
from poise.run.session import DATA_FIELDS, SESSION_KEYWORDS, Session, Step
from poise.runtime import dist as rdist

log = logging.getLogger(__name__)

# DDPStrategy arguments that register a comm hook of their own (on CUDA only): poise's replaces them.
_HOOK_ARGS = ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper", "model_averaging_period")
# DataLoader settings carried over to the rebuilt training loader (batching is the sampler's).
# Session arguments the strategy derives from the trainer; every other one of Session.from_kwargs's is taken.
_SET_HERE = ("accum_steps", "total_steps")
_SESSION_ARGS = frozenset(DATA_FIELDS + SESSION_KEYWORDS) - frozenset(_SET_HERE)
_LOADER_ARGS = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context",
                "generator", "persistent_workers", "pin_memory_device", "in_order")


class _SessionSteps:
    """What both strategies do around Lightning's loop (see the module doc): the session's
    keywords, the balanced training loader, a step per batch with the weighted backward, the
    report at the end, and the session state in checkpoints. Mixed in before the Lightning
    strategy, whose methods ``super()`` reaches."""

    # Whether Lightning itself holds back the reduction of an accumulating batch (DDP's
    # no_sync); where it does not (FSDP2), the step does.
    _lightning_holds_sync = True

    def _take_session_kwargs(self, kwargs: dict[str, Any]) -> None:
        """Move the session's keywords out of ``kwargs`` (the rest are the Lightning strategy's)."""
        name = type(self).__name__
        set_here = sorted(key for key in _SET_HERE if key in kwargs)
        if set_here:
            raise ValueError(f"{name} sets {', '.join(set_here)} itself (accum_steps is the trainer's "
                             "accumulate_grad_batches, total_steps its max_steps)")
        former = former_keywords(sorted(kwargs))  # an older poise's keyword: Lightning would hand it to DDP
        if former:
            raise FormerName(f"{name}: keyword(s) {', '.join(former)} ({CHANGES})")
        self._session_kwargs = {key: kwargs.pop(key) for key in list(kwargs) if key in _SESSION_ARGS}
        comm = self._session_kwargs.get("comm", "none")
        self._session_kwargs["comm"] = self.comm_config = CommConfig(codec=comm) if isinstance(comm, str) else comm
        self.session: Session | None = None
        self.step: Step | None = None
        self._loaded_state: dict[str, Any] | None = None

    def setup_environment(self) -> None:
        """Lightning's set-up (it starts the process group), then destroy that group at exit.

        Why: Lightning destroys it at exit for NCCL only. A gloo group left to the interpreter's
        finalization can abort the process as it exits (``terminate called without an active
        exception``, SIGABRT after ``fit`` returned: ``tests/e2e/test_integrations.py`` saw it),
        so the job fails though training ended. No barrier here: a peer may already be gone.
        """
        super().setup_environment()  # type: ignore[misc]
        atexit.register(rdist.close, synchronize=False)

    def _check_automatic(self) -> None:
        module = self.lightning_module  # type: ignore[attr-defined]
        if not module.automatic_optimization:
            raise ValueError(f"{type(self).__name__} needs automatic optimization: with automatic_optimization=False "
                             "the backward calls are yours, so write the loop with poise.Session directly")

    def _make_session(self, model: nn.Module) -> None:
        """The session on ``model`` (Lightning's DDP model, or the sharded model), with the
        trainer's accumulation and run length, and any state a checkpoint brought."""
        trainer = self.lightning_module.trainer  # type: ignore[attr-defined]
        self.session = Session.from_kwargs(
            model, accum_steps=trainer.accumulate_grad_batches,
            total_steps=trainer.max_steps if trainer.max_steps > 0 else None, **self._session_kwargs,
        )
        if self._loaded_state is not None:
            state, self._loaded_state = self._loaded_state, None
            self._restore(state)

    def _restore(self, state: dict[str, Any]) -> None:
        """``session.load_state_dict(state)``, at the next epoch's start if saved at an epoch's end."""
        assert self.session is not None
        self.session.load_state_dict(state)
        sampler = self.session.sampler
        if sampler.position >= len(sampler):
            # Saved at an epoch's end (ModelCheckpoint's default): Lightning resumes with the
            # next epoch but iterates the loader before it sets the sampler's epoch.
            sampler.set_epoch(sampler.epoch + 1)

    def process_dataloader(self, dataloader: object) -> object:
        """The training DataLoader again, batched by ``session.sampler``; any other one unchanged."""
        module = self.lightning_module  # type: ignore[attr-defined]
        trainer = module.trainer if module is not None else None
        if self.session is None or trainer is None or trainer.state.stage != RunningStage.TRAINING:
            return dataloader
        name = type(self).__name__
        if not isinstance(dataloader, DataLoader):
            raise ValueError(f"{name} balances a torch DataLoader; the train dataloader is a "
                             f"{type(dataloader).__name__}")
        dataset = dataloader.dataset
        if isinstance(dataset, IterableDataset):
            raise ValueError(f"{name} plans batches by sample index: the train dataset must be map-style, "
                             f"not an IterableDataset ({type(dataset).__name__})")
        kwargs = {key: getattr(dataloader, key) for key in _LOADER_ARGS if hasattr(dataloader, key)}
        if dataloader.num_workers > 0:
            kwargs["prefetch_factor"] = dataloader.prefetch_factor
        checked = self.session.dataloader(dataset, **kwargs)  # checks len(dataset) == len(lengths)
        kwargs["collate_fn"] = checked.collate_fn  # (with an emulated slow input pipeline, if configured)
        return DataLoader(dataset, batch_sampler=_LightningEpochs(self.session.sampler), **kwargs)

    # -- one training batch: open, weighted backward, close -------------------------------------

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Open the step of this batch (the oldest one ``session.sampler`` handed out)."""
        super().on_train_batch_start(batch, batch_idx)  # type: ignore[misc]
        self._close_open_step()
        module = self.lightning_module  # type: ignore[attr-defined]
        assert self.session is not None and module is not None
        # Lightning syncs on an epoch's last batch too, so ask it instead of counting.
        accumulates = module.trainer.fit_loop._should_accumulate()
        if self._lightning_holds_sync:
            # Lightning runs DDP's no_sync itself around an accumulating batch's closure, so the
            # session must not enter it as well (the two would exit out of order and leave DDP
            # never syncing again): open the step as a syncing one, then say what Lightning decided.
            self.step = self.session.step(sync=True)
            self.step.sync = not accumulates
        else:
            self.step = self.session.step(sync=not accumulates)

    def backward(self, closure_loss: torch.Tensor, optimizer: Optimizer | None, *args: Any,
                 **kwargs: Any) -> torch.Tensor:
        """Lightning's backward, on the loss weighted by the open step (exact gradient)."""
        step, session = self.step, self.session
        if step is None or session is None:
            raise ValueError(f"{type(self).__name__}.backward outside a training batch: poise weights training "
                             "steps only")
        out: list[torch.Tensor] = []

        def run(weighted: torch.Tensor) -> None:
            out.append(super(_SessionSteps, self).backward(weighted, optimizer, *args, **kwargs))  # type: ignore[misc]

        # Lightning already divided the loss by accumulate_grad_batches, and the step's weight
        # divides by accum_steps too: undo Lightning's, so the step also records the real loss.
        step.backward(closure_loss * session.accum_steps, backward=run)
        if not step.sync:  # an accumulating micro-batch: no optimizer step follows
            self._end_step()
        return out[0]

    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any],
                       model: pl.LightningModule | torch.nn.Module | None = None, **kwargs: Any) -> Any:
        """Lightning's optimizer step (which runs the forward and backward closure), then the step ends."""
        result = super().optimizer_step(optimizer, closure, model, **kwargs)  # type: ignore[misc]
        if self.step is not None:
            self._end_step()
        return result

    def _end_step(self) -> None:
        step, self.step = self.step, None
        assert step is not None
        step.end()

    def _close_open_step(self) -> None:
        """A step left open (its optimizer step never ran): recorded if it did backward, else dropped."""
        if self.step is None:
            return
        if self.step.backward_done:
            self._end_step()
        else:
            log.warning("step %d had no backward (training_step returned None?): not recorded", self.step.index)
            self.step.abort()
            self.step = None

    # -- the end, and checkpoints -----------------------------------------------------------------

    def on_train_end(self) -> None:
        """``session.finish()`` on every rank (a collective), with the trainer's logged metrics."""
        super().on_train_end()  # type: ignore[misc]
        self._close_open_step()
        if self.session is None or self.session.steps_done == 0:
            return
        module = self.lightning_module  # type: ignore[attr-defined]
        trainer = module.trainer if module is not None else None
        extra: dict[str, Any] = {}
        if trainer is not None:
            metrics = {k: float(v) for k, v in trainer.callback_metrics.items()
                       if isinstance(v, torch.Tensor) and v.numel() == 1}
            extra = {"lightning": {"global_step": trainer.global_step, "epochs": trainer.current_epoch,
                                   "accumulate_grad_batches": trainer.accumulate_grad_batches, "metrics": metrics}}
        self.session.finish(extra)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Lightning's checkpoint (written by rank 0) with this rank's ``session.state_dict()`` in ``"poise"``."""
        if self.session is not None:
            checkpoint["poise"] = self.session.state_dict()
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)  # type: ignore[misc]

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Lightning's checkpoint; its ``"poise"`` state goes into the session before the first step."""
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)  # type: ignore[misc]
        state = checkpoint.get("poise")
        if state is not None:
            if self.session is not None:  # PoiseFSDPStrategy: Lightning restores after the set-up
                self._restore(state)
            else:  # PoiseStrategy: fit restores before it sets the model up: load when the session exists
                self._loaded_state = state
        return checkpoint


class _LightningEpochs:
    """``session.sampler`` as the training DataLoader's batch sampler, where Lightning's loop
    finds its ``set_epoch``: Lightning calls it on a loader's ``sampler`` and
    ``batch_sampler.sampler`` only, never on the batch sampler itself, so without this every
    epoch after the first trained nothing (the sampler stayed at the end of epoch 0)."""

    def __init__(self, batches: Any) -> None:
        self.batches = batches
        self.sampler = self  # what Lightning's _set_sampler_epoch looks at

    def __iter__(self) -> Any:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch``'s plan, unless the sampler is in it already: Lightning also calls
        this for the epoch in hand, after its loader has fetched the first batch (a restart of
        that epoch would hand out its first steps twice)."""
        if getattr(self.batches, "epoch", None) != epoch:
            self.batches.set_epoch(epoch)


class PoiseStrategy(_SessionSteps, DDPStrategy):
    """Lightning's DDP strategy with a :class:`poise.Session` on the wrapped model (see module doc).

    Keyword arguments named like :class:`poise.Session`'s (``lengths``, ``loss_terms``,
    ``batch_size``, ``balance``, ``comm``, ``out_dir``, ``cost_fn``, ``seed``, ...) go to the
    session, with the same meaning and units; its ``accum_steps`` is the trainer's
    ``accumulate_grad_batches`` and its ``total_steps`` the trainer's ``max_steps`` (when set).
    Every other keyword goes to Lightning's ``DDPStrategy`` (``timeout``,
    ``process_group_backend``, DDP's own ``find_unused_parameters``, ``bucket_cap_mb``, ...).

    Attributes:
        session: the run's session (None until ``fit`` has set the model up).
        step: the open step of the training batch in hand (None between batches).

    Raises:
        ValueError: one line, for a comm-hook argument of DDPStrategy, a session argument the
            trainer decides (``accum_steps``, ``total_steps``, ...), manual optimization, or a
            training DataLoader whose dataset does not match ``lengths``.
    """

    def __init__(self, **kwargs: Any) -> None:
        refused = [name for name in _HOOK_ARGS if kwargs.get(name) is not None]
        self._take_session_kwargs(kwargs)
        if refused:
            raise ValueError(f"PoiseStrategy registers poise's comm hook itself: drop {', '.join(refused)} "
                             "(choose the codec with comm=)")
        super().__init__(**kwargs)  # what is left is DDPStrategy's (and DDP's)

    def configure_ddp(self) -> None:
        """Wrap the model in DDP (Lightning's way), then make the session on it (poise's hook)."""
        assert self.lightning_module is not None
        self._check_automatic()
        size_bytes = sum(p.numel() * p.element_size() for p in self.lightning_module.parameters())
        if comm_builder.requires_single_bucket(self.comm_config):
            # the codec needs the whole gradient in one bucket on gloo
            self._ddp_kwargs["bucket_cap_mb"] = max(self._ddp_kwargs.get("bucket_cap_mb") or 0,
                                                    2 * size_bytes / 2**20 + 1)
        else:
            self._ddp_kwargs.setdefault("bucket_cap_mb", self.comm_config.bucket_mb)
        super().configure_ddp()
        assert self.model is not None
        self._make_session(self.model)


class PoiseFSDPStrategy(_SessionSteps, ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2) with a :class:`poise.Session` on the model
    the LightningModule shards in ``configure_model`` (see module doc)::

        def configure_model(self):                       # in your LightningModule
            mesh = self.device_mesh["data_parallel"]
            for block in self.net.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    Every rank is a data-parallel rank (``data_parallel_size`` is the world size, tensor
    parallelism 1). Session keywords as :class:`PoiseStrategy`'s; every other keyword goes to
    ``ModelParallelStrategy`` (``save_distributed_checkpoint``, ``process_group_backend``,
    ``timeout``).

    Attributes:
        session: the run's session (None until ``fit`` has set the model up).
        step: the open step of the training batch in hand (None between batches).

    Raises:
        ValueError: one line, for tensor parallelism, a session argument the trainer decides,
            manual optimization, a LightningModule whose trained parameters are not all in one
            ``fully_shard`` model, or what :class:`poise.sync.Sharded` refuses (a codec or
            setting FSDP2 cannot run).
    """

    _lightning_holds_sync = False

    def __init__(self, **kwargs: Any) -> None:
        self._take_session_kwargs(kwargs)
        sizes = {name: kwargs.pop(name) for name in ("data_parallel_size", "tensor_parallel_size") if name in kwargs}
        if sizes.get("tensor_parallel_size", 1) != 1 or sizes.get("data_parallel_size", "auto") != "auto":
            raise ValueError(f"PoiseFSDPStrategy runs every rank data-parallel; {sizes} is not taken (tensor "
                             "parallelism is not balanced by poise): leave both sizes out")
        super().__init__(**kwargs)

    def setup_environment(self) -> None:
        """Every rank data-parallel: the mesh is (world, 1), not Lightning's default (nodes, GPUs per node)."""
        self._data_parallel_size = self.num_nodes * self.num_processes
        self._tensor_parallel_size = 1
        super().setup_environment()

    def setup(self, trainer: pl.Trainer) -> None:
        """Lightning's set-up (after ``configure_model`` sharded the model), then the session on
        the sharded model, for ``fit``."""
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        self._check_automatic()
        assert self.lightning_module is not None
        self._make_session(_sharded_model(self.lightning_module))


def _sharded_model(module: pl.LightningModule) -> nn.Module:
    """The one ``fully_shard`` model inside ``module`` that holds every trained parameter.

    Raises:
        ValueError: none, several, the LightningModule itself, or a trained parameter outside it.
    """
    if isinstance(module, FSDPModule):
        raise ValueError("fully_shard the model inside the LightningModule (e.g. self.net), not the LightningModule: "
                         "Lightning calls training_step, not its forward, so FSDP2 would not gather its parameters")
    outermost: list[tuple[str, nn.Module]] = []
    for name, child in module.named_modules():
        if isinstance(child, FSDPModule) and not any(name.startswith(f"{outer}.") for outer, _ in outermost):
            outermost.append((name, child))
    if len(outermost) != 1:
        found = ", ".join(name for name, _ in outermost) or "none"
        raise ValueError(f"PoiseFSDPStrategy needs one fully_shard model holding every trained parameter (found "
                         f"{found}): in configure_model, fully_shard each block, then the model that holds them")
    name, sharded = outermost[0]
    inside = {id(p) for p in sharded.parameters()}
    outside = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in inside]
    if outside:
        raise ValueError(f"parameter {outside[0]!r} is outside the sharded model {name!r}: poise would not reduce its "
                         "gradient; keep every trained parameter inside the model you fully_shard")
    return sharded


__all__ = ["PoiseFSDPStrategy", "PoiseStrategy"]
