"""Streaming DiLoCo's fragments (Douillard et al. 2025): how the model's parameters are cut
into parts synchronized in turn, and after which inner step of a round each part launches its
outer all-reduce, so that the traffic of one round is spread evenly over its steps."""

from __future__ import annotations

from collections.abc import Sequence


def fragments(sizes: Sequence[int], count: int) -> list[list[int]]:
    """Split parameters (their ``sizes``, in model order) into at most ``count`` contiguous
    groups of about equal size: Streaming DiLoCo's fragments (consecutive layers together).
    Every group is non-empty; fewer groups than ``count`` when there are fewer parameters."""
    count = max(1, min(count, len(sizes)))
    total = sum(sizes)
    groups: list[list[int]] = [[] for _ in range(count)]
    done, group = 0, 0
    for index, size in enumerate(sizes):
        share = int(done * count / total) if total else index
        # one group on at most, and never so late that a later group would stay empty
        group = max(min(count - 1, group + 1, share), group, count - (len(sizes) - index))
        groups[group].append(index)
        done += size
    return [g for g in groups if g]


def launch_step(fragment: int, count: int, inner_steps: int) -> int:
    """The optimizer step (mod ``inner_steps``) after which ``fragment`` of ``count`` launches its
    outer all-reduce: fragments take turns at equal spacing, the last at the round's end."""
    return ((fragment + 1) * inner_steps // count) % inner_steps


__all__ = ["fragments", "launch_step"]
