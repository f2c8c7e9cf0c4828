"""Live metrics of a running ``poise train`` job: scraped and parsed with prometheus_client's
parser, and scraped by a real Prometheus server queried through its HTTP API.

The job is kept running long enough to be scraped by an injected slow input pipeline
(``--faults.data_delay_s``), not by timed assertions: the test polls until the figures appear,
bounded by a deadline.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ROOT

pytestmark = pytest.mark.e2e

JOB = ["--task", "digits", "--nproc", "2", "--steps", "150", "--batch-size", "16", "--faults.data_delay_s", "0.06",
       "--diagnostics.gather_every_steps", "2", "--diagnostics.progress", "false", "--diagnostics.plot", "false"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(url: str, timeout_s: float = 2.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return response.read().decode()


def start_job(out: Path, port: int) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "poise", "train", *JOB, "--metrics.port", str(port),
                             "--out", str(out)], cwd=ROOT, text=True, stdout=subprocess.DEVNULL,
                            stderr=open(out.parent / f"{out.name}.log", "w"), start_new_session=True)


def stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def poll(fn, deadline_s: float, what: str):
    """``fn()`` until it returns something truthy; fail naming ``what`` at the deadline."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        value = fn()
        if value:
            return value
        time.sleep(0.5)
    pytest.fail(f"no {what} within {deadline_s} s")


def test_a_running_job_serves_prometheus_metrics(tmp_path):
    port = free_port()
    job = start_job(tmp_path / "run", port)
    try:
        def scrape() -> dict | None:
            try:
                text = get(f"http://127.0.0.1:{port}/metrics")
            except OSError:
                return None
            families = {f.name: f for f in text_string_to_metric_families(text)}
            steps = families.get("poise_steps")
            return families if steps and steps.samples and steps.samples[0].value >= 4 else None

        families = poll(scrape, 180, "scrape with gathered steps")
        assert families["poise_steps"].type == "counter"
        assert families["poise_world_size"].samples[0].value == 2
        for name in ("poise_rank_step_compute_seconds", "poise_rank_step_idle_seconds",
                     "poise_rank_step_communication_seconds", "poise_rank_compute_seconds"):
            ranks = {s.labels["rank"] for s in families[name].samples if s.name.startswith(name)}
            assert ranks == {"0", "1"}, name
        on_cpu = {s.labels["rank"]: s.value for s in families["poise_rank_compute_on_cpu_ratio"].samples}
        assert set(on_cpu) == {"0", "1"} and all(0 < v <= 1 for v in on_cpu.values()), on_cpu
        data = {s.labels["rank"]: s.value for s in families["poise_rank_step_data_seconds"].samples}
        assert all(v >= 0.05 for v in data.values()), data  # the injected 60 ms per batch
        assert 0 < families["poise_balance_ratio"].samples[0].value <= 1
        assert families["poise_throughput_samples_per_second"].samples[0].value > 0
        wire = next(s.value for s in families["poise_wire_bytes"].samples if s.name == "poise_wire_bytes_total")
        assert wire > 0
        assert families["poise_compression_ratio"].samples[0].value == pytest.approx(1.0)
        for name in ("poise_replans", "poise_checkpoint_stall_seconds", "poise_checkpoints"):
            assert families[name].type == "counter"
    finally:
        stop(job)


def prometheus_binary() -> str | None:
    """Debian's prometheus, installed here if missing (the reason to skip is the install's failure)."""
    found = shutil.which("prometheus")
    if found:
        return found
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip("prometheus is not installed and apt-get cannot run here (not root or no apt-get)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", "--no-install-recommends", "prometheus"]):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        if proc.returncode != 0:
            tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
            pytest.skip(f"cannot install Debian's prometheus ({' '.join(cmd)}: {tail})")
    # the package's service would start a server of its own where init scripts may run: stop it
    subprocess.run(["service", "prometheus", "stop"], capture_output=True, timeout=60)
    return shutil.which("prometheus")


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[tuple[str, int]]:
    """A Prometheus server of this test's own (config and data in tmp_path, 127.0.0.1, a free
    port) scraping a job target every second; yields (its URL, the target's port); stopped after."""
    binary = prometheus_binary()
    assert binary
    target = free_port()
    listen = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: poise\n    scrape_interval: 1s\n    scrape_timeout: 1s\n"
        f"    static_configs:\n      - targets: ['127.0.0.1:{target}']\n")
    log = open(tmp_path / "prometheus.log", "w")
    server = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                               f"--web.listen-address=127.0.0.1:{listen}"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{listen}"
    try:
        def ready() -> bool:
            if server.poll() is not None:
                pytest.fail(f"prometheus exited with {server.returncode}: see {tmp_path / 'prometheus.log'}")
            try:
                return "Ready" in get(f"{url}/-/ready")
            except OSError:
                return False

        poll(ready, 60, "ready prometheus")
        yield url, target
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=10)
        log.close()


def query(url: str, promql: str) -> list[dict]:
    answer = json.loads(get(f"{url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})))
    assert answer["status"] == "success", answer
    return answer["data"]["result"]


def test_a_real_prometheus_scrapes_the_job_and_answers_queries(tmp_path, prometheus):
    url, port = prometheus
    job = start_job(tmp_path / "run", port)
    try:
        steps = poll(lambda: query(url, 'max_over_time(poise_steps_total{job="poise"}[5m]) >= 4'), 180,
                     "poise_steps_total in prometheus")
        assert float(steps[0]["value"][1]) >= 4
        per_rank = poll(lambda: query(url, "max_over_time(poise_rank_compute_seconds_total[5m]) > 0"), 60,
                        "per-rank compute in prometheus")
        assert {r["metric"]["rank"] for r in per_rank} == {"0", "1"}
        up = query(url, 'max_over_time(up{job="poise"}[5m])')
        assert float(up[0]["value"][1]) == 1.0
    finally:
        stop(job)
