"""Checkpoints that lose nothing: complete, atomic, verified, asynchronous and differential.

What is saved (:mod:`poise.checkpoint.state`): the model, the optimizer, the LR scheduler, the
step, every rank's RNG states, the data schedule's epoch, position and plan, the re-planner's
shares and speed windows, and the comm hook's error-feedback residuals, so that a resumed run
takes the very steps the uninterrupted one would have taken.

How it is written (:mod:`poise.checkpoint.layout`: names, manifests, verification;
:mod:`poise.checkpoint.directory`: writing, the lock, retention; :mod:`poise.checkpoint.saver`):
a temporary directory, files written to temporary names, fsync'd and renamed, a manifest with
the size and sha256 of every file written last, then the directory renamed into place; on load
the newest checkpoint that verifies is used, and a corrupt or incomplete one is skipped with a
one-line warning. Saves are asynchronous (a snapshot in memory, written by a background
thread) and differential (between full bases, only tensors whose hash changed are written;
restore composes base + differentials and checks every tensor's hash: bit-exact). With a
``delta_codec``, changed tensors are written as codec-encoded changes since the last save,
with error feedback against the restorable state (see ``Checkpointer._entry``): fewer
bytes in full training, restored within the error each save logs.

torch.distributed.checkpoint (DCP) and what poise adds. DCP saves a state dict from every
rank in parallel: each rank plans the tensor pieces it owns, replicated tensors are
deduplicated so one rank writes them, a ``.metadata`` file records where each piece lives,
and loading reshards pieces onto whatever layout the new job has; ``async_save`` stages the
tensors in CPU memory and writes them in the background. Under DDP every tensor of the
model and optimizer is a full replica, so DCP would have rank 0 write all of them, as here,
and resharding has nothing to do. What rules it out for poise is loading: DCP's file-system
reader unpickles ``.metadata`` (``pickle.load`` in torch 2.13), so a crafted checkpoint could
run code, while poise reads checkpoints only with ``torch.load(weights_only=True)`` and
plain JSON. poise therefore writes its own files and borrows DCP's design for the rest
(staging to CPU, one writer per replicated tensor, per-rank files for per-rank state), and
adds what DCP lacks: per-file checksums with fallback to the previous good checkpoint,
differential saves, the non-tensor training state (data position, RNGs, residuals), a fit
check against the config and parameter shapes before anything is loaded, and re-planning
the rest of an epoch when a job comes back with another number of ranks.
"""

from poise.checkpoint.saver import Checkpointer, SaveRecord, check_fresh_start, find_resume_point, load
from poise.checkpoint.state import DoesNotFit, TrainingState, capture, live_problems, restore

__all__ = [
    "Checkpointer", "DoesNotFit", "SaveRecord", "TrainingState", "capture", "check_fresh_start",
    "find_resume_point", "live_problems", "load", "restore",
]
