"""Turning a gathered timeline into the run report, the timeline plot and the summary table.

Definitions (all over the measured steps, per-rank compute Tᵢ = forward + own backward):

- ``balance``: mean over steps of 1 − (max Tᵢ − min Tᵢ) / max Tᵢ.
- ``idle_fraction``: share of rank-seconds spent waiting for the slowest rank's compute.
- ``comm_fraction``: share of step time blocked in communication *beyond* waiting for the
  slowest rank (Σ max(0, blocked − idle) / Σ step time), so imbalance is not counted twice.
- ``blocked_fraction``: share of step time blocked in communication, waiting included.
- throughput: samples (real tokens) of all ranks / the job's time in steps (the rank with
  the most, its step times summed: :func:`poise.diagnostics.timeline.elapsed_s`; under
  synchronous steps, each step's slowest rank); ``steady_throughput_*``: the same over the
  steps after the warm-up (below).
- ``padding_waste``: padded tokens computed per real token, minus 1 (0 = no padding).
- ``ideal_tokens_per_s``: the sum of the ranks' own speeds (real tokens per second of their
  compute); ``throughput_vs_ideal`` = steady throughput / ideal, the share of the ranks'
  combined speed that the job turned into progress.
- ``loss_curve``: training loss against cumulative real tokens, to compare runs whose
  batches differ at equal tokens rather than equal steps.
- ``balance_last_half``: balance over the second half of the steps, after a dynamic
  re-planner has had time to converge; ``balance_per_step``: every step's balance;
  ``balance_ceiling_last_half``: over the same steps, the balance a perfect plan would reach
  given how much one step's time strays from its cost model (:func:`balance_ceiling_of`): the
  gap between the two is the plan's, the rest the machine's noise.
- ``comm_overlap``: share of the time gradients were being reduced (from a bucket's hand-off
  to DDP until its reduction completed) that overlapped the rank's own backward compute,
  i.e. communication hidden by DDP's bucketing (``--bucket-mb``); ``comm_busy_s_per_step``
  and ``comm_exposed_s_per_step`` (the part not hidden) are medians over steps and ranks.

The first step is left out of medians and means: it pays for DDP's bucket rebuild and lazy
allocations, and is not what a user's run looks like.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from poise.balance.metrics import balance, balance_ceiling, idle_fraction
from poise.diagnostics.timeline import column, cpus_busy, elapsed_s, on_cpu_share, save_table, write_chrome_trace
from poise.files import write_json_atomic

WARMUP_STEPS = 1
_PER_RANK_FIELDS = (
    "data_s", "forward_s", "backward_s", "compute_s", "comm_wait_s", "optim_s", "step_s",
    "samples", "tokens",
)


def _steady(table: np.ndarray) -> np.ndarray:
    """Drop warm-up steps unless that would leave nothing."""
    return table[:, WARMUP_STEPS:] if table.shape[1] > WARMUP_STEPS else table


def steady_throughput(table: np.ndarray) -> tuple[float, float]:
    """Samples and real tokens per second over the steps after the warm-up (``[ranks, steps,
    fields]``; all steps when there are no others): what a run settles at, without the first
    step's bucket rebuild and lazy allocations, which cost some setups more than others."""
    steady = _steady(table)
    seconds = float(elapsed_s(steady)[-1])
    if seconds <= 0:
        return 0.0, 0.0
    return float(column(steady, "samples").sum()) / seconds, float(column(steady, "tokens").sum()) / seconds


def balance_ceiling_of(table: np.ndarray) -> float | None:
    """:func:`~poise.balance.metrics.balance_ceiling` of a gathered timeline's steps
    (``[ranks, steps, fields]``); None for one rank or too few steps."""
    if table.shape[0] < 2:
        return None
    return balance_ceiling(column(table, "samples"), column(table, "padded_tokens"), column(table, "compute_s"))


