"""``poise pipeline``: split code-lm's transformer into balanced stages and train it as a pipeline.

One stage per worker (``--stages P``, the same as ``--nproc``), launched exactly as
``poise train`` launches its workers (torch's elastic launcher, :func:`poise.launch.elastic.launch`),
running :mod:`poise.pipeline.worker`. Prints the plan and the measured vs predicted balance.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from poise.cli.flags import add_config_flags
from poise.cli.train import add_overwrite_flag, record_config
from poise.launch.job import launch_job
from poise.log import make_console

WORKER_MODULE = "poise.pipeline.worker"
# Short flags of this command only (the pipeline settings mean nothing to `poise train`).
PIPELINE_ALIASES = {
    "--stages": "dist.nproc",
    "--schedule": "pipeline.schedule",
    "--micro-batches": "pipeline.micro_batches",
    "--partition": "pipeline.partition",
}


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("pipeline", help="train code-lm as a pipeline of balanced stages, one per worker")
    add_config_flags(parser, PIPELINE_ALIASES)
    add_overwrite_flag(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from poise.pipeline.worker import check_config  # torch is imported only when a command runs

    config, config_path = record_config(args)
    check_config(config, config.train.batch_size)  # fail here, in one line, before starting workers
    code = launch_job(config, config_path, module=WORKER_MODULE, command="pipeline")
    report_path = Path(config.out_dir) / "report.json"
    if code == 0 and report_path.exists():
        show_report(json.loads(report_path.read_text()))
        make_console().print(f"  wrote {report_path}")
    return code


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
