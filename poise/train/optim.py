"""AdamW that can freeze its second moment: the optimizer side of lossy gradient compression.

Why: Adam divides each entry's step by the root of a running mean of that entry's squared
gradient. With 1-bit sign compression (and error feedback) every entry of a bucket arrives as
``±scale``: the running mean of squares becomes ``scale²`` everywhere, Adam's per-entry step
size (the reason transformers train with it) is gone, and each entry moves by its share of the
codec's noise. Error feedback cannot help: it makes the *sum* of the sent gradients right, and
the second moment is a mean of *squares*.

The remedy is 1-bit Adam's (Tang et al. 2021, "1-bit Adam: Communication Efficient Large-Scale
Training with Adam's Convergence Speed"): run plain AdamW while gradients still go
uncompressed, then freeze the second moment. From then on the update is linear in the
gradient, and the delayed errors of error feedback add up to nothing, as they do for SGD.

Measured (code-lm, 300 steps, 2 workers, bits per byte against uncompressed AdamW at 3.366):

- sign: +5.4 % with the live variance; +1.0 % frozen after 20 steps (twice the warm-up). Frozen
  after 2 or 10 steps it is +31 % and +15 %: the warm-up must outlast the learning-rate ramp,
  hence ``poise.comm.registry.compression_start``.
- top-k (1 %): +6.4 % live, +9.8 % frozen; PowerSGD: +2.9 % live, +4.4 % frozen; random-k
  worse frozen too. Their payloads carry real per-entry magnitudes, which the live variance
  uses; so ``comm.freeze_variance=auto`` freezes for sign only.
- compressing after 2 instead of 20 steps, live: top-k +8.9 %, random-k +48 %, PowerSGD
  +3.3 %: hence the lossy codecs' longer warm-up.
- top-k's gap is not the second moment's fault: fed the exact uncompressed gradient's ``v``
  (an experiment that all-reduced the dense gradient too), top-k still ends +5.6 %. What costs
  is the delay itself: error feedback sends a small entry only after it has piled up, so at
  1 % each entry moves about once per hundred steps. One worker alone, sending nothing, ends
  +2.7 %; top-k and random-k end below it (``poise bench codecs`` shows that ``alone`` row).
  ``comm.local_first`` removes the delay of each rank's own share (poise/comm/wrappers.py):
  top-k +2.3 %, random-k +3.0 %.

Entries whose gradient was zero through the warm-up (embedding rows of unseen tokens, border
pixels) would be divided by ``eps`` alone once frozen, while sign keeps sending them
``±scale``: each entry's denominator is floored at ``denominator_floor`` (1 %) of its tensor's
mean. Against no floor, 10 % cost sign 1.1 % bits per byte more, 1 % cost 0.2 %.

:class:`AdamW` is torch's AdamW (fused where it can be) for its first ``freeze_after`` steps,
then applies the frozen-variance update with ``torch._foreach`` kernels. Its
state is torch's (``step``, ``exp_avg``, ``exp_avg_sq``) plus ``freeze_after`` and
``denominator_floor`` in each parameter group, so a checkpoint resumes with the same freeze.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


class AdamW(torch.optim.AdamW):
    """torch's AdamW, with the second moment frozen after ``freeze_after`` steps (None: never).

    Once frozen, each entry's ``sqrt(v_hat)`` is kept at or above ``denominator_floor`` times
    its tensor's mean, so no entry's step can exceed ``1 / denominator_floor`` times a typical
    one (see :meth:`_denominator`).

    Args:
        params: parameters or parameter groups, as for ``torch.optim.AdamW``.
        freeze_after: optimizer steps that update the second moment; later steps reuse it.
        denominator_floor: see above; in [0, 1].
        **kwargs: torch AdamW's options (``lr``, ``betas``, ``eps``, ``weight_decay``, ``fused``);
            ``amsgrad`` is not supported with a freeze.
    """

    def __init__(self, params: Iterable[Any], *, freeze_after: int | None = None, denominator_floor: float = 0.01,
                 **kwargs: Any) -> None:
        if freeze_after is not None and freeze_after < 1:
            raise ValueError(f"freeze_after={freeze_after} must be >= 1 (Adam needs one step to estimate "
                             "the variance) or None")
        if not 0.0 <= denominator_floor <= 1.0:
            raise ValueError(f"denominator_floor={denominator_floor} is outside [0, 1]")
        if freeze_after is not None and kwargs.get("amsgrad"):
            raise ValueError("freeze_after cannot be combined with amsgrad=True")
        super().__init__(params, **kwargs)
        for group in self.param_groups:
            group.setdefault("freeze_after", freeze_after)
            group.setdefault("denominator_floor", denominator_floor)
        # per parameter: sqrt(v_hat) + eps at the freeze, rebuilt after a load (not state)
        self._denominators: dict[torch.Tensor, torch.Tensor] = {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:  # state saved by torch's own AdamW: no freeze
            group.setdefault("freeze_after", None)
            group.setdefault("denominator_floor", 0.01)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._denominators.clear()

    def steps_done(self) -> int:
        """Optimizer steps taken so far (0 before the first)."""
        for state in self.state.values():
            if "step" in state:
                return int(state["step"])
        return 0

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        done = self.steps_done()
        if all(g["freeze_after"] is None or done < g["freeze_after"] for g in self.param_groups):
            super().step()
            return loss
        for group in self.param_groups:
            if group["freeze_after"] is None or done < group["freeze_after"]:
                raise ValueError("parameter groups with different freeze_after are not supported")
            self._frozen_step(group)
        return loss

    def _frozen_step(self, group: dict[str, Any]) -> None:
        """One AdamW step with ``v`` as it was after ``freeze_after`` steps."""
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        beta1, beta2 = group["betas"]
        lr = float(group["lr"])
        states = [self.state[p] for p in params]
        torch._foreach_add_([s["step"] for s in states], 1)
        step = float(states[0]["step"])
        denominators = [self._denominator(p, group, beta2) for p in params]
        if group["weight_decay"]:
            torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
        exp_avgs = [s["exp_avg"] for s in states]
        torch._foreach_lerp_(exp_avgs, [p.grad for p in params], 1 - beta1)
        torch._foreach_addcdiv_(params, exp_avgs, denominators, value=-lr / (1 - beta1 ** step))

    def _denominator(self, p: torch.Tensor, group: dict[str, Any], beta2: float) -> torch.Tensor:
        """``max(sqrt(v_hat), floor) + eps``, with ``floor`` a share of the tensor's mean.

        The floor is for entries whose gradient was (near) zero all through the warm-up, such
        as the embedding rows of tokens not seen yet: live Adam would raise their ``v`` on the
        first real gradient, a frozen one would divide it by ``eps``.
        """
        denominator = self._denominators.get(p)
        if denominator is None:
            bias_correction = 1 - beta2 ** group["freeze_after"]
            root = (self.state[p]["exp_avg_sq"] / bias_correction).sqrt_()
            floor = group["denominator_floor"] * float(root.mean()) if root.numel() else 0.0
            denominator = root.clamp_(min=floor).add_(group["eps"])
            self._denominators[p] = denominator
        return denominator
