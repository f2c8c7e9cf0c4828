"""Diagnosis rules: where a run's time went, and which setting to change.

Each rule is a small pure function of a :class:`~poise.diagnostics.run.RunData` (the gathered
per-rank per-step table and report.json) returning one :class:`Finding`: a verdict (``ok``,
``warn``, ``problem``), the figures it used, the threshold it applied, the setting or command
to try, and the rank to blame where there is one. They are listed in :data:`RULES`, one dict;
``poise diagnose run`` evaluates them all.

The rules follow a troubleshooting table of distributed training (symptom, likely cause,
what to look at), restated in what poise measures:

- some ranks' utilisation swings with the work they are handed -> data skew (:func:`data_skew`);
- one rank slower per unit of work than the best -> a straggler, scored relative to the best
  rank in 0..1 as NVIDIA's resiliency extension scores ranks (:func:`straggler`);
- every rank waiting for its data together -> a shared input-pipeline bottleneck
  (:func:`input_pipeline`);
- communication exposed beyond waiting for the slowest rank -> network or topology
  (:func:`communication`), against the line rate when it is known;
- shares reversing from re-plan to re-plan -> dynamic balancing too aggressive (:func:`replan_oscillation`);
- ranks whose training thread is off the CPU for part of its own compute -> more runnable
  threads than cores, or a CPU quota or other processes on one rank's host (:func:`cpu_contention`);
- and non-finite skipped steps, checkpoint stalls and padding waste.

Thresholds are module constants (shares of time are 0..1). They are set so that a clean run
on a shared machine reports nothing, and each injected cause of ``poise bench diagnose`` is
found; that bench is what keeps them honest.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from poise.balance.metrics import balance, idle_fraction
from poise.diagnostics.run import RunData
from poise.diagnostics.timeline import column, cpus_busy, elapsed_s, on_cpu_share

VERDICTS = ("ok", "warn", "problem")

STRAGGLER_WARN, STRAGGLER_PROBLEM = 0.85, 0.75  # score (rank speed / best rank's) below which
SKEW_IDLE_WARN, SKEW_IDLE_PROBLEM = 0.08, 0.15  # idle share of rank-seconds
SKEW_WORK_SPREAD = 0.05  # mean per-step 1 - balance of the work (padded tokens) handed out
SKEW_CORRELATION = 0.5  # compute deviations must follow work deviations this closely
DATA_WARN, DATA_PROBLEM = 0.10, 0.20  # share of step time loading data, on every rank
COMM_WARN, COMM_PROBLEM = 0.15, 0.30  # share of step time in exposed communication beyond idle
LINK_SATURATED = 0.7  # busbw at this share of the line rate or more: the link is the limit
OSCILLATION_REPLANS = 4  # re-plans with moves needed before judging oscillation
OSCILLATION_WARN, OSCILLATION_PROBLEM = 0.3, 0.4  # share of share moves that reverse the previous
OSCILLATION_MOVE = 0.03  # mean relative share change per re-plan
UNSTABLE_CV = 0.5  # step-time coefficient of variation flagged without re-planning
NONFINITE_PROBLEM = 0.01  # share of steps skipped
STALL_WARN, STALL_PROBLEM = 0.02, 0.05  # checkpoint stall share of training time
PADDING_WARN, PADDING_PROBLEM = 0.25, 0.5  # padded tokens per real token, minus 1
ON_CPU_WARN, ON_CPU_PROBLEM = 0.8, 0.6  # share of its compute's wall time the training thread was on a CPU


@dataclass(frozen=True)
class Finding:
    """One rule's answer. ``evidence`` maps figure names to the values used (shares 0..1,
    seconds, bytes, as named); ``threshold`` says in words what was compared to what."""

    rule: str
    verdict: str
    summary: str
    evidence: dict[str, Any] = field(default_factory=dict)
    threshold: str = ""
    advice: str = ""
    rank: int | None = None

    def __post_init__(self) -> None:
        assert self.verdict in VERDICTS, self.verdict

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _level(value: float, warn: float, problem: float, *, below: bool = False) -> str:
    """``problem``/``warn``/``ok`` for ``value`` against the two thresholds (``below``: low is bad)."""
    if below:
        return "problem" if value < problem else "warn" if value < warn else "ok"
    return "problem" if value >= problem else "warn" if value >= warn else "ok"


def _r(value: float, digits: int = 3) -> float:
    return round(float(value), digits)


def _work(table: np.ndarray) -> np.ndarray:
    """``[ranks, steps]`` work handed to each rank: padded tokens (samples when none are recorded)."""
    padded = column(table, "padded_tokens")
    return padded if padded.sum() > 0 else column(table, "samples")


# -- the rules ------------------------------------------------------------------------------


def straggler(run: RunData) -> Finding:
    """Each rank's speed (work per second of its own compute) relative to the best rank's."""
    steady = run.steady
    compute = column(steady, "compute_s").sum(axis=1)
    work = _work(steady).sum(axis=1)
    speed = np.where(compute > 0, work / np.maximum(compute, 1e-12), 0.0)
    if run.world_size < 2 or speed.max() <= 0:
        return Finding("straggler", "ok", "one rank (or no work): nothing to compare")
    score = speed / speed.max()
    worst = int(np.argmin(score))
    verdict = _level(float(score[worst]), STRAGGLER_WARN, STRAGGLER_PROBLEM, below=True)
    evidence = {"score_per_rank": [_r(s) for s in score], "worst_rank": worst, "worst_score": _r(score[worst]),
                "median_compute_s_per_rank": [_r(v, 4) for v in np.median(column(steady, "compute_s"), axis=1)]}
    if run.balance_strategy == "dynamic":
        advice = (f"dynamic balancing already moves work off rank {worst} "
                  f"(balance {run.report.get('balance', 0):.2f}); if it stays slow, look at that host: "
                  "poise diagnose host, its CPU quota, clocks, other processes")
    else:
        advice = (f"--balance dynamic (Session(balance='dynamic')) re-plans shares from measured speeds so the "
                  f"other ranks stop waiting for rank {worst}; and look at that host: poise diagnose host, its CPU "
                  "quota, clocks, other processes")
    return Finding("straggler", verdict, f"rank {worst} runs at {score[worst]:.2f} of the best rank's speed",
                   evidence, f"problem under {STRAGGLER_PROBLEM}, warn under {STRAGGLER_WARN} (score in 0..1)",
                   advice if verdict != "ok" else "", worst if verdict != "ok" else None)


def data_skew(run: RunData) -> Finding:
    """Idle time that follows the work handed out: ranks with more (padded) tokens in a step
    compute longer and the others wait (unequal sample costs split by count)."""
    steady = run.steady
    compute, work = column(steady, "compute_s"), _work(steady)
    idle = idle_fraction(compute.T)
    spread = float(np.mean([1.0 - balance(row) for row in work.T])) if run.world_size > 1 else 0.0
    dc = (compute - compute.mean(axis=0, keepdims=True)).ravel()
    dw = (work - work.mean(axis=0, keepdims=True)).ravel()
    corr = float(np.corrcoef(dc, dw)[0, 1]) if dc.std() > 0 and dw.std() > 0 else 0.0
    slowest = compute.max(axis=0, keepdims=True)
    idle_by_rank = ((slowest - compute).sum(axis=1) / np.maximum(slowest.sum(), 1e-12)).tolist()
    evidence = {"idle_fraction": _r(idle), "work_spread": _r(spread), "compute_follows_work_correlation": _r(corr),
                "idle_share_by_rank": [_r(v) for v in idle_by_rank]}
    follows = corr >= SKEW_CORRELATION and spread >= SKEW_WORK_SPREAD
    verdict = _level(idle, SKEW_IDLE_WARN, SKEW_IDLE_PROBLEM) if follows else "ok"
    if run.balance_strategy == "static":
        advice = ("--balance cost (Session(balance='cost', lengths=...)): steps of equal cost, split by padded cost; "
                  "--balance dynamic also learns the ranks' speeds")
    else:
        advice = ("the cost model misjudges samples: --balance.cost_model attention with --balance.cost_alpha, or "
                  "your own cost_fn; --balance dynamic refits alpha from measured times")
    return Finding("data_skew", verdict,
                   f"{idle:.0%} of rank-seconds idle; compute follows the work handed out (r = {corr:.2f})" if follows
                   else f"{idle:.0%} of rank-seconds idle, not following the work handed out (r = {corr:.2f})",
                   evidence, f"problem at idle >= {SKEW_IDLE_PROBLEM}, warn >= {SKEW_IDLE_WARN}, when r >= "
                   f"{SKEW_CORRELATION} and work spread >= {SKEW_WORK_SPREAD}", advice if verdict != "ok" else "")


def input_pipeline(run: RunData) -> Finding:
    """Share of step time spent waiting for data: on every rank together (a shared input
    pipeline, storage or host CPU), or on one rank only."""
    steady = run.steady
    data, step = column(steady, "data_s"), column(steady, "step_s")
    share = data.sum(axis=1) / np.maximum(step.sum(axis=1), 1e-12)
    slow = data > 0.5 * np.maximum(np.median(step, axis=1, keepdims=True), 1e-12)
    together = float(slow.all(axis=0).mean())
    evidence = {"data_share_per_rank": [_r(s) for s in share], "median_data_s_per_rank":
                [_r(v, 4) for v in np.median(data, axis=1)], "steps_slow_on_every_rank": _r(together)}
    every = float(share.min())
    verdict = _level(every, DATA_WARN, DATA_PROBLEM)
    threshold = f"problem at a data share >= {DATA_PROBLEM} on every rank, warn >= {DATA_WARN}"
    if verdict != "ok":
        return Finding("input_pipeline", verdict, f"every rank spends >= {every:.0%} of its steps waiting for data",
                       evidence, threshold,
                       "load ahead of the step: DataLoader(num_workers=N, prefetch_factor=2, persistent_workers=True, "
                       "pin_memory=True) in your script; faster storage or pre-tokenised data; enough CPU threads "
                       "for loading beside the workers (poise diagnose host)")
    worst = int(np.argmax(share))
    if _level(float(share[worst]), DATA_WARN, DATA_PROBLEM) != "ok":
        return Finding("input_pipeline", "warn", f"rank {worst} alone spends {share[worst]:.0%} of its steps loading",
                       evidence, threshold, f"rank {worst}'s host loads data slowly: its storage, CPU, workers",
                       worst)
    return Finding("input_pipeline", "ok", f"data loading is {share.max():.0%} of step time at most", evidence,
                   threshold)


def communication(run: RunData) -> Finding:
    """Communication exposed beyond waiting for the slowest rank, with bucket overlap and the
    bus bandwidth it achieved (against the line rate when known)."""
    steady = run.steady
    compute, blocked, step = column(steady, "compute_s"), column(steady, "comm_wait_s"), column(steady, "step_s")
    idle = compute.max(axis=0, keepdims=True) - compute
    share = float(np.clip(blocked - idle, 0, None).sum() / max(step.sum(), 1e-12))
    busy, hidden = column(steady, "comm_busy_s"), column(steady, "comm_hidden_s")
    wire = float(np.median(column(steady, "wire_bytes")))
    raw = float(np.median(column(steady, "raw_bytes")))
    n = run.world_size
    busy_s = float(np.median(busy))
    busbw_bit_per_s = 8 * wire * 2 * (n - 1) / n / busy_s if busy_s > 0 and n > 1 else 0.0
    evidence: dict[str, Any] = {"exposed_comm_share": _r(share), "comm_overlap": _r(hidden.sum() / busy.sum())
                                if busy.sum() > 0 else 0.0, "wire_bytes_per_step": wire,
                                "compression_ratio": _r(raw / wire if wire else 1.0, 2),
                                "busbw_bit_per_s": _r(busbw_bit_per_s, 0)}
    ratio = None
    if run.link_bit_per_s:
        ratio = busbw_bit_per_s / run.link_bit_per_s
        evidence["link_bit_per_s"] = run.link_bit_per_s
        evidence["busbw_vs_line_rate"] = _r(ratio)
    verdict = _level(share, COMM_WARN, COMM_PROBLEM)
    advice = ""
    if verdict != "ok":
        codec = run.report.get("codec", "none")
        if ratio is not None and ratio >= LINK_SATURATED:
            where = f"the link is saturated ({ratio:.0%} of line rate): send fewer bytes"
        elif ratio is not None:
            where = (f"busbw is {ratio:.0%} of the line rate: contention or topology; measure it with "
                     "poise diagnose busbw --link RATE, check poise diagnose host")
        else:
            where = "measure the network with poise diagnose busbw --link RATE"
        advice = f"{where}; {_fewer_bytes(run.report, codec, evidence['comm_overlap'])}"
    return Finding("communication", verdict, f"{share:.0%} of step time is communication beyond waiting for the "
                   "slowest rank", evidence, f"problem at >= {COMM_PROBLEM} of step time, warn >= {COMM_WARN}", advice)


_OUTER_MODES = ("local_sgd", "diloco", "streaming", "torch-localsgd", "torchft-diloco")


def _fewer_bytes(report: dict[str, Any], codec: str, overlap: float) -> str:
    """The knobs that cut exposed communication for the run's synchronization (the report's
    ``sync.mode``): each strategy has its own, and DDP's bucket size means nothing to FSDP2."""
    sync = report.get("sync") if isinstance(report.get("sync"), dict) else {}
    mode = str(sync.get("mode", "step")).removeprefix("auto: ")
    reshard = ("--parallel.reshard_after_forward false keeps each block's gathered parameters from forward "
               "to backward (one all-gather per block less, more memory)")
    if mode == "fsdp":
        return (f"a codec on the reduce-scatter (--codec fp16 halves its bytes, int8 quarters them; now {codec}), "
                "--parallel hsdp with --parallel.shard_size set to the ranks of a node: only the replicate "
                f"all-reduce crosses nodes, with any codec there, powersgd included; {reshard}")
    if mode == "hsdp":
        where = ("fp16 or bf16 on the reduce-scatter; for powersgd or int8 between nodes, fully_shard on "
                 "mesh['shard'] alone (poise train does so for any codec but a cast)" if sync.get("native")
                 else "powersgd sends 1/10-1/100 between nodes")
        return f"a codec (now {codec}; {where}); {reshard}"
    if mode in _OUTER_MODES:
        return ("synchronize less often (a larger --sync.inner_steps), compress the outer change (--sync.codec int8), "
                "or --sync streaming: fragments in turn, overlapped with the next inner steps")
    return (f"a gradient codec (--codec fp16 halves the bytes, powersgd or topk with error feedback send "
            f"1/10-1/100; now {codec}), --collective hierarchical across nodes, a smaller --bucket-mb so more of it "
            f"overlaps backward (overlap {overlap:.0%}); where compute is short beside the link, outer steps "
            "(--sync diloco, or --sync auto to choose)")


