"""``[dist]``: where the workers run and how they find each other."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from poise.config.fields import check_finite, check_positive, setting

BACKENDS = ("auto", "gloo", "nccl")
START_METHODS = ("auto", "fork", "subprocess")
# torch's c10d/etcd rendezvous options (torchrun's --rdzv-conf) in whole seconds or counts;
# is_host has a setting of its own (rdzv_is_host)
RDZV_CONF_KEYS = ("join_timeout", "last_call_timeout", "close_timeout", "read_timeout", "keep_alive_interval",
                  "keep_alive_max_attempt")
MAX_RDZV_CONF_VALUE = 7 * 24 * 3600
# More local workers than this on one machine is almost certainly a typo (e.g. 1000 for 10).
MAX_LOCAL_WORKERS = 64
MAX_TIMEOUT_S = 7 * 24 * 3600
# Machines in one job: far beyond any cluster, and a bound on the ranks that seeds and ids count.
MAX_NODES = 100_000


@dataclass(frozen=True, kw_only=True)
class DistConfig:
    """Where the workers run and how they find each other (passed to torch.distributed.run)."""

    nproc: int = setting(2, "worker processes on this machine")
    nnodes: str = setting("1", "number of machines, or MIN:MAX for an elastic job")
    node_rank: int | None = setting(None, "this machine's rank (static rendezvous only)")
    rdzv_endpoint: str = setting("", "HOST:PORT of the rendezvous for multi-node jobs ('' = standalone)")
    rdzv_backend: str = setting("c10d", "torch rendezvous backend for multi-node jobs")
    rdzv_id: str = setting("poise", "job id shared by all machines of one job")
    backend: str = setting("auto", f"process-group backend: {', '.join(BACKENDS)} (auto: nccl with CUDA)")
    timeout_s: float = setting(120.0, "timeout of every collective and store wait, in seconds")
    threads_per_worker: int = setting(0, "torch CPU threads per worker (0 = cores / workers on this machine)")
    local_addr: str = setting(
        "", "address of this machine that the agent and workers use for the rendezvous ('' = its hostname's)"
    )
    rdzv_conf: str = setting(
        "", "rendezvous options as torchrun's --rdzv-conf, KEY=N,...: last_call_timeout (seconds an elastic job "
        "waits for more machines once it has enough; torch's default 30), join_timeout, close_timeout, "
        "read_timeout, keep_alive_interval (seconds), keep_alive_max_attempt"
    )
    rdzv_is_host: bool | None = setting(
        None, "whether this machine's agent hosts the c10d rendezvous store (unset = when the endpoint is its own)"
    )
    socket_ifname: str = setting("", "network interface gloo/NCCL sockets bind to ('' = the backend's choice)")
    start_method: str = setting(
        "auto", "how the workers start: fork (from the launcher, which imported torch once), subprocess (each "
        "a new interpreter: python -m MODULE), auto (fork where torch has no GPU build and each worker uses one "
        "CPU thread; else subprocess)"
    )
    max_restarts: int = setting(0, "times the launcher restarts the workers after one fails (see --checkpoint-every)")
    keep_freed_memory: bool | None = setting(
        None, "keep the memory a step frees for the next (glibc; given back past half of this worker's "
        "share of the machine's memory; unset = when training on the CPU)"
    )

    def worker_threads(self, cores: int, workers_on_machine: int) -> int:
        """CPU threads per worker: ``threads_per_worker``, or ``cores`` shared evenly by the
        machine's ``workers_on_machine`` workers (at least 1)."""
        return self.threads_per_worker or max(1, cores // max(1, workers_on_machine))

    def __post_init__(self) -> None:
        check_finite("dist", self)
        check_positive("dist", "nproc", self.nproc, allow_none=False)
        if self.max_restarts < 0:
            raise ValueError(f"dist.max_restarts={self.max_restarts} must be >= 0")
        if self.nproc > MAX_LOCAL_WORKERS:
            raise ValueError(
                f"dist.nproc={self.nproc} is not sensible: allowed is 1..{MAX_LOCAL_WORKERS} "
                f"(this machine has {os.cpu_count()} cores)"
            )
        parts = self.nnodes.split(":")
        whole = all(p.isascii() and p.isdigit() and len(p) <= 9 for p in parts)
        if len(parts) > 2 or not whole or not all(0 < int(p) <= MAX_NODES for p in parts):
            raise ValueError(f"dist.nnodes={self.nnodes[:40]!r} is invalid: give N or MIN:MAX, integers from 1 to "
                             f"{MAX_NODES}")
        if self.node_rank is not None and self.node_rank < 0:
            raise ValueError(f"dist.node_rank={self.node_rank} must be >= 0")
        if self.backend not in BACKENDS:
            raise ValueError(f"dist.backend={self.backend!r} is unknown: allowed are {', '.join(BACKENDS)}")
        if self.start_method not in START_METHODS:
            raise ValueError(f"dist.start_method={self.start_method!r} is unknown: allowed are "
                             f"{', '.join(START_METHODS)}")
        check_positive("dist", "timeout_s", self.timeout_s, allow_none=False)
        if self.timeout_s > MAX_TIMEOUT_S:  # torch keeps it as a timedelta: 1e300 s overflows in every worker
            raise ValueError(f"dist.timeout_s={self.timeout_s:g} is invalid: allowed is at most {MAX_TIMEOUT_S} s")
        if self.threads_per_worker < 0:
            raise ValueError(f"dist.threads_per_worker={self.threads_per_worker} must be >= 0")
        if self.rdzv_endpoint and ":" not in self.rdzv_endpoint:
            raise ValueError(f"dist.rdzv_endpoint={self.rdzv_endpoint!r} is invalid: give HOST:PORT")
        if self.local_addr and not re.fullmatch(r"[A-Za-z0-9.:_-]+", self.local_addr):
            raise ValueError(f"dist.local_addr={self.local_addr!r} is invalid: give a host name or an IP address")
        if self.socket_ifname and not re.fullmatch(r"[A-Za-z0-9._-]{1,15}", self.socket_ifname):
            raise ValueError(
                f"dist.socket_ifname={self.socket_ifname!r} is invalid: give an interface name of 1-15 characters"
            )
        if not self.rdzv_endpoint and (self.local_addr or self.rdzv_is_host is not None or self.rdzv_conf):
            raise ValueError("dist.local_addr, dist.rdzv_is_host and dist.rdzv_conf only apply to multi-node jobs: "
                             "set dist.rdzv_endpoint=HOST:PORT as well")
        for item in filter(None, self.rdzv_conf.split(",")):
            key, _, value = item.partition("=")
            if key.strip() not in RDZV_CONF_KEYS or not value.strip().isdigit() or \
                    not 0 < int(value) <= MAX_RDZV_CONF_VALUE:
                raise ValueError(f"dist.rdzv_conf item {item[:40]!r} is invalid: give KEY=N with N from 1 to "
                                 f"{MAX_RDZV_CONF_VALUE} and KEY one of {', '.join(RDZV_CONF_KEYS)}")


# Settings that differ from machine to machine in one job: left out of the config hash that
# ranks compare, since every machine writes its own config file.
NODE_LOCAL_SETTINGS = {"dist": ("node_rank", "local_addr", "rdzv_is_host", "socket_ifname")}

