"""Predictors of a rank's next micro-batch time, in seconds per cost unit.

The deadline of a step (:func:`poise.straggler.queues.deadline_s`) is set from each rank's
predicted rate times its planned cost. What it needs is the *typical* rate: a delay is by
definition not typical, and a deadline that follows the delays waits for them. So the
default is a windowed median (robust: a 20 % Bernoulli stall moves it not at all); an EWMA
(cheap, follows drifts fast, but every stall drags it up) and the small LSTM the seed names
(trained online on the recorded window, L1 loss so it, too, aims at the typical value) are
there to compare. :func:`evaluate` scores any of them on a recorded trace;
``poise bench stragglers`` reports all three and keeps the LSTM only where it wins.

Every predictor: ``update(rate)`` with an observed rate, ``predict()`` the next one (None
before it has seen ``min_samples``).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

import numpy as np
import torch

PREDICTORS = ("quantile", "ewma", "lstm")


class QuantilePredictor:
    """The ``q`` quantile of the last ``window`` observations (q = 0.5: the median)."""

    def __init__(self, q: float = 0.5, window: int = 64, min_samples: int = 3) -> None:
        self.q, self.min_samples = q, min_samples
        self.values: deque[float] = deque(maxlen=window)

    def update(self, rate: float) -> None:
        self.values.append(rate)

    def predict(self) -> float | None:
        if len(self.values) < self.min_samples:
            return None
        return float(np.quantile(np.fromiter(self.values, dtype=np.float64), self.q))


class EwmaPredictor:
    """Exponentially weighted mean with weight ``alpha`` on the newest observation."""

    def __init__(self, alpha: float = 0.1, min_samples: int = 3) -> None:
        self.alpha, self.min_samples = alpha, min_samples
        self.value: float | None = None
        self.count = 0

    def update(self, rate: float) -> None:
        self.value = rate if self.value is None else (1 - self.alpha) * self.value + self.alpha * rate
        self.count += 1

    def predict(self) -> float | None:
        return self.value if self.count >= self.min_samples else None


class _Lstm(torch.nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.lstm = torch.nn.LSTM(1, hidden, batch_first=True)
        self.head = torch.nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (batch, time, 1) -> (batch,)
        out, _ = self.lstm(x)
        return self.head(out[:, -1]).squeeze(-1)


class LstmPredictor:
    """A one-layer LSTM over the last ``context`` log-rates (relative to the window's median),
    refitted every ``refit_every`` observations on the window (``epochs`` passes of Adam, L1
    loss). Falls back to the median until the first fit. Its own generator: it never moves
    the training's random state."""

    def __init__(self, context: int = 8, hidden: int = 8, window: int = 128, refit_every: int = 32,
                 epochs: int = 40, min_samples: int = 3, seed: int = 0) -> None:
        self.context, self.refit_every, self.epochs, self.min_samples = context, refit_every, epochs, min_samples
        self.values: deque[float] = deque(maxlen=window)
        self.seen = 0
        gen_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        self.net = _Lstm(hidden)
        torch.random.set_rng_state(gen_state)
        self.fitted = False

    def update(self, rate: float) -> None:
        self.values.append(max(rate, 1e-12))
        self.seen += 1
        if self.seen % self.refit_every == 0 and len(self.values) > self.context + 8:
            self._fit()

    def _series(self) -> tuple[np.ndarray, float]:
        logs = np.log(np.fromiter(self.values, dtype=np.float64))
        centre = float(np.median(logs))
        return logs - centre, centre

    def _fit(self) -> None:
        series, _ = self._series()
        c = self.context
        windows = np.lib.stride_tricks.sliding_window_view(series, c + 1)
        x = torch.tensor(windows[:, :c, None], dtype=torch.float32)
        y = torch.tensor(windows[:, c], dtype=torch.float32)
        opt = torch.optim.Adam(self.net.parameters(), lr=0.02)
        with torch.enable_grad():
            for _ in range(self.epochs):
                opt.zero_grad()
                torch.nn.functional.l1_loss(self.net(x), y).backward()
                opt.step()
        self.fitted = True

    def predict(self) -> float | None:
        if len(self.values) < self.min_samples:
            return None
        series, centre = self._series()
        if not self.fitted or len(series) < self.context:
            return math.exp(centre)
        with torch.no_grad():
            out = self.net(torch.tensor(series[None, -self.context:, None], dtype=torch.float32))
        return math.exp(centre + float(out))


Predictor = QuantilePredictor | EwmaPredictor | LstmPredictor


def make_predictor(name: str, seed: int = 0) -> Predictor:
    """A predictor by name (``quantile``, ``ewma``, ``lstm``).

    Raises:
        ValueError: an unknown name.
    """
    if name == "quantile":
        return QuantilePredictor()
    if name == "ewma":
        return EwmaPredictor()
    if name == "lstm":
        return LstmPredictor(seed=seed)
    raise ValueError(f"straggler.predictor={name!r} is unknown: allowed are {', '.join(PREDICTORS)}")


def evaluate(trace: Sequence[float], name: str, typical: Sequence[float] | None = None) -> dict[str, float]:
    """Score predictor ``name`` on ``trace`` (observed rates in order), one step ahead.

    Returns the median absolute relative error against the next observation (``mdape``)
    and, when ``typical`` (the same trace without its injected stalls) is given, against
    the typical rate the deadline needs (``mdape_typical``): both fractions, 0.1 = 10 %.
    """
    predictor = make_predictor(name)
    errors, typical_errors = [], []
    for i, rate in enumerate(trace):
        guess = predictor.predict()
        if guess is not None:
            errors.append(abs(guess - rate) / rate)
            if typical is not None:
                typical_errors.append(abs(guess - typical[i]) / typical[i])
        predictor.update(rate)
    out = {"mdape": float(np.median(errors)) if errors else math.nan, "predictions": float(len(errors))}
    if typical is not None:
        out["mdape_typical"] = float(np.median(typical_errors)) if typical_errors else math.nan
    return out


__all__ = ["PREDICTORS", "EwmaPredictor", "LstmPredictor", "Predictor", "QuantilePredictor", "evaluate",
           "make_predictor"]
