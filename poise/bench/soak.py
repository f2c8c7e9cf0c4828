"""``poise bench faults --minutes M --fault-every-s S``: the time soak. One long ``poise train``
job hit by faults drawn at a rate for a given time, against the same job without faults.

The job is :mod:`poise.bench.faults`' (digits on 2 workers, a checkpoint every 4 steps, every
rank's samples recorded) with as many epochs as it can reach and many launcher restarts. Its
faults come at the times of a Poisson process of mean interval ``S`` seconds drawn from
``--seed`` (:func:`fault_schedule`), each a ``kill`` (SIGKILL of a random rank's worker) or a
``stop`` (SIGSTOP of it) from ``--kinds``: the launcher notices, restarts the workers and the
job resumes from its newest good checkpoint by itself. After ``M`` minutes the job is stopped
(SIGTERM, as a scheduler would) and its sample record is read; the fault-free reference is the
same job run for ``--reference-minutes`` (default ``min(M, 3)``) and stopped the same way, half
of it before the soak and half after: the machine's own speed drifts by 10 % and more over a
20-minute soak (a fault-free job of 9 ms steps, checkpointing every 4 steps, ran between 90 and
124 steps a second from one half-minute to the next), and a reference taken on one side of the
soak only measured that drift as much as the faults.

Reported (:func:`account`): ``samples_lost`` (over every epoch the job completed: the samples a
complete epoch trains, as the reference's first epoch counts them, less those trained in it),
``samples_duplicated`` (indices trained more than once in one epoch of the record, which a
resume cuts back to its checkpoint: any is a bug), ``hangs`` (the job made no step for
``--hang-s`` seconds: it is ended and resumed with ``--resume``), ``restarts`` (attempts the
launcher started after the first, as rank 0's log counts them), ``job_exits`` (the job stopped
with an error and was resumed by the bench), and throughput: samples in the final record per
second from the job's first step (startup excluded from both runs), against the reference's.
Target: 0 lost, 0 duplicated, 0 hangs, and at one fault a minute at least 90 % of the
fault-free throughput.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from poise.bench import faults
from poise.bench.faults import KINDS, Job, _job_flags
from poise.bench.harness import output_dir, require_positive, save_results, show_table
from poise.log import make_console

log = logging.getLogger(__name__)

SOAK_KINDS = ("kill", "stop")
# the job trains until stopped: more epochs than any soak reaches
_EPOCHS = 100_000
# no fault before the job has trained this long, seconds: it must have a checkpoint to go back to
_WARMUP_S = 15.0


@dataclass(frozen=True)
class Fault:
    """One fault of the soak: ``at_s`` seconds after the job's first step, ``kind``, on ``rank``."""

    at_s: float
    kind: str
    rank: int


def fault_schedule(duration_s: float, every_s: float, seed: int, kinds: list[str], ranks: int = 2,
                   warmup_s: float = _WARMUP_S) -> list[Fault]:
    """Faults at the times of a Poisson process of mean interval ``every_s`` seconds in
    ``[warmup_s, duration_s)``, kinds and ranks drawn uniformly, all from ``seed``."""
    rng = random.Random(seed)
    faults, at = [], warmup_s
    while True:
        at += rng.expovariate(1.0 / every_s)
        if at >= duration_s:
            return faults
        faults.append(Fault(at, rng.choice(kinds), rng.randrange(ranks)))


def read_record(directory: Path) -> dict[int, list[int]]:
    """Epoch -> sample indices of every rank's record in ``directory``; a line cut short by a
    killed process is skipped."""
    out: dict[int, list[int]] = {}
    for path in sorted(directory.glob("rank-*.jsonl")):
        for line in path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError, KeyError, TypeError):
                entry = json.loads(line)
                out.setdefault(int(entry["epoch"]), []).extend(int(i) for i in entry["indices"])
    return out


