"""The settings: one frozen dataclass per section of :class:`RunConfig`, each validated in
``__post_init__`` (a one-line ``ValueError`` naming the bad value and what is allowed), and the
names that sections accept (codecs, collectives, tasks...)."""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

from poise.cluster import links
from poise.cluster.state import MAX_NODES, validate_name
from poise.straggler.delays import DelayModel
from poise.units import format_rate_bit_per_s

TASK_NAMES = ("code-lm", "digits")
BACKENDS = ("auto", "gloo", "nccl")
BALANCE_STRATEGIES = ("static", "cost", "dynamic")
STRAGGLER_MODES = ("off", "deadline", "deadline+stale")
# Gradient codecs (poise.comm.codecs.CODECS) plus torch's own hooks, for comparison.
CODEC_NAMES = ("none", "fp16", "bf16", "int8", "sign", "topk", "randomk", "powersgd", "auto", "torch-fp16",
               "torch-powersgd")
# codecs whose error per step is of the order of the gradient itself: they start compressing
# after a longer uncompressed warm-up (CommConfig.compression_start)
LOSSY_CODECS = ("sign", "topk", "randomk", "powersgd", "auto", "torch-powersgd")
# codecs whose payload gives every entry the same magnitude, so that Adam's second moment would
# measure the codec's scale instead of the gradient: with these, comm.freeze_variance=auto
# freezes it (poise/optim.py has the measurements; sparse and low-rank codecs train better
# with it live)
VARIANCE_FREEZING_CODECS = ("sign",)
# checkpoint deltas: codecs that need no state or shared seed to decode (random-k and PowerSGD do)
DELTA_CODECS = ("exact", "int8", "fp16", "bf16", "topk")
# poise.balance.partition.METHODS and poise.pipeline.stage.SCHEDULES, by name.
PARTITION_METHODS = ("exact", "uniform", "parameters", "greedy")
PIPELINE_SCHEDULES = ("gpipe", "1f1b")
# More local workers than this on one machine is almost certainly a typo (e.g. 1000 for 10).
# names of poise.comm.collectives.COLLECTIVES (kept here so the config does not import torch.distributed)
COLLECTIVE_NAMES = ("flat", "ring", "tree", "hierarchical", "auto")
MAX_LOCAL_WORKERS = 64


