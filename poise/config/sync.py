"""``[sync]``: how often the ranks' models meet: every step (DDP), or every few steps (local SGD,
DiLoCo, Streaming DiLoCo), or chosen from measurements (``auto``). See ``poise/sync/outer.py``."""

from __future__ import annotations

from dataclasses import dataclass

from poise.config.fields import check_finite, setting

# step: gradients all-reduced every step ([comm] decides how); the others: see poise/sync/outer.py
SYNC_MODES = ("step", "local_sgd", "diloco", "streaming", "auto", "torch-localsgd", "torchft-diloco")
OUTER_MODES = ("local_sgd", "diloco", "streaming")
MAX_INNER_STEPS = 100_000
# codecs of the outer parameter change (poise/comm/codecs/), each with error feedback
OUTER_CODECS = ("none", "fp16", "bf16", "int8", "topk")
# who trains together between outer steps: each rank alone, or each node's ranks as one DDP replica
INNER_SCOPES = ("rank", "node")


@dataclass(frozen=True, kw_only=True)
class SyncConfig:
    """When the ranks synchronize: every step, or an outer step every ``inner_steps`` steps."""

    mode: str = setting(
        "step", "step = every step's gradients all-reduced ([comm]); local_sgd = parameters averaged every "
        "inner_steps; diloco = an outer Nesterov step on the averaged parameter change every inner_steps; "
        "streaming = diloco by fragments in turn, overlapped with the next inner steps; auto = step or diloco "
        "and inner_steps from the measured compute and link (said in the report); torch-localsgd and "
        "torchft-diloco: other libraries' versions, for comparison"
    )
    inner_steps: int = setting(20, "optimizer steps between two outer steps (H; streaming: of each fragment)")
    inner_scope: str = setting(
        "rank", "outer modes: who trains together between outer steps. rank = every rank alone (its own batch, "
        "nothing sent); node = the ranks of a node as one replica: their gradients all-reduced every step within "
        "the node (DDP over LOCAL_WORLD_SIZE consecutive ranks, [comm]'s codec), and the outer step between nodes "
        "only, each rank sending 1/LOCAL_WORLD_SIZE of it (post-local SGD's layout: fewer, larger-batch replicas "
        "drift apart less; a node sends one model's change per outer step, not one per rank)")
    warmup_steps: int = setting(
        0, "optimizer steps synchronized every step (DDP's all-reduce, [comm]; inner_scope=node: the node's, then "
        "an uncompressed average between nodes) before the first outer round: the early steps, where the ranks' "
        "models would drift apart most (post-local SGD's warm-up)")
    outer_lr: float = setting(0.7, "diloco, streaming: the outer SGD's learning rate (local_sgd: 1)")
    outer_momentum: float = setting(0.9, "diloco, streaming: the outer SGD's Nesterov momentum (0 = none)")
    fragments: int = setting(4, "streaming: the model's parts, synchronized in turn, one every inner_steps/fragments")
    delay_steps: int = setting(
        1, "streaming: inner steps the outer all-reduce overlaps before its result is applied (tau)")
    mixing: float = setting(
        0.5, "streaming: share of the rank's own parameters kept when the outer result lands (alpha; 0 = take "
        "the global parameters)")
    codec: str = setting(
        "none", "codec of the outer parameter change: none, fp16, bf16, int8, topk (with error feedback)")
    topk_ratio: float = setting(0.05, "codec=topk: share of the parameter change's entries sent, in (0, 1]")
    weighting: str = setting(
        "tokens", "how the ranks' changes are averaged: tokens (by the tokens each rank trained in the round: "
        "a rank given fewer samples counts less) or equal")
    auto_max_overhead: float = setting(
        0.15, "auto: the largest share of compute time communication may add: every step synchronizes if DDP's "
        "exposed communication stays within it, else H is the fewest inner steps that keep the outer all-reduce "
        "there")
    auto_trial_steps: int = setting(
        4, "auto: DDP steps timed at the start (the first is not), then, if DDP's exposed communication is too "
        "large, as many steps synchronized in full after each, timed")

    def __post_init__(self) -> None:
        check_finite("sync", self)
        if self.mode not in SYNC_MODES:
            raise ValueError(f"sync.mode={self.mode!r} is unknown: allowed are {', '.join(SYNC_MODES)}")
        if not 1 <= self.inner_steps <= MAX_INNER_STEPS:
            raise ValueError(f"sync.inner_steps={self.inner_steps!r} is outside 1..{MAX_INNER_STEPS}")
        if not 0 <= self.warmup_steps <= MAX_INNER_STEPS * 100:
            raise ValueError(f"sync.warmup_steps={self.warmup_steps!r} is outside 0..{MAX_INNER_STEPS * 100}")
        if not 0.0 < self.outer_lr <= 10.0:
            raise ValueError(f"sync.outer_lr={self.outer_lr!r} is outside (0, 10]")
        if not 0.0 <= self.outer_momentum < 1.0:
            raise ValueError(f"sync.outer_momentum={self.outer_momentum!r} is outside [0, 1)")
        if not 1 <= self.fragments <= 1024:
            raise ValueError(f"sync.fragments={self.fragments!r} is outside 1..1024")
        if not 0 <= self.delay_steps <= MAX_INNER_STEPS:
            raise ValueError(f"sync.delay_steps={self.delay_steps!r} is outside 0..{MAX_INNER_STEPS}")
        if self.mode == "streaming" and self.delay_steps >= self.inner_steps:
            raise ValueError(f"sync.delay_steps={self.delay_steps} must be below sync.inner_steps="
                             f"{self.inner_steps}: a fragment's result lands before its next round begins")
        if not 0.0 <= self.mixing < 1.0:
            raise ValueError(f"sync.mixing={self.mixing!r} is outside [0, 1)")
        if self.codec not in OUTER_CODECS:
            raise ValueError(f"sync.codec={self.codec!r} is unknown: allowed are {', '.join(OUTER_CODECS)}")
        if not 0.0 < self.topk_ratio <= 1.0:
            raise ValueError(f"sync.topk_ratio={self.topk_ratio!r} is outside (0, 1]")
        if self.inner_scope not in INNER_SCOPES:
            raise ValueError(f"sync.inner_scope={self.inner_scope!r} is unknown: allowed are {', '.join(INNER_SCOPES)}")
        if self.inner_scope == "node" and self.mode not in (*OUTER_MODES, "auto"):
            raise ValueError(f"sync.inner_scope='node' is for poise's outer modes ({', '.join(OUTER_MODES)}, auto), "
                             f"not sync.mode={self.mode!r}")
        if self.weighting not in ("tokens", "equal"):
            raise ValueError(f"sync.weighting={self.weighting!r} is unknown: allowed are tokens, equal")
        if not 0.0 < self.auto_max_overhead <= 1.0:
            raise ValueError(f"sync.auto_max_overhead={self.auto_max_overhead!r} is outside (0, 1]")
        if not 2 <= self.auto_trial_steps <= 100:
            raise ValueError(f"sync.auto_trial_steps={self.auto_trial_steps!r} is outside 2..100")

    def check_codec(self, codec: str | None) -> None:
        """Refuse, in one line, a per-step gradient codec ``codec`` (``comm.codec``) that this
        mode would never use: an outer mode's inner steps reduce no gradient, so only its
        warm-up and ``inner_scope=node`` all-reduce one (the report would name a codec that
        compressed nothing). None (no codec named) is poise's to decide: exact here."""
        named = codec not in (None, "none")
        if self.mode in OUTER_MODES and named and not self.warmup_steps and self.inner_scope == "rank":
            raise ValueError(f"comm.codec={codec!r} compresses the per-step gradient all-reduce, which sync.mode="
                             f"{self.mode!r} never runs (inner steps send nothing; the outer step sends the "
                             f"parameter change): compress that with sync.codec (SyncConfig(codec=...): "
                             f"{', '.join(OUTER_CODECS)}), or leave comm.codec='none' (it applies only to "
                             "sync.warmup_steps and inner_scope='node')")

    @property
    def outer(self) -> bool:
        """Whether the models meet every few steps (an outer step), not every step."""
        return self.mode != "step"
