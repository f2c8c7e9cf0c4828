"""Saving checkpoints while training goes on, and finding and loading the newest good one.

A save has two halves. The *snapshot* runs in the training loop: it copies the state's
tensors to fresh CPU memory (DCP's "staging") and is all the loop waits for when saves are
asynchronous. The *write* runs in a background thread: every rank writes its own file and
notes its size and checksum in the job's key-value store; rank 0 also hashes the model and
optimizer tensors, writes those that changed (all of them in a full save), waits for every
rank's note, writes the manifest and renames the directory into place. Only one save is in
flight: a save that finds the previous one still writing waits for it (and that wait counts
as stall). With ``async_save`` off the write runs inline, and all of it is stall.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from poise.checkpoint import contents, directory, layout
from poise.checkpoint.state import DoesNotFit, TrainingState, fit_config, fit_problems, param_shapes
from poise.comm import codecs
from poise.config import RunConfig, config_hash
from poise.runtime.launcher import job_key, job_token

log = logging.getLogger(__name__)

MIN_DELTA_NUMEL = 4096  # smaller tensors are stored whole: a delta would save next to nothing
_TOKEN_KEY = "checkpoint/token"


@dataclass(frozen=True)
class SaveRecord:
    """One checkpoint as rank 0 saw it: bytes are what this save wrote (all ranks' files)."""

    step: int
    kind: str  # "full" or "differential"
    bytes_written: int
    tensors_written: int
    tensors_total: int
    stall_s: float  # seconds the training loop was held up
    write_s: float  # seconds from the snapshot's end to the checkpoint being in place
    max_error: float = 0.0  # largest |restored - saved| entry, in the tensors' units (0: exact)


def _copy(value: Any) -> Any:
    """Deep copy of nested containers, tensors cloned to CPU (a snapshot nothing can change)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copy(v) for v in value)
    return value


class Checkpointer:
    """Saves this rank's part of every checkpoint (see module doc).

    Args:
        config: the run's config (its ``checkpoint`` section, and what a checkpoint must fit).
        rank, world_size: this process in the job.
        store: the job's key-value store, where ranks note their finished files.
        attempt: the launcher's restart count (names partial directories).
        model: for parameter names and shapes in the manifest.
    """

    def __init__(self, config: RunConfig, *, rank: int, world_size: int, store: dist.Store | None,
                 attempt: int, model: torch.nn.Module) -> None:
        self.settings = config.checkpoint
        self.root = Path(config.checkpoint_dir)
        self.rank, self.world_size, self.store, self.attempt = rank, world_size, store, attempt
        self.timeout_s = config.dist.timeout_s
        self.fit = {"config": fit_config(config), "config_hash": config_hash(config), "params": param_shapes(model),
                    "dtypes": {k: str(v.dtype) for k, v in model.state_dict().items()}}
        self.records: list[SaveRecord] = []
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        # rank 0, differential saves: group -> key -> manifest entry of the last save
        self._index: dict[str, dict[str, dict[str, Any]]] = {}
        self._saves_since_full = 0
        # rank 0, lossy deltas: the codec per group, what a restore of the last save gives, and
        # the true tensor's digest then. Optimizer moments always get bf16 deltas: their entries
        # span many orders of magnitude, and a scale shared by a chunk (int8) or dropping the
        # small ones (top-k) left tiny second moments near zero, which made a resumed run diverge.
        self._delta_codecs: dict[str, codecs.Codec] = {}
        if self.settings.delta_codec != "exact":
            self._delta_codecs = {"model": codecs.make(self.settings.delta_codec), "optim": codecs.make("bf16")}
        self._restored: dict[str, torch.Tensor] = {}
        self._true_digest: dict[str, str] = {}
        # names of this writer's own saves (and others it verified): retention skips re-checking them
        self._verified: set[str] = set()
        self._token: str | None = None
        if rank == 0:
            # before training starts: a file in the way, or another job on the directory, stops
            # the run now instead of at its first save
            directory.check_directory(self.root)
            directory.lock(self.root)
            directory.clean_partials(self.root)  # an earlier attempt's unfinished saves: room on a full disk
            self._token = job_token("checkpoint", attempt) or layout.new_token()
            if store is not None and not job_key():
                store.set(_TOKEN_KEY, self._token)

    def token(self) -> str:
        """This attempt's writer token (names partial folders): derived from the job's secret by
        every rank alike when a poise launcher gave one (nothing in the store to replace), else
        rank 0's, shared through the store."""
        if self._token is None:
            self._token = job_token("checkpoint", self.attempt) or None
        if self._token is None:
            assert self.store is not None, "a multi-rank checkpoint needs the job's store"
            self.store.wait([_TOKEN_KEY], timedelta(seconds=self.timeout_s))
            self._token = self.store.get(_TOKEN_KEY).decode()
        return self._token

    def due(self, steps_done: int) -> bool:
        return self.settings.every_steps > 0 and steps_done % self.settings.every_steps == 0

    def save(self, state: TrainingState) -> float:
        """Snapshot ``state`` and write it (in the background with ``async_save``); returns the
        seconds the caller was held up (the stall: the snapshot, or the whole write when sync)."""
        start = time.perf_counter()
        self.wait()
        snapshot = TrainingState(
            tensors=_copy(state.tensors) if self.rank == 0 else {},
            shared=_copy(state.shared) if self.rank == 0 else {},
            per_rank=_copy(state.per_rank),
        )
        if self.settings.async_save:
            stall = time.perf_counter() - start
            self._thread = threading.Thread(target=self._write_guarded, args=(snapshot, stall), daemon=True,
                                            name=f"poise-checkpoint-{state.per_rank['step']}")
            self._thread.start()
            return stall
        self._write(snapshot, stall_start=start)
        return time.perf_counter() - start

    def wait(self) -> None:
        """Block until the save in flight (if any) is in place; re-raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"writing a checkpoint failed: {error}") from error

    def _write_guarded(self, snapshot: TrainingState, stall_s: float) -> None:
        try:
            self._write(snapshot, stall_s=stall_s)
        except BaseException as exc:  # reported by the next wait() in the training loop
            self._error = exc

    def _write(self, snapshot: TrainingState, *, stall_s: float = 0.0, stall_start: float | None = None) -> None:
        step = int(snapshot.per_rank["step"])  # every rank's part carries it: the ranks meet under it
        partial = self.root / layout.partial_name(step, self.token())
        try:
            self._write_into(partial, snapshot, stall_s=stall_s, stall_start=stall_start)
        except BaseException:
            if self.rank == 0:  # a failed save leaves no partial folder behind to fill the disk
                directory.clean_partials(self.root)
            raise

    def _write_into(self, partial: Path, snapshot: TrainingState, *, stall_s: float,
                    stall_start: float | None) -> None:
        begin = time.perf_counter()
        step = int(snapshot.per_rank["step"])
        try:
            partial.mkdir(exist_ok=True)  # never recreates a checkpoint directory that was removed
        except FileNotFoundError:
            raise FileNotFoundError(f"checkpoint directory {str(self.root)!r} is gone: it was removed during "
                                    "the run") from None
        try:
            mine = directory.write_payload(partial, layout.rank_file(self.rank), snapshot.per_rank)
        except BaseException:
            # this save can never count (rank 0 gets no note from this rank, so nothing of it is
            # renamed into place), and after this rank's failure the launcher stops rank 0 in its
            # wait, before rank 0 could remove the folder: a full disk must not keep it
            if self.rank != 0:
                directory.remove_partial(partial)
            raise
        note = json.dumps(mine.entry())
        if self.store is not None:
            self.store.set(f"checkpoint/{step}/rank-{self.rank}", note)
        if self.rank != 0:
            return
        files = {mine.name: mine.entry()}
        full = (not self.settings.differential or not self._index
                or self._saves_since_full + 1 >= self.settings.full_every)
        name = layout.checkpoint_name(step)
        index: dict[str, dict[str, dict[str, Any]]] = {}
        written, max_error = 0, 0.0
        for group in ("model", "optim"):
            entries, payload = {}, {}
            for key, tensor in snapshot.tensors.items():
                if not key.startswith(group + "/"):
                    continue
                previous = None if full else self._index.get(group, {}).get(key)
                entries[key], stored, error = self._entry(key, tensor, previous, name)
                if stored is not None:
                    payload[key] = stored
                max_error = max(max_error, error)
            written += len(payload)
            index[group] = entries
            files[f"{group}.pt"] = directory.write_payload(partial, f"{group}.pt", payload).entry()
        files["state.pt"] = directory.write_payload(partial, "state.pt", snapshot.shared).entry()
        for r in range(1, self.world_size):
            files[layout.rank_file(r)] = json.loads(self._wait_note(step, r))
        self._confirm_parts(partial, {k: v for k, v in files.items() if k.startswith("rank-")})
        bases = sorted({holder for group in index.values() for e in group.values() for holder in layout.holders(e)}
                       | {name})
        manifest = {
            "step": step, "kind": "full" if full else "differential", "world_size": self.world_size,
            "files": files, "bases": bases, "tensors": index, **self.fit,
        }
        directory.finalize(self.root, partial, step, manifest)
        self._verified.add(name)
        self._index = index
        self._saves_since_full = 0 if full else self._saves_since_full + 1
        total_bytes = sum(f["bytes"] for f in files.values())
        if stall_start is not None:
            stall_s = time.perf_counter() - stall_start
        record = SaveRecord(step, manifest["kind"], total_bytes, written, len(snapshot.tensors), stall_s,
                            time.perf_counter() - begin, max_error)
        self.records.append(record)
        deleted = directory.prune(self.root, self.settings.keep, self.token(), name, self._verified)
        log.info("checkpoint %s: %s, %.2f MB, %d of %d tensors written, stall %.1f ms, write %.2f s%s%s",
                 name, record.kind, total_bytes / 1e6, written, len(snapshot.tensors), 1e3 * stall_s,
                 record.write_s, f", restores within {max_error:.2g}" if max_error else "",
                 f", removed {', '.join(deleted)}" if deleted else "")

    def _entry(self, key: str, tensor: torch.Tensor, previous: dict[str, Any] | None,
               name: str) -> tuple[dict[str, Any], Any, float]:
        """Rank 0: ``(manifest entry, what to store under key in this save or None, max |error|)``.

        Unchanged since the last save (same digest): the previous entry, nothing stored. Else, in
        a full save or with exact deltas: the tensor itself. Else, with a delta codec: the
        codec's encoding of the change since what a restore of the last save gives, which
        carries every earlier delta's error forward (error feedback), so the error never grows
        past one encoding's.
        """
        digest = layout.tensor_digest(tensor)
        if previous is not None and self._true_digest.get(key) == digest:
            return previous, None, float((tensor - self._restored[key]).abs().max()) if "deltas" in previous else 0.0
        self._true_digest[key] = digest
        codec = self._delta_codecs.get(key.split("/", 1)[0])
        if previous is None or codec is None or not tensor.is_floating_point() or tensor.numel() < MIN_DELTA_NUMEL:
            if codec is not None:
                self._restored[key] = tensor
            return {"in": name, "sha256": digest}, tensor, 0.0
        encoded = codec.encode(tensor - self._restored[key])
        self._restored[key] = self._restored[key] + codec.decode(encoded)
        entry = {**previous, "deltas": [*previous.get("deltas", []), {"in": name, "codec": codec.name}]}
        return entry, list(encoded.tensors), float((tensor - self._restored[key]).abs().max())

    def _confirm_parts(self, partial: Path, parts: dict[str, Any]) -> None:
        """Rank 0: every rank's file is in ``partial`` as its note in the store says (size and
        sha256) before the save counts. A note is only a claim: a rank that wrote elsewhere (its
        token replaced in the store by another local process) or a note forged there would
        otherwise give a checkpoint missing a rank, logged as saved.

        Raises:
            RuntimeError: naming the rank whose part is not on disk as reported.
        """
        try:
            layout.check_files(partial, parts)
        except (layout.CorruptCheckpoint, KeyError, TypeError, AttributeError) as exc:  # a note may be forged
            raise RuntimeError(f"checkpoint {partial.name.removeprefix(layout.PARTIAL_PREFIX)[:13]}: a rank's part "
                               f"is not on disk as its note in the job's store says ({exc}): this save does not "
                               "count") from None

    def _wait_note(self, step: int, rank: int) -> str:
        assert self.store is not None, "a multi-rank checkpoint needs the job's store"
        key = f"checkpoint/{step}/rank-{rank}"
        self.store.wait([key], timedelta(seconds=self.timeout_s))
        return self.store.get(key).decode()

    def report(self) -> dict[str, Any]:
        """For report.json: every save, and medians of bytes and stall by kind."""
        out: dict[str, Any] = {"saves": [asdict(r) for r in self.records]}
        for kind in ("full", "differential"):
            rows = [r for r in self.records if r.kind == kind]
            if rows:
                out[f"{kind}_bytes_median"] = float(torch.tensor([float(r.bytes_written) for r in rows]).median())
        if self.records:
            out["stall_s_median"] = float(torch.tensor([r.stall_s for r in self.records]).median())
            out["bytes_written_total"] = sum(r.bytes_written for r in self.records)
        return out


def check_fresh_start(config: RunConfig) -> None:
    """A new run that saves checkpoints must not mix them with an earlier run's.

    Raises:
        ValueError: when the checkpoint directory already holds checkpoints.
    """
    root = Path(config.checkpoint_dir)
    found = layout.list_checkpoints(root)
    if config.checkpoint.every_steps and not config.checkpoint.resume and found:
        raise ValueError(
            f"checkpoint directory {str(root)!r} already holds checkpoints (newest {found[0][1].name}): "
            "pass --resume to continue from them, or give another --checkpoint-dir / --out"
        )


def find_resume_point(config: RunConfig, *, required: bool,
                      below: int | None = None) -> tuple[str, dict[str, Any]] | None:
    """The newest good checkpoint in the run's directory (of a step before ``below``, when given;
    run on rank 0 only): one that verifies and loads (:func:`~poise.checkpoint.contents.newest_loadable`).
    The newer ones, which do not, are renamed aside (:func:`poise.checkpoint.directory.set_aside`).

    The directory's lock is taken first, so that a second job on it changes nothing (it gets
    the lock's one-line error); unfinished saves' partial folders are removed.

    Raises:
        ValueError: when ``required`` and the directory is missing or holds no good checkpoint,
            or when another job holds the directory.
    """
    root = Path(config.checkpoint_dir)
    if required and not root.is_dir():
        raise ValueError(f"checkpoint.resume is set but the checkpoint directory {str(root)!r} does not exist")
    if root.is_dir():
        directory.lock(root)
        directory.clean_partials(root)
        directory.recover(root)
    found = contents.newest_loadable(root, below)
    if found is None and required:
        raise ValueError(f"checkpoint.resume is set but {str(root)!r} holds no complete, intact checkpoint")
    if root.is_dir():
        # those newer than the one resumed from do not verify: out of the way of retention and restarts
        directory.set_aside(root, int(found[1]["step"]) if found is not None else -1)
    return found


def load(config: RunConfig, name: str, manifest: dict[str, Any], *, rank: int, world_size: int,
         model: torch.nn.Module) -> TrainingState:
    """Read checkpoint ``name`` for this rank, after checking that it fits the run.

    Raises:
        DoesNotFit: one line naming what does not fit (config settings, parameter names or shapes).
        CorruptCheckpoint, or whatever a damaged file makes loading raise.
    """
    root = Path(config.checkpoint_dir)
    problems = fit_problems(manifest, config, model)
    if problems:
        raise DoesNotFit(
            f"checkpoint {root / name} does not fit this run: {'; '.join(problems[:3])}"
            f"{f' (+{len(problems) - 3} more)' if len(problems) > 3 else ''} "
            f"[config hash {manifest['config_hash'][:12]} in the checkpoint, {config_hash(config)[:12]} now]"
        )
    tensors = {**layout.load_tensors(root, manifest, "model"), **layout.load_tensors(root, manifest, "optim")}
    shared = layout.load_file(root / name / "state.pt")
    per_rank: dict[str, Any] = {}
    saved_world = int(manifest["world_size"])
    if saved_world == world_size:
        per_rank = layout.load_file(root / name / layout.rank_file(rank))
        grads = per_rank.get("grads")
    else:
        log.warning("resuming on %d ranks from a checkpoint of %d: the rest of the epoch is re-planned; "
                    "RNG states, error-feedback residuals and speed estimates start fresh",
                    world_size, saved_world)
        grads = composed_grads(root / name, rank, world_size, saved_world) if shared.get("in_window") else None
    return TrainingState(tensors, shared, per_rank, grads)


def composed_grads(path: Path, rank: int, world_size: int, saved_world: int) -> dict[str, torch.Tensor] | None:
    """This rank's share of an accumulation window's gradients saved by ``saved_world`` ranks.

    The window's reduction is ``(1/W) Σ_r g_r`` over the saved ranks. New rank ``k`` of ``W'``
    takes ``(W'/W) Σ_{r ≡ k mod W'} g_r``; averaging those over the ``W'`` new ranks gives the
    same reduction, so the window completes as if no rank had changed.
    """
    out: dict[str, torch.Tensor] | None = None
    for r in range(rank, saved_world, world_size):
        grads = layout.load_file(path / layout.rank_file(r)).get("grads") or {}
        if out is None:
            out = {k: torch.zeros_like(v) for k, v in grads.items()}
        for key, grad in grads.items():
            out[key] += grad * (world_size / saved_world)
    return out
