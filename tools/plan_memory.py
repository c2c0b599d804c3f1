"""What fits: predicted peak device memory per phase of a LoRA run, and the settings that fit a card.

    python tools/plan_memory.py --config_file configs/flux1_dev_24gb.toml --vram 24
    python tools/plan_memory.py --preset flux1-dev --vram 16          # no files needed: built-in configs
    python tools/plan_memory.py --preset qwen-image --vram 24 --resolution 1328 --batch_size 1
    python tools/plan_memory.py --preset flux1-kontext-dev --vram 24   # the reference's tokens included
    python tools/plan_memory.py --preset qwen-image-edit --vram 24     # likewise
    python tools/plan_memory.py --preset flux2-klein-4b --vram 16

Everything is simulated on `meta` (library/training/memory_plan.py): no weight is read, the files'
headers give the shapes. With a config file the run's own settings are planned (its base precision,
blocks_to_swap, checkpointing, network, optimizer, largest bucket); then, for the card, every base
precision x checkpointing pair gets the fewest blocks_to_swap that fit. A card fits a plan when the
peak stays under 95% of (its memory - the CUDA context, ~0.6 GiB).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tools.cli import check_command_line  # noqa: E402

# Full-size models without files: transformer config, text encoder parameter counts.
PRESETS = {
    "flux1-dev": ("flux", "FLUX_DEV", {"clip_l": 123_060_480, "t5xxl": 4_762_310_656}),
    "flux1-schnell": ("flux", "FLUX_SCHNELL", {"clip_l": 123_060_480, "t5xxl": 4_762_310_656}),
    "flux1-kontext-dev": ("flux_kontext", "FLUX_DEV", {"clip_l": 123_060_480, "t5xxl": 4_762_310_656}),
    "qwen-image": ("qwen_image", "QWEN_IMAGE", {"text_encoder": 7_615_616_512}),
    # Qwen-Image-Edit(-2509/-2511): Qwen-Image's transformer, one reference's tokens; Qwen2.5-VL-7B with
    # its vision tower (0.68 B) as the text encoder.
    "qwen-image-edit": ("qwen_image_edit", "QWEN_IMAGE", {"text_encoder": 8_292_166_656}),
    # klein's Qwen3 as load_klein_text_encoder reads it: embeddings + the first 27 of 36 layers, no head.
    "flux2-klein-4b": ("flux2", "FLUX2_KLEIN_4B", {"text_encoder": 3_114_090_752}),
    "flux2-klein-9b": ("flux2", "FLUX2_KLEIN_9B", {"text_encoder": 5_831_887_616}),
    # [dev]'s Mistral Small 3.1 as load_dev_text_encoder reads it: embeddings + the first 30 of 40 layers, no head.
    "flux2-dev": ("flux2", "FLUX2_DEV", {"text_encoder": 17_343_759_360}),
}
# family -> (module, class) of the transformer a preset builds
PRESET_MODELS = {"flux": ("library.models.flux1.model", "Flux"), "flux2": ("library.models.flux2.model", "Flux2"),
                 "qwen_image": ("library.models.qwen_image.model", "QwenImage")}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--config_file", help="a train_lora.py TOML config (its files' headers are read)")
    p.add_argument("--preset", choices=sorted(PRESETS), help="a full-size model without files")
    p.add_argument("--vram", type=float, default=24.0, help="the card's memory in GiB")
    p.add_argument("--resolution", type=int, default=None, help="square side in pixels (default: the largest bucket, or 1024)")
    p.add_argument("--batch_size", type=int, default=None)
    return p


# The arguments are checked before torch and the library load (seconds): --help and a bad flag answer at once.
if __name__ == "__main__":
    check_command_line(build_parser)

import torch  # noqa: E402

from library.training.memory_plan import (  # noqa: E402
    CUDA_CONTEXT_BYTES, GiB, caching_phase, sampling_phase, training_plan)


class PresetFamily:
    """A family whose transformer is a built-in full-size config on meta (no files)."""

    def __new__(cls, preset: str):
        from library.models.family import family_class

        name, config_name, text_params = PRESETS[preset]
        base = family_class(name)

        class Preset(base):
            def __init__(self):
                self.name, self.vae_path, self.text_paths, self.text_params = name, None, {}, text_params

            def load_transformer(self, dtype, base_precision="bf16", read_weights=False):
                import importlib

                from library.precision.fp8 import prepare_fp8

                module, cls_name = PRESET_MODELS[self.arch]
                m = importlib.import_module(module)
                with torch.device("meta"):
                    model = getattr(m, cls_name)(getattr(m, config_name))
                if base_precision != "bf16":
                    prepare_fp8(model, base_precision, self.arch)
                model.to(dtype)
                model.compute_dtype = dtype
                return model

            def t5_max_length(self):
                return 512 if config_name == "FLUX_DEV" else 256

        return Preset()


def default_args(model_type: str) -> argparse.Namespace:
    from library.training.config import SCHEMA

    args = argparse.Namespace(**{k: spec.default for k, spec in SCHEMA.items()})
    args.config_file, args.model_type = None, model_type
    args.gradient_checkpointing, args.network_dim, args.network_alpha = True, 16, 16
    return args


def text_tokens_for(family) -> int:
    return family.t5_max_length() if family.arch == "flux" else 512  # Qwen-Image: a long caption; klein: always 512


def usable(vram_gib: float) -> float:
    return 0.95 * (vram_gib * GiB - CUDA_CONTEXT_BYTES)


def plan_run(family, args, width: int, height: int, batch: int) -> list:
    """The three phases of this run (caching, training, sampling)."""
    tokens = text_tokens_for(family)
    plan = training_plan(family, args, width, height, batch, tokens)
    training = plan.phase(args.blocks_to_swap)
    caching = caching_phase(family, args, width, height, batch)
    return [caching, training, sampling_phase(family, args, training, width, height, tokens)]


def setting_plans(family, args, width: int, height: int, batch: int) -> dict:
    """{(base precision, checkpointing): TrainingPlan} for bf16 / fp8_scaled x checkpointing off / on."""
    plans = {}
    for base in ("bf16", "fp8_scaled"):
        for ckpt in (False, True):
            trial = copy.copy(args)
            trial.fp8_base, trial.fp8_scaled, trial.gradient_checkpointing = base != "bf16", True, ckpt
            plans[base, ckpt] = training_plan(family, trial, width, height, batch, text_tokens_for(family))
    return plans


def fewest_swaps(plan, vram_gib: float) -> int | None:
    """The fewest blocks_to_swap whose training peak fits the card, or None."""
    return next((n for n in range(len(plan.block_bytes)) if plan.phase(n).peak <= usable(vram_gib)), None)


def fitting_settings(family, args, width: int, height: int, batch: int, vram_gib: float) -> list[tuple]:
    """(base precision, checkpointing, fewest blocks_to_swap that fits or None, its training peak)."""
    rows = []
    for (base, ckpt), plan in setting_plans(family, args, width, height, batch).items():
        fit = fewest_swaps(plan, vram_gib)
        rows.append((base, ckpt, fit, plan.phase(fit or 0).peak))
    return rows


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if bool(args.config_file) == bool(args.preset):
        p.error("give --config_file or --preset")
    if args.preset:
        family = PresetFamily(args.preset)
        run = default_args(family.name)
        side, batch = args.resolution or 1024, args.batch_size or 1
        width = height = side
    else:
        from library.data.dataset_config import load_dataset_config
        from library.models.family import get_family
        from library.training.config import ConfigError, load_config

        try:
            run = load_config(["--config_file", args.config_file])
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        family = get_family(run)
        datasets = load_dataset_config(run.dataset_config).datasets
        width, height = max((d.resolution for d in datasets), key=lambda r: r[0] * r[1])
        if args.resolution:
            width = height = args.resolution
        batch = args.batch_size or max(d.batch_size for d in datasets)
    print(f"{args.preset or args.config_file}: {width}x{height}, batch {batch}, LoRA rank {run.network_dim}, "
          f"{run.optimizer_type}; predicted peak device memory (tensors; add ~0.6 GiB of CUDA context):")
    for phase in plan_run(family, run, width, height, batch):
        print("  " + phase.row())
    print(f"\nOn a {args.vram:g} GiB card (usable {usable(args.vram) / GiB:.1f} GiB), training:")
    for base, ckpt, fit, peak in fitting_settings(family, run, width, height, batch, args.vram):
        what = "does not fit" if fit is None else f"fits with blocks_to_swap = {fit} (peak {peak / GiB:.1f} GiB)"
        print(f"  {base:10s} gradient_checkpointing={str(ckpt).lower():5s}: {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