def summarize(table: np.ndarray, loss_scale: float = 1.0) -> dict[str, Any]:
    """Report figures from a gathered timeline ``[ranks, steps, fields]`` (see module doc).

    ``loss_scale`` converts the recorded training loss (nats) to the reported unit.
    """
    if table.shape[1] == 0:
        raise ValueError("no steps were recorded: nothing to summarize")
    steady = _steady(table)
    compute = column(steady, "compute_s").T  # [steps, ranks]
    blocked = column(steady, "comm_wait_s").T
    step_s = column(steady, "step_s").T
    idle = compute.max(axis=1, keepdims=True) - compute
    samples = column(table, "samples").sum()
    tokens = column(table, "tokens").sum()
    padded = column(table, "padded_tokens").sum()
    elapsed = elapsed_s(table)
    total_s = float(elapsed[-1])
    steady_step_s = float(np.median(step_s.max(axis=1)))
    # per step, the ranks' losses weighted by their real tokens (as the gradient is)
    step_tokens = column(table, "tokens")
    # (a rank that trained nothing in a step, under a deadline, has no loss: weight 0)
    weighted = np.where(step_tokens > 0, column(table, "loss") * step_tokens, 0.0)
    losses = loss_scale * weighted.sum(axis=0) / np.maximum(step_tokens.sum(axis=0), 1)
    k = max(1, min(5, len(losses) // 4))
    per_rank = []
    cpus, on_cpu = cpus_busy(steady), on_cpu_share(steady)
    for r in range(table.shape[0]):
        one = steady[r : r + 1]
        entry: dict[str, Any] = {"rank": r}
        for name in _PER_RANK_FIELDS:
            entry[f"median_{name}"] = float(np.median(column(one, name)))
        entry["samples_per_s"] = float(column(one, "samples").sum() / column(one, "step_s").sum())
        entry["tokens_per_s"] = float(column(one, "tokens").sum() / column(one, "step_s").sum())
        entry["tokens_per_compute_s"] = float(column(one, "tokens").sum() / column(one, "compute_s").sum())
        # the share of its wall time the rank computed (forward, backward, optimizer; emulated
        # slowness counts as compute): what waiting for others and for the network leaves
        busy_s = column(one, "compute_s").sum() + column(one, "optim_s").sum()
        entry["compute_utilization"] = float(busy_s / max(column(one, "step_s").sum(), 1e-12))
        # CPUs the rank's process kept busy; the share of its compute its training thread was on a CPU
        entry["cpus_busy"] = float(cpus[r]) if np.isfinite(cpus[r]) else None
        entry["compute_on_cpu"] = float(on_cpu[r]) if np.isfinite(on_cpu[r]) else None
        per_rank.append(entry)
    ideal = sum(r["tokens_per_compute_s"] for r in per_rank)
    raw, wire = column(steady, "raw_bytes"), column(steady, "wire_bytes")
    inter_raw, inter_wire = column(steady, "inter_node_raw_bytes"), column(steady, "inter_node_wire_bytes")
    busy, hidden = column(steady, "comm_busy_s"), column(steady, "comm_hidden_s")
    steady_samples_per_s, steady_tput = steady_throughput(table)
    step_balance = [balance(row) for row in compute]
    return {
        "steps": int(table.shape[1]),
        "throughput_samples_per_s": float(samples / total_s),
        "throughput_tokens_per_s": float(tokens / total_s),
        "steady_throughput_samples_per_s": steady_samples_per_s,
        "steady_throughput_tokens_per_s": steady_tput,
        "median_step_s": steady_step_s,
        "balance": float(np.mean(step_balance)),
        "balance_last_half": float(np.mean(step_balance[len(step_balance) // 2 :])),
        "balance_ceiling_last_half": balance_ceiling_of(steady[:, len(step_balance) // 2 :]),
        # every step's balance, the first included (step 0 is left out of the means above)
        "balance_per_step": [float(balance(row)) for row in column(table, "compute_s").T],
        "step_s_per_step": [float(v) for v in column(table, "step_s").max(axis=0)],  # the slowest rank's, seconds
        "elapsed_s_per_step": [float(v) for v in elapsed],  # the job's time in steps by each step's end, seconds
        "idle_fraction": idle_fraction(compute),
        "comm_fraction": float(np.clip(blocked - idle, 0, None).sum() / step_s.sum()),
        "blocked_fraction": float(blocked.sum() / step_s.sum()),
        # bytes a rank put on the wire per step (after compression), over every step: the mean,
        # so the outer steps of local SGD and DiLoCo count (the median step of those sends nothing)
        "bytes_communicated_per_step": float(np.mean(wire)),
        "comm_raw_bytes_per_step": float(np.median(raw)),
        "comm_wire_bytes_per_step": float(np.median(wire)),
        # the mean counts the rare outer steps of local SGD and DiLoCo, which the median misses
        "comm_wire_bytes_mean_per_step": float(np.mean(wire)),
        # every rank's bytes over every token trained (all steps)
        "wire_bytes_per_token": float(column(table, "wire_bytes").sum() / max(tokens, 1)),
        # the steps in which the ranks sent anything (all steps), and a rank's mean bytes in those:
        # with outer steps (local SGD, DiLoCo) what one synchronization costs, beside the mean above
        "steps_sending": int((column(table, "wire_bytes").mean(axis=0) > 0).sum()),
        "wire_bytes_per_sending_step": _per_sending_step(column(table, "wire_bytes")),
        # median over the steps that sent something, so the uncompressed warm-up steps do not
        # dilute it and an outer strategy's silent inner steps do not read as 0
        "compression_ratio": float(np.median(raw[wire > 0] / wire[wire > 0])) if (wire > 0).any() else 1.0,
        "codec_s_per_step": float(np.median(column(steady, "codec_s"))),
        # hierarchical with a codec: what all node leaders together sent between nodes per
        # step (compressed), and the compression of those node sums (0 and 1 without one)
        "comm_inter_node_wire_bytes_per_step": float(np.median(inter_wire.sum(axis=0))),
        "inter_node_compression_ratio": float(inter_raw.sum() / inter_wire.sum()) if inter_wire.sum() else 1.0,
        "comm_overlap": float(hidden.sum() / busy.sum()) if busy.sum() > 0 else 0.0,
        "comm_busy_s_per_step": float(np.median(busy)),
        "comm_exposed_s_per_step": float(np.median(busy - hidden)),
        "steps_skipped": int(column(table, "skipped").max(axis=0).sum()),
        "padding_waste": float(padded / tokens - 1.0) if tokens else 0.0,
        "ideal_tokens_per_s": ideal,
        "throughput_vs_ideal": steady_tput / ideal if ideal else 0.0,
        "train_loss_first": float(losses[:k].mean()),
        "train_loss_last": float(losses[-k:].mean()),
        "per_rank": per_rank,
        # training loss against real tokens seen, all ranks together: [[tokens, loss], ...]
        "loss_curve": [[float(t), float(v)] for t, v in zip(np.cumsum(step_tokens.sum(axis=0)), losses, strict=True)],
    }


def write_outputs(out: Path, report: dict, table: np.ndarray, *, plot: bool) -> None:
    """Rank 0: report.json, timeline.npz, trace.json and (optionally) timeline.png from the
    gathered ``table``."""
    write_json_atomic(out / "report.json", report)
    save_table(table, out / "timeline.npz")  # for `poise diagnose run`
    write_chrome_trace(table, out / "trace.json")
    if plot:
        plot_timeline(table, out / "timeline.png")


# (label, color) of the stacked bars, bottom to top, in timeline.png and compare.png alike
_PHASES = (
    ("compute", "#4c72b0"),
    ("communication", "#dd8452"),
    ("idle (waiting for slowest)", "#c44e52"),
    ("data + optimizer", "#8c8c8c"),
)


def _timeline_parts(table: np.ndarray) -> list[np.ndarray]:
    """The stacked parts of every rank's step, ``[ranks, steps]`` seconds each, in :data:`_PHASES` order.

    Idle is the time a rank's compute was shorter than the slowest rank's in that step; the
    communication part is the blocked time beyond that idle.
    """
    compute = column(table, "compute_s")
    idle = compute.max(axis=0, keepdims=True) - compute
    comm = np.clip(column(table, "comm_wait_s") - idle, 0, None)
    idle = np.minimum(idle, column(table, "comm_wait_s"))
    other = column(table, "data_s") + column(table, "optim_s")
    return [compute, comm, idle, other]


def draw_timeline(axes: Sequence[Any], table: np.ndarray) -> None:
    """Draw ``table``'s per-rank stacked bars per step into ``axes`` (one matplotlib Axes per rank)."""
    steps = table.shape[1]
    parts = _timeline_parts(table)
    x = np.arange(steps)
    for r, ax in enumerate(axes):
        bottom = np.zeros(steps)
        for values, (label, color) in zip(parts, _PHASES, strict=True):
            ax.bar(x, values[r], bottom=bottom, width=1.0, color=color, label=label, linewidth=0)
            bottom += values[r]


def plot_timeline(table: np.ndarray, path: str | Path) -> Path:
    """Per-rank stacked bars per step: compute, communication, idle, data + optimizer (seconds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = table.shape[0]
    fig, axes = plt.subplots(ranks, 1, figsize=(10, 1.8 + 1.6 * ranks), sharex=True, squeeze=False)
    draw_timeline(axes[:, 0], table)
    for r, ax in enumerate(axes[:, 0]):
        ax.set_ylabel(f"rank {r}\nseconds")
    axes[0, 0].legend(loc="upper right", fontsize="small", ncol=4)
    axes[-1, 0].set_xlabel("step")
    fig.suptitle("Per-rank step time")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)


def plot_timelines(panels: Sequence[tuple[str, np.ndarray]], path: str | Path, *, title: str = "",
                   groups: Sequence[Sequence[int]] = ()) -> Path:
    """Several runs' timelines: one column per run (``(title, table)`` panels), one row per rank,
    drawn as :func:`plot_timeline` draws one run.

    ``groups``: panels whose runs are compared (a baseline and poise's runs). Each group is a row
    of panels of its own, side by side, sharing one y scale in seconds so that a shorter bar is a
    shorter step; a panel in no group is a group of its own. One row per comparison keeps a
    figure of five runs readable at a page's width (the README and the site show it).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not panels:
        raise ValueError("plot_timelines: no runs to draw")
    grouped = {i for group in groups for i in group}
    rows_of = [list(group) for group in groups] + [[i] for i in range(len(panels)) if i not in grouped]
    ranks = max(table.shape[0] for _, table in panels)
    width = max(len(group) for group in rows_of)
    fig = plt.figure(figsize=(3.6 * width + 0.8, 0.8 + (1.0 + 1.5 * ranks) * len(rows_of)), layout="constrained")
    handles: list[Any] = []
    labels: list[str] = []
    for subfig, group in zip(fig.subfigures(len(rows_of), 1, squeeze=False)[:, 0], rows_of, strict=True):
        axes = subfig.subplots(ranks, width, squeeze=False)
        for c in range(width):
            if c >= len(group):
                for ax in axes[:, c]:
                    ax.set_visible(False)
                continue
            name, table = panels[group[c]]
            draw_timeline(axes[: table.shape[0], c], table)
            for ax in axes[table.shape[0]:, c]:
                ax.set_visible(False)
            axes[0, c].set_title(name, fontsize="medium")
            axes[table.shape[0] - 1, c].set_xlabel("step")
        for r in range(ranks):
            axes[r, 0].set_ylabel(f"rank {r}\nseconds")
        visible = [ax for c in range(len(group)) for ax in axes[:, c] if ax.get_visible()]
        top = max(ax.get_ylim()[1] for ax in visible)
        for ax in visible:
            ax.set_ylim(0, top)
        if not handles:
            handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=len(labels), fontsize="small", frameon=False)
    if title:
        fig.suptitle(title)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)


def _per_sending_step(wire: np.ndarray) -> float:
    """A rank's mean wire bytes over the steps in which the ranks sent anything (``wire``:
    ``[ranks, steps]``); 0 when none did."""
    per_step = wire.mean(axis=0)
    sent = per_step > 0
    return float(per_step[sent].mean()) if sent.any() else 0.0


# how each outer mode synchronizes, for the summary (the report's ``sync`` dict fills it in)
_OUTER_WORDS = {
    "local_sgd": "parameters averaged every {H} steps (H)",
    "diloco": "outer Nesterov SGD every {H} steps (H), lr {lr:g}, momentum {m:g}",
    "streaming": "{F} fragments, each every {H} steps (H); outer Nesterov SGD, lr {lr:g}, momentum {m:g}",
    "torch-localsgd": "torch's post-local SGD: parameters averaged every {H} steps (H)",
    "torchft-diloco": "torchft's DiLoCo: an outer step every {H} steps (H)",
}


def summary_rows(report: dict[str, Any]) -> tuple[str, list[tuple[str, str]]]:
    """The title and the (metric, value) rows of the summary ``poise train`` prints, from a
    report.json dict.

    The title names what was on (balance, the per-step codec, the synchronization). Bytes per
    step are the mean over the run's steps (after the first): where outer steps synchronize
    (local SGD, DiLoCo, Streaming) most steps send nothing and the median would read 0, so a
    row also gives the steps that sent and a rank's mean bytes in each; the outer steps that
    ran, and H, are said. Bytes are decimal MB (10^6), per rank.
    """
    sync = report.get("sync") if isinstance(report.get("sync"), dict) else {"mode": "step"}
    mode = str(sync.get("mode", "step"))
    outer = mode.removeprefix("auto: ") in _OUTER_WORDS
    codec = report.get("codec", "none")
    title = (f"poise train: {report['task']} on {report['world_size']} ranks; balance "
             f"{report.get('balance_strategy', 'static')}, codec {codec}, sync {mode}")
    if outer:
        title += f" (H={sync.get('inner_steps')})"
    unit = report.get("loss_unit", "")
    rows = [
        ("steps", f"{report['steps']}"),
        ("wall time", f"{report['wall_s']:.1f} s"),
        ("throughput", f"{report['throughput_samples_per_s']:.1f} samples/s"),
        ("", f"{report['throughput_tokens_per_s']:.0f} tokens/s"),
        ("median step", f"{report['median_step_s'] * 1e3:.1f} ms"),
        ("balance", f"{report['balance']:.3f}"),
        ("idle fraction", f"{report['idle_fraction']:.1%}"),
        ("comm fraction", f"{report['comm_fraction']:.1%}"),
        ("comm hidden by backward", f"{report['comm_overlap']:.0%} of {report['comm_busy_s_per_step'] * 1e3:.1f} ms"),
        ("bytes communicated / step (mean)", f"{report['bytes_communicated_per_step'] / 1e6:.3f} MB"),
    ]
    if outer:
        rows += _outer_rows(report, sync, mode)
    else:
        rows.append(("compression", f"{report['compression_ratio']:.1f}x ({codec})"))
    rows += [
        ("padding waste", f"{report['padding_waste']:.2f} padded per real token"),
        ("train loss (first → last)", f"{report['train_loss_first']:.3f} → {report['train_loss_last']:.3f} {unit}"),
        ("eval loss", f"{report['eval_loss']:.4f} {unit}"),
        ("eval accuracy", f"{report['eval_accuracy']:.2%}"),
    ]
    return title, rows


def _outer_rows(report: dict[str, Any], sync: dict[str, Any], mode: str) -> list[tuple[str, str]]:
    """The summary's rows for a run whose ranks meet in outer steps: how, how often, how many ran
    and what they sent."""
    words = _OUTER_WORDS[mode.removeprefix("auto: ")].format(
        H=sync.get("inner_steps"), lr=float(sync.get("outer_lr") or 1.0), m=float(sync.get("outer_momentum") or 0.0),
        F=sync.get("fragments"))
    rows = [("sync", f"{mode}: {words}")]
    ran = f"{sync.get('outer_steps', 0)}"
    if sync.get("warmup_steps"):
        ran += f", after {sync['warmup_steps']} steps synchronized every step"
    if sync.get("final_sync_at_finish"):
        ran += ", and one more at finish() (the loop ended before the last step)"
    rows.append(("outer steps", ran))
    steps_sending = report.get("steps_sending")
    if steps_sending is not None:
        rows.append(("bytes / step that sent", f"{report.get('wire_bytes_per_sending_step', 0.0) / 1e6:.3f} MB "
                                                f"({steps_sending} of {report['steps']} steps)"))
    outer_codec = sync.get("codec", "none")
    rows.append(("compression (steps that sent)", f"{report['compression_ratio']:.1f}x (outer step: {outer_codec})"))
    return rows


def summary_table(report: dict[str, Any]) -> Any:
    """A rich Table of the headline figures of a report.json dict (:func:`summary_rows`)."""
    from rich.table import Table

    title, rows = summary_rows(report)
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name, value in rows:
        table.add_row(name, value)
    return table


VERDICT_STYLE = {"ok": "green", "info": "cyan", "warn": "yellow", "problem": "bold red"}


def show_findings(console: Any, findings: Sequence[Any], title: str) -> None:
    """Print diagnosis findings (:class:`poise.diagnostics.rules.Finding`, worst first) on a rich
    ``console``: one table row per rule, then the evidence and what to try for each that is not ok."""
    from rich.table import Table

    table = Table(title=title)
    for header in ("verdict", "rule", "rank", "finding", "threshold"):
        table.add_column(header)
    for f in findings:
        style = VERDICT_STYLE[f.verdict]
        table.add_row(f"[{style}]{f.verdict}[/]", f.rule, "" if f.rank is None else str(f.rank), f.summary,
                      f.threshold)
    console.print(table)
    for f in findings:
        if f.verdict != "ok":
            figures = ", ".join(f"{k} {v}" for k, v in f.evidence.items())
            console.print(f"[{VERDICT_STYLE[f.verdict]}]{f.rule}[/]: {f.summary}\n  evidence: {figures}\n"
                          f"  try: {f.advice}", highlight=False)
    if all(f.verdict == "ok" for f in findings):
        console.print("no problem found")
