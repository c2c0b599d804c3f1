"""Random weights for parity tests: every parameter drawn (the references zero-init the modulation and the outputs, so a
freshly built model would compare zeros), norm weights around 1."""

import torch


def randomized(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """`model` with every parameter redrawn from `seed`: 1-D norm weights 1 + N(0, 0.2), matrices N(0, 0.15), other
    vectors N(0, 0.1); in eval mode."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            norm = p.dim() == 1 and "norm" in name
            p.copy_(1 + 0.2 * noise if norm else 0.15 * noise if p.dim() > 1 else 0.1 * noise)
    return model.eval()
