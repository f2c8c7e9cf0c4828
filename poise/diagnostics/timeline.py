"""Per-rank, per-step measurements, gathered to rank 0 at a fixed interval.

Every rank records one :class:`StepRecord` per training step: wall-clock seconds spent
loading data, in forward, in its own backward compute, blocked in gradient communication
and in the optimizer, plus the samples, real tokens and gradient bytes it processed.

How compute is separated from communication: DDP's all-reduce evens out backward time
across ranks (every rank waits for the slowest), so timing ``backward()`` as a whole would
hide a slow rank. Instead the DDP communication hook is wrapped by a probe
(:class:`poise.comm.probe.BucketProbe`) that notes when the *last* gradient bucket became
ready on this rank: forward + backward up to that moment is the rank's own compute; the
rest of ``backward()`` is time blocked in communication (transfer plus waiting for slower
ranks). On CUDA the marks are CUDA events, read after the step (``runtime/clock.py``).

Records are gathered to rank 0 every ``gather_every_steps`` steps with one ``gather`` of a
small float64 tensor, not every step, so measuring costs one tiny collective per interval.
Rank 0 keeps the full history and exports it as a Chrome trace (open in Perfetto) and as
``timeline.npz`` (:func:`save_table`), the table itself with its field names, which
``poise diagnose run`` reads back (:func:`load_table`) for any run, a user's script included.
"""

from __future__ import annotations

import dataclasses
import io
import math
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from poise.files import write_atomic, write_json_atomic


@dataclass(frozen=True)
class StepRecord:
    """One rank's figures for one step (seconds unless named otherwise).

    ``start_time_s`` is wall-clock (``time.time()``) so ranks on one machine line up in the
    trace; durations come from ``time.perf_counter()``.
    """

    step: int
    start_time_s: float
    data_s: float
    forward_s: float
    backward_s: float
    comm_wait_s: float
    optim_s: float
    step_s: float
    samples: int
    tokens: int
    padded_tokens: int
    loss: float
    raw_bytes: int  # gradient bytes handed to communication
    wire_bytes: int  # bytes this rank put into collectives after compression
    inter_node_raw_bytes: int  # hierarchical with a codec: node-sum bytes this leader encoded (0 elsewhere)
    inter_node_wire_bytes: int  # ... and the compressed bytes it sent to the other nodes' leaders
    codec_s: float  # encode + decode seconds (encode overlaps backward, decode the wait)
    comm_busy_s: float  # seconds at least one gradient bucket was being reduced
    comm_hidden_s: float  # the part of comm_busy_s that overlapped this rank's backward compute
    skipped: int  # 1 when the optimizer step was skipped (non-finite gradients)
    # CPU seconds (NaN: not measured, e.g. a timeline written before they were recorded)
    cpu_s: float = float("nan")  # this rank's process, from the previous step's end to this one's (all threads)
    compute_cpu_s: float = float("nan")  # its training thread inside forward and backward
    # wall seconds of its compute: forward + backward until the last bucket was handed over (under
    # deadline steps the micro-batches' own spans, without the stalls and claims between them;
    # without the sleeps of emulated slowness, which stand for a slower chip).
    # compute_cpu_s / compute_wall_s is the share of its compute the training thread spent on a
    # CPU; compute_cpu_s also counts the thread's work while backward finishes the reduction (DDP
    # copying reduced buckets back, a codec's decode), so with a tiny model it can exceed 1.
    compute_wall_s: float = float("nan")

    @property
    def compute_s(self) -> float:
        """This rank's own forward + backward compute, excluding communication waits."""
        return self.forward_s + self.backward_s


FIELDS = tuple(f.name for f in dataclasses.fields(StepRecord))
# fields a timeline written by an earlier poise may lack: they load as NaN (not measured)
OPTIONAL_FIELDS = ("cpu_s", "compute_cpu_s", "compute_wall_s")


