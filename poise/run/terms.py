"""What a step's loss averages over, counted in the batch in hand when the model says so.

A step weights each rank's mean loss by its share of the loss terms of every rank's batch;
the weight is exact only if the terms are the ones the loss averages over. For a Hugging Face
model given ``labels`` the loss is known: the mean over the labels that are not -100, shifted
by one for a causal language model (it predicts token n+1 from tokens up to n). Counting those
in the batch in hand makes the common case exact without the user knowing the trick
(``step.backward(loss, num_items=...)``); ``Data.loss_terms``, when given, stand (no count,
no all-reduce per step), and any other model keeps them (or one term per sample).

:class:`LabelCount` is a forward pre-hook on the session's model: it counts the terms of each
forward given ``labels`` and the step reads the count (:mod:`poise.run.step`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

IGNORE_INDEX = -100  # Hugging Face's label for "no loss term here" (padding, prompts)


def is_causal_lm(module: nn.Module) -> bool:
    """Whether ``module`` is one of Hugging Face's causal language models (its loss shifts the
    labels), by its class or a base class named in ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    return any(cls.__name__ in names for cls in type(module).__mro__)


def hugging_face_model(model: nn.Module) -> nn.Module | None:
    """The Hugging Face model inside ``model`` (itself, or a DDP wrapper's ``.module``), or None."""
    inner = getattr(model, "module", model)
    return inner if type(inner).__module__.startswith("transformers.") else None


class LabelCount:
    """A forward pre-hook (``with_kwargs``) that counts the loss terms of a Hugging Face
    model's forward given ``labels=``: labels other than -100, after the shift of a causal LM
    (or ``shift_labels=`` as given). ``count`` is the latest forward's, None when the forward
    had no labels or normalizes its loss itself (``num_items_in_batch=``); :meth:`reset` at
    each step's start."""

    def __init__(self, causal: bool) -> None:
        self.causal = causal
        self.count: torch.Tensor | None = None

    def reset(self) -> None:
        self.count = None

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        labels, shifted = kwargs.get("labels"), kwargs.get("shift_labels")
        if "num_items_in_batch" in kwargs or not isinstance(labels if shifted is None else shifted, torch.Tensor):
            self.count = None
            return
        if shifted is not None:
            terms = shifted
        else:
            terms = labels[..., 1:] if self.causal else labels
        self.count = (terms != IGNORE_INDEX).sum().detach()


def planned_terms(loss_terms: np.ndarray | None, lengths: np.ndarray) -> str | None:
    """What the planned loss weights assume, when it may not be what the loss averages over:
    ``Data.loss_terms`` not given (one term per sample) while the samples' lengths differ, so a
    loss averaged over tokens would be weighted wrongly. None: nothing to say."""
    if loss_terms is not None or len(lengths) == 0 or bool(np.all(lengths == lengths[0])):
        return None
    return "Data.loss_terms not given: one term per sample"


def install_label_count(model: nn.Module) -> LabelCount | None:
    """A :class:`LabelCount` hooked on ``model`` if it is (or wraps) a Hugging Face model, else None."""
    inner = hugging_face_model(model)
    if inner is None:
        return None
    counter = LabelCount(causal=is_causal_lm(inner))
    model.register_forward_pre_hook(counter, with_kwargs=True)
    return counter


__all__ = ["IGNORE_INDEX", "LabelCount", "hugging_face_model", "install_label_count", "is_causal_lm", "planned_terms"]
