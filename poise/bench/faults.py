"""``poise bench faults``: the fault soak. Many real ``poise train`` jobs, each hit by one fault
drawn at random from ``--seed``, each checked against an uninterrupted run of the same job.

The job: digits on 2 workers, 2 epochs of 22 steps, a checkpoint every 4 steps, up to 2
launcher restarts, collectives and stores timing out after ``--timeout-s-collective`` seconds,
every rank's samples recorded. The faults:

- ``kill``: SIGKILL of a random rank's worker once the job has done a random number of
  steps (from outside, at any point of a step or a save); the launcher restarts the job.
- ``stop``: SIGSTOP of a random rank's worker (a peer that stops responding): its peers'
  collectives time out, the launcher ends the attempt and restarts it.
- ``bitflip``, ``truncate``, ``manifest``: the job is killed (no restarts) at a random step,
  its newest checkpoint is damaged (a flipped bit in ``model.pt``, ``optim.pt`` cut in half,
  a manifest that is valid JSON but ``[]``), and ``poise train --resume`` continues it. Killed
  before its second checkpoint, nothing good is left: the resume must fail in one line.
- ``disk_full``: the checkpoint directory is a tmpfs too small for the saves that retention
  keeps (root only): the job must stop with a one-line error, and after the tmpfs is grown,
  ``--resume`` continues it.
- ``node``: an emulated cluster of 2 nodes x 1 worker (root, ``ip``, ``tc``), one node killed
  whole (every process in its namespace): the job stops with a one-line error; ``--resume``
  on a new cluster continues it.

Per run: ``finished``; ``samples_lost`` and ``samples_duplicated`` (over the epochs: indices of
the uninterrupted run missing, and indices trained more than once in one epoch);
``params_match`` (the final model equals the uninterrupted run's, to float32 reduction-order
rounding: rtol 1e-5, atol 1e-6); ``hung`` (a job ran past ``--run-timeout-s`` and was ended);
``error`` (the one line a job that could not recover by itself stopped with), ``wall_s``, and
``outcome``: ``recovered``, ``error`` (nothing could be recovered and the job said so in one
line) or ``FAILED``. The target: no ``FAILED``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import random
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from poise.bench.harness import output_dir, require_positive, save_results, show_table
from poise.launch.command import start as start_command
from poise.launch.processes import end_tree, workers
from poise.log import make_console

log = logging.getLogger(__name__)

HELP = "fault soak: random kills, stops, corrupt checkpoints, full disks, lost nodes; nothing lost or hung"
KINDS = ("kill", "stop", "bitflip", "truncate", "manifest", "disk_full", "node")
STEPS = 44  # 2 epochs of 22 steps (1437 samples, 2 x 32 per step)
EVERY = 4
_TMPFS_MIN_BYTES = 64 << 10


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runs", type=int, default=50, help="faulted runs")
    parser.add_argument("--seed", type=int, default=0, help="seed of the faults drawn")
    parser.add_argument("--kinds", default=",".join(KINDS),
                        help=f"faults to draw from, comma-separated: {', '.join(KINDS)} (those this machine "
                             "cannot do, e.g. without root, are left out with a note)")
    parser.add_argument("--timeout-s-collective", type=float, default=8.0,
                        help="the jobs' dist.timeout_s: how soon a stopped peer is noticed, seconds")
    parser.add_argument("--run-timeout-s", type=float, default=240.0, help="limit per job; past it: hung")
    parser.add_argument("--out", default="", help="output directory (default runs/bench-faults-<timestamp>)")
    parser.add_argument("--minutes", type=float, default=0.0,
                        help="soak instead: one job for this many minutes with faults drawn at --fault-every-s "
                             "(kinds kill, stop), against the fault-free job (poise.bench.soak)")
    parser.add_argument("--fault-every-s", type=float, default=60.0,
                        help="soak: mean seconds between faults (a Poisson process drawn from --seed)")
    parser.add_argument("--reference-minutes", type=float, default=0.0,
                        help="soak: minutes of the fault-free reference (default: min(--minutes, 3))")
    parser.add_argument("--hang-s", type=float, default=120.0,
                        help="soak: a job without a step for this many seconds is a hang (ended and resumed)")


def _job_flags(args: argparse.Namespace, out: Path) -> list[str]:
    return ["train", "--task", "digits", "--nproc", "2", "--epochs", "2", "--batch-size", "32",
            "--checkpoint-every", str(EVERY), "--diagnostics.record_samples", "true",
            "--dist.timeout_s", f"{args.timeout_s_collective:g}", "--diagnostics.progress", "false",
            "--diagnostics.plot", "false", "--out", str(out)]


class Job:
    """One ``poise train`` command in a session of its own (:func:`poise.launch.command.start`),
    its output appended to ``log_path``."""

    def __init__(self, flags: list[str], log_path: Path) -> None:
        self.log_path = log_path
        self.proc = start_command(flags, log_path, append=True)
        self.started = time.monotonic()

    def wait(self, timeout_s: float, until: Callable[[], bool] | None = None) -> tuple[int | None, bool]:
        """Wait for the job (or for ``until()``, polled); ``(exit code or None, hung)``."""
        while self.proc.poll() is None:
            if until is not None and until():
                return None, False
            if time.monotonic() - self.started > timeout_s:
                end_tree(self.proc)
                return None, True
            time.sleep(0.1)
        return self.proc.returncode, False

    def worker(self, rank: int) -> int | None:
        """The pid of the worker process of global rank ``rank`` (None when there is none)."""
        return next((pid for pid, r in workers(self.proc.pid).items() if r == rank), None)



def _steps_done(out: Path) -> int:
    path = out / "samples" / "rank-00000.jsonl"
    try:
        return path.read_text().count("\n")
    except OSError:
        return 0


def _final_model(out: Path) -> dict[str, Any] | None:
    from poise.checkpoint import layout

    found = layout.newest_good(out / "checkpoints") if (out / "checkpoints").is_dir() else None
    if found is None or found[1]["step"] != STEPS:
        return None
    return layout.load_tensors(out / "checkpoints", found[1], "model")


def compare(reference: Path, out: Path) -> dict[str, Any]:
    """``samples_lost``, ``samples_duplicated`` and ``params_match`` of run ``out`` against ``reference``."""
    import torch

    from poise.train.samples import read_samples

    want, got = read_samples(reference / "samples"), read_samples(out / "samples") if (out / "samples").is_dir() \
        else {}
    lost = sum(len(set(want[e]) - set(got.get(e, []))) for e in want)
    duplicated = sum(len(v) - len(set(v)) for v in got.values())
    a, b = _final_model(reference), _final_model(out)
    match = a is not None and b is not None and a.keys() == b.keys() and all(
        torch.allclose(b[k], a[k], rtol=1e-5, atol=1e-6) for k in a)
    return {"samples_lost": lost, "samples_duplicated": duplicated, "params_match": bool(match)}


def _signal_rank_at(job: Job, out: Path, rank: int, step: int, sig: int, timeout_s: float) -> tuple[int | None, bool]:
    """Wait until the job has done ``step`` steps, send ``sig`` to rank ``rank``'s worker, then wait for the job."""
    code, hung = job.wait(timeout_s, until=lambda: _steps_done(out) >= step)
    if code is not None or hung:
        return code, hung
    pid = job.worker(rank)
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    return job.wait(timeout_s)