def replan_oscillation(run: RunData) -> Finding:
    """Shares that reverse direction from one re-plan to the next: dynamic balancing chasing
    noise, which makes step time unstable."""
    replans = [e for e in run.report.get("replans") or [] if isinstance(e, dict) and e.get("shares")]
    slowest = column(run.steady, "step_s").max(axis=0)
    cv = float(slowest.std() / slowest.mean()) if slowest.mean() > 0 else 0.0
    evidence: dict[str, Any] = {"replans": len(replans), "step_time_cv": _r(cv)}
    threshold = (f"problem when >= {OSCILLATION_PROBLEM} of share moves reverse the previous one and moves average "
                 f">= {OSCILLATION_MOVE} of a share, over >= {OSCILLATION_REPLANS} re-plans; warn at "
                 f">= {OSCILLATION_WARN}")
    if not replans:
        verdict = "warn" if cv >= UNSTABLE_CV else "ok"
        return Finding("replan_oscillation", verdict, f"no re-plans; step time varies by {cv:.0%} (std / mean)",
                       evidence, threshold + f"; without re-plans, warn at a step-time CV >= {UNSTABLE_CV}",
                       "step time varies without re-planning: see the data, communication and straggler findings"
                       if verdict != "ok" else "")
    shares = np.array([np.full(len(replans[0]["shares"]), 1.0 / len(replans[0]["shares"]))]
                      + [np.asarray(e["shares"], dtype=np.float64) for e in replans])
    moves = np.diff(shares, axis=0)  # [replans, ranks]
    moved = np.abs(moves).max(axis=1) > 1e-9
    moving = moves[moved]
    # how far a re-plan that moves at all moves the shares (holds are not averaged in)
    relative = float(np.mean((np.abs(moves) / np.maximum(shares[:-1], 1e-12))[moved])) if moved.any() else 0.0
    reversals = sum(1 for a, b in itertools.pairwise(moving) if float(np.dot(a, b)) < 0)
    rate = reversals / (len(moving) - 1) if len(moving) > 1 else 0.0
    evidence.update({"share_moves": len(moving), "reversals": reversals, "reversal_rate": _r(rate),
                     "mean_relative_share_change": _r(relative)})
    verdict = "ok"
    if len(moving) >= OSCILLATION_REPLANS and relative >= OSCILLATION_MOVE:
        verdict = _level(rate, OSCILLATION_WARN, OSCILLATION_PROBLEM)
    current = ", ".join(f"{k} {run.setting('balance', k, '?')}" for k in
                        ("max_share_change", "confident_error", "replan_every_steps", "window_steps"))
    return Finding("replan_oscillation", verdict,
                   f"{reversals} of {max(len(moving) - 1, 0)} share moves reversed the previous one "
                   f"(moves of {relative:.0%} of a share on average)", evidence, threshold,
                   "damp the re-planner: --balance.max_share_change 0.15 --balance.confident_error 0.05 "
                   f"--balance.replan_every_steps 5 --balance.window_steps 50 (now: {current})"
                   if verdict != "ok" else "")


