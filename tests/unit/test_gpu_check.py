"""The prepared GPU check (``python -m poise.bench.gpu``, ``make gpu-check``) checked on the CPU.

Its ``--dry-run`` runs every phase's code path with the device replaced by the CPU and tiny
sizes; here it must write the JSON a lent GPU's run will write, with every key the closing
note reads. The test phase is checked on a small file of its own (a pass, a failure, a skip),
so that a failing ``cuda`` test on a GPU is reported by name, not lost.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from poise.bench import gpu, probe_overhead
from poise.bench.codecs import KERNEL_CASES

ROOT = Path(__file__).resolve().parents[2]


def test_the_dry_run_writes_every_phase_into_one_json(tmp_path):
    out = tmp_path / "check"
    done = subprocess.run([sys.executable, "-m", "poise.bench.gpu", "--dry-run", "--no-tests", "--codec-mbytes", "0.25",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "probe overhead per step" in done.stdout and "wrote" in done.stdout  # progress is printed
    result = json.loads((out / gpu.RESULT).read_text())
    assert result["bench"] == "gpu_check" and result["dry_run"] is True and result["ok"] is True
    assert result["tests"] is None  # --no-tests
    device = result["device"]
    assert device["type"] == "cpu" and device["torch"] == torch.__version__ and "cuda" in device and device["name"]
    codecs = result["codecs"]
    assert [row["codec"] for row in codecs["rows"]] == [case.label for case in KERNEL_CASES]
    assert codecs["copy_gb_per_s"] > 0 and codecs["numel"] == 250_000 // 4
    for row in codecs["rows"]:
        assert row["codec_gb_per_s"] > 0 and row["vs_copy"] > 0 and row["compression_ratio"] >= 1
    (probe,) = result["probe"]
    assert probe["model"]["label"] == "tiny" and probe["session_clock"] == "HostClock"
    assert set(probe["step_ms"]) == set(probe_overhead.VARIANTS)
    assert all(len(v) == probe["rounds"] for v in probe["step_ms_per_round"].values())
    for key in ("probe_overhead_pct", "session_vs_ddp_pct", "hook_vs_ddp_pct", "probe_overhead_ms"):
        assert isinstance(probe[key], float)
    assert probe["target_pct"] == 1.0 and isinstance(probe["meets_target"], bool)
    assert probe["session_report"]["steps"] == probe["rounds"] * (probe["warmup_steps"] + probe["steps_per_round"])
    assert isinstance(result["elapsed_s"], float) and result["started_utc"].endswith("Z")  # recorded, not judged


def test_the_test_phase_names_failures_and_counts_skips(tmp_path):
    (tmp_path / "test_sample.py").write_text(
        "import pytest\n"
        "pytestmark = pytest.mark.cuda\n"
        "def test_passes():\n    assert True\n"
        "def test_fails():\n    assert 1 == 2, 'one is not two'\n"
        "@pytest.mark.skip(reason='no device here')\n"
        "def test_skipped():\n    pass\n")
    (tmp_path / "test_other.py").write_text("def test_not_cuda():\n    assert True\n")  # deselected by -m cuda
    lines: list[str] = []
    result = gpu.run_cuda_tests(tmp_path, 120, lines.append, paths=["test_sample.py", "test_other.py"], cwd=tmp_path)
    assert (result["passed"], result["failed"], result["errors"], result["skipped"]) == (1, 1, 0, 1)
    assert result["exit_code"] == 1 and not result["timed_out"]
    (failure,) = result["failures"]
    assert "test_fails" in failure and "one is not two" in failure
    assert result["skip_reasons"] == ["no device here"]
    assert any("FAILED" in line and "test_fails" in line for line in lines)
    assert (tmp_path / "cuda_tests.log").read_text()


def test_the_cuda_tests_are_found_where_the_check_looks():
    paths = gpu.test_paths()
    assert paths[0] == "tests/cuda" and all((ROOT / p).exists() for p in paths)
    assert not any(p.startswith("tests/cuda/") for p in paths)  # the directory is named once
    modules = sorted(p.name for p in (ROOT / "tests" / "cuda").glob("test_*.py"))
    assert {"test_codecs_cuda.py", "test_probe_cuda.py", "test_session_cuda.py", "test_powersgd_cuda.py",
            "test_checkpoint_cuda.py"} <= set(modules)


@pytest.mark.parametrize(("argv", "says"), [
    (["--dry-run", "--sizes", "huge"], "--sizes='huge': allowed are"),
    (["--dry-run", "--codec-mbytes", "-1"], "--codec-mbytes=-1.0 must be in"),
    (["--dry-run", "--probe-steps", "0"], "--probe-steps=0 must be positive"),
])
def test_bad_input_is_one_line_and_exit_2(argv, says, tmp_path, capsys):
    assert gpu.main([*argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1
    assert not (tmp_path / gpu.RESULT).exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_without_a_device_the_real_check_says_so_in_one_line(tmp_path, capsys):
    assert gpu.main(["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "no CUDA device" in err and "--dry-run" in err and len(err.splitlines()) == 1


def test_a_failing_bench_is_kept_as_an_error_not_lost():
    lines: list[str] = []
    assert gpu._phase(lambda: {"figure": 1.0}, lines.append) == {"figure": 1.0}
    assert gpu._phase(lambda: {"x": 1 / 0}, lines.append) == {"error": "ZeroDivisionError: division by zero"}
    assert lines == ["  FAILED ZeroDivisionError: division by zero"]
