"""One data-parallel training step, predicted: compute, buckets, codecs and their overlap.

A step is ``data + forward + backward + optimizer``. Backward hands DDP its gradient buckets
in backward order (the last layers first); each bucket's reduction starts once the bucket is
complete and the communication channel is free, and runs while the rest of backward
computes. The step waits for the last reduction, then steps the optimizer. What runs where
follows poise's reducers (``poise/comm/reducers.py``, ``wrappers.py``):

- summable codecs (none, fp16, bf16, randomk): encode in the hook (on the backward thread),
  one all-reduce of the payload, decode when it completes;
- others (sign, topk, int8): encode in the hook, all-gather of every rank's payload, one
  fused decode of them all;
- powersgd: the whole bucket on its own communication thread, one bucket after the other
  (project P, all-reduce P and the dense entries, compute Q, all-reduce Q, decode), while
  backward goes on; the backend's all-reduce whatever the collective, unless hierarchical;
- hierarchical with a codec: the whole bucket goes through node reduce, the leader's codec
  and its reduction between leaders, and the node broadcast, on the communication thread;
  hierarchical without one: the pipelined three-phase all-reduce.

Buckets follow DDP: parameters in reverse registration order, a first bucket of 1 MiB, then
buckets closed once they reach the cap (``bucket_cap_mb`` in MiB). Seconds are per step on
one rank; bytes are bytes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from poise.plan.costs import Cluster, Link, all_gather_s, all_reduce_s, hierarchical_phases_s, resolve

if TYPE_CHECKING:
    from poise.comm.codecs import Codec

FIRST_BUCKET_BYTES = 1 << 20  # DDP's first bucket (dist._DEFAULT_FIRST_BUCKET_BYTES)
_ALIGN_BYTES = 8  # all-gather payloads are padded to this (reducers._ALIGN_BYTES)


@dataclass(frozen=True)
class Param:
    """One parameter tensor: ``name``, ``shape`` and the share of backward compute it ends
    (``backward_weight``, any positive scale; default its number of entries)."""

    name: str
    shape: tuple[int, ...]
    backward_weight: float | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Bucket:
    """A DDP bucket: parameter indices (backward order), entries, the shapes in it, and the
    share of backward done when it is complete (0..1)."""

    params: tuple[int, ...]
    numel: int
    shapes: tuple[tuple[int, ...], ...]
    ready_fraction: float


def plan_buckets(params: Sequence[Param], bucket_bytes: float, *, itemsize: int = 4,
                 first_bucket_bytes: float = FIRST_BUCKET_BYTES) -> list[Bucket]:
    """DDP's bucket assignment: reverse registration order, close a bucket once it holds at
    least its cap (the first: ``first_bucket_bytes``, then ``bucket_bytes``)."""
    weights = [p.backward_weight if p.backward_weight is not None else float(p.numel) for p in params]
    total = sum(weights) or 1.0
    buckets: list[Bucket] = []
    current: list[int] = []
    numel = 0  # entries in ``current`` (kept, not re-summed: a bucket of many small tensors stays O(n))
    done = 0.0
    for index in reversed(range(len(params))):
        current.append(index)
        numel += params[index].numel
        done += weights[index]
        cap = first_bucket_bytes if not buckets else bucket_bytes
        if numel * itemsize >= cap or index == 0:
            buckets.append(Bucket(tuple(current), numel, tuple(params[i].shape for i in current),
                                  min(1.0, done / total)))
            current, numel = [], 0
    return buckets


@functools.lru_cache(maxsize=16)
def _buckets(params: tuple[Param, ...], bucket_bytes: float) -> list[Bucket]:
    """:func:`plan_buckets`, once per model and bucket size: a plan predicts every codec and
    collective on the same buckets (the list is shared; nobody changes it)."""
    return plan_buckets(params, bucket_bytes)


@dataclass(frozen=True)
class Compute:
    """One worker's step without communication, in seconds, as it runs in the job.

    Attributes:
        forward_s, backward_s, optimizer_s, data_s: seconds per step.
        codec_scale: factor on the codecs' measured seconds (1; on the emulated cluster,
            where every node shares one machine's cores, the slow-down of sharing them).
        alone_step_s: one worker training alone (the scaling baseline); None: the sum of
            the four phases.
        sharing_s: the wait per step of workers that share one machine's cores (the
            emulated cluster): time-sliced, they reach each collective at different times
            and the slowest sets the step; the machine's own reduction work, and with the
            flat collectives each rank's codec work, hide under it (see
            :func:`hidden_by_sharing_s`). Measured by ``calibrate.sharing_s``; 0 on a real
            cluster, where each worker has its own cores.
        source: where the figures come from (shown as measured or assumed).
    """

    forward_s: float
    backward_s: float
    optimizer_s: float = 0.0
    data_s: float = 0.0
    codec_scale: float = 1.0
    alone_step_s: float | None = None
    sharing_s: float = 0.0
    source: str = "assumed"

    @property
    def step_s(self) -> float:
        """One worker alone: ``alone_step_s``, or data + forward + backward + optimizer."""
        if self.alone_step_s is not None:
            return self.alone_step_s
        return self.step_phases_s

    @property
    def step_phases_s(self) -> float:
        """data + forward + backward + optimizer, as this worker runs them."""
        return self.data_s + self.forward_s + self.backward_s + self.optimizer_s


@dataclass(frozen=True)
class CodecSpeed:
    """Encode and decode seconds per fp32 gradient byte on one worker, and where they come from."""

    encode_s_per_byte: float
    decode_s_per_byte: float
    source: str = "assumed"


@dataclass(frozen=True)
class StepConfig:
    """What is being predicted: a codec (name and options), a collective and a bucket size."""

    codec: str
    collective: str
    bucket_mb: float
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StepPrediction:
    """Seconds and bytes of one predicted step (one rank); ``sharing_s``: the part of
    ``step_s`` (and of ``exposed_comm_s``) that the compute's ``sharing_s`` adds."""

    step_s: float
    compute_s: float
    exposed_comm_s: float
    comm_s: float
    codec_s: float
    wire_bytes: float
    inter_node_bytes: float
    num_buckets: int
    sharing_s: float = 0.0


