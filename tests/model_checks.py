"""Shared checks of a transformer on the shared core for the families' parity tests: random weights (the references
zero-init the modulation and the outputs, so a freshly built model would compare zeros) and the gradients with and
without gradient checkpointing; a LoRA's runtime output beside that of its converted files read back."""

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


def checkpointing_gradients(model: torch.nn.Module, inputs: dict) -> tuple[dict, dict]:
    """Every parameter's gradient of mean(model(**inputs)^2) without and with model.gradient_checkpointing."""
    def grads(checkpointing: bool) -> dict[str, torch.Tensor]:
        model.zero_grad()
        model.gradient_checkpointing = checkpointing
        model(**inputs).square().mean().backward()
        return {name: p.grad.clone() for name, p in model.named_parameters()}

    return grads(False), grads(True)


@torch.no_grad()
def lora_read_back(model: torch.nn.Module, arch: str, net, files: dict, predict) -> tuple[torch.Tensor, torch.Tensor,
                                                                                           dict[str, float]]:
    """(predict() without a LoRA, with `net` applied at runtime, {"ours_from_<layout>": the max abs difference to the
    runtime output of each file of `files` (layout -> path) read back by LoRANetwork.from_weights and applied})."""
    from networks.lora import LoRANetwork

    base = predict()
    net.apply()
    want = predict()
    net.remove()
    diffs = {}
    for layout, path in files.items():
        read = LoRANetwork.from_weights(model, arch, str(path))
        read.apply()
        diffs[f"ours_from_{layout}"] = (predict() - want).abs().max().item()
        read.remove()
    return base, want, diffs