def _field(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


def _finite(section: str, obj: Any) -> None:
    """Reject ``inf``/``nan`` in every float field of ``obj``: no setting means anything with
    them (``timeout_s=inf`` crashes every worker; ``lr=inf`` or ``grad_clip_norm=nan`` would
    silently stop training or clipping)."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{section}.{f.name}={value!r} is invalid: it must be a finite number")


def _positive(section: str, name: str, value: int | float | None, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if value is None or isinstance(value, bool) or not value > 0:
        raise ValueError(f"{section}.{name}={value!r} is invalid: it must be a positive number")


@dataclass(frozen=True, kw_only=True)
class TaskConfig:
    """What is trained: the task and its model size."""

    name: str = _field("code-lm", f"task to train: {', '.join(TASK_NAMES)}")
    max_seq_len: int = _field(1024, "code-lm: samples are truncated to this many bytes")
    d_model: int = _field(128, "code-lm: transformer width")
    num_layers: int = _field(2, "code-lm: transformer blocks")
    num_heads: int = _field(4, "code-lm: attention heads (must divide d_model)")
    eval_max_samples: int = _field(
        512, "held-out samples evaluated at the end (0 = all of the held-out split)"
    )
    cache_dir: str = _field("", "where the code-lm corpus index is cached ('' = ~/.cache/poise)")

    def __post_init__(self) -> None:
        _finite("task", self)
        if self.name not in TASK_NAMES:
            raise ValueError(f"task.name={self.name!r} is unknown: allowed are {', '.join(TASK_NAMES)}")
        for name in ("max_seq_len", "d_model", "num_layers", "num_heads"):
            _positive("task", name, getattr(self, name), allow_none=False)
        if self.max_seq_len < 16:
            raise ValueError(f"task.max_seq_len={self.max_seq_len} is too small: it must be >= 16")
        if self.d_model % self.num_heads:
            raise ValueError(
                f"task.d_model={self.d_model} is not divisible by task.num_heads={self.num_heads}"
            )
        if self.eval_max_samples < 0:
            raise ValueError(f"task.eval_max_samples={self.eval_max_samples} must be >= 0")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """How long and how hard to train."""

    steps: int | None = _field(None, "optimizer steps to run (default 100 unless epochs is set)")
    epochs: int | None = _field(None, "full passes over the training split (instead of steps)")
    batch_size: int | None = _field(None, "samples per rank per step (default: the task's)")
    batch_tokens: int | None = _field(
        None, "code-lm: per-rank token budget per step, padded tokens counted (instead of batch_size)"
    )
    lr: float | None = _field(None, "peak learning rate of AdamW (default: the task's)")
    weight_decay: float = _field(0.01, "AdamW weight decay")
    warmup_steps: int = _field(10, "linear learning-rate warm-up, then cosine decay to 10%")
    schedule_steps: int | None = _field(
        None, "optimizer steps the learning-rate schedule spans while gradients go exact (default: the whole "
        "run; its cosine reaches 10% there and stays); a lossy codec, or auto keeping PowerSGD, spans the whole "
        "run, as its steps are worth less (poise bench network gives them extra steps)"
    )
    grad_clip_norm: float = _field(1.0, "clip the global gradient norm to this (0 = off)")
    seed: int = _field(0, "seed for the model, data order and every rank's RNG")
    accum_steps: int = _field(
        1, "micro-batches per optimizer step (gradient accumulation); --checkpoint-every, --fail-at count micro-batches"
    )
    frozen: str = _field(
        "", "parameter-name prefixes kept fixed, comma-separated (fine-tuning), e.g. 'blocks.0,token_embedding'"
    )
    eval_every: int = _field(
        0, "evaluate every N optimizer steps too, not only at the end (0: at the end only); the report's "
        "eval_curve gives each evaluation's loss against the training seconds so far (time to accuracy)"
    )
    stop_at_eval_loss: float | None = _field(
        None, "stop once an evaluation (train.eval_every) reaches this eval loss (the task's unit; the "
        "learning-rate schedule still spans the whole run)"
    )

    def frozen_prefixes(self) -> tuple[str, ...]:
        """``frozen`` parsed: the parameter-name prefixes kept fixed."""
        return tuple(p.strip() for p in self.frozen.split(",") if p.strip())

    def __post_init__(self) -> None:
        _finite("train", self)
        for name in ("steps", "epochs", "batch_size", "batch_tokens", "lr", "schedule_steps"):
            _positive("train", name, getattr(self, name))
        _positive("train", "accum_steps", self.accum_steps, allow_none=False)
        if self.steps is not None and self.epochs is not None:
            raise ValueError(
                f"train.steps={self.steps} and train.epochs={self.epochs} are both set: give one"
            )
        if self.batch_size is not None and self.batch_tokens is not None:
            raise ValueError(
                f"train.batch_size={self.batch_size} and train.batch_tokens={self.batch_tokens} "
                "are both set: give one"
            )
        if self.weight_decay < 0 or self.warmup_steps < 0 or self.grad_clip_norm < 0:
            raise ValueError("train.weight_decay, train.warmup_steps and train.grad_clip_norm must be >= 0")
        if self.eval_every < 0:
            raise ValueError(f"train.eval_every={self.eval_every} must be >= 0 (0: evaluate at the end only)")
        if self.stop_at_eval_loss is not None and not self.eval_every:
            raise ValueError(f"train.stop_at_eval_loss={self.stop_at_eval_loss} needs train.eval_every > 0: "
                             "the loss is checked at those evaluations")


@dataclass(frozen=True, kw_only=True)
class DistConfig:
    """Where the workers run and how they find each other (passed to torch.distributed.run)."""

    nproc: int = _field(2, "worker processes on this machine")
    nnodes: str = _field("1", "number of machines, or MIN:MAX for an elastic job")
    node_rank: int | None = _field(None, "this machine's rank (static rendezvous only)")
    rdzv_endpoint: str = _field("", "HOST:PORT of the rendezvous for multi-node jobs ('' = standalone)")
    rdzv_backend: str = _field("c10d", "torch rendezvous backend for multi-node jobs")
    rdzv_id: str = _field("poise", "job id shared by all machines of one job")
    backend: str = _field("auto", f"process-group backend: {', '.join(BACKENDS)} (auto: nccl with CUDA)")
    timeout_s: float = _field(120.0, "timeout of every collective and store wait, in seconds")
    threads_per_worker: int = _field(0, "torch CPU threads per worker (0 = cores / workers on this machine)")
    local_addr: str = _field(
        "", "address of this machine that the agent and workers use for the rendezvous ('' = its hostname's)"
    )
    rdzv_is_host: bool | None = _field(
        None, "whether this machine's agent hosts the c10d rendezvous store (unset = when the endpoint is its own)"
    )
    socket_ifname: str = _field("", "network interface gloo/NCCL sockets bind to ('' = the backend's choice)")
    max_restarts: int = _field(0, "times the launcher restarts the workers after one fails (see --checkpoint-every)")
    keep_freed_memory: bool | None = _field(
        None, "keep the memory a step frees for the next (glibc; given back past half of this worker's "
        "share of the machine's memory; unset = when training on the CPU)"
    )

    def __post_init__(self) -> None:
        _finite("dist", self)
        _positive("dist", "nproc", self.nproc, allow_none=False)
        if self.max_restarts < 0:
            raise ValueError(f"dist.max_restarts={self.max_restarts} must be >= 0")
        if self.nproc > MAX_LOCAL_WORKERS:
            raise ValueError(
                f"dist.nproc={self.nproc} is not sensible: allowed is 1..{MAX_LOCAL_WORKERS} "
                f"(this machine has {os.cpu_count()} cores)"
            )
        parts = self.nnodes.split(":")
        if len(parts) > 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"dist.nnodes={self.nnodes!r} is invalid: give N or MIN:MAX, positive integers")
        if self.node_rank is not None and self.node_rank < 0:
            raise ValueError(f"dist.node_rank={self.node_rank} must be >= 0")
        if self.backend not in BACKENDS:
            raise ValueError(f"dist.backend={self.backend!r} is unknown: allowed are {', '.join(BACKENDS)}")
        _positive("dist", "timeout_s", self.timeout_s, allow_none=False)
        if self.threads_per_worker < 0:
            raise ValueError(f"dist.threads_per_worker={self.threads_per_worker} must be >= 0")
        if self.rdzv_endpoint and ":" not in self.rdzv_endpoint:
            raise ValueError(f"dist.rdzv_endpoint={self.rdzv_endpoint!r} is invalid: give HOST:PORT")
        if self.local_addr and not re.fullmatch(r"[A-Za-z0-9.:_-]+", self.local_addr):
            raise ValueError(f"dist.local_addr={self.local_addr!r} is invalid: give a host name or an IP address")
        if self.socket_ifname and not re.fullmatch(r"[A-Za-z0-9._-]{1,15}", self.socket_ifname):
            raise ValueError(
                f"dist.socket_ifname={self.socket_ifname!r} is invalid: give an interface name of 1-15 characters"
            )
        if not self.rdzv_endpoint and (self.local_addr or self.rdzv_is_host is not None):
            raise ValueError("dist.local_addr and dist.rdzv_is_host only apply to multi-node jobs: "
                             "set dist.rdzv_endpoint=HOST:PORT as well")


# Settings that differ from machine to machine in one job: left out of the config hash that
# ranks compare, since every machine writes its own config file.
NODE_LOCAL_SETTINGS = {"dist": ("node_rank", "local_addr", "rdzv_is_host", "socket_ifname")}


@dataclass(frozen=True, kw_only=True)
class BalanceConfig:
    """How work is split across ranks (see poise/balance/)."""

    strategy: str = _field(
        "static", f"data split: {', '.join(BALANCE_STRATEGIES)} (static = DistributedSampler, equal sample counts)"
    )
    cost_model: str = _field("auto", "per-sample cost: auto (the task's), linear (L), attention (L + alpha*L^2)")
    cost_alpha: float | None = _field(None, "attention cost's alpha per token (default: the task's prior, then fitted)")
    fit_alpha: bool = _field(True, "dynamic: refit alpha from measured step times at each re-plan")
    bucket_steps: int = _field(50, "length bucketing: samples of this many steps are sorted by length together")
    cold_start_steps: int = _field(10, "dynamic: steps on the equal split before the first re-plan")
    window_steps: int = _field(20, "dynamic: most steps of measurements behind each speed estimate (20-100)")
    replan_every_steps: int = _field(5, "dynamic: steps between re-plans after the first")
    max_share_change: float = _field(
        0.15, "dynamic: largest relative change of a rank's share per re-plan while estimates are noisy, (0, 1]"
    )
    confident_error: float = _field(
        0.05, "dynamic: relative standard error of every speed below which a re-plan moves straight to its target"
    )
    rank_speed: str = _field("", "emulated heterogeneity, RANK:SPEED[@STEP],... with SPEED in (0, 1], e.g. '1:0.5' "
                             "or '1:0.5@80' (slowed from step 80 on)")
    speed_noise: float = _field(0.0, "emulated noise: every rank's compute in every step is stretched by 1 + X, "
                                "X exponential with this mean (sleeps; 0 = none)")
    speed_noise_steps: int = _field(1, "emulated noise: steps in a row that share one draw of X (bursts of "
                                    "contention; 1 = a fresh draw every step)")
    slowdown_method: str = _field("auto", "how rank_speed slows a rank: auto, cgroup (CPU quota), sleep")

    def __post_init__(self) -> None:
        _finite("balance", self)
        if self.strategy not in BALANCE_STRATEGIES:
            raise ValueError(
                f"balance.strategy={self.strategy!r} is unknown: allowed are {', '.join(BALANCE_STRATEGIES)}"
            )
        if self.cost_model not in ("auto", "linear", "attention"):
            raise ValueError(f"balance.cost_model={self.cost_model!r} is unknown: allowed are auto, linear, attention")
        if self.cost_alpha is not None and self.cost_alpha < 0:
            raise ValueError(f"balance.cost_alpha={self.cost_alpha} must be >= 0")
        _positive("balance", "bucket_steps", self.bucket_steps, allow_none=False)
        _positive("balance", "replan_every_steps", self.replan_every_steps, allow_none=False)
        _positive("balance", "speed_noise_steps", self.speed_noise_steps, allow_none=False)
        if self.cold_start_steps < 1:
            raise ValueError(f"balance.cold_start_steps={self.cold_start_steps} must be >= 1")
        if not 20 <= self.window_steps <= 100:
            raise ValueError(f"balance.window_steps={self.window_steps} is outside the allowed 20-100")
        if not 0.0 < self.max_share_change <= 1.0:
            raise ValueError(f"balance.max_share_change={self.max_share_change} is outside (0, 1]")
        if not 0.0 <= self.confident_error <= 1.0:
            raise ValueError(f"balance.confident_error={self.confident_error} is outside [0, 1]")
        if self.slowdown_method not in ("auto", "cgroup", "sleep"):
            raise ValueError(
                f"balance.slowdown_method={self.slowdown_method!r} is unknown: allowed are auto, cgroup, sleep"
            )
        if not 0.0 <= self.speed_noise <= 10.0:  # also refuses nan
            raise ValueError(f"balance.speed_noise={self.speed_noise} is outside [0, 10]")
        self.rank_speeds()  # validates

    def rank_speeds(self) -> dict[int, tuple[float, int]]:
        """``rank_speed`` parsed: rank -> (speed factor in (0, 1], 1 = full speed; the step it
        applies from, 0 = from the start)."""
        speeds: dict[int, tuple[float, int]] = {}
        for item in filter(None, (p.strip() for p in self.rank_speed.split(","))):
            rank, sep, rest = item.partition(":")
            speed, at, step = rest.partition("@")
            try:
                r, s, k = int(rank), float(speed), int(step) if at else 0
            except ValueError:
                r, s, k = -1, float("nan"), 0
            if not sep or r < 0 or k < 0:
                raise ValueError(f"balance.rank_speed item {item!r} is invalid: give RANK:SPEED or RANK:SPEED@STEP, "
                                 "e.g. 1:0.5 or 1:0.5@80")
            if not 0.0 < s <= 1.0:
                raise ValueError(f"balance.rank_speed: speed {speed!r} of rank {r} is outside (0, 1]")
            speeds[r] = (s, k)
        return speeds


@dataclass(frozen=True, kw_only=True)
class StragglerConfig:
    """Straggler-tolerant aggregation: a shared deadline per step (see poise/straggler/)."""

    mode: str = _field("off", f"{', '.join(STRAGGLER_MODES)}: deadline = each rank computes micro-batches until "
                       "the step's shared deadline, what it did not reach goes back into the epoch's plan; "
                       "deadline+stale = also, a rank that computed nothing sends its previous gradient (biased)")
    micro_batches: int = _field(4, "deadline: micro-batches per rank per step (its batch cut into this many parts)")
    slack: float = _field(0.25, "deadline: the deadline is (1 + slack) x the median rank's predicted step compute")
    predictor: str = _field("quantile", "deadline: per-rank predictor of micro-batch time: quantile (median of "
                            "the window), ewma, lstm")
    max_staleness: int = _field(1, "deadline+stale: oldest previous gradient sent, in steps")
    delay: str = _field("", "injected delays (sleeps): bernoulli:p=0.2,x=1[,per=micro] | lognormal:mean=0.2,sigma=1 "
                        "| pareto:mean=0.2,alpha=2.5 | slow:rank=1,x=0.2 ('' = none); works in every mode")

    def __post_init__(self) -> None:
        _finite("straggler", self)
        if self.mode not in STRAGGLER_MODES:
            raise ValueError(f"straggler.mode={self.mode!r} is unknown: allowed are {', '.join(STRAGGLER_MODES)}")
        if not 1 <= self.micro_batches <= 1024:
            raise ValueError(f"straggler.micro_batches={self.micro_batches} is outside 1-1024")
        if not 0.0 <= self.slack <= 10.0:
            raise ValueError(f"straggler.slack={self.slack} is outside [0, 10]")
        if self.predictor not in ("quantile", "ewma", "lstm"):
            raise ValueError(f"straggler.predictor={self.predictor!r} is unknown: allowed are quantile, ewma, lstm")
        if not 0 <= self.max_staleness <= 100:
            raise ValueError(f"straggler.max_staleness={self.max_staleness} is outside 0-100")
        self.delay_model()  # validates

    @property
    def enabled(self) -> bool:
        """Whether steps run against a deadline."""
        return self.mode != "off"

    def delay_model(self, seed: int = 0) -> DelayModel:
        """``delay`` parsed, its draws seeded by ``seed``."""
        return DelayModel.parse(self.delay, seed=seed)


@dataclass(frozen=True, kw_only=True)
class CommConfig:
    """How gradients are communicated: the DDP communication hook and its codec."""

    codec: str = _field("none", f"gradient codec: {', '.join(CODEC_NAMES)}")
    error_feedback: bool = _field(True, "add each bucket's compression error back into the next step")
    topk_ratio: float = _field(0.01, "topk/randomk: share of gradient entries sent, in (0, 1]")
    powersgd_rank: int = _field(8, "powersgd: rank of the approximation (code-lm: rank 4 costs 2.9%, 8 costs 1.5%)")
    int8_chunk_size: int = _field(1024, "int8: entries per scale (one fp32 scale per chunk)")
    auto_trial_steps: int = _field(
        3, "auto: PowerSGD dry runs, after each of the last uncompressed steps before start_step (the first "
           "untimed): its reduction once more, result thrown away, so a dropped codec changes nothing"
    )
    auto_margin: float = _field(
        1.25, "auto: use PowerSGD only if its predicted step times this is still below the uncompressed one "
        "(a lossy step is worth less: PowerSGD needed ~1.2x DDP's steps to reach its loss on code-lm)"
    )
    start_step: int | None = _field(
        None, "optimizer steps run uncompressed first (unset: 2, as DDP rebuilds its buckets after step 1; for "
        f"{', '.join(LOSSY_CODECS)}: a twentieth of the run and at least twice the learning-rate warm-up)"
    )
    local_first: bool = _field(
        False, "each rank applies its own gradient whole at once; error feedback then delays only what the "
        "other ranks send (ranks' weights differ by their unsent residuals; see poise/comm/wrappers.py)"
    )
    on_nonfinite: str = _field("error", "NaN/Inf in a gradient: 'error' stops, 'skip' skips the step and logs")
    freeze_variance: str = _field(
        "auto", "freeze AdamW's second moment once compression starts (1-bit Adam; see poise/optim.py): "
        f"on, off, or auto (on for {', '.join(VARIANCE_FREEZING_CODECS)})"
    )
    collective: str = _field(
        "flat", f"all-reduce algorithm: {', '.join(COLLECTIVE_NAMES)} (flat = the backend's own; hierarchical "
        "compresses only between nodes; auto: see poise/comm/collectives.py)"
    )
    segment_bytes: int = _field(1 << 20, "ring and hierarchical: pipeline segment, in bytes")
    tree_max_bytes: int = _field(64 << 10, "auto: messages up to this many bytes use the tree (recursive doubling)")
    bucket_mb: float = _field(
        25.0, "DDP gradient bucket size in MB (2**20 bytes): smaller buckets start communicating earlier in "
        "backward, larger ones send fewer messages"
    )

    def __post_init__(self) -> None:
        _finite("comm", self)
        if self.codec not in CODEC_NAMES:
            raise ValueError(f"comm.codec={self.codec!r} is unknown: allowed are {', '.join(CODEC_NAMES)}")
        if not 0.0 < self.topk_ratio <= 1.0:
            raise ValueError(f"comm.topk_ratio={self.topk_ratio} is outside (0, 1]")
        _positive("comm", "powersgd_rank", self.powersgd_rank, allow_none=False)
        _positive("comm", "int8_chunk_size", self.int8_chunk_size, allow_none=False)
        if self.auto_trial_steps < 2:
            raise ValueError(f"comm.auto_trial_steps={self.auto_trial_steps} must be >= 2 "
                             "(the first dry run is not timed)")
        if not self.auto_margin >= 1.0:
            raise ValueError(f"comm.auto_margin={self.auto_margin} must be >= 1")
        if self.start_step is not None and self.start_step < 0:
            raise ValueError(f"comm.start_step={self.start_step} must be >= 0")
        _positive("comm", "bucket_mb", self.bucket_mb, allow_none=False)
        if self.on_nonfinite not in ("error", "skip"):
            raise ValueError(f"comm.on_nonfinite={self.on_nonfinite!r} is unknown: allowed are error, skip")
        if self.freeze_variance not in ("auto", "on", "off"):
            raise ValueError(f"comm.freeze_variance={self.freeze_variance!r} is unknown: allowed are auto, on, off")
        if self.collective not in COLLECTIVE_NAMES:
            raise ValueError(
                f"comm.collective={self.collective!r} is unknown: allowed are {', '.join(COLLECTIVE_NAMES)}"
            )
        if self.collective != "flat" and self.codec.startswith("torch-"):
            raise ValueError(
                f"comm.collective={self.collective!r} cannot carry torch's own hook {self.codec!r}: "
                "use a poise codec or comm.collective=flat"
            )
        _positive("comm", "segment_bytes", self.segment_bytes, allow_none=False)
        _positive("comm", "tree_max_bytes", self.tree_max_bytes, allow_none=False)
        if self.local_first and (self.codec == "none" or self.codec.startswith("torch-") or not self.error_feedback
                                 or self.collective in ("hierarchical", "auto")):
            raise ValueError(
                f"comm.local_first needs a poise codec with error feedback over a flat, ring or tree collective "
                f"(codec={self.codec!r}, error_feedback={self.error_feedback}, collective={self.collective!r})"
            )

    def freezes_variance(self) -> bool:
        """Whether the optimizer freezes its second moment when compression starts
        (``freeze_variance`` resolved)."""
        if self.freeze_variance == "auto":
            return self.codec in VARIANCE_FREEZING_CODECS
        return self.freeze_variance == "on"

    def compression_start(self, optimizer_steps: int, lr_warmup_steps: int) -> int:
        """Optimizer steps sent uncompressed: ``start_step`` if set; else for the lossy codecs
        the larger of 5% of ``optimizer_steps`` and twice ``lr_warmup_steps``; else 2.

        Why a longer warm-up for lossy codecs: their error-feedback residuals are as large as
        the gradients, and early training, while the learning rate ramps up, is where
        gradients change fastest (torch's PowerSGD and DGC advise warm-ups too); a frozen
        second moment is also an average of the squared gradients seen by then. The
        measurements behind the rule are in ``poise/optim.py``.
        """
        if self.start_step is not None:
            return self.start_step
        if self.codec not in LOSSY_CODECS and not self.freezes_variance():
            return 2
        return max(2, 2 * lr_warmup_steps, math.ceil(0.05 * optimizer_steps))


DEFAULT_LINK = format_rate_bit_per_s(10**9)


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """An emulated multi-node cluster on this machine (see poise/cluster/): each node a network
    namespace behind a rate-shaped link. Needs root. ``dist.nproc`` is the workers per node."""

    nodes: int = _field(0, "emulated nodes to run the job on (0 = none: run on this machine's own network)")
    link: str = _field(DEFAULT_LINK, "rate of every node's link, each direction, e.g. 100mbit, 1gbit, 10gbit "
                                     "(a named cluster's own rate by default)")
    delay: str = _field("", "one-way delay added to each direction of every link, e.g. 2ms (needs netem)")
    name: str = _field("", "run on this cluster from 'poise cluster up' ('' = bring one up for the job, down after)")

    def __post_init__(self) -> None:
        _finite("cluster", self)
        if isinstance(self.nodes, bool) or not 0 <= self.nodes <= MAX_NODES:
            raise ValueError(f"cluster.nodes={self.nodes!r} is invalid: allowed is 0..{MAX_NODES} (0 = no cluster)")
        if self.name:
            validate_name(self.name)
        rate_bit_per_s = links.link_rate_bit_per_s(self.link)
        links.link_delay_s(self.delay)
        if not self.enabled and (rate_bit_per_s != links.link_rate_bit_per_s(DEFAULT_LINK) or self.delay):
            raise ValueError("cluster.link and cluster.delay only apply with cluster.nodes >= 1 or cluster.name")

    @property
    def enabled(self) -> bool:
        """Whether the job runs on an emulated cluster."""
        return self.nodes > 0 or bool(self.name)

    @property
    def link_rate_bit_per_s(self) -> int:
        """The link rate in bits per second."""
        return links.link_rate_bit_per_s(self.link)

    @property
    def delay_s(self) -> float:
        """The one-way link delay in seconds (0 = none)."""
        return links.link_delay_s(self.delay)


@dataclass(frozen=True, kw_only=True)
class DiagnosticsConfig:
    """What is measured and written."""

    gather_every_steps: int = _field(10, "per-rank step figures are gathered to rank 0 this often")
    log_every_steps: int = _field(10, "rank 0 logs a progress line this often")
    plot: bool = _field(True, "write timeline.png (matplotlib)")
    progress: bool = _field(True, "show a live progress bar on rank 0")
    record_samples: bool = _field(
        False, "write the sample indices each rank trains on, per step, to samples/rank-<r>.jsonl (exactly-once checks)"
    )

    def __post_init__(self) -> None:
        _finite("diagnostics", self)
        _positive("diagnostics", "gather_every_steps", self.gather_every_steps, allow_none=False)
        _positive("diagnostics", "log_every_steps", self.log_every_steps, allow_none=False)


@dataclass(frozen=True, kw_only=True)
class MetricsConfig:
    """Live metrics for Prometheus, served by rank 0 (see poise/diagnostics/metrics.py)."""

    port: int | None = _field(
        None, "serve Prometheus metrics on this TCP port from rank 0 (0 = a free port, logged; unset = off)"
    )
    host: str = _field("127.0.0.1", "address the metrics endpoint binds to (0.0.0.0: every interface)")

    def __post_init__(self) -> None:
        if self.port is not None and (isinstance(self.port, bool) or not 0 <= self.port <= 65535):
            raise ValueError(f"metrics.port={self.port!r} is outside 0-65535 (0 picks a free port)")
        if not self.host.strip():
            raise ValueError("metrics.host is empty: give an address such as 127.0.0.1 or 0.0.0.0")

    @property
    def enabled(self) -> bool:
        """Whether the endpoint is served at all."""
        return self.port is not None


@dataclass(frozen=True, kw_only=True)
class FaultConfig:
    """Injected failures, for tests and demos of the failure path (see runtime/faults.py)."""

    fail_at: str = _field(
        "", "RANK:STEP: that worker kills itself (SIGKILL) before that step, in the launcher's first attempt only"
    )
    data_delay_s: float = _field(
        0.0, "emulated slow input pipeline: every batch takes this many more seconds to load on every rank "
        "(sleeps in the DataLoader's collate; 0 = none)"
    )

    def __post_init__(self) -> None:
        _finite("faults", self)
        self.rank_step()  # validates
        if not 0.0 <= self.data_delay_s <= 60.0:  # also refuses nan
            raise ValueError(f"faults.data_delay_s={self.data_delay_s} is outside [0, 60] seconds")

    def rank_step(self) -> tuple[int, int] | None:
        """``fail_at`` parsed: ``(rank, step)``, or None when no failure is planned."""
        if not self.fail_at:
            return None
        rank, sep, step = self.fail_at.partition(":")
        if not sep or not rank.strip().isdigit() or not step.strip().isdigit():
            raise ValueError(f"faults.fail_at={self.fail_at!r} is invalid: give RANK:STEP, e.g. 1:30")
        return int(rank), int(step)


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Checkpoints and resuming (see poise/checkpoint/)."""

    every_steps: int = _field(0, "save a checkpoint every this many steps, and at the end (0 = never)")
    dir: str = _field("", "checkpoint directory ('' = <out_dir>/checkpoints)")
    resume: bool = _field(False, "start from the newest good checkpoint in dir (it must exist)")
    async_save: bool = _field(True, "write checkpoints in the background while training continues")
    differential: bool = _field(True, "between full saves, write only the tensors that changed (exact, by hash)")
    full_every: int = _field(10, "differential: every this many saves is a full one")
    delta_codec: str = _field(
        "exact", "differential: 'exact' writes changed tensors whole; a codec (int8, fp16, bf16, topk) writes "
        "their change since the last save, with its error carried to the next (restore within the logged error)")
    keep: int = _field(3, "newest checkpoints kept (plus the full bases they build on)")

    def __post_init__(self) -> None:
        _finite("checkpoint", self)
        if self.every_steps < 0:
            raise ValueError(f"checkpoint.every_steps={self.every_steps} must be >= 0 (0 = no checkpoints)")
        _positive("checkpoint", "full_every", self.full_every, allow_none=False)
        _positive("checkpoint", "keep", self.keep, allow_none=False)
        if self.delta_codec not in DELTA_CODECS:
            raise ValueError(f"checkpoint.delta_codec={self.delta_codec!r} is unknown: allowed are "
                             f"{', '.join(DELTA_CODECS)}")


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    """Pipeline parallelism (``poise pipeline``): one stage per worker, see poise/pipeline/."""

    schedule: str = _field("1f1b", f"pipeline schedule: {', '.join(PIPELINE_SCHEDULES)}")
    micro_batches: int = _field(4, "micro-batches per step (train.batch_size samples are cut into this many)")
    partition: str = _field("exact", f"how layers are split into stages: {', '.join(PARTITION_METHODS)}")
    link_bandwidth_bytes_per_s: float = _field(
        0.0, "link bandwidth between stages for the plan's communication cost (0 = not modelled)"
    )
    memory_cap_bytes: float = _field(0.0, "most bytes one stage may hold, exact plan only (0 = no cap)")
    profile_repeats: int = _field(5, "timed runs per layer when profiling (median is used)")
    profile_warmup: int = _field(2, "untimed runs per layer before profiling")
    warmup_steps: int = _field(2, "first steps left out of the measured stage times")

    def __post_init__(self) -> None:
        _finite("pipeline", self)
        if self.schedule not in PIPELINE_SCHEDULES:
            raise ValueError(
                f"pipeline.schedule={self.schedule!r} is unknown: allowed are {', '.join(PIPELINE_SCHEDULES)}"
            )
        if self.partition not in PARTITION_METHODS:
            raise ValueError(
                f"pipeline.partition={self.partition!r} is unknown: allowed are {', '.join(PARTITION_METHODS)}"
            )
        _positive("pipeline", "micro_batches", self.micro_batches, allow_none=False)
        _positive("pipeline", "profile_repeats", self.profile_repeats, allow_none=False)
        if self.link_bandwidth_bytes_per_s < 0 or self.memory_cap_bytes < 0:
            raise ValueError(
                f"pipeline.link_bandwidth_bytes_per_s={self.link_bandwidth_bytes_per_s} and "
                f"pipeline.memory_cap_bytes={self.memory_cap_bytes} must be >= 0"
            )
        if self.profile_warmup < 0 or self.warmup_steps < 0:
            raise ValueError(
                f"pipeline.profile_warmup={self.profile_warmup} and pipeline.warmup_steps={self.warmup_steps} "
                "must be >= 0"
            )
        if self.memory_cap_bytes and self.partition != "exact":
            raise ValueError(
                f"pipeline.memory_cap_bytes={self.memory_cap_bytes:g} needs pipeline.partition='exact', "
                f"not {self.partition!r}"
            )


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """A whole run: the sections above plus where outputs go."""

    out_dir: str = _field("", "output directory ('' = runs/<timestamp>)")
    task: TaskConfig = field(default_factory=TaskConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    balance: BalanceConfig = field(default_factory=BalanceConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    straggler: StragglerConfig = field(default_factory=StragglerConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    diagnostics: DiagnosticsConfig = field(default_factory=DiagnosticsConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    faults: FaultConfig = field(default_factory=FaultConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def __post_init__(self) -> None:
        self._check_world()
        if (self.straggler.enabled or self.straggler.delay) and self.train.accum_steps != 1:
            raise ValueError(f"train.accum_steps={self.train.accum_steps} with straggler.mode={self.straggler.mode!r} "
                             "(or straggler.delay): a deadline step accumulates its own micro-batches "
                             "(straggler.micro_batches); use accum_steps=1")
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
        outside = sorted(r for r in self.balance.rank_speeds() if r >= world)
        if outside:
            raise ValueError(f"balance.rank_speed names rank {outside[0]}, but the job has {world} rank(s): "
                             f"allowed are 0..{world - 1}")
        planned = self.faults.rank_step()
        if planned is not None and planned[0] >= world:
            raise ValueError(f"faults.fail_at={self.faults.fail_at!r} names rank {planned[0]}, but the job has "
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