def nonfinite_steps(run: RunData) -> Finding:
    """Optimizer steps skipped for non-finite gradients, and non-finite training losses."""
    skipped = int(column(run.table, "skipped").max(axis=0).sum())
    loss = column(run.table, "loss")
    trained = column(run.table, "samples") > 0  # under a deadline, a rank that trained nothing has no loss
    nan_loss = int((~np.isfinite(loss) & trained).any(axis=0).sum())
    steps = run.table.shape[1]
    share = skipped / steps
    verdict = "problem" if share >= NONFINITE_PROBLEM else "warn" if skipped or nan_loss else "ok"
    return Finding("nonfinite_steps", verdict, f"{skipped} of {steps} steps skipped, {nan_loss} with a non-finite loss",
                   {"skipped_steps": skipped, "nonfinite_loss_steps": nan_loss, "skipped_share": _r(share, 4)},
                   f"problem at >= {NONFINITE_PROBLEM} of steps skipped, warn at any",
                   "lower --lr or lengthen --train.warmup_steps, keep --train.grad_clip_norm on; with a lossy codec "
                   "start compressing later (--comm.start_step)" if verdict != "ok" else "")


def checkpoint_stalls(run: RunData) -> Finding:
    """Seconds the loop waited for checkpoints, as a share of training time."""
    saves = ((run.report.get("checkpoints") or {}).get("saves")) or []
    if not saves:
        return Finding("checkpoint_stalls", "ok", "no checkpoints recorded", {"saves": 0})
    stall = float(sum(float(s.get("stall_s", 0.0)) for s in saves))
    train_s = float(elapsed_s(run.table)[-1])
    share = stall / max(train_s, 1e-12)
    verdict = _level(share, STALL_WARN, STALL_PROBLEM)
    worst = max(float(s.get("stall_s", 0.0)) for s in saves)
    return Finding("checkpoint_stalls", verdict, f"checkpoints held the loop up for {share:.1%} of training time",
                   {"saves": len(saves), "stall_s_total": _r(stall, 3), "stall_s_max": _r(worst, 3),
                    "stall_share": _r(share, 4)},
                   f"problem at >= {STALL_PROBLEM} of training time, warn >= {STALL_WARN}",
                   "--checkpoint-async (write in the background), --checkpoint-differential, a larger "
                   "--checkpoint-every, or --checkpoint.delta_codec int8" if verdict != "ok" else "")


