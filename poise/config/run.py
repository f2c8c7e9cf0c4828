"""``RunConfig``: a whole run, its sections and the checks that span several of them."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from poise.config.balance import BalanceConfig
from poise.config.checkpoint import CheckpointConfig
from poise.config.cluster import ClusterConfig
from poise.config.comm import CommConfig
from poise.config.diagnostics import DiagnosticsConfig
from poise.config.dist import MAX_LOCAL_WORKERS, DistConfig
from poise.config.emulate import EmulateConfig
from poise.config.fields import setting
from poise.config.metrics import MetricsConfig
from poise.config.parallel import ParallelConfig
from poise.config.pipeline import PipelineConfig
from poise.config.straggler import StragglerConfig
from poise.config.sync import SyncConfig
from poise.config.task import TaskConfig
from poise.config.train import TrainConfig


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """A whole run: one field per section (poise/config/<section>.py) plus where outputs go."""

    out_dir: str = setting("", "output directory ('' = runs/<timestamp>)")
    task: TaskConfig = field(default_factory=TaskConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    balance: BalanceConfig = field(default_factory=BalanceConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    straggler: StragglerConfig = field(default_factory=StragglerConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    diagnostics: DiagnosticsConfig = field(default_factory=DiagnosticsConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    emulate: EmulateConfig = field(default_factory=EmulateConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def __post_init__(self) -> None:
        self._check_world()
        if (self.straggler.enabled or self.emulate.delay) and self.train.accum_steps != 1:
            raise ValueError(f"train.accum_steps={self.train.accum_steps} with straggler.mode={self.straggler.mode!r} "
                             "(or straggler.delay): a deadline step accumulates its own micro-batches "
                             "(straggler.micro_batches); use accum_steps=1")
        if self.sync.outer and (self.straggler.enabled or self.emulate.delay or self.comm.local_first):
            raise ValueError(f"sync.mode={self.sync.mode!r} meets the other ranks every sync.inner_steps steps, not "
                             f"at every step's deadline: it needs straggler.mode=off (not {self.straggler.mode!r}), no "
                             "emulate.delay and no comm.local_first")
        self.sync.check_codec(self.comm.codec)
        if self.parallel.sharded:
            self._check_sharded()
        if self.comm.codec == "auto" and (self.train.accum_steps != 1 or self.straggler.enabled):
            raise ValueError(f"comm.codec='auto' times whole steps: it needs train.accum_steps=1 (not "
                             f"{self.train.accum_steps}) and straggler.mode=off (not {self.straggler.mode!r})")
        if self.train.eval_every and self.comm.local_first:
            raise ValueError(f"train.eval_every={self.train.eval_every} with comm.local_first: the ranks' weights "
                             "differ during training, so only the final evaluation (of rank 0's) is meaningful")
        if self.train.batch_tokens is not None and self.task.name != "code-lm":
            raise ValueError(
                f"train.batch_tokens={self.train.batch_tokens} only applies to task code-lm, "
                f"not {self.task.name!r}: use train.batch_size"
            )
        if self.train.batch_tokens is not None and self.train.batch_tokens < self.task.max_seq_len:
            raise ValueError(
                f"train.batch_tokens={self.train.batch_tokens} is below task.max_seq_len="
                f"{self.task.max_seq_len}: a budget must fit at least one full sample"
            )
        if self.cluster.enabled:
            d = self.dist
            given = [f"dist.{k}" for k, v in (("nnodes", d.nnodes != "1"), ("rdzv_endpoint", d.rdzv_endpoint),
                                              ("node_rank", d.node_rank is not None), ("local_addr", d.local_addr),
                                              ("rdzv_is_host", d.rdzv_is_host is not None),
                                              ("socket_ifname", d.socket_ifname)) if v]
            if given:
                raise ValueError(
                    f"{', '.join(given)} cannot be set with an emulated cluster (cluster.nodes/cluster.name): "
                    "it places the nodes and the rendezvous itself"
                )

    def max_world_size(self) -> int:
        """The most ranks this job can have: workers per node times nodes (an emulated
        cluster's, or ``dist.nnodes``'s maximum for an elastic job)."""
        nodes = self.cluster.nodes if self.cluster.nodes > 0 else int(self.dist.nnodes.split(":")[-1])
        return nodes * self.dist.nproc

    def _check_sharded(self) -> None:
        """What a model sharded with FSDP2 (``parallel.mode`` fsdp or hsdp) cannot be combined with."""
        mode = f"parallel.mode={self.parallel.mode!r}"
        if self.straggler.enabled or self.emulate.delay:
            raise ValueError(f"{mode} gathers and reduces inside every block's forward and backward, so no rank can "
                             f"stop at a deadline: it needs straggler.mode=off (not {self.straggler.mode!r}) and no "
                             "emulate.delay (deadline steps run on parallel.mode=ddp)")
        if self.sync.mode != "step":
            raise ValueError(f"{mode} reduces every step's gradients: it needs sync.mode='step' (not "
                             f"{self.sync.mode!r}); outer-step sync runs on parallel.mode=ddp")
        if self.comm.local_first:
            raise ValueError(f"{mode} with comm.local_first: a rank holds only its shard of the gradient, so it "
                             "cannot apply its own whole; use parallel.mode=ddp")
        every, accum = self.checkpoint.every_steps, self.train.accum_steps
        if every and every % accum:
            raise ValueError(f"checkpoint.every_steps={every} is not a multiple of train.accum_steps={accum}: under "
                             f"{mode} the gradients accumulated inside a window are held unsharded by FSDP2 and "
                             "cannot be saved, so checkpoints fall at the ends of accumulation windows")
        if self.parallel.mode == "hsdp" and not (self.cluster.name and self.cluster.nodes == 0):
            shard, world = self.parallel.shard_group(self.dist.nproc), self.max_world_size()
            if world % shard:
                raise ValueError(f"parallel.shard_size={shard} does not divide the job's {world} ranks: hsdp needs "
                                 "equal shard groups (give a divisor, or leave it unset for one group per machine)")

    def _check_world(self) -> None:
        """Ranks named in settings must exist; an emulated cluster must fit one machine."""
        if self.cluster.nodes > 0 and self.cluster.nodes * self.dist.nproc > MAX_LOCAL_WORKERS:
            raise ValueError(
                f"cluster of {self.cluster.nodes} node(s) x {self.dist.nproc} worker(s) is "
                f"{self.cluster.nodes * self.dist.nproc} processes on this machine: allowed is at most "
                f"{MAX_LOCAL_WORKERS} in all"
            )
        if self.cluster.name and self.cluster.nodes == 0:
            return  # a named cluster's shape is filled in from its state first (poise/cli/train.py)
        world = self.max_world_size()
        outside = sorted(r for r in self.emulate.rank_speeds() if r >= world)
        if outside:
            raise ValueError(f"balance.rank_speed names rank {outside[0]}, but the job has {world} rank(s): "
                             f"allowed are 0..{world - 1}")
        planned = self.emulate.rank_step()
        if planned is not None and planned[0] >= world:
            raise ValueError(f"faults.fail_at={self.emulate.fail_at!r} names rank {planned[0]}, but the job has "
                             f"{world} rank(s): allowed are 0..{world - 1}")
        delay = self.emulate.delay_spec()
        if delay.name == "slow" and delay.rank >= world:
            raise ValueError(f"straggler.delay={self.emulate.delay!r} names rank {delay.rank}, but the job has "
                             f"{world} rank(s): allowed are 0..{world - 1}")

    @property
    def checkpoint_dir(self) -> str:
        """Where checkpoints go: ``checkpoint.dir`` or ``<out_dir>/checkpoints``."""
        return self.checkpoint.dir or os.path.join(self.out_dir, "checkpoints")

    @property
    def total_steps(self) -> int | None:
        """Steps to run, or None when the run is measured in epochs."""
        if self.train.epochs is not None:
            return None
        return self.train.steps if self.train.steps is not None else 100


SECTIONS: dict[str, type] = {
    f.name: f.default_factory  # type: ignore[misc]
    for f in dataclasses.fields(RunConfig)
    if f.default_factory is not dataclasses.MISSING
}
