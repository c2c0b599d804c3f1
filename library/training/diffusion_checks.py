"""What a diffusion config is checked against before minutes of caching: the model's file headers, the model
built on the meta device, the dataset and the sample prompts (seconds). DiffusionTask, the web UI's config check
and tools/plan_memory.py run check_before_caching, so a config one refuses the others refuse with the same line."""

from __future__ import annotations

import functools
import os

from library.data.controls import check_prompt_controls
from library.data.prompts import read_prompt_file
from library.training.config import (ConfigError, base_precision, check_fp8_compute_layout, check_stored_precision,
                                     compute_dtype, where_set)
from library.training.config_keys import IDLE_UNLESS
from library.training.config_schema import SCHEMA
from library.training.lora_inputs import check_lora_inputs, check_network_fits, check_network_settings
from networks.lora_arch import check_model_files


def check_config_against_data(args, held_out: bool, regularized: bool) -> None:
    """The training config's keys that need something of the dataset (tools/check_dataset.py asks too)."""
    for key in ("validate_every_n_steps", "validate_every_n_epochs"):
        if getattr(args, key, 0) and not held_out:
            raise ConfigError(f"{args.dataset_config}: {key} is set but no image is held out; set "
                              f"validation_split or add [[validation_datasets]]")
    if args.prior_loss_weight != 1.0 and not regularized:
        raise ConfigError(f"{where_set(args, 'prior_loss_weight')} and {args.dataset_config}: key "
                          f"'prior_loss_weight' = {args.prior_loss_weight:g} does nothing: no subset has is_reg = "
                          f"true (it weights the regularization images' loss)")


def check_before_caching(args, family) -> tuple[str | None, str | None]:
    """What train_lora.py checks of a diffusion config first, from the config, the files' headers and the model
    built on the meta device (seconds): DiffusionTask, the web UI's config check (library/ui/config_check.py) and
    tools/plan_memory.py run this one function, so a config one refuses the others refuse with the same line.
    (stored, widened): the base's pre-quantized layout and its plain e5m2 one (None, None: a high-precision file)."""
    check_model_files(family, args.pretrained_model_name_or_path)  # a wrong file stops the run now, not after caching
    check_blocks_to_swap(args, family)
    check_unread_keys(args, family)
    check_network_settings(args, family.arch)
    check_lora_inputs(args, family.arch)  # network_weights, base_loras: their headers
    check_prompt_references(args, family)
    # the model on the meta device (no weights read, seconds at full size), built once for the checks that ask it
    meta_model = functools.cache(lambda: family.load_transformer(compute_dtype(args), base_precision(args),
                                                                 read_weights=False))
    check_own_draw_keys(args, family, meta_model)
    check_timestep_range(args, family, meta_model)
    stored_and_widened = check_base_layout(args, family)
    # network_args against the model's blocks and names, network_weights' ranks against the network's (it wraps
    # the model's Linears: after the checks that read the bare model)
    check_network_fits(args, family.arch, meta_model)
    return stored_and_widened


OWN_LAW_NEEDS = {"shifted_draw": "a shift (timestep_sampling = \"shift\")",
                 **dict.fromkeys(("sigmoid_scale", "sigmoid_mean"),
                                 "a sigmoid draw (timestep_sampling = \"sigmoid\", or a shift)")}


def check_own_draw_keys(args, family, meta_model) -> None:
    """sigmoid_scale, sigmoid_mean and shifted_draw where the law drawn is the model's own (timestep_sampling unset,
    or qinglong with qinglong_mid unset): config_keys refuses them beside a named law that does not read them, but
    the own law is known only from the checkpoint (a release whose scheduler has no shift draws unshifted sigmoid,
    another uniform), so they were taken and recorded in the header while nothing read them."""
    mid = args.timestep_sampling == "qinglong"
    if args.timestep_sampling is not None and not (mid and args.qinglong_mid is None):
        return
    set_keys = [key for key in OWN_LAW_NEEDS if getattr(args, key) != SCHEMA[key].default]
    if not set_keys:
        return
    own = family.default_timestep_sampling(meta_model())
    unset = "timestep_sampling = \"qinglong\" with qinglong_mid unset" if mid else "timestep_sampling unset"
    for key in set_keys:
        if not IDLE_UNLESS[key][1](own):  # (the test config_keys runs on a named law)
            raise ConfigError(f"{where_set(args, key)}: key '{key}' = {getattr(args, key)} does nothing: {unset} "
                              f"draws {args.pretrained_model_name_or_path}'s own law, \"{own}\"; it needs "
                              f"{OWN_LAW_NEEDS[key]}")


