"""``[parallel]``: how the model is laid out over the ranks: whole on every rank (DDP), sharded over
all of them (FSDP2), sharded inside a group and replicated across groups (HSDP), or data x
pipeline parallelism (``poise pipeline``). See ``poise/train/shard.py`` for what ``poise train``
shards and ``docs/reference/config.md`` for every field."""

from __future__ import annotations

from dataclasses import dataclass

from poise.config.fields import setting

# ddp: every rank holds the whole model (poise's default); fsdp and hsdp: torch's fully_shard
# (FSDP2); dp-pp: data x pipeline parallelism, run by ``poise pipeline``
PARALLEL_MODES = ("ddp", "fsdp", "hsdp", "dp-pp")
SHARDED_MODES = ("fsdp", "hsdp")
# a shard group larger than this is a typo (the dist section allows 64 workers per machine)
MAX_SHARD_SIZE = 100_000


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """How the model is laid out over the ranks (see module doc)."""

    mode: str = setting(
        "ddp", "ddp = every rank holds the whole model; fsdp = parameters, gradients and optimizer state sharded "
        "over all ranks (FSDP2's fully_shard); hsdp = sharded inside each group of shard_size ranks, replicated "
        "across the groups; dp-pp = data x pipeline parallelism (poise pipeline)")
    shard_size: int | None = setting(
        None, "hsdp: ranks per shard group, consecutive ranks (unset = dist.nproc, the ranks of one machine); "
        "the world size must be a multiple of it")
    reshard_after_forward: bool = setting(
        True, "fsdp, hsdp: free each block's gathered parameters after its forward and gather them again for "
        "the backward (less memory, one more all-gather per block)")

    def __post_init__(self) -> None:
        if self.mode not in PARALLEL_MODES:
            raise ValueError(f"parallel.mode={self.mode!r} is unknown: allowed are {', '.join(PARALLEL_MODES)}")
        if self.shard_size is not None:
            if isinstance(self.shard_size, bool) or not 1 <= self.shard_size <= MAX_SHARD_SIZE:
                raise ValueError(f"parallel.shard_size={self.shard_size!r} is outside 1..{MAX_SHARD_SIZE}")
            if self.mode != "hsdp":
                raise ValueError(f"parallel.shard_size={self.shard_size} only applies to parallel.mode='hsdp', not "
                                 f"{self.mode!r} (fsdp shards over every rank)")

    @property
    def sharded(self) -> bool:
        """Whether the model is sharded with FSDP2 (``fsdp`` or ``hsdp``)."""
        return self.mode in SHARDED_MODES

    def shard_group(self, nproc: int) -> int:
        """Ranks per shard group: ``shard_size``, by default ``nproc`` (one machine's ranks)."""
        return self.shard_size if self.shard_size is not None else nproc
