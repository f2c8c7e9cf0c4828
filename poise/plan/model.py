"""A model's parameter tensors as the planner sees them: names, shapes, backward shares.

From a real module (:func:`params_of`), or synthesized for a decoder-only transformer of a
given parameter count (:func:`transformer_params`) when only ``--params`` is known. Pure:
a module is only read.
"""

from __future__ import annotations

import math
from typing import Any

from poise.plan.step_time import Param

# The largest decoder :func:`transformer_params` synthesizes: 10^14 parameters (today's largest
# models have a few 10^12) is d_model ~1e5 in ~800 blocks, about 5,000 tensors to plan.
MAX_PARAMS = 1e14
MAX_VOCAB_SIZE = 10**8


def params_of(module: Any) -> list[Param]:
    """Every parameter of ``module`` in registration order (DDP's order). Backward share:
    the entries of a weight (backward FLOPs are proportional to them); embeddings are a
    gather and take none (assumed)."""
    embeddings = {name for name, m in module.named_modules() if type(m).__name__ == "Embedding"}
    out = []
    for name, p in module.named_parameters():
        owner = name.rsplit(".", 1)[0]
        out.append(Param(name, tuple(p.shape), 0.0 if owner in embeddings else float(p.numel())))
    return out


def transformer_params(num_params: float, *, vocab_size: int = 32000,
                       head_dim_ratio: int = 128) -> tuple[list[Param], dict[str, int]]:
    """A GPT-style decoder of about ``num_params`` parameters (assumed shapes): untied token
    embedding and head of ``vocab_size``, ``L = d / head_dim_ratio`` blocks of
    attention (qkv, out) and a 4d MLP, d a multiple of 128 solving ``12 L d^2 + 2 V d = P``."""
    if not 1 <= num_params <= MAX_PARAMS:  # also refuses nan and inf, for which the search below never ends
        raise ValueError(f"--params={num_params:g} is invalid: allowed is 1 to {MAX_PARAMS:g} parameters")
    if isinstance(vocab_size, bool) or not 1 <= vocab_size <= MAX_VOCAB_SIZE:
        raise ValueError(f"--vocab-size={vocab_size} is invalid: allowed is 1 to {MAX_VOCAB_SIZE}")
    d = 128
    while 12 * (d / head_dim_ratio) * d * d + 2 * vocab_size * d < num_params:
        d += 128
    layers = max(1, round(d / head_dim_ratio))
    params = [Param("token_embedding.weight", (vocab_size, d), 0.0)]
    for i in range(layers):
        b = f"blocks.{i}"
        params += [Param(f"{b}.norm1.weight", (d,)), Param(f"{b}.attn.qkv.weight", (3 * d, d)),
                   Param(f"{b}.attn.proj.weight", (d, d)), Param(f"{b}.norm2.weight", (d,)),
                   Param(f"{b}.mlp.fc1.weight", (4 * d, d)), Param(f"{b}.mlp.fc2.weight", (d, 4 * d))]
    params += [Param("final_norm.weight", (d,)), Param("head.weight", (vocab_size, d))]
    return params, {"d_model": d, "num_layers": layers, "vocab_size": vocab_size,
                    "num_params": sum(math.prod(p.shape) for p in params)}