def _codec(name: str, options: dict[str, Any]) -> Codec:
    from poise.comm import codecs

    return codecs.make(name, **options)


def _rounds(codec: Codec, bucket: Bucket) -> tuple[list[float], bool]:
    """Payload bytes per rank per round, and whether they are all-gathered (not summed)."""
    from poise.comm.codecs.lowrank import PowerSGDCodec

    if isinstance(codec, PowerSGDCodec):
        layout = codec.layout(bucket.numel, list(bucket.shapes))
        if not layout.blocks:
            return [4.0 * bucket.numel], False
        return [4.0 * (layout.p_numel + layout.dense_numel), 4.0 * layout.q_numel], False
    nbytes = float(codec.encoded_nbytes(bucket.numel))
    if codec.summable:
        return [nbytes], False
    return [math.ceil(nbytes / _ALIGN_BYTES) * _ALIGN_BYTES], True


def _reduce_s(cluster: Cluster, rounds: list[float], gathered: bool, collective: str) -> float:
    if gathered:
        return all_gather_s(cluster, rounds[0], collective)
    return sum(all_reduce_s(cluster, r, collective) for r in rounds)


def _link_bytes(cluster: Cluster, rounds: list[float], gathered: bool, collective: str) -> float:
    """Bytes over one node's link (ring: one stream each way) for these payloads."""
    n, nodes = cluster.world_size, cluster.num_nodes
    if nodes == 1:
        return 0.0
    name = resolve(collective, cluster, sum(rounds))
    if name == "hierarchical":
        return sum((nodes - 1) * r * (1 if gathered else 2 / nodes) * (cluster.procs_per_node if gathered else 1)
                   for r in rounds)
    if gathered:
        return (n - 1) * rounds[0]
    if name == "tree":  # the exchanges across nodes: every rank of the node sends its whole message
        return sum(math.ceil(math.log2(nodes)) * cluster.procs_per_node * r for r in rounds)
    return sum(2 * (n - 1) / n * r for r in rounds)


