"""``poise pipeline``: split code-lm's transformer into balanced stages and train it as a pipeline.

One stage per worker: ``--stages P`` runs P workers, and ``--dp N`` N replicas of the pipeline
(P x N workers; each stage in DDP over its N replicas with ``--codec``). Launched exactly as
``poise train`` launches its workers (torch's elastic launcher, :func:`poise.launch.elastic.launch`),
running :mod:`poise.pipeline.worker`. Prints the plan and the measured vs predicted balance.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from poise.cli.flags import add_config_flags, overrides, resolve
from poise.cli.train import add_overwrite_flag, record_config
from poise.launch.job import launch_job
from poise.log import make_console

WORKER_MODULE = "poise.pipeline.worker"
# Short flags of this command only (the pipeline settings mean nothing to `poise train`).
PIPELINE_ALIASES = {
    "--dp": "pipeline.dp_size",
    "--schedule": "pipeline.schedule",
    "--micro-batches": "pipeline.micro_batches",
    "--partition": "pipeline.partition",
}


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("pipeline", help="train code-lm as a pipeline of balanced stages, one per worker "
                                             "(--dp N: N data-parallel replicas of it)")
    parser.add_argument("--stages", dest="stages", type=int, default=argparse.SUPPRESS, metavar="P",
                        help="pipeline stages: runs P x pipeline.dp_size workers (sets --dist.nproc to that over "
                             "the nodes)")
    add_config_flags(parser, PIPELINE_ALIASES)
    add_overwrite_flag(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from poise.pipeline.worker import check_config  # torch is imported only when a command runs

    set_workers(args)
    config, config_path = record_config(args)
    check_config(config, config.train.batch_size)  # fail here, in one line, before starting workers
    code = launch_job(config, config_path, module=WORKER_MODULE, command="pipeline")
    report_path = Path(config.out_dir) / "report.json"
    if code == 0 and report_path.exists():
        show_report(json.loads(report_path.read_text()))
        make_console().print(f"  wrote {report_path}")
    return code


def set_workers(args: argparse.Namespace) -> None:
    """Turn ``--stages P`` into ``dist.nproc`` = P x ``pipeline.dp_size`` / nodes, as a flag.

    Raises:
        ValueError: the workers do not spread evenly over the nodes, or an explicit
            ``--nproc`` (or ``--cluster N:M``) says otherwise.
    """
    stages = getattr(args, "stages", None)
    if stages is None:
        return
    if stages < 1:
        raise ValueError(f"--stages {stages} is invalid: give a positive number of stages")
    config = resolve(args)  # for pipeline.dp_size and the nodes, from the file and flags
    dp = config.pipeline.dp_size
    nodes = config.max_world_size() // config.dist.nproc
    if (stages * dp) % nodes:
        raise ValueError(f"--stages {stages} x pipeline.dp_size={dp} = {stages * dp} workers do not spread evenly "
                         f"over {nodes} nodes")
    nproc = stages * dp // nodes
    given = overrides(args).get("dist", {}).get("nproc")  # --nproc, --dist.nproc or --cluster N:M
    if given is not None and str(given).strip() != str(nproc):
        raise ValueError(f"--stages {stages} with pipeline.dp_size={dp} runs {nproc} workers per node, but "
                         f"dist.nproc={given} is given too: give one of them")
    setattr(args, "config:dist.nproc", str(nproc))  # as --dist.nproc would (flags.py's dest)


def show_report(report: dict[str, Any]) -> None:
    """The plan, stage by stage, with predicted and measured seconds, and the balance line."""
    from rich.table import Table

    plan = report["plan"]
    table = Table(title=f"poise pipeline: {report['num_stages']} stages, {plan['method']} plan, "
                        f"{report['schedule']}, {report['micro_batches']} micro-batches")
    for header in ("stage", "layers", "predicted s/step", "measured s/step"):
        table.add_column(header, justify="right")
    for k, layers in enumerate(plan["stage_layers"]):
        table.add_row(str(k), " ".join(layers), f"{report['predicted_stage_s'][k]:.4f}",
                      f"{report['measured_stage_s'][k]:.4f}")
    console = make_console()
    console.print(table)
    if report.get("dp_size", 1) > 1:
        show_replicas(report)
    advice = plan["advice"]
    console.print(
        f"  balance: predicted {report['predicted_balance']:.3f}, measured {report['measured_balance']:.3f} "
        f"(gap {report['balance_gap']:.3f}); bubble {plan['bubble_fraction']:.1%}; "
        f"{report['throughput_tokens_per_s']:,.0f} tokens/s; loss {report['train_loss_first']:.3f} -> "
        f"{report['train_loss_last']:.3f} {report['loss_unit']}"
    )
    console.print(
        f"  advice: {advice['num_stages']} stages (limited by {advice['stages_limited_by']}, "
        f"N_opt {advice['n_opt'] or 'unbounded: no communication cost modelled'}), "
        f"{advice['num_micro_batches']} micro-batches (limited by {advice['micro_batches_limited_by']}, "
        f"bubble {advice['bubble_fraction']:.1%})"
    )


def show_replicas(report: dict[str, Any]) -> None:
    """Each data-parallel replica's share, its stages' seconds and its DDP traffic per step."""
    from rich.table import Table

    codec = report["config"]["comm"].get("codec") or "none"  # (unset: exact, as poise decides for pipelines)
    table = Table(title=f"{report['dp_size']} data-parallel replicas ({codec} on dp)")
    for header in ("replica", "samples/step", "measured s/step per stage", "dp bytes sent/step", "dp comm s",
                   "exposed s"):
        table.add_column(header, justify="right")
    for r in report["per_dp_rank"]:
        table.add_row(str(r["dp_rank"]), str(r["samples_per_step"]),
                      " ".join(f"{s:.4f}" for s in r["measured_stage_s"]),
                      f"{sum(r['wire_bytes_per_step']):,.0f}", f"{max(r['dp_comm_s']):.4f}",
                      f"{max(r['dp_exposed_s']):.4f}")
    console = make_console()
    console.print(table)
    console.print(f"  replicas: balance {report['dp_balance']:.3f}; dp traffic {report['dp_wire_bytes_per_step']:,.0f} "
                  f"bytes/step in all, compression {report['dp_compression_ratio']:.2f}x")