class Timeline:
    """Collects this rank's step records; rank 0 ends up with every rank's.

    Every rank must call :meth:`record` for the same steps and :meth:`flush` at the same
    point, because gathering is a collective.
    """

    def __init__(self, rank: int, world_size: int, gather_every_steps: int, device: torch.device,
                 on_gather: Callable[[np.ndarray], None] | None = None):
        self.rank = rank
        self.world_size = world_size
        self.gather_every_steps = gather_every_steps
        self.device = device
        self._pending: list[StepRecord] = []
        self._gathered: list[np.ndarray] = []  # rank 0 only: [world, n, fields] blocks
        # rank 0: called with each newly gathered block (the live metrics), no collective of its own
        self.on_gather = on_gather

    def record(self, rec: StepRecord) -> None:
        """Add this rank's record; gathers to rank 0 when the interval is full."""
        self._pending.append(rec)
        if len(self._pending) >= self.gather_every_steps:
            self.flush()

    def flush(self) -> None:
        """Gather whatever is pending on every rank to rank 0 (a collective; call on all ranks)."""
        if not self._pending:
            return
        mine = torch.tensor(
            [[float(getattr(r, f)) for f in FIELDS] for r in self._pending],
            dtype=torch.float64,
            device=self.device,
        )
        self._pending.clear()
        if self.world_size == 1:
            block = mine.cpu().numpy()[None]
        else:
            bucket = [torch.empty_like(mine) for _ in range(self.world_size)] if self.rank == 0 else None
            dist.gather(mine, gather_list=bucket, dst=0)
            if bucket is None:
                return
            block = torch.stack(bucket).cpu().numpy()
        self._gathered.append(block)
        if self.on_gather is not None:
            self.on_gather(block)

    def table(self) -> np.ndarray:
        """Rank 0: array ``[world_size, steps, len(FIELDS)]`` of everything gathered so far."""
        if self.rank != 0:
            raise RuntimeError("only rank 0 holds the gathered timeline")
        if not self._gathered:
            return np.zeros((self.world_size, 0, len(FIELDS)))
        return np.concatenate(self._gathered, axis=1)


def column(table: np.ndarray, name: str) -> np.ndarray:
    """The ``[ranks, steps]`` slice of one field (or ``compute_s``) of a gathered table."""
    if name == "compute_s":
        return column(table, "forward_s") + column(table, "backward_s")
    return table[:, :, FIELDS.index(name)]


def elapsed_s(table: np.ndarray) -> np.ndarray:
    """Seconds the job had spent in its steps by the end of each step (``[steps]``): per rank
    its own step seconds summed (each rank's own clock, so hosts need not agree on the time),
    the latest rank at every step; the last entry is the job's time in steps.

    Why not each step's slowest rank, summed: under deadline steps a rank whose stall outlasted
    a reduction (the watchdog entered it for the rank) ends its step while the others are
    already in their next one, and summing each step's slowest rank counts that overlap twice
    (7 % of a 40-step run at 4 ranks under Pareto delays, ``runs/s37-normal``). Under
    synchronous steps the two agree: every rank leaves each all-reduce at the same moment.
    """
    return column(table, "step_s").cumsum(axis=1).max(axis=0)