# preserve_distribution_shape: the least share of the law's draws in the range (each sample redraws up to 65,536
# times: at 0.1%, ~65 in range, and a sample without one once in e^65)
LEAST_RANGE_SHARE = 1e-3


def check_timestep_range(args, family, meta_model) -> None:
    """preserve_distribution_shape redraws a sample's sigma until one falls in min_timestep / max_timestep: a range
    its law hardly reaches (sigma above 0.99 under the plain logit-normal draw: 2 in a million) would stop the run
    at its first step, after caching. Its share of the law's draws at 1024 px, now (meta_model(): the model on the
    meta device, which tells the model's own law)."""
    import torch

    from library.models import flow_matching as fm

    lo, hi = fm.timestep_range(args)
    if not args.preserve_distribution_shape or (lo, hi) == (0.0, 1.0):
        return
    model = meta_model()
    side = 1024 // family.vae_downsample
    draws = family.draw_sigmas(model, args, torch.Generator().manual_seed(0), side, side,
                               fm.REDRAW_CHUNK * fm.REDRAW_ROUNDS)
    share = ((draws >= lo) & (draws <= hi)).double().mean().item()
    if share < LEAST_RANGE_SHARE:
        method = args.timestep_sampling or f"unset: {family.default_timestep_sampling(model)}"
        raise ConfigError(f"{where_set(args, 'min_timestep', 'max_timestep', 'preserve_distribution_shape')}: "
                          f"min_timestep {args.min_timestep} / max_timestep {args.max_timestep} with "
                          f"preserve_distribution_shape: the sigma law (timestep_sampling {method}) puts {share:.4%} "
                          f"of its draws in [{lo:g}, {hi:g}] at 1024 px, under the {LEAST_RANGE_SHARE:.1%} its redraws "
                          f"need; widen the range, or set preserve_distribution_shape = false (the law scaled into it)")


def check_prompt_references(args, family) -> None:
    """The sample prompts' reference images (--ci) against what the model takes (how many, what its image
    processor reads): a prompt file for an edit model on a text-to-image one was refused only once the models
    had loaded, and the web UI's check and the planner passed it. A prompt file missing now is one a tool
    writes later (the quickstarts'): read with the rest of the prompts (DiffusionTask._read_prompts)."""
    if not args.sample_prompts or not os.path.isfile(args.sample_prompts):
        return
    prompts = read_prompt_file(args.sample_prompts, guidance_is_cfg=family.guidance_is_cfg_scale(),
                               negatives=family.true_cfg)
    check_prompt_controls(prompts, args.sample_prompts, family.name, family.max_controls, family.min_controls,
                          family.reference_vl_size)


def check_base_layout(args, family) -> tuple[str | None, str | None]:
    """A pre-quantized checkpoint (fp8, GGUF) is trained on as it is stored; the config must say so (and
    sample_bf16_reference = true on it is refused: it has no bf16 reference copy), and base_loras cannot merge
    into it. A plain e5m2 file widens exactly, to a bf16 base only. (stored, widened) as check_before_caching."""
    stored = family.stored_layout()
    if args.fp8_compute and not stored:
        check_fp8_compute_layout(args, family.widened_layout("bf16"))
    check_stored_precision(args, stored)
    if stored and args.base_loras:
        raise ConfigError(f"{args.pretrained_model_name_or_path}: base_loras merge into a high-precision base; "
                          f"this checkpoint is pre-quantized ({stored}): give the bf16 one")
    return stored, None if stored else family.widened_layout(base_precision(args))


def check_unread_keys(args, family) -> None:
    """Keys set off their default that this model's training never reads (the family says which,
    from the checkpoint's header): refused, not trained without and recorded in the LoRA's header."""
    for key, why in family.unread_training_keys(args).items():
        value = getattr(args, key)
        # guidance_scale 0: sd-scripts' setting for a model without guidance (its docs): as idle as 1
        if value != SCHEMA[key].default and not (key == "guidance_scale" and value == 0):
            raise ConfigError(f"{where_set(args, key)}: key '{key}' = {value} does nothing: "
                              f"{why}; remove it")


def check_blocks_to_swap(args, family) -> None:
    """blocks_to_swap against the model's blocks (its header), before caching rather than after it."""
    from library.models.block_swap import check_swap_count

    if args.blocks_to_swap:  # (FSDP refuses it: check_fsdp)
        try:
            check_swap_count(args.blocks_to_swap, family.swappable_block_count())
        except ValueError as e:
            raise ConfigError(f"{args.pretrained_model_name_or_path}: {e}") from None
