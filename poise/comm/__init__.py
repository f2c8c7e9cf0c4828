"""How gradients move: DDP communication hooks and what they measure."""