def account(record: dict[int, list[int]], per_epoch: int) -> dict[str, int]:
    """``samples`` (in the record), ``complete_epochs`` (all but the newest), ``samples_lost``
    (over the complete epochs, ``per_epoch`` each, less the distinct ones trained) and
    ``samples_duplicated`` (indices trained more than once in one epoch, over every epoch)."""
    if not record:
        return {"samples": 0, "complete_epochs": 0, "samples_lost": 0, "samples_duplicated": 0}
    newest = max(record)
    complete = list(range(newest))
    lost = sum(max(0, per_epoch - len(set(record.get(e, [])))) for e in complete)
    duplicated = sum(len(v) - len(set(v)) for v in record.values())
    return {"samples": sum(len(v) for v in record.values()), "complete_epochs": len(complete),
            "samples_lost": lost, "samples_duplicated": duplicated}


def _progress(out: Path) -> int:
    """The size in bytes of rank 0's sample record: it changes at every step (a resume cuts the
    record back, so it can go down). Only its size is read: counting its lines five times a
    second read the whole record each time, which grew to tens of MB in a 20-minute soak and took
    CPU from the job being measured (its fault-free stretches slowed from 111 to about 90
    steps/s over the run)."""
    try:
        return (out / "samples" / "rank-00000.jsonl").stat().st_size
    except OSError:
        return 0


def run_for(args: argparse.Namespace, out: Path, minutes: float, faults: list[Fault]) -> dict[str, Any]:
    """Run the soak job into ``out`` for ``minutes`` from its first step, injecting ``faults``;
    its counts (see the module doc) and ``first_step_s``/``trained_s`` (seconds)."""
    from poise.launch.processes import end_tree

    flags = [*_job_flags(args, out), "--max-restarts", "1000"]
    flags[flags.index("--epochs") + 1] = str(_EPOCHS)
    log_path = out.parent / f"{out.name}.log"
    job = Job(flags, log_path)
    counts = {"faults": 0, "faults_missed": 0, "hangs": 0, "job_exits": 0}
    begin, first, last_change, last_seen = time.monotonic(), None, time.monotonic(), -1
    pending = list(faults)
    while True:
        now = time.monotonic()
        done = _progress(out)
        if done != last_seen:
            last_seen, last_change = done, now
        if first is None and done > 0:
            first = now
        if first is not None and now - first >= minutes * 60:
            break
        if first is None and now - begin > args.run_timeout_s:
            raise RuntimeError(f"the soak job made no step in {args.run_timeout_s:g} s (see {log_path})")
        code = job.proc.poll()
        if code is not None or now - last_change > args.hang_s:
            if code is None:  # no step for hang_s seconds: a hang; end it and go on from its checkpoints
                counts["hangs"] += 1
                log.warning("soak: no step for %.0f s: ending the job and resuming it", args.hang_s)
                end_tree(job.proc)
            else:
                counts["job_exits"] += 1
                log.warning("soak: the job exited with %s: resuming it", code)
            job.wait(float("inf"))  # it has exited: this closes its log
            job = Job([*flags, "--resume"], log_path)
            last_change = time.monotonic()
        while pending and first is not None and now - first >= pending[0].at_s:
            fault = pending.pop(0)
            pid = job.worker(fault.rank)
            if pid is None:
                counts["faults_missed"] += 1  # between attempts: no worker to hit
                continue
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL if fault.kind == "kill" else signal.SIGSTOP)
            counts["faults"] += 1
        time.sleep(0.2)
    trained_s = time.monotonic() - (first or begin)
    hung = stop(job, grace_s=60.0)
    # rank 0 logs "training <task>: ..." once per attempt; the bench itself started 1 + exits + hangs jobs
    attempts = log_path.read_text(errors="replace").count("INFO poise.train.loop: training ")
    restarts = max(0, attempts - 1 - counts["job_exits"] - counts["hangs"])
    return {**counts, "restarts": restarts, "trained_s": trained_s,
            "stop_hung": hung, "record": read_record(out / "samples")}


def stop(job: Any, grace_s: float) -> bool:
    """SIGTERM the job's command (it stops its workers, one line, exit 143) and wait up to
    ``grace_s`` seconds; past that, end its whole tree. True when it had to be ended."""
    from poise.launch.processes import end_tree

    if job.proc.poll() is None:
        job.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while job.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    hung = job.proc.poll() is None
    if hung:
        end_tree(job.proc)
    job.wait(float("inf"))  # closes its log
    return hung


