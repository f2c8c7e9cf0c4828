"""Live metrics for Prometheus: rank 0 serves the job's figures in the Prometheus text format.

Why here and why this way: an autoscaler, a dashboard or an alert needs the figures while the
job runs, not the report at its end. The per-rank step records already reach rank 0 every
``diagnostics.gather_every_steps`` steps (:class:`~poise.diagnostics.timeline.Timeline`), so the
exporter is fed from that gather and adds no collective to the training step; between gathers
the figures are as old as the last one (``poise_last_gather_timestamp_seconds`` says when).

Names follow Prometheus' conventions: base units (seconds, bytes), ``_total`` for counters,
``_ratio`` for 0..1 shares, a ``rank`` label for per-rank figures. Gauges hold the median over
the steps of the last gather ("now"); counters accumulate over the run (use ``rate()``).
Idle and communication are split as in ``timeline.png``: a rank's idle seconds are the time its
compute was shorter than the slowest rank's in that step (at most what it spent blocked); its
communication seconds are the blocked time beyond that.

The endpoint is off unless ``MetricsConfig.port`` is set; it binds 127.0.0.1 unless
``MetricsConfig.host`` says otherwise (the figures say how a job runs; do not expose them to
a network by accident). Port 0 picks a free port, which is logged and in :attr:`MetricsExporter.port`.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from poise.balance.metrics import balance
from poise.config import MetricsConfig
from poise.diagnostics.timeline import column, elapsed_s, on_cpu_share

if TYPE_CHECKING:  # prometheus_client is imported by an exporter: a job without one never loads it
    from prometheus_client import CollectorRegistry, Counter, Gauge

log = logging.getLogger(__name__)

NAMESPACE = "poise"


def split_idle(block: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per ``[ranks, steps]``: (idle seconds, communication seconds beyond idle) of a table block."""
    compute = column(block, "compute_s")
    blocked = column(block, "comm_wait_s")
    idle = compute.max(axis=0, keepdims=True) - compute
    return np.minimum(idle, blocked), np.clip(blocked - idle, 0, None)