def cpu_contention(run: RunData) -> Finding:
    """The share of each rank's own compute (forward and backward: wall seconds) its training
    thread spent on a CPU (its CPU seconds there), from the timeline's ``compute_cpu_s`` and
    ``compute_wall_s``.

    Why: a rank whose thread waits for a core computes slowly although its chip is as fast as
    the others', and when every rank waits alike (more ranks × threads than cores) no
    comparison between ranks shows it: each looks balanced and merely slow. Waits for other
    ranks block off the CPU outside these spans, so they do not lower the share. CPU runs only:
    a GPU rank's thread waits for its device by design.
    """
    steady = run.steady
    threshold = f"problem under {ON_CPU_PROBLEM}, warn under {ON_CPU_WARN} (share 0..1, worst rank)"
    if str(run.report.get("backend", "gloo")) != "gloo":
        return Finding("cpu_contention", "ok", "GPU ranks: the training thread waits for its device, not a CPU",
                       threshold=threshold)
    share = on_cpu_share(steady)  # NaN: a rank without CPU figures (an old timeline, or it computed nothing)
    known = np.isfinite(share)
    if not known.any():
        return Finding("cpu_contention", "ok", "no CPU seconds recorded (a timeline from before poise recorded them)",
                       threshold=threshold)
    busy = cpus_busy(steady)
    worst = int(np.argmin(np.where(known, share, np.inf)))
    verdict = _level(float(share[worst]), ON_CPU_WARN, ON_CPU_PROBLEM, below=True)
    evidence = {"on_cpu_share_per_rank": [_r(s) if np.isfinite(s) else None for s in share], "worst_rank": worst,
                "cpus_busy_per_rank": [_r(b) if np.isfinite(b) else None for b in busy]}
    others = share[known & (np.arange(len(share)) != worst)]
    alone = len(others) > 0 and float(np.median(others)) >= ON_CPU_WARN
    low, high = float(share[known].min()), float(share[known].max())
    if verdict == "ok":
        return Finding("cpu_contention", "ok", f"every rank's training thread was on a CPU for >= {low:.0%} "
                       "of its compute", evidence, threshold)
    if alone:
        return Finding("cpu_contention", verdict, f"rank {worst}'s training thread was on a CPU for only "
                       f"{share[worst]:.0%} of its compute (the others' median {np.median(others):.0%})",
                       evidence, threshold,
                       f"something else takes rank {worst}'s cores: its CPU quota (cgroup cpu.max), other processes "
                       "on its host, or more threads than its cores; poise diagnose host on that host", worst)
    return Finding("cpu_contention", verdict, f"the ranks' training threads were on a CPU for only "
                   f"{low:.0%}-{high:.0%} of their compute: more runnable threads than cores",
                   evidence, threshold,
                   "fewer ranks per host or fewer threads per rank (--dist.threads_per_worker; ranks x threads at "
                   "most the host's cores: poise diagnose host), or stop what else runs on the hosts")