def predict_step(cluster: Cluster, params: Sequence[Param], compute: Compute, config: StepConfig,
                 speeds: dict[str, CodecSpeed] | None = None, *, leader_speeds: dict[str, CodecSpeed] | None = None,
                 segment_bytes: float = 1 << 20, host: Cluster | None = None) -> StepPrediction:
    """Seconds of one step of ``config`` on ``cluster`` (see the module docstring).

    Args:
        params: the model's parameter tensors in registration order (fp32 gradients).
        compute: one worker's compute seconds.
        speeds: codec encode/decode speeds by codec name (missing: 0 s, shown as assumed),
            decoding ``world_size`` payloads; ``leader_speeds``: the same for the node leaders
            of a hierarchical reduction, decoding ``num_nodes`` (None: ``speeds``).
        segment_bytes: hierarchical pipeline segment, bytes.
        host: with ``compute.sharing_s`` (workers sharing one machine's cores), the same
            ranks with the machine's own links alone (``calibrate.host_link``). The step
            then waits ``max(sharing_s, h) + (e - h)`` after backward instead of ``e``:
            ``e`` the exposed seconds on ``cluster``, ``h`` the machine's own work for the
            config, which the sharing wait hides (see :func:`hidden_by_sharing_s`); what
            the links and the codecs add beyond it comes on top. None: ``h`` without the
            collectives' seconds.
    """
    pred = _predict_step(cluster, params, compute, config, speeds, leader_speeds, segment_bytes)
    floor = compute.sharing_s
    if not floor > 0 or cluster.world_size == 1:
        return pred
    hidden = hidden_by_sharing_s(cluster, params, compute, config, speeds, host=host, segment_bytes=segment_bytes)
    exposed = max(floor, hidden) + max(0.0, pred.exposed_comm_s - hidden)
    added = exposed - pred.exposed_comm_s
    return replace(pred, step_s=pred.step_s + added, exposed_comm_s=exposed, sharing_s=added)


def hidden_by_sharing_s(cluster: Cluster, params: Sequence[Param], compute: Compute, config: StepConfig,
                        speeds: dict[str, CodecSpeed] | None = None, *, host: Cluster | None = None,
                        segment_bytes: float = 1 << 20) -> float:
    """Seconds per step of the machine's own work that the sharing wait (``compute.sharing_s``)
    hides: the exposed seconds of ``config`` on ``host`` (None: links that take no time).

    Workers time-sliced on shared cores reach each collective at different times; the
    first to arrive waits for the slowest. What a rank does on its own cores in that time
    costs the step nothing beyond the wait: the collectives' copies and reductions on the
    machine, and, with the flat collectives (and PowerSGD, which always reduces flat),
    each rank's codec encode and decode, done by every rank for itself in its hook and
    after its collective, so that a rank's codec seconds fill its own wait for the others.
    With the hierarchical collective the codec seconds are not hidden: the node leaders
    encode, reduce between leaders and decode one after the other on the communication
    thread after the node reduce, which every rank of the node waits for, so that work
    comes after the slowest rank has arrived. Codec seconds are ``speeds`` (per rank, as
    :func:`predict_step` takes them), so the same calibration as the prediction."""
    hierarchical = resolve(config.collective, cluster, 1 << 30) == "hierarchical" and cluster.num_nodes > 1
    own = None if hierarchical else speeds
    machine = host if host is not None else Cluster(cluster.num_nodes, cluster.procs_per_node,
                                                     Link(0.0, math.inf), Link(0.0, math.inf))
    return _predict_step(machine, params, compute, config, own, None, segment_bytes).exposed_comm_s


