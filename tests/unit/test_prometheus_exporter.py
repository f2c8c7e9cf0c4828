"""The Prometheus exporter fed with gathered blocks: names, labels, units, and the config."""

from __future__ import annotations

import urllib.request

import numpy as np
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from poise.config import MetricsConfig
from poise.diagnostics import metrics
from poise.diagnostics.timeline import FIELDS


def block(compute: list[list[float]], comm_wait: list[list[float]]) -> np.ndarray:
    c, w = np.asarray(compute), np.asarray(comm_wait)
    out = np.zeros((*c.shape, len(FIELDS)))
    out[:, :, FIELDS.index("forward_s")] = c
    out[:, :, FIELDS.index("comm_wait_s")] = w
    out[:, :, FIELDS.index("step_s")] = c + w + 0.01
    out[:, :, FIELDS.index("data_s")] = 0.01
    out[:, :, FIELDS.index("samples")] = 4
    out[:, :, FIELDS.index("tokens")] = 100
    out[:, :, FIELDS.index("raw_bytes")] = 1000
    out[:, :, FIELDS.index("wire_bytes")] = 500
    out[:, :, FIELDS.index("compute_wall_s")] = c
    out[:, :, FIELDS.index("compute_cpu_s")] = 0.5 * c  # each training thread on a CPU half of its compute
    out[:, :, FIELDS.index("cpu_s")] = 0.5 * c + 0.02
    return out


def families(exporter: metrics.MetricsExporter) -> dict:
    return {f.name: f for f in text_string_to_metric_families(generate_latest(exporter.registry).decode())}


def value(fams: dict, family: str, sample: str | None = None, **labels: str) -> float:
    return next(s.value for s in fams[family].samples
                if s.name == (sample or family) and all(s.labels.get(k) == v for k, v in labels.items()))


def test_block_figures_split_idle_from_communication():
    e = metrics.MetricsExporter(2)
    # rank 0 computes 0.1 s and waits 0.15 (0.1 for rank 1, then 0.05 of transfer); rank 1 0.2 + 0.05
    e.observe(block([[0.1, 0.1], [0.2, 0.2]], [[0.15, 0.15], [0.05, 0.05]]), replans=2)
    f = families(e)
    assert value(f, "poise_steps", "poise_steps_total") == 2
    assert value(f, "poise_rank_step_idle_seconds", rank="0") == pytest.approx(0.1)
    assert value(f, "poise_rank_step_communication_seconds", rank="0") == pytest.approx(0.05)
    assert value(f, "poise_rank_step_idle_seconds", rank="1") == pytest.approx(0.0)
    assert value(f, "poise_rank_compute_seconds", "poise_rank_compute_seconds_total", rank="1") == pytest.approx(0.4)
    assert value(f, "poise_balance_ratio") == pytest.approx(0.5)
    assert value(f, "poise_compression_ratio") == pytest.approx(2.0)
    assert value(f, "poise_wire_bytes", "poise_wire_bytes_total") == 2000
    assert value(f, "poise_replans", "poise_replans_total") == 2
    assert value(f, "poise_step_seconds") == pytest.approx(0.26)
    assert value(f, "poise_rank_compute_on_cpu_ratio", rank="1") == pytest.approx(0.5)
    assert value(f, "poise_rank_cpu_seconds", "poise_rank_cpu_seconds_total", rank="0") == pytest.approx(0.14)
    e.observe(block([[0.1], [0.1]], [[0.0], [0.0]]), replans=2)  # counters accumulate, re-plans are not recounted
    e.observe_checkpoint(0.25)
    f = families(e)
    assert value(f, "poise_steps", "poise_steps_total") == 3 and value(f, "poise_replans", "poise_replans_total") == 2
    assert value(f, "poise_checkpoint_stall_seconds", "poise_checkpoint_stall_seconds_total") == 0.25
    for fam in f.values():  # Prometheus naming: counters end in _total, every name is poise_*
        assert fam.name.startswith("poise_")
        if fam.type == "counter":
            assert any(s.name.endswith("_total") for s in fam.samples)


def test_serve_on_a_free_port_of_loopback_and_close():
    exporter = metrics.start(MetricsConfig(port=0), world_size=1)
    assert exporter is not None and exporter.port
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{exporter.port}/metrics", timeout=5).read().decode()
        assert "poise_world_size 1.0" in text
    finally:
        exporter.close()
    assert metrics.start(MetricsConfig(), world_size=1) is None  # off by default


def test_metrics_config_validation():
    assert MetricsConfig().host == "127.0.0.1" and not MetricsConfig().enabled
    with pytest.raises(ValueError, match=r"metrics\.port=70000 is outside 0-65535"):
        MetricsConfig(port=70000)
    with pytest.raises(ValueError, match=r"metrics\.host is empty"):
        MetricsConfig(port=1, host=" ")