def run_bench(args: argparse.Namespace) -> int:
    """``poise bench faults``: the soak when ``--minutes`` is given, else the fault runs."""
    if args.minutes < 0 or args.minutes != args.minutes:
        raise ValueError(f"--minutes={args.minutes} must be positive (or 0: no soak)")
    if args.minutes == 0:
        return faults.run(args)
    require_positive(args, "runs", "timeout_s_collective", "run_timeout_s")
    given = [k.strip() for k in args.kinds.split(",") if k.strip()]
    return run(args, list(SOAK_KINDS) if args.kinds == ",".join(KINDS) else given)


def _row(name: str, result: dict[str, Any], per_epoch: int) -> dict[str, Any]:
    row = {"run": name, **{k: v for k, v in result.items() if k != "record"}, **account(result["record"], per_epoch)}
    row["samples_per_s"] = row["samples"] / result["trained_s"] if result["trained_s"] > 0 else 0.0
    return row


def run(args: argparse.Namespace, kinds: list[str]) -> int:
    """``poise bench faults --minutes``: half the reference, the soak, the other half; a table and
    ``faults-soak.json``."""
    unknown = sorted(set(kinds) - set(SOAK_KINDS))
    if unknown:
        raise ValueError(f"--kinds={','.join(kinds)}: the soak draws from {', '.join(SOAK_KINDS)} only")
    if not args.fault_every_s > 0 or not args.hang_s > 0:
        raise ValueError(f"--fault-every-s={args.fault_every_s} and --hang-s={args.hang_s} must be positive")
    out = output_dir(args.out, "faults-soak")
    ref_minutes = args.reference_minutes if args.reference_minutes > 0 else min(args.minutes, 3.0)
    before = run_for(args, out / "reference-before", ref_minutes / 2, [])
    ref_record = before["record"]
    per_epoch = len(set(ref_record.get(0, [])))
    if not per_epoch or 1 not in ref_record:
        raise RuntimeError(f"the reference completed no epoch in {ref_minutes / 2:g} minutes: give --reference-minutes")
    faults = fault_schedule(args.minutes * 60, args.fault_every_s, args.seed, kinds)
    soak = run_for(args, out / "soak", args.minutes, faults)
    after = run_for(args, out / "reference-after", ref_minutes / 2, [])
    rows = [_row(name, result, per_epoch)
            for name, result in (("reference-before", before), ("reference-after", after), ("soak", soak))]
    reference = {"run": "reference", **{key: rows[0][key] + rows[1][key] for key in ("trained_s", "samples")}}
    reference["samples_per_s"] = reference["samples"] / reference["trained_s"] if reference["trained_s"] > 0 else 0.0
    soak_row = rows[2]
    soak_row["throughput_vs_reference"] = soak_row["samples_per_s"] / reference["samples_per_s"] \
        if reference["samples_per_s"] else 0.0
    rows.insert(2, reference)
    met = (not soak_row["samples_lost"] and not soak_row["samples_duplicated"] and not soak_row["hangs"]
           and not soak_row["stop_hung"] and soak_row["throughput_vs_reference"] >= 0.9)
    show_table(
        f"poise bench faults: soak of {args.minutes:g} min, a fault every {args.fault_every_s:g} s on average "
        f"({', '.join(kinds)}), seed {args.seed}",
        rows,
        [("run", "run", str), ("trained_s", "s", lambda v: f"{v:.0f}"), ("faults", "faults", str),
         ("faults_missed", "missed", str), ("restarts", "restarts", str), ("job_exits", "exits", str),
         ("hangs", "hangs", str), ("complete_epochs", "epochs", str), ("samples_lost", "lost", str),
         ("samples_duplicated", "dup", str), ("samples_per_s", "samples/s", lambda v: f"{v:.1f}"),
         ("throughput_vs_reference", "vs fault-free", lambda v: f"{100 * v:.0f}%")],
    )
    make_console().print(f"target: 0 lost, 0 duplicated, 0 hangs, >= 90% of fault-free throughput: "
                         f"{'met' if met else 'NOT met'}")
    save_results(out, "faults-soak", {
        "seed": args.seed, "minutes": args.minutes, "reference_minutes": ref_minutes,
        "fault_every_s": args.fault_every_s, "kinds": kinds, "faults": [asdict(f) for f in faults],
        "rows": rows, "met": met, "per_epoch": per_epoch,
    })
    return 0 if met else 1