def _predict_step(cluster: Cluster, params: Sequence[Param], compute: Compute, config: StepConfig,
                  speeds: dict[str, CodecSpeed] | None, leader_speeds: dict[str, CodecSpeed] | None,
                  segment_bytes: float) -> StepPrediction:
    from poise.comm.codecs.lowrank import PowerSGDCodec

    codec = _codec(config.codec, config.options)
    speed = (speeds or {}).get(config.codec, CodecSpeed(0.0, 0.0))
    if resolve(config.collective, cluster, 1 << 30) == "hierarchical" and cluster.num_nodes > 1:
        speed = (leader_speeds or speeds or {}).get(config.codec, speed)  # the leaders decode num_nodes payloads
    scale = compute.codec_scale
    buckets = _buckets(tuple(params), config.bucket_mb * (1 << 20))
    backward_s = compute.backward_s
    hierarchical = resolve(config.collective, cluster, 1 << 30) == "hierarchical" and cluster.world_size > 1
    lowrank = isinstance(codec, PowerSGDCodec)
    leaders = Cluster(cluster.num_nodes, 1, cluster.intra, cluster.inter)
    delay = 0.0  # backward seconds lost in hooks (encodes)
    channel_free = 0.0
    last_done = 0.0
    comm_total = codec_total = wire = link = 0.0
    for bucket in buckets:
        ready = bucket.ready_fraction * backward_s + delay
        raw = 4.0 * bucket.numel
        enc = speed.encode_s_per_byte * raw * scale
        dec = speed.decode_s_per_byte * raw * scale
        rounds, gathered = _rounds(codec, bucket)
        if config.codec == "none" or (lowrank and len(rounds) == 1):  # sent as it is (PowerSGD: no matrix)
            enc = dec = 0.0
        if hierarchical and config.codec == "none":
            comm = all_reduce_s(cluster, raw, "hierarchical", segment_bytes)
            start = max(ready, channel_free)
            channel_free = done = start + comm
            wire += raw
            link += _link_bytes(cluster, [raw], False, "hierarchical")
        elif hierarchical:
            node_reduce, _, node_broadcast = hierarchical_phases_s(cluster, raw)
            inter = _reduce_s(leaders, rounds, gathered, "flat")
            comm = node_reduce + inter + node_broadcast
            start = max(ready, channel_free)
            channel_free = done = start + comm + enc + dec
            wire += raw
            link += _link_bytes(leaders, rounds, gathered, "flat")
        elif lowrank and len(rounds) == 2:
            # on its own communication thread (wrappers.OnCommThread): backward goes on while
            # the thread projects, reduces round 1, computes Q, reduces round 2 and decodes,
            # one bucket after the other
            comm = all_reduce_s(cluster, rounds[0], "flat") + all_reduce_s(cluster, rounds[1], "flat")
            start = max(ready, channel_free)
            channel_free = done = start + enc + comm + dec
            wire += sum(rounds)
            link += _link_bytes(cluster, rounds, False, "flat")
        else:
            collective = "flat" if lowrank else config.collective
            comm = _reduce_s(cluster, rounds, gathered, collective)
            delay += enc
            start = max(ready + enc, channel_free)
            channel_free = start + comm
            done = channel_free + dec
            wire += sum(rounds)
            link += _link_bytes(cluster, rounds, gathered, collective)
        comm_total += comm
        codec_total += enc + dec
        last_done = max(last_done, done)
    backward_end = backward_s + delay
    compute_s = compute.forward_s + compute.optimizer_s + compute.data_s
    tail = max(backward_end, last_done)
    step = compute_s + tail
    return StepPrediction(step_s=step, compute_s=compute_s + backward_s, exposed_comm_s=tail - backward_s,
                          comm_s=comm_total, codec_s=codec_total, wire_bytes=wire, inter_node_bytes=link,
                          num_buckets=len(buckets))