def padding_waste(run: RunData) -> Finding:
    """Padded tokens computed per real token, minus 1."""
    padded, tokens = column(run.table, "padded_tokens").sum(), column(run.table, "tokens").sum()
    waste = float(padded / tokens - 1.0) if tokens > 0 and padded > 0 else 0.0
    verdict = _level(waste, PADDING_WARN, PADDING_PROBLEM)
    advice = ("--balance cost groups samples of similar length into a step (length bucketing, "
              "--balance.bucket_steps); in your own loop, give Session(lengths=...)" if run.balance_strategy == "static"
              else "a larger --balance.bucket_steps sorts more samples by length together")
    return Finding("padding_waste", verdict, f"{waste:.2f} padded tokens per real token", {"padding_waste": _r(waste)},
                   f"problem at >= {PADDING_PROBLEM}, warn >= {PADDING_WARN}", advice if verdict != "ok" else "")


Rule = Callable[[RunData], Finding]
RULES: dict[str, Rule] = {
    "straggler": straggler,
    "data_skew": data_skew,
    "input_pipeline": input_pipeline,
    "communication": communication,
    "replan_oscillation": replan_oscillation,
    "nonfinite_steps": nonfinite_steps,
    "checkpoint_stalls": checkpoint_stalls,
    "padding_waste": padding_waste,
    "cpu_contention": cpu_contention,
}


def evaluate(run: RunData, names: list[str] | None = None) -> list[Finding]:
    """Every rule of :data:`RULES` (or those ``names``) on ``run``, worst verdict first.

    Raises:
        ValueError: for an unknown rule name, listing the known ones.
    """
    unknown = [n for n in names or [] if n not in RULES]
    if unknown:
        raise ValueError(f"unknown rules {', '.join(unknown)}: allowed are {', '.join(RULES)}")
    findings = [RULES[n](run) for n in (names or list(RULES))]
    return sorted(findings, key=lambda f: -VERDICTS.index(f.verdict))


__all__ = ["RULES", "VERDICTS", "Finding", "evaluate"]