def cpus_busy(table: np.ndarray) -> np.ndarray:
    """Per rank, the CPUs its process kept busy over its steps, all its threads: ``cpu_s`` over
    ``step_s`` (1.0: one core's worth; below 1 each on a machine with fewer cores than ranks ×
    threads). NaN where not measured (a timeline from before CPU seconds were recorded)."""
    cpu, step = column(table, "cpu_s").sum(axis=1), column(table, "step_s").sum(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(step > 0, cpu / step, np.nan)


def on_cpu_share(table: np.ndarray) -> np.ndarray:
    """Per rank, the share (0..1) of its compute's wall seconds its training thread spent on a
    CPU: ``compute_cpu_s`` over ``compute_wall_s``, summed over the steps where both were
    recorded (NaN for a rank with none). Below 1 on a CPU rank: its thread waited for a core."""
    cpu, wall = column(table, "compute_cpu_s"), column(table, "compute_wall_s")
    measured = np.isfinite(cpu) & np.isfinite(wall)
    wall_s = np.where(measured, wall, 0.0).sum(axis=1)
    cpu_s = np.where(measured, cpu, 0.0).sum(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(wall_s > 0, np.minimum(cpu_s / wall_s, 1.0), np.nan)


TABLE_FORMAT = "poise-timeline-1"


class TimelineFileError(ValueError):
    """A timeline file that cannot be used (truncated, not a timeline, fields missing); one line."""


def save_table(table: np.ndarray, path: str | Path) -> Path:
    """Write a gathered ``table`` ``[ranks, steps, fields]`` with its field names to ``path``
    (npz, compressed, atomic): what a run leaves for ``poise diagnose run``."""
    def write(handle: io.BufferedIOBase) -> None:
        np.savez_compressed(handle, table=np.asarray(table, dtype=np.float64), fields=np.array(FIELDS),
                            format=np.array(TABLE_FORMAT))
    return write_atomic(path, write)


# What load_table accepts, checked from the file's headers before anything is decompressed (a
# small compressed file can hold a huge array): 2^26 float64 entries is 512 MB, e.g. 64 ranks x
# 50,000 steps x 20 fields.
MAX_TIMELINE_FILE_BYTES = 1 << 30
MAX_TABLE_ENTRIES = 1 << 26
MAX_FIELDS = 1024
_ARRAYS = {"table": MAX_TABLE_ENTRIES, "fields": MAX_FIELDS, "format": 1}


def _check_npz(path: Path) -> None:
    """Refuse, from the zip directory and the ``.npy`` headers alone, an npz whose arrays
    :func:`load_table` would not read within bounds: a member too large, of an object
    (pickled) or non-numeric dtype, or an array of more entries than :data:`_ARRAYS` allows.

    Raises:
        FileNotFoundError: no such file. TimelineFileError: one line naming what is wrong.
    """
    if path.is_dir() or (path.exists() and not path.is_file()):
        raise TimelineFileError(f"{path}: not a regular file")
    if path.stat().st_size > MAX_TIMELINE_FILE_BYTES:
        raise TimelineFileError(f"{path}: larger than {MAX_TIMELINE_FILE_BYTES} bytes")
    with zipfile.ZipFile(path) as archive:
        for name, limit in _ARRAYS.items():
            try:
                info = archive.getinfo(f"{name}.npy")
            except KeyError:
                continue  # np.load names what is missing
            with archive.open(info) as member:
                version = np.lib.format.read_magic(member)
                if version not in ((1, 0), (2, 0)):
                    raise TimelineFileError(f"{path}: {name} has npy format {version}, expected 1.0 or 2.0")
                read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                               else np.lib.format.read_array_header_2_0)
                shape, _, dtype = read_header(member)  # the header only: nothing is decompressed beyond it
            entries = math.prod(shape)
            if dtype.hasobject or dtype.kind not in ("f", "i", "u", "b", "U", "S"):
                raise TimelineFileError(f"{path}: {name} has dtype {dtype}, expected numbers or text")
            if entries > limit or entries * dtype.itemsize > MAX_TIMELINE_FILE_BYTES:
                raise TimelineFileError(f"{path}: {name} has shape {list(shape)[:8]}: more than {limit} entries")


def load_table(path: str | Path) -> np.ndarray:
    """Read a file of :func:`save_table` back as ``[ranks, steps, len(FIELDS)]`` in today's field order.

    Fields are matched by name, so a file with extra fields still loads; a missing field, a
    truncated file, an array of the wrong shape or non-finite durations raise one line. The
    arrays' sizes and types are checked from their headers first (:func:`_check_npz`).

    Raises:
        TimelineFileError: naming the file and what is wrong with it.
    """
    path = Path(path)
    try:
        _check_npz(path)
        with np.load(path, allow_pickle=False) as data:
            names = [str(n) for n in np.asarray(data["fields"]).reshape(-1)]
            table = np.asarray(data["table"], dtype=np.float64)
            fmt = str(data["format"]) if "format" in data.files else ""
    except FileNotFoundError:
        raise TimelineFileError(f"{path}: no such file (Session.finish writes it with out_dir set)") from None
    except TimelineFileError:
        raise
    except (zipfile.BadZipFile, zipfile.LargeZipFile, zlib.error, EOFError, OSError, KeyError, ValueError,
            TypeError, RuntimeError, NotImplementedError) as exc:  # RuntimeError: an encrypted member
        raise TimelineFileError(f"{path}: not a readable poise timeline ({type(exc).__name__}: "
                                f"{str(exc)[:200]})") from None
    if fmt != TABLE_FORMAT:
        raise TimelineFileError(f"{path}: format {fmt!r}, expected {TABLE_FORMAT!r}")
    if table.ndim != 3 or table.shape[2] != len(names):
        raise TimelineFileError(f"{path}: table of shape {list(table.shape)} does not match its {len(names)} "
                                "field names (expected [ranks, steps, fields])")
    missing = [f for f in FIELDS if f not in names and f not in OPTIONAL_FIELDS]
    if missing:
        raise TimelineFileError(f"{path}: fields {', '.join(missing)} are missing (written by another poise version?)")
    absent = [f for f in OPTIONAL_FIELDS if f not in names]
    if absent:  # not measured by the poise that wrote the file
        table = np.concatenate([table, np.full((*table.shape[:2], len(absent)), np.nan)], axis=2)
        names = [*names, *absent]
    table = table[:, :, [names.index(f) for f in FIELDS]]
    if table.shape[0] == 0 or table.shape[1] == 0:
        raise TimelineFileError(f"{path}: no steps recorded ({table.shape[0]} ranks, {table.shape[1]} steps)")
    durations = [FIELDS.index(f) for f in ("data_s", "forward_s", "backward_s", "comm_wait_s", "optim_s", "step_s")]
    if not np.all(np.isfinite(table[:, :, durations])) or np.any(table[:, :, durations] < -1e-6):
        raise TimelineFileError(f"{path}: durations are not finite non-negative seconds")
    counts = [FIELDS.index(f.name) for f in dataclasses.fields(StepRecord) if f.type in ("int", int)]
    if not np.all(np.isfinite(table[:, :, counts])) or np.any(table[:, :, counts] < 0):
        raise TimelineFileError(f"{path}: counts (steps, samples, tokens, bytes, skipped) are not finite and >= 0")
    return table


def chrome_trace(table: np.ndarray) -> dict:
    """Chrome trace-event JSON (Perfetto, chrome://tracing): one track per rank.

    Phases are drawn back to back from each step's start: data, forward, backward,
    communication wait, optimizer. Timestamps are microseconds.
    """
    phases = ("data_s", "forward_s", "backward_s", "comm_wait_s", "optim_s")
    origin = float(column(table, "start_time_s").min()) if table.size else 0.0
    events: list[dict] = []
    for rank in range(table.shape[0]):
        events.append(
            {"ph": "M", "name": "thread_name", "pid": 0, "tid": rank, "args": {"name": f"rank {rank}"}}
        )
        for row in table[rank]:
            rec = dict(zip(FIELDS, row.tolist(), strict=True))
            t = (rec["start_time_s"] - origin) * 1e6
            for phase in phases:
                dur = rec[phase] * 1e6
                events.append(
                    {
                        "name": phase.removesuffix("_s"),
                        "ph": "X",
                        "pid": 0,
                        "tid": rank,
                        "ts": round(t, 1),
                        "dur": round(dur, 1),
                        "args": {"step": int(rec["step"])},
                    }
                )
                t += dur
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(table: np.ndarray, path: str | Path) -> Path:
    """Write :func:`chrome_trace` of ``table`` to ``path``."""
    return write_json_atomic(path, chrome_trace(table), indent=None)
