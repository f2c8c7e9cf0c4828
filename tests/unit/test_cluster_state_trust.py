"""A cluster's state file is input: validated on load, in a directory only its owner can write,
opened without following symlinks (issue 16, item 8). No namespaces are created here."""

from __future__ import annotations

import json
import os
from dataclasses import asdict

import pytest

from poise.cluster import state as cstate
from poise.cluster.state import ClusterState


@pytest.fixture
def state_dir(tmp_path, monkeypatch):
    directory = tmp_path / "clusters"
    directory.mkdir(mode=0o755)
    monkeypatch.setenv("POISE_CLUSTER_STATE_DIR", str(directory))
    return directory


def _write(state_dir, file_name: str, **changes) -> None:
    name = file_name
    state = ClusterState(name=name, nodes=2, procs_per_node=1, link_rate_bit_per_s=10**9, subnet="10.9.8.0/24",
                         phase="up", namespaces=[cstate.switch_namespace(name), cstate.node_namespace(name, 0)])
    (state_dir / f"{name}.json").write_text(json.dumps({**asdict(state), **changes}))


def test_a_valid_state_loads(state_dir):
    _write(state_dir, "c")
    assert ClusterState.load("c").namespaces == ["poise-c-sw", "poise-c-n0"]


@pytest.mark.parametrize("changes,match", [
    ({"name": "other"}, "its name 'other' is not the file's 'c'"),
    ({"name": "../../etc/passwd"}, "is not the file's"),
    ({"namespaces": ["poise-c-n0", "important-netns"]}, "namespaces must all start with 'poise-c-'"),
    ({"namespaces": ["poise-cd-n0"]}, "namespaces must all start with 'poise-c-'"),
    ({"nodes": "2"}, "nodes='2' is invalid"),
    ({"phase": "gone"}, "phase='gone'"),
    ({"subnet": "not a net"}, "subnet="),
    ({"owner_pid": -1}, "owner_pid=-1"),
])
def test_a_state_file_that_is_not_this_clusters_is_refused(state_dir, changes, match):
    _write(state_dir, "c", **changes)
    with pytest.raises(ValueError, match=match):
        ClusterState.load("c")


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o757])
def test_a_state_directory_others_can_write_is_refused(state_dir, mode):
    _write(state_dir, "c")
    os.chmod(state_dir, mode)
    with pytest.raises(ValueError, match="writable by others"):
        ClusterState.load("c")
    with pytest.raises(ValueError, match="writable by others"), cstate.locked():
        pass


def test_symlinks_are_not_followed(state_dir, tmp_path):
    target = tmp_path / "victim"
    target.write_text("precious")
    (state_dir / ".lock").symlink_to(target)
    with pytest.raises(OSError), cstate.locked():
        pass
    assert target.read_text() == "precious"
    (state_dir / "c.json").symlink_to(target)
    with pytest.raises(ValueError, match="cannot be opened"):
        ClusterState.load("c")


def test_a_symlinked_state_directory_is_refused(tmp_path, monkeypatch):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    monkeypatch.setenv("POISE_CLUSTER_STATE_DIR", str(tmp_path / "link"))
    with pytest.raises(ValueError, match="is not a directory"):
        cstate.state_dir()


def test_a_cluster_past_64_processes_is_refused():
    with pytest.raises(ValueError, match="4096 processes on this machine"):
        cstate.validate_shape(64, 64)
