"""The emulated cluster's pure parts: rates, shaping sizes, config and flags, launcher arguments."""

from __future__ import annotations

import argparse
import logging
import re
from pathlib import Path

import pytest

from poise import config as cfg
from poise.cli import build_parser, main
from poise.cli.flags import resolve
from poise.cluster.links import Shaping
from poise.cluster.state import ClusterState, validate_shape
from poise.config import validate_name
from poise.launch.elastic import launcher_args
from poise.units import link_delay_s, link_rate_bit_per_s


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["train", *argv])


@pytest.mark.parametrize(
    ("text", "bit_per_s"),
    [("500kbit", 500_000), ("1gbit", 10**9), (" 64kbit ", 64_000), ("100gbit", 10**11), ("1GB/s", 8 * 10**9),
     ("0.0001234567gbit", 123_457)],
)
def test_link_rates_are_whole_bits_per_second(text, bit_per_s):
    rate = link_rate_bit_per_s(text)
    assert rate == bit_per_s and isinstance(rate, int)


@pytest.mark.parametrize(
    ("text", "needle"),
    [("1gbps", "link rate '1gbps' is invalid: give a number above 0 and a unit"), ("fast", "is invalid"),
     ("", "is invalid"), ("-1gbit", "is invalid"), ("10kbit", "outside the allowed 64kbit..100gbit"),
     ("200gbit", "outside the allowed"), ("25GB/s", "outside the allowed")],
)
def test_bad_link_rates_are_one_line_errors(text, needle):
    with pytest.raises(ValueError, match=re.escape(needle)) as info:
        link_rate_bit_per_s(text)
    assert "\n" not in str(info.value) and repr(text) in str(info.value)


def test_link_delays_are_seconds_up_to_10():
    assert link_delay_s("") == 0.0
    assert link_delay_s("250us") == pytest.approx(250e-6)
    assert link_delay_s("10s") == 10.0
    for bad, needle in (("5", "link delay '5' is invalid"), ("11s", "link delay '11s' is outside the allowed 0..10s")):
        with pytest.raises(ValueError, match=re.escape(needle)):
            link_delay_s(bad)


def test_shaping_holds_a_gso_packet_and_a_millisecond_of_traffic():
    slow, gbit, fast = (Shaping.for_rate(link_rate_bit_per_s(r)) for r in ("500kbit", "1gbit", "10gbit"))
    assert slow.burst_bytes == 64 * 1024  # never below one 64 KiB GSO segment
    assert gbit.burst_bytes == 125_000 and fast.burst_bytes == 1_250_000  # 1 ms at the rate
    for s in (slow, gbit, fast):
        assert s.limit_bytes > s.burst_bytes
    (tbf,) = gbit.tc_args("eth0")
    assert tbf[tbf.index("rate") + 1] == "1000000000bit" and "netem" not in tbf
    tbf, netem = Shaping.for_rate(10**9, delay_s=0.002).tc_args("eth0")
    assert netem[netem.index("delay") + 1] == "2000us" and netem[netem.index("parent") + 1] == "1:1"


def test_names_and_shapes_are_validated():
    assert validate_name("t123_a") == "t123_a"
    for bad in ("", "A", "1abc", "a-b", "a" * 33, "a b"):
        with pytest.raises(ValueError, match="cluster name"):
            validate_name(bad)
    validate_shape(2, 1)
    with pytest.raises(ValueError, match="nodes=0 is invalid"):
        validate_shape(0, 1)
    with pytest.raises(ValueError, match="procs_per_node=65 is invalid"):
        validate_shape(2, 65)


def test_node_addresses_come_from_the_subnet():
    state = ClusterState(name="c", nodes=3, procs_per_node=1, link_rate_bit_per_s=10**9, subnet="10.9.8.0/24")
    assert [state.address(i) for i in range(3)] == ["10.9.8.1", "10.9.8.2", "10.9.8.3"]
    assert state.planned_namespaces() == ["poise-c-sw", "poise-c-n0", "poise-c-n1", "poise-c-n2"]
    assert state.link == "1gbit"


def test_cluster_flag_sets_nodes_and_workers_per_node():
    c = resolve(parse("--cluster", "3:2", "--link", "100mbit"))
    assert (c.cluster.nodes, c.dist.nproc, c.cluster.link_rate_bit_per_s) == (3, 2, 10**8)
    c = resolve(parse("--cluster", "2", "--nproc", "4"))
    assert (c.cluster.nodes, c.dist.nproc) == (2, 4)
    assert resolve(parse()).cluster.enabled is False


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--cluster", "2:1:1"], "--cluster '2:1:1' is invalid"),
        (["--cluster", "2:"], "is invalid: give N[:M]"),
        (["--cluster", "2:1", "--nproc", "2"], "sets dist.nproc=1, but --dist.nproc 2 is given too"),
        (["--cluster", "x"], "cluster.nodes='x' is not a valid int"),
        (["--cluster", "65"], "cluster.nodes=65 is invalid: allowed is 0..64"),
        (["--cluster", "2", "--link", "5gbps"], "link rate '5gbps' is invalid"),
        (["--link", "100mbit"], "only apply with cluster.nodes"),
        (["--cluster", "2", "--nnodes", "2"], "dist.nnodes cannot be set with an emulated cluster"),
        (["--cluster", "2", "--dist.socket_ifname", "eth0"], "dist.socket_ifname cannot be set"),
        (["--cluster.name", "Bad"], "cluster name 'Bad' is invalid"),
    ],
)
def test_bad_cluster_settings_are_one_line_errors(argv, needle):
    with pytest.raises(ValueError, match=re.escape(needle)) as info:
        resolve(parse(*argv))
    assert "\n" not in str(info.value)