class MetricsExporter:
    """The job's metrics in a registry of their own, updated from each gathered block (rank 0).

    Args:
        world_size: ranks of the job (one ``rank`` label value each).
        registry: where the metrics live (a fresh one by default, so two sessions in one
            process, or a user's own metrics, never collide).
    """

    def __init__(self, world_size: int, registry: CollectorRegistry | None = None) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.registry = registry or CollectorRegistry(auto_describe=True)
        self.world_size = world_size
        self.port: int | None = None
        self._server: Any = None
        self._replans_seen = 0
        r = self.registry

        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
            return Gauge(name, doc, labels, namespace=NAMESPACE, registry=r)

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, labels, namespace=NAMESPACE, registry=r)

        self.world = gauge("world_size", "ranks in the job")
        self.world.set(world_size)
        self.steps = counter("steps", "training steps (micro-batches) gathered so far")
        self.step_s = gauge("step_seconds", "median step time of the last gather, slowest rank per step")
        self.train_s = counter("train_seconds", "time in training steps (the busiest rank's step times summed)")
        self.balance = gauge("balance_ratio", "mean over the last gather's steps of 1 - (max - min) / max compute")
        self.samples_per_s = gauge("throughput_samples_per_second", "samples of all ranks per second, last gather")
        self.tokens_per_s = gauge("throughput_tokens_per_second", "real tokens of all ranks per second, last gather")
        self.samples = counter("samples", "samples trained on, all ranks")
        self.tokens = counter("tokens", "real (unpadded) tokens trained on, all ranks")
        self.wire_bytes = counter("wire_bytes", "bytes put into gradient collectives after compression, all ranks")
        self.raw_bytes = counter("raw_bytes", "gradient bytes handed to communication before compression, all ranks")
        self.compression = gauge("compression_ratio", "raw / wire gradient bytes of the last gather")
        self.replans = counter("replans", "re-plans of the dynamic balancer")
        self.skipped = counter("skipped_steps", "optimizer steps skipped (non-finite gradients)")
        self.checkpoints = counter("checkpoints", "checkpoints saved")
        self.stall_s = counter("checkpoint_stall_seconds", "seconds the training loop was held up by checkpoints")
        self.last_gather = gauge("last_gather_timestamp_seconds", "unix time of the last gathered block")
        self.rank_compute = gauge("rank_step_compute_seconds", "median own compute per step, last gather", ("rank",))
        self.rank_comm = gauge("rank_step_communication_seconds",
                               "median communication per step beyond waiting for the slowest rank", ("rank",))
        self.rank_idle = gauge("rank_step_idle_seconds", "median seconds per step waiting for the slowest rank",
                               ("rank",))
        self.rank_data = gauge("rank_step_data_seconds", "median data-loading seconds per step, last gather", ("rank",))
        self.rank_compute_total = counter("rank_compute_seconds", "own compute seconds", ("rank",))
        self.rank_comm_total = counter("rank_communication_seconds", "communication seconds beyond idle", ("rank",))
        self.rank_idle_total = counter("rank_idle_seconds", "seconds waiting for the slowest rank", ("rank",))
        self.rank_data_total = counter("rank_data_seconds", "data-loading seconds", ("rank",))
        self.rank_cpu_total = counter("rank_cpu_seconds", "CPU seconds of the rank's process in its steps, all threads",
                                      ("rank",))
        self.rank_on_cpu = gauge("rank_compute_on_cpu_ratio", "share of its compute the training thread spent on a "
                                 "CPU, last gather (below 1 on a CPU rank: it waited for a core)", ("rank",))
        for rank in range(world_size):  # every series exists from the start, at 0
            for metric in (self.rank_compute, self.rank_comm, self.rank_idle, self.rank_data, self.rank_compute_total,
                           self.rank_comm_total, self.rank_idle_total, self.rank_data_total, self.rank_cpu_total):
                metric.labels(rank=str(rank))

    def observe(self, block: np.ndarray, replans: int = 0) -> None:
        """Fold in one gathered block ``[ranks, steps, fields]``; ``replans``: re-plans so far."""
        if block.ndim != 3 or block.shape[1] == 0:
            return
        compute = column(block, "compute_s")
        idle, comm = split_idle(block)
        data = column(block, "data_s")
        slowest = column(block, "step_s").max(axis=0)
        total_s = float(elapsed_s(block)[-1])  # not slowest.sum(): deadline steps overlap
        self.steps.inc(block.shape[1])
        self.train_s.inc(total_s)
        self.step_s.set(float(np.median(slowest)))
        self.balance.set(float(np.mean([balance(row) for row in compute.T])))
        samples, tokens = float(column(block, "samples").sum()), float(column(block, "tokens").sum())
        self.samples.inc(samples)
        self.tokens.inc(tokens)
        if total_s > 0:
            self.samples_per_s.set(samples / total_s)
            self.tokens_per_s.set(tokens / total_s)
        raw, wire = float(column(block, "raw_bytes").sum()), float(column(block, "wire_bytes").sum())
        self.raw_bytes.inc(raw)
        self.wire_bytes.inc(wire)
        self.compression.set(raw / wire if wire > 0 else 1.0)
        self.skipped.inc(float(column(block, "skipped").max(axis=0).sum()))
        if replans > self._replans_seen:
            self.replans.inc(replans - self._replans_seen)
            self._replans_seen = replans
        cpu, on_cpu = column(block, "cpu_s"), on_cpu_share(block)
        for rank in range(min(self.world_size, block.shape[0])):
            label = str(rank)
            self.rank_cpu_total.labels(rank=label).inc(float(np.nansum(cpu[rank])))
            if np.isfinite(on_cpu[rank]):  # not measured: the gauge keeps its last value (absent until one)
                self.rank_on_cpu.labels(rank=label).set(float(on_cpu[rank]))
            for gauge_, counter_, values in ((self.rank_compute, self.rank_compute_total, compute[rank]),
                                             (self.rank_comm, self.rank_comm_total, comm[rank]),
                                             (self.rank_idle, self.rank_idle_total, idle[rank]),
                                             (self.rank_data, self.rank_data_total, data[rank])):
                gauge_.labels(rank=label).set(float(np.median(values)))
                counter_.labels(rank=label).inc(float(values.sum()))
        self.last_gather.set(time.time())

    def observe_checkpoint(self, stall_s: float) -> None:
        """One checkpoint saved, holding the loop up for ``stall_s`` seconds."""
        self.checkpoints.inc()
        self.stall_s.inc(max(0.0, stall_s))

    def serve(self, host: str, port: int) -> int:
        """Serve ``/metrics`` on ``host:port`` from a daemon thread; returns the bound port.

        Raises:
            ValueError: one line when the address cannot be bound (in use, not this host's).
        """
        from prometheus_client import start_http_server

        try:
            server, _thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise ValueError(f"metrics endpoint {host}:{port} cannot be bound: {exc.strerror or exc}") from None
        self._server = server
        self.port = int(server.server_port)
        log.info("metrics: Prometheus endpoint on http://%s:%d/metrics", host, self.port)
        return self.port

    def close(self) -> None:
        """Stop serving (the figures stay readable in :attr:`registry`)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def start(config: MetricsConfig, world_size: int) -> MetricsExporter | None:
    """An exporter serving per ``config``, or None when metrics are off (``port`` unset)."""
    if not config.enabled:
        return None
    exporter = MetricsExporter(world_size)
    assert config.port is not None
    exporter.serve(config.host, config.port)
    return exporter


__all__ = ["NAMESPACE", "MetricsExporter", "split_idle", "start"]
