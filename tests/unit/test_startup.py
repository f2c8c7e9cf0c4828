"""What start-up imports (issue 58): ``poise train`` parses and checks its flags and config
before torch, so bad input is refused at once, and a DDP job's worker imports neither FSDP nor
the packages only some runs use. Each check runs in a fresh interpreter: what a process has
imported is process-wide."""

from __future__ import annotations

import json
import subprocess
import sys

import poise

TIMEOUT_S = 180  # one interpreter that imports torch, on a loaded 2-core machine


def _modules_after(code: str) -> tuple[set[str], str]:
    """The modules a fresh interpreter holds after running ``code``, and what ``code`` printed."""
    script = f"{code}\nimport json as _json, sys as _sys\nprint(_json.dumps(sorted(_sys.modules)))"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=TIMEOUT_S,
                          check=True)
    *printed, modules = done.stdout.strip().splitlines()
    return set(json.loads(modules)), "\n".join(printed)


def test_import_poise_and_the_train_command_parser_import_no_torch():
    modules, _ = _modules_after(
        "import poise\n"
        "from poise.cli import build_parser\n"
        "build_parser('train').parse_args(['train', '--steps', '3', '--codec', 'fp16'])")
    assert "torch" not in modules and "numpy" not in modules
    assert not {m.split(".")[1] for m in modules if m.startswith("poise.")} & {"bench", "run", "comm", "launch"}


def test_a_bad_setting_is_refused_with_exit_2_before_torch(tmp_path):
    modules, printed = _modules_after(
        "import contextlib, io\n"
        "from poise.cli import main\n"
        "with contextlib.redirect_stderr(io.StringIO()) as err:\n"
        f"    code = main(['train', '--steps', '-1', '--out', {str(tmp_path / 'out')!r}])\n"
        "print(code, err.getvalue().strip())")
    assert printed == "2 poise train: error: train.steps=-1 is invalid: it must be a positive number"
    assert "torch" not in modules


def test_the_help_still_lists_the_names_a_registry_allows():
    from poise.cli import build_parser

    train = build_parser("train")._subparsers._group_actions[0].choices["train"]  # type: ignore[union-attr]
    text = " ".join(train.format_help().split())
    assert "allowed: none, fp16, bf16" in text and "(= --comm.codec)" in text


def test_a_ddp_worker_imports_no_fsdp_and_no_optional_package():
    modules, _ = _modules_after("import poise.train.worker")
    unused = {"torch.distributed.fsdp", "torch.distributed.tensor", "torch.distributed.checkpoint", "scipy",
              "matplotlib", "sklearn", "numba", "rich", "prometheus_client", "poise.sync.sharded",
              "poise.checkpoint.sharded", "poise.train.shard"}
    assert not unused & modules


def test_the_lazy_names_are_the_modules_own():
    from poise.run.data import Data
    from poise.run.session import DeadlineStep, Session, Step
    from poise.sync.sharded import Sharded

    assert (poise.Session, poise.Data, poise.Step, poise.DeadlineStep) == (Session, Data, Step, DeadlineStep)
    assert poise.sync.Sharded is Sharded and poise.balance.make_sampler is not None
    assert {"Session", "Data", "balance"} <= set(dir(poise))