def test_dist_node_settings_are_validated():
    with pytest.raises(ValueError, match="only apply to multi-node jobs"):
        cfg.DistConfig(local_addr="10.0.0.1")
    with pytest.raises(ValueError, match=re.escape("dist.socket_ifname='a very long name' is invalid")):
        cfg.DistConfig(socket_ifname="a very long name")
    with pytest.raises(ValueError, match=re.escape("dist.local_addr='a b' is invalid")):
        cfg.DistConfig(rdzv_endpoint="h:1", nnodes="2", local_addr="a b")


def test_launcher_args_place_the_agent_on_its_address():
    dist = cfg.DistConfig(nproc=2, nnodes="2", node_rank=1, rdzv_endpoint="10.1.2.1:29400", rdzv_id="j",
                          local_addr="10.1.2.2", rdzv_is_host=False, socket_ifname="eth0")
    args = launcher_args(dist, Path("c.toml"))
    for expected in ("--nnodes=2", "--node-rank=1", "--rdzv-endpoint=10.1.2.1:29400", "--local-addr=10.1.2.2",
                     "--rdzv-conf=is_host=0", "--nproc-per-node=2"):
        assert expected in args
    host = launcher_args(cfg.DistConfig(nnodes="2", rdzv_endpoint="h:1", rdzv_is_host=True), Path("c.toml"))
    assert "--rdzv-conf=is_host=1" in host and not any(a.startswith("--local-addr") for a in host)
    elastic = cfg.DistConfig(nnodes="1:2", rdzv_endpoint="h:1", rdzv_is_host=True,
                             rdzv_conf="last_call_timeout=2, keep_alive_interval=1")
    assert "--rdzv-conf=is_host=1,last_call_timeout=2,keep_alive_interval=1" in launcher_args(elastic, Path("c.toml"))


@pytest.mark.parametrize(("conf", "endpoint", "needle"), [
    ("last_call=2", "h:1", "dist.rdzv_conf item 'last_call=2' is invalid: give KEY=N"),
    ("last_call_timeout=0", "h:1", "item 'last_call_timeout=0' is invalid"),
    ("join_timeout=1e9", "h:1", "item 'join_timeout=1e9' is invalid"),
    ("last_call_timeout=2", "", "dist.rdzv_conf only apply to multi-node jobs"),
])
def test_bad_rendezvous_options_are_refused(conf, endpoint, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        cfg.DistConfig(nnodes="1:2", rdzv_endpoint=endpoint, rdzv_conf=conf)


def test_node_local_settings_stay_out_of_the_config_hash():
    base = cfg.RunConfig(dist=cfg.DistConfig(nnodes="2", rdzv_endpoint="h:1"))
    other_node = cfg.RunConfig(dist=cfg.DistConfig(nnodes="2", rdzv_endpoint="h:1", node_rank=1,
                                                   local_addr="10.0.0.2", rdzv_is_host=False, socket_ifname="eth0"))
    assert cfg.config_hash(base) == cfg.config_hash(other_node)
    assert cfg.config_hash(base) != cfg.config_hash(cfg.RunConfig(dist=cfg.DistConfig(nnodes="3",
                                                                                       rdzv_endpoint="h:1")))


def test_cluster_settings_round_trip_through_toml(tmp_path):
    c = resolve(parse("--cluster", "2:1", "--link", "10gbit"))
    assert cfg.load(cfg.save(c, tmp_path / "config.toml")) == c


@pytest.mark.parametrize(
    ("args", "needle"),
    [(["--nodes", "2", "--link", "1gbps"], "link rate '1gbps' is invalid"),
     (["--nodes", "0"], "nodes=0 is invalid: allowed is 1..64"),
     (["--nodes", "2", "--name", "No-Dash"], "cluster name 'No-Dash' is invalid")],
)
def test_bad_cluster_up_arguments_exit_2_with_one_line(args, needle, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("POISE_CLUSTER_STATE_DIR", str(tmp_path))  # rejected before anything is created
    handlers = logging.getLogger("poise").handlers[:]
    try:
        assert main(["cluster", "up", *args]) == 2
    finally:  # main() points poise's log handler at the captured stderr; put the old one back
        logging.getLogger("poise").handlers[:] = handlers
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []
