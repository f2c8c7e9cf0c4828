"""``poise pipeline --dp N`` without processes: the replicas' shares and loss weights, the
report's figures over a (dp, pp) grid, ``--stages`` x ``--dp`` into workers, and the one-line
refusals of what DDP over the replicas cannot run."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from poise import config as cfg
from poise.cli import build_parser
from poise.cli.pipeline import set_workers
from poise.pipeline.replicas import ReplicaGrid, replica_shares, replica_weight
from poise.pipeline.stages import plan_stages
from poise.pipeline.worker import build_report, check_config
from poise.tasks.base import IGNORE_INDEX


def test_shares_split_every_row_once_in_whole_micro_batches():
    shares = replica_shares(5, 47, 2)
    assert [s.tolist() for s in shares] == [[0, 2, 4], [1, 3]]
    assert [s.tolist() for s in replica_shares(10, 47, 2, 2)] == [[0, 1, 4, 5, 8, 9], [2, 3, 6, 7]]
    for batch, dp, m in ((8, 4, 1), (7, 3, 1), (6, 1, 3), (24, 3, 4), (12, 2, 3)):
        shares = replica_shares(batch, 31, dp, m)
        assert sorted(np.concatenate(shares).tolist()) == list(range(batch))
        assert all(len(s) % m == 0 for s in shares)
        assert max(map(len, shares)) - min(map(len, shares)) <= m
        assert [s.tolist() for s in replica_shares(batch, 31, dp, m)] == [s.tolist() for s in shares]  # every step
    for batch, dp, m in ((5, 2, 2), (6, 4, 2)):
        with pytest.raises(ValueError, match="cannot be cut into"):
            replica_shares(batch, 31, dp, m)


def test_weights_turn_the_mean_of_replica_losses_into_the_batch_mean():
    g = torch.Generator().manual_seed(0)
    targets = torch.randint(0, 256, (5, 12), generator=g)
    for row, real in enumerate((12, 3, 7, 1, 9)):  # unequal real tokens per sample
        targets[row, real:] = IGNORE_INDEX
    terms = torch.rand(5, 12, generator=g) * (targets != IGNORE_INDEX)  # per-token losses
    shares = replica_shares(5, 12, 2)
    replica_losses = []
    for d, share in enumerate(shares):
        own_mean = float(terms[share].sum() / (targets[share] != IGNORE_INDEX).sum())
        replica_losses.append(replica_weight(targets, shares, d) * own_mean)
    whole = float(terms.sum() / (targets != IGNORE_INDEX).sum())
    assert sum(replica_losses) / 2 == pytest.approx(whole, rel=1e-6)
    assert sum(replica_losses) / 2 != pytest.approx(
        sum(float(terms[s].sum() / (targets[s] != IGNORE_INDEX).sum()) for s in shares) / 2, rel=1e-3)
    assert replica_weight(targets, [np.arange(5)], 0) == 1.0


def _plan():
    from poise.balance.profile import LayerProfile

    profile = LayerProfile(names=["embedding", "block0", "head"], time_s=[0.1, 0.3, 0.2], forward_s=[0.05, 0.1, 0.1],
                           param_bytes=[10, 20, 10], activation_bytes=[1, 1, 1], output_bytes=[4, 4, 4])
    return profile, plan_stages(profile, 2, method="exact", num_micro_batches=2, batch_size=4,
                                in_flight_micro_batches=2)


def _row(compute_s: float, loss: float | None, weight: float, samples: int) -> dict:
    return {"compute_s": compute_s, "step_s": 1.0, "loss": loss, "tokens": 100, "samples": samples, "targets": 40,
            "weight": weight, "raw_bytes": 400, "wire_bytes": 200, "dp_comm_s": 0.01, "dp_exposed_s": 0.002}


def test_report_over_a_grid_takes_each_stage_at_its_slowest_replica_and_the_mean_loss():
    profile, plan = _plan()
    config = cfg.from_dict({"pipeline": {"dp_size": 2, "warmup_steps": 0}, "dist": {"nproc": 4}})
    grid = ReplicaGrid(2, 2, 0, 0, None, None)
    per_rank = [  # rank = d * 2 + p, two steps each
        [_row(0.2, None, 1.2, 3)] * 2, [_row(0.5, 3.0, 1.2, 3)] * 2,
        [_row(0.3, None, 0.8, 2)] * 2, [_row(0.4, 1.0, 0.8, 2)] * 2,
    ]
    report = build_report(config, plan, profile, per_rank, loss_unit="nats", wall_s=1.0, grid=grid)
    assert report["dp_size"] == 2 and report["num_stages"] == 2 and report["world_size"] == 4
    assert report["measured_stage_s"] == [0.3, 0.5]
    assert report["loss_curve"] == [2.0, 2.0]
    first, second = report["per_dp_rank"]
    assert (first["samples_per_step"], second["samples_per_step"]) == (3, 2)
    assert first["measured_stage_s"] == [0.2, 0.5] and second["bottleneck_s"] == 0.4
    assert first["train_loss_last"] == pytest.approx(3.0 / 1.2)
    assert report["dp_balance"] == pytest.approx(1 - (0.5 - 0.4) / 0.5)
    assert report["dp_wire_bytes_per_step"] == 800 and report["dp_compression_ratio"] == 2.0
    alone = build_report(cfg.from_dict({"pipeline": {"warmup_steps": 0}}), plan, profile, per_rank[:2],
                         loss_unit="nats", wall_s=1.0)
    assert alone["dp_size"] == 1 and "per_dp_rank" not in alone and alone["loss_curve"] == [3.0, 3.0]


def _workers(*argv: str) -> str:
    args = build_parser().parse_args(["pipeline", *argv])
    set_workers(args)
    return getattr(args, "config:dist.nproc")


def test_stages_times_dp_are_the_workers():
    assert _workers("--stages", "2", "--dp", "2") == "4"
    assert _workers("--stages", "3") == "3"
    assert _workers("--stages", "2", "--dp", "2", "--cluster", "2:2") == "2"  # 2 nodes x 2 workers
    assert _workers("--stages", "2", "--dp", "2", "--nproc", "4") == "4"
    with pytest.raises(ValueError, match=r"dist\.nproc=3 is given too"):
        _workers("--stages", "2", "--dp", "2", "--nproc", "3")
    with pytest.raises(ValueError, match="do not spread evenly over 2 nodes"):
        _workers("--stages", "3", "--cluster", "2")


@pytest.mark.parametrize(("settings", "message"), [
    ({"dist": {"nproc": 3}, "pipeline": {"dp_size": 2}}, "pipeline.dp_size=2 does not divide the 3 workers"),
    ({"dist": {"nproc": 4}, "pipeline": {"dp_size": 2, "micro_batches": 2}, "train": {"batch_size": 1}},
     "give at least 2 per replica and a multiple of 2 per step"),
    ({"dist": {"nproc": 4}, "pipeline": {"dp_size": 2, "micro_batches": 4}, "train": {"batch_size": 5}},
     r"\(10 samples per step over pipeline.dp_size=2 replicas\)"),
    ({"dist": {"nproc": 2}, "pipeline": {"micro_batches": 2}, "train": {"batch_size": 5}},
     "equal micro-batches: give a multiple of 2$"),
    ({"dist": {"nproc": 4}, "pipeline": {"dp_size": 2}, "comm": {"collective": "ring"}}, "'flat' only"),
    ({"dist": {"nproc": 4}, "pipeline": {"dp_size": 2}, "comm": {"codec": "auto"}}, "name a codec"),
    ({"dist": {"nproc": 4}, "pipeline": {"dp_size": 2}, "comm": {"local_first": True}}, "must stay alike"),
    ({"dist": {"nproc": 4}, "parallel": {"mode": "fsdp"}}, "use --dp N"),
])
def test_what_replicas_cannot_run_is_refused_in_one_line(settings, message):
    config = cfg.from_dict({"task": {"name": "code-lm"}, **settings})
    with pytest.raises(ValueError, match=message) as info:
        check_config(config, config.train.batch_size)
    assert "\n" not in str(info.value)


def test_one_replica_keeps_every_check_of_before():
    config = cfg.from_dict({"task": {"name": "code-lm", "num_layers": 2}, "dist": {"nproc": 9}})
    with pytest.raises(ValueError, match=r"^9 stages need at least as many layers"):
        check_config(config, None)
    config = cfg.from_dict({"task": {"name": "code-lm"}, "dist": {"nproc": 4},
                            "pipeline": {"dp_size": 2, "micro_batches": 2}, "comm": {"codec": "fp16"},
                            "train": {"batch_size": 5}})
    check_config(config, 5)  # 2 stages x 2 replicas; 10 samples a step: shares of 6 and 4 in 2 micro-batches