def _damage(root: Path, kind: str) -> str:
    """Damage the newest checkpoint under ``root`` as ``kind`` says; its name."""
    from poise.checkpoint import layout

    newest = layout.list_checkpoints(root)[0][1]
    if kind == "bitflip":
        data = bytearray((newest / "model.pt").read_bytes())
        data[len(data) // 2] ^= 0x10
        (newest / "model.pt").write_bytes(bytes(data))
    elif kind == "truncate":
        data = (newest / "optim.pt").read_bytes()
        (newest / "optim.pt").write_bytes(data[: len(data) // 2])
    else:
        (newest / layout.MANIFEST).write_text("[]")
    return newest.name


@contextlib.contextmanager
def _tmpfs(path: Path, size_bytes: int):
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)], check=True,
                   capture_output=True, timeout=30)
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


def _can_mount() -> str:
    """'' when this process can mount a tmpfs, else why not."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return "needs root and mount"
    return ""


def _can_cluster() -> str:
    try:
        from poise.cluster import net

        net.require_support()
    except ValueError as exc:
        return str(exc)
    return ""


def one_run(index: int, kind: str, rng: random.Random, args: argparse.Namespace, out: Path,
            reference: Path, checkpoint_bytes: int) -> dict[str, Any]:
    """Run job ``index`` with fault ``kind`` (parameters drawn from ``rng``); its row."""
    run_dir = out / f"run-{index:03d}-{kind}"
    job_out = run_dir / "job"
    run_dir.mkdir(parents=True)
    flags = _job_flags(args, job_out)
    log_path = run_dir / "train.log"
    limit = args.run_timeout_s
    rank, step = rng.randrange(2), rng.randrange(2, STEPS - 2)
    row: dict[str, Any] = {"run": index, "fault": kind, "rank": rank, "step": step, "error": ""}
    start = time.monotonic()
    hung = False
    if kind in ("kill", "stop"):
        sig = signal.SIGKILL if kind == "kill" else signal.SIGSTOP
        code, hung = _signal_rank_at(Job([*flags, "--max-restarts", "2"], log_path), job_out, rank, step, sig, limit)
    elif kind in ("bitflip", "truncate", "manifest"):
        first = Job([*flags, "--fail-at", f"{rank}:{step}"], log_path)
        code, hung = first.wait(limit)
        if not hung:
            found = checkpoint_count(job_out / "checkpoints")
            if found:
                row["damaged"] = _damage(job_out / "checkpoints", kind)
            # killed before its second checkpoint: nothing good is left to resume from
            row["recoverable"] = found >= 2
            code, hung = Job([*flags, "--resume"], log_path).wait(limit)
    elif kind == "disk_full":
        mount = run_dir / "ckpt"
        # room for two checkpoints and a bit: the third save (retention keeps 3) runs out of space
        size = max(_TMPFS_MIN_BYTES, int(2.5 * checkpoint_bytes))
        with _tmpfs(mount, size):
            disk_flags = [*flags, "--checkpoint-dir", str(mount), "--max-restarts", "1"]
            first = Job(disk_flags, log_path)
            code, hung = first.wait(limit)
            row["error"] = error_line(log_path) if code else ""
            if not hung and code != 0:
                subprocess.run(["mount", "-o", f"remount,size={64 << 20}", str(mount)], check=True,
                               capture_output=True, timeout=30)
                code, hung = Job([*disk_flags, "--resume"], log_path).wait(limit)
            if not hung:  # compare() reads the checkpoints before the tmpfs goes
                shutil.copytree(mount, job_out / "checkpoints", dirs_exist_ok=True,
                                ignore=shutil.ignore_patterns(".lock", ".partial-*"))
    else:  # node
        node_flags = [f if f != "--nproc" else "--cluster" for f in flags]
        node_flags[node_flags.index("--cluster") + 1] = "2:1"
        first = Job([*node_flags, "--max-restarts", "1"], log_path)
        code, hung = first.wait(limit, until=lambda: _steps_done(job_out) >= step)
        if code is None and not hung:
            _kill_node(first, node=1)
            code, hung = first.wait(limit)
        row["error"] = error_line(log_path) if code else ""
        if not hung and code != 0:
            code, hung = Job([*node_flags, "--resume"], log_path).wait(limit)
    row.update({"finished": code == 0 and not hung, "hung": hung, "wall_s": time.monotonic() - start})
    row.update(compare(reference, job_out))
    if not row["finished"]:
        row["error"] = row["error"] or error_line(log_path)
    row["outcome"] = outcome(row)
    return row


def checkpoint_count(root: Path) -> int:
    from poise.checkpoint import layout

    return len(layout.list_checkpoints(root))


def outcome(row: dict[str, Any]) -> str:
    """``recovered`` (finished, nothing lost or twice, equal parameters), ``error`` (nothing could
    be recovered and the job said so in one line), else ``FAILED``: what the target counts."""
    if row["hung"]:
        return "FAILED"
    if row["finished"] and not row["samples_lost"] and not row["samples_duplicated"] and row["params_match"]:
        return "recovered"
    if not row["finished"] and not row.get("recoverable", True) and row["error"] and "\n" not in row["error"]:
        return "error"
    return "FAILED"


def error_line(log_path: Path) -> str:
    """The last one-line error a ``poise`` command wrote to ``log_path`` ('' when none)."""
    lines = [line for line in log_path.read_text(errors="replace").splitlines() if line.startswith("poise ")]
    return lines[-1] if lines else ""


def job_namespaces(job_pid: int, node: int, namespaces: list[str]) -> list[str]:
    """Of ``namespaces``, node ``node``'s of the cluster that the ``poise train`` process
    ``job_pid`` brought up for itself (``job<pid>_<token>``, :mod:`poise.launch.cluster_job`):
    never another job's or another bench's."""
    from poise.cluster.net import NS_PREFIX

    prefix, suffix = f"{NS_PREFIX}job{job_pid}_", f"-n{node}"
    return [ns for ns in namespaces if ns.startswith(prefix) and ns.endswith(suffix)
            and ns[len(prefix):-len(suffix)].isalnum()]


def _kill_node(job: Job, node: int) -> None:
    """SIGKILL every process in the namespace of node ``node`` of the cluster ``job`` brought up
    (its agent and workers): a lost machine."""
    from poise.cluster import net

    for ns in job_namespaces(job.proc.pid, node, net.list_namespaces()):
        for pid in net.namespace_pids(ns):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def run(args: argparse.Namespace) -> int:
    require_positive(args, "runs", "timeout_s_collective", "run_timeout_s")
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown or not kinds:
        raise ValueError(f"--kinds={args.kinds!r}: {', '.join(unknown) or 'none given'}; "
                         f"allowed are {', '.join(KINDS)}")
    console = make_console()
    for kind, why in (("disk_full", _can_mount()), ("node", _can_cluster() if "node" in kinds else "")):
        if kind in kinds and why:
            console.print(f"leaving out {kind}: {why}")
            kinds.remove(kind)
    if not kinds:
        raise ValueError("none of --kinds can run on this machine")
    out = output_dir(args.out, "faults")
    begin = time.monotonic()
    reference = out / "reference"
    code, _ = Job(_job_flags(args, reference), out / "reference.log").wait(args.run_timeout_s)
    if code != 0:
        raise RuntimeError(f"the uninterrupted reference run failed (see {out / 'reference.log'})")
    from poise.checkpoint import layout

    newest = layout.list_checkpoints(reference / "checkpoints")[0][1]
    checkpoint_bytes = sum(f.stat().st_size for f in newest.iterdir())
    rng = random.Random(args.seed)
    rows = []
    for index in range(args.runs):
        kind = rng.choice(kinds)
        row = one_run(index, kind, rng, args, out, reference, checkpoint_bytes)
        rows.append(row)
        log.info("run %d %s: finished %s, lost %d, duplicated %d, params %s%s", index, kind, row["finished"],
                 row["samples_lost"], row["samples_duplicated"], row["params_match"],
                 f", error: {row['error']}" if row["error"] else "")
    wall_s = time.monotonic() - begin
    yes = lambda v: "yes" if v else "NO"  # noqa: E731
    show_table(
        f"poise bench faults: {len(rows)} runs, seed {args.seed}, digits on 2 workers, {STEPS} steps",
        rows,
        [("run", "run", str), ("fault", "fault", str), ("rank", "rank", str), ("step", "step", str),
         ("finished", "finished", yes), ("samples_lost", "lost", str), ("samples_duplicated", "dup", str),
         ("params_match", "params", yes), ("hung", "hung", lambda v: "HUNG" if v else "no"),
         ("outcome", "outcome", str), ("wall_s", "s", lambda v: f"{v:.0f}"),
         ("error", "error (first attempt)", lambda v: v[:70])],
    )
    ok = [r for r in rows if r["outcome"] != "FAILED"]
    console.print(f"target: every run recovers (finished, nothing lost or duplicated, equal parameters) or, with "
                  f"nothing to recover, fails in one line; nothing hangs: {len(ok)}/{len(rows)} "
                  f"({sum(r['outcome'] == 'error' for r in rows)} one-line errors; {wall_s:.0f} s)")
    save_results(out, "faults", {"seed": args.seed, "kinds": kinds, "runs": rows, "wall_s": wall_s,
                                 "met": len(ok) == len(rows), "job": _job_flags(args, Path("OUT"))})
    return 0 if len(ok) == len(rows) else 1
