"""Validation loss of a diffusion LoRA: one number that is comparable between steps and runs.

Every held-out image (validation_split, [[validation_datasets]]) is noised at the same five
sigmas with the same noise each time, and the loss is the plain mean squared error of the
predicted velocity, averaged over images and sigmas:

    val_loss = mean over (image, s in VALIDATION_SIGMAS) of mean(mask * (v_pred - (noise - x0))^2)

mask: the image's loss mask (alpha_mask, mask_dir), applied as the training step applies it (1
where it has none), so the part of a held-out image that training ignores is not measured either.

Nothing in it is drawn from the training step or the training seed (the noise is seeded by the
image's path in its folder and the sigma's index, not by where its dataset sits in the TOML), and
it uses no loss weighting or Huber loss whatever the training uses, so two runs with other seeds,
objectives or other datasets listed beside it compare on the same number. Each
(image, sigma) is one forward of batch 1, so it does not depend on the batch size either.
"""

from __future__ import annotations

import hashlib

import torch

from library.data.masks import on_latent_grid

# Evenly spaced over the noise range; the ends (pure image, pure noise) tell little.
VALIDATION_SIGMAS = (0.1, 0.3, 0.5, 0.7, 0.9)


def noise_seed(key: str, sigma_index: int) -> int:
    """Seed of one validation image's noise at one sigma (key: ImageDataset's sample key)."""
    return int.from_bytes(hashlib.sha256(f"validation|{key}|{sigma_index}".encode()).digest()[:8], "little") >> 1


@torch.no_grad()
def validation_loss(family, model, dataset, guidance: float | None, accelerator) -> float:
    """val_loss over `dataset` (an ImageDataset with cached latents and text, validation=True).
    Process r of N computes images r, r+N, ...; the [images, sigmas] float32 table of losses
    (zeros where another process computes) is summed over processes, so the result is the
    same on 1 or N processes. Call it on every process, with the network in eval mode."""
    from library.training.fsdp import uses_fsdp

    device, n, world = accelerator.device, len(dataset), accelerator.num_processes
    losses = torch.zeros(n, len(VALIDATION_SIGMAS), dtype=torch.float32, device=device)
    # A sharded base (FSDP) all-gathers its weights in every forward, so every process must run
    # as many forwards: the last round is padded with image 0, whose losses are dropped.
    end = -(-n // world) * world if uses_fsdp(accelerator) else n
    with accelerator.autocast():  # the compute the training forward runs under
        for i in range(accelerator.process_index, end, world):
            sample = dataset[i % n]
            latents = sample["latents"][None].to(device)  # float32 [1, C, h, w]
            text = {k: v[None].to(device) for k, v in sample["text"].items()}
            control = [c[None].to(device) for c in sample["controls"]] if "controls" in sample else None
            # the training step's mask: on the family's latent grid, as training_loss puts it
            mask = on_latent_grid(sample["mask"][None].to(device), latents.shape[-2:]) if "mask" in sample else None
            for j, sigma in enumerate(VALIDATION_SIGMAS):
                gen = torch.Generator().manual_seed(noise_seed(sample["key"], j))
                noise = torch.randn(latents.shape, generator=gen, dtype=torch.float32).to(device)
                sigmas = torch.full((1,), sigma, dtype=torch.float32, device=device)
                loss = family.loss_at(model, latents, text, noise, sigmas, guidance, mask=mask, control=control)
                if i < n:
                    losses[i, j] = loss
    if accelerator.num_processes > 1:
        losses = accelerator.reduce(losses, reduction="sum")
    return losses.mean().item()
