"""What fits: predicted peak device memory per phase of a LoRA run, and the settings that fit a card.

    python tools/plan_memory.py --config_file my_run.toml --vram 24
    python tools/plan_memory.py --preset NAME --vram 16          # a released model, no files (--help: the names)
    python tools/plan_memory.py --preset NAME --vram 24 --resolution 1328 --batch_size 1
    python tools/plan_memory.py --preset NAME --vram 48 --references 3   # an edit model, 3 references per image
    python tools/plan_memory.py --preset NAME --vram 12 --gguf Q4_K      # a ComfyUI-GGUF base of that type
    python tools/plan_memory.py --preset NAME --vram 16 --base_precision fp8_scaled   # that base's rows only

Everything is simulated on `meta` (library/training/memory_plan.py): no weight is read, the files'
headers give the shapes. With a config file the run's own settings are planned (its base precision,
blocks_to_swap, checkpointing, network, optimizer, vae_batch_size, largest bucket, the references
per image of its control_directory, each at the size the family encodes the largest of them, or a
multiple_target composite and its layers); then, for the card, every base precision x checkpointing
pair gets the fewest blocks_to_swap that fit (--base_precision: that one's rows only, each base left
out one to two full-size simulations less; a base the rest of the config rules out, fp8_compute's bf16
or LyCORIS algo=full's fp8, is one line saying why). A card fits a plan when the peak stays under 95% of (its
memory - the CUDA context, ~0.6 GiB). The presets (each family's spec: planner.presets) are the
released models' configs and text-encoder sizes; an edit model is planned with one reference per
image unless --references says otherwise, as large as the family encodes one. A pre-quantized base
(an fp8 or GGUF file, or a preset with --gguf) is planned as it is stored: its layout is the one base
precision tried.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import sys
from typing import NamedTuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tools.cli import Parser, check_command_line, exit_without_collecting  # noqa: E402


# The base precisions a card is planned with (the stored layout alone for a pre-quantized file); the
# 4- and 8-bit integer ones only on cards of LOWBIT_UP_TO_GIB and less, where fp8 often needs block swap
# (each is one more full-size simulation; a larger card's user can still plan one via base_precision).
# 16 GiB cards included: there a 17 B mixture of experts' fp8_scaled base needs blocks_to_swap 8 where its nf4 one
# (the packed experts too) fits without swap (14.5 against 10.5 GiB planned); `--vram 16` showed no nf4 row before.
PLANNED_PRECISIONS = ("bf16", "fp8_scaled")
LOWBIT_PRECISIONS = ("nf4", "int8")
LOWBIT_UP_TO_GIB = 16


def presets() -> dict:
    """--preset name -> the PlannerPreset of a released model (every family's spec: planner.presets)."""
    from library.models.registry import arch_specs

    return {name: preset for spec in arch_specs().values() if spec.planner for name, preset in spec.planner.presets.items()}


def build_parser() -> argparse.ArgumentParser:
    from library.models.registry import BASE_PRECISIONS

    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--config_file", help="a train_lora.py TOML config (its files' headers are read)")
    p.add_argument("--preset", choices=sorted(presets()), help="a full-size model without files")
    p.add_argument("--vram", type=float, default=24.0, help="the card's memory in GiB")
    p.add_argument("--resolution", type=int, default=None, help="square side in pixels (default: the largest bucket, or 1024)")
    p.add_argument("--batch_size", type=int, default=None)
    p.add_argument("--references", type=int, default=None,
                   help="reference images per image of an edit model (default: the dataset's control_directory; 1)")
    p.add_argument("--gguf", metavar="TYPE", default=None,
                   help="with --preset: plan the base as a GGUF file of this block type (Q8_0, Q6_K, Q5_K, Q4_K, ...)")
    p.add_argument("--base_precision", choices=BASE_PRECISIONS, default=None,
                   help="plan the card's rows in this base precision only (default: bf16 and fp8_scaled, and nf4 "
                        f"and int8 on cards of {LOWBIT_UP_TO_GIB} GiB or less); each one left out is seconds less at "
                        "full size")
    return p


# The arguments are checked before torch and the library load (seconds): --help and a bad flag answer at once.
if __name__ == "__main__":
    check_command_line(build_parser)

import torch  # noqa: E402

from library.training.config_schema import KEEPING_KEYS  # noqa: E402
from library.data.image_folders import LargestStep, largest_step  # noqa: E402
from library.training.memory_plan import (  # noqa: E402
    CUDA_CONTEXT_BYTES, KEEPING_MARGIN, GiB, bf16_reference_by_swap, caching_phase, meta_model_and_network,
    network_tensors, references_and_tokens, renders_bf16_reference, reusing_meta_models, sampling_phase, step_plan,
    tensor_bytes, text_tokens_for, usable_bytes, vae_pass_peak)


class PresetFamily:
    """A family whose transformer is a released model's config built on meta (no files): what the
    family would read from its files comes from the preset."""

    def __new__(cls, name: str, gguf: str | None = None):
        from library.models.family import family_class
        from library.models.registry import spec_of
        from library.models.spec import load_symbol

        preset = presets()[name]
        spec = spec_of(preset.model_type)
        planner = spec.planner
        if gguf and spec.gguf is None:
            raise ValueError(f"--gguf {gguf}: ComfyUI-GGUF has no layout for {spec.title} ({name}); plan it with "
                             f"--config_file on its GGUF file, or without --gguf")

        class Preset(family_class(preset.model_type)):
            def __init__(self):
                self.name, self.vae_path, self.text_paths = preset.model_type, None, {}
                for attribute, value in preset.attributes.items():
                    setattr(self, attribute, value)

            def stored_layout(self):
                return f"gguf_{gguf.lower()}" if gguf else None

            def load_transformer(self, dtype, base_precision="bf16", read_weights=False):
                from library.models.family import fp8_prepare
                from library.precision.gguf_writer import prepare_gguf_like

                with torch.device("meta"):
                    model = load_symbol(planner.transformer)(load_symbol(preset.transformer))
                if gguf:  # the file's layout, whatever base precision is asked for (as the loaders do)
                    prepare_gguf_like(model, gguf, spec.gguf)
                elif base_precision != "bf16":  # fp8 / nf4 / int8 layers on meta, as the loaders prepare them
                    fp8_prepare(base_precision, self.arch)(model)
                model.to(dtype)
                model.compute_dtype = dtype
                return model

            def text_options(self, args):
                return dict(preset.text_options)

            def text_encoder_weights(self):
                return list(preset.text_params.values())

        return Preset()


def default_args(model_type: str) -> argparse.Namespace:
    from library.training.config_schema import SCHEMA

    args = argparse.Namespace(**{k: spec.default for k, spec in SCHEMA.items()})
    args.config_file, args.model_type = None, model_type
    args.gradient_checkpointing, args.network_dim, args.network_alpha = True, 16, 16
    return args


def usable(vram_gib: float) -> float:
    return usable_bytes(vram_gib * GiB)


def plan_run(family, args, step: LargestStep, planned: dict | None = None,
             sample_size: tuple[int, int] | None = (0, 0), vram_gib: float | None = None) -> list:
    """The phases of this run (caching, training, and sampling at sample_size: (0, 0) the training size, None no
    samples) for `step` (image_folders.LargestStep: size, batch, references, their size, layers). planned:
    setting_plans' answers for the same card; the run's training step is taken from them where one of them is the
    same step (a full-size step is seconds of simulation). vram_gib: the card, where caching depends on it (text
    encoders that take turns on a card that cannot hold them together)."""
    count, _ = references_and_tokens(family, args, step)
    same = next((plan for setting, plan in (planned or {}).items() if same_step(args, setting_args(family, args, *setting))), None)
    training = (same or step_plan(family, args, step)).phase(args.blocks_to_swap)
    card = vram_gib * GiB if vram_gib else None
    caching = caching_phase(family, args, step.width, step.height, count, step.reference_size, card)
    if sample_size is None:
        return [caching, training]
    sw, sh = sample_size if sample_size != (0, 0) else (step.width, step.height)
    return [caching, training, sampling_phase(family, args, sw, sh, text_tokens_for(family, args, count, sw, sh), count)]


def setting_plans(family, args, step: LargestStep, bases: tuple[str, ...] = PLANNED_PRECISIONS) -> dict:
    """{(base precision, checkpointing): TrainingPlan of `step`} for each of `bases` x checkpointing off / on; a
    pre-quantized base (family.stored_layout()) only in its stored layout, which the loader always uses."""
    stored = family.stored_layout()
    return {(base, ckpt): step_plan(family, setting_args(family, args, base, ckpt), step)
            for base in ((stored,) if stored else bases) for ckpt in (False, True)}


def setting_args(family, args, base: str, ckpt: bool):
    """args with this base precision (a pre-quantized base: the setting its stored layout needs) and checkpointing."""
    from library.precision.stored_layouts import config_precision

    trial = copy.copy(args)
    trial.base_precision = config_precision(base) if family.stored_layout() else base
    trial.gradient_checkpointing = ckpt
    return trial


def same_step(a, b) -> bool:
    """Whether two configs plan the same training step: equal keys, the base precision as the trainer
    reads it (library.training.config.base_precision: base_precision, else fp8_base / fp8_scaled)."""
    from library.training.config import base_precision

    def step(args):
        keys = {k: v for k, v in vars(args).items() if k not in ("base_precision", "fp8_base", "fp8_scaled")}
        return keys, base_precision(args)

    return step(a) == step(b)


def fewest_swaps(plan, vram_gib: float, sample_extra: SampleExtra | None = None) -> int | None:
    """The fewest blocks_to_swap whose training peak fits the card and, with sample_extra (sampling_extra), the
    samples' peak at that swap too (sampling_peak), or None. (Training alone chose swaps whose first sample
    ran out of memory: a 20 B model's fp8 base on 24 GB, swap 6: sampling 26.8 GiB of 22.2 usable.)"""
    room = usable(vram_gib)
    return next((n for n in range(len(plan.block_bytes)) if plan.phase(n).peak <= room
                 and (sample_extra is None or sampling_peak(plan, n, sample_extra, room)[0] <= room)), None)


class SampleExtra(NamedTuple):
    """What a sample holds above the resident training state (its forward, the VAE with its decode): decoded
    whole (None: vae_tiling = true) and in tiles (None: vae_tiling = false); with sample_bf16_reference = true,
    the bf16 reference copy of the base at each blocks_to_swap (swapped as the base is)."""
    whole: int | None
    tiled: int | None
    reference: tuple[int, ...] | None = None


def sampling_extra(family, args, width: int, height: int, references: int) -> SampleExtra:
    """A sample of width x height above the resident training state, decoded whole and in tiles as vae_tiling
    allows; the bf16 reference copy only where the config sets sample_bf16_reference = true (unset, train_lora.py
    turns it off where it does not fit; true, it renders it anyway: rows without it called a setting fitting
    whose first sample ran out of memory)."""
    def extra(tiling: bool) -> int:
        trial = copy.copy(args)
        trial.blocks_to_swap, trial.sample_bf16_reference, trial.vae_tiling = 0, False, tiling
        phase = sampling_phase(family, trial, width, height, text_tokens_for(family, trial, references, width, height),
                               references)
        return phase.peak - phase.parts["resident (base, lora, optimizer)"]

    reference = None
    if getattr(args, "sample_bf16_reference", None) is True and renders_bf16_reference(family, args):
        _, network = meta_model_and_network(family, args)
        reference = tuple(bf16_reference_by_swap(family, args, tensor_bytes(network_tensors(network))))
    tiling = getattr(args, "vae_tiling", None)
    return SampleExtra(None if tiling else extra(False), None if tiling is False else extra(True), reference)


def sampling_extras(family, args, planned: dict, sample_size: tuple[int, int] | None,
                    references: int | None) -> dict | None:
    """{(base precision, checkpointing): sampling_extra} for each planned setting (None: no samples planned). One
    sample's simulation each; the rows that add a KEEPING_KEYS key take their setting's: a sample runs no backward."""
    if sample_size is None:
        return None
    count = family.plan_controls if references is None else references
    return {setting: sampling_extra(family, setting_args(family, args, *setting), *sample_size, count) for setting in planned}


def sampling_peak(plan, blocks_to_swap: int, extra: SampleExtra, room: float) -> tuple[int, bool]:
    """A sample's peak at this swap (the training state resident as the plan's, sampling_phase's own sum, + extra)
    and whether it decodes in tiles: where the whole decode is over `room` and vae_tiling allows tiles, as
    train_lora.py's settle_sampling turns them on."""
    resident = sum(plan.resident(blocks_to_swap).values()) + (extra.reference[blocks_to_swap] if extra.reference else 0)
    tiles = extra.whole is None or (extra.tiled is not None and extra.tiled < extra.whole and resident + extra.whole > room)
    return resident + (extra.tiled if tiles else extra.whole), tiles


def card_bases(family, args, vram_gib: float, only: str | None = None) -> tuple[str, ...]:
    """The base precisions tried on a card of vram_gib (only: that one, --base_precision), and a config's own
    (an nf4 run on a 24 GB card was planned in every precision but the one it trains in)."""
    from library.training.config import base_precision

    if only:
        return (only,)
    bases = PLANNED_PRECISIONS + (LOWBIT_PRECISIONS if vram_gib <= LOWBIT_UP_TO_GIB else ())
    own = base_precision(args) if args.config_file and not family.stored_layout() else None
    return bases + ((own,) if own and own not in bases else ())


def refused_bases(family, args, bases: tuple[str, ...]) -> dict[str, str]:
    """{base precision: the line train_lora.py refuses it with, the rest of the config kept} among `bases`: the
    config's own checks run on the trial (fp8_compute needs an fp8 base, LyCORIS algo=full a high-precision one).
    A row the trainer refuses is no setting to offer (the web UI applies the fitting row's keys as they are). A
    preset's default keys take every base; a pre-quantized base is planned as stored, which the run's checks passed."""
    if args.config_file is None or family.stored_layout():
        return {}
    from library.training.config import validate
    from library.training.lora_inputs import check_network_settings

    refused = {}
    for base in bases:
        trial = setting_args(family, args, base, args.gradient_checkpointing)
        trial.fp8_base = False  # base_precision replaces the older spelling (the web UI's Apply drops fp8_base)
        try:
            validate(trial, args.config_file)
            check_network_settings(trial, family.arch)
        except ValueError as e:
            refused[base] = str(e)
    return refused


def card_plans(family, args, step: LargestStep, vram_gib: float, only: str | None = None) -> dict:
    """setting_plans for the base precisions planned on a card of vram_gib (only: that one, --base_precision), less
    those the config cannot train with (refused_bases)."""
    bases = card_bases(family, args, vram_gib, only)
    refused = refused_bases(family, args, bases)
    return setting_plans(family, args, step, tuple(b for b in bases if b not in refused))


def fitting_settings(family, args, step: LargestStep, vram_gib: float, planned: dict | None = None,
                     extras: dict | None = None) -> list[tuple]:
    """(base precision, checkpointing, fewest blocks_to_swap that fits or None, its training peak, its samples'
    (peak, in tiles) or None); extras: sampling_extras, whose samples fit too (None: no samples planned); planned: card_plans'
    answer where already planned."""
    rows = []
    planned = planned or card_plans(family, args, step, vram_gib)
    for (base, ckpt), plan in planned.items():
        extra = extras[base, ckpt] if extras else None
        fit = fewest_swaps(plan, vram_gib, extra)
        sample = None if extra is None else sampling_peak(plan, fit or 0, extra, usable(vram_gib))
        rows.append((base, ckpt, fit, plan.phase(fit or 0).peak, sample))
    return rows


MAX_SIDE = 16384  # beyond it the resolution shift's exp(mu) overflows a float; no family trains near it


def bad_value(cli) -> str | None:
    """The first command-line number that cannot be planned, as one line (None: all can)."""
    if not 0 < cli.vram < math.inf:
        return f"--vram {cli.vram:g}: the card's memory in GiB must be a number > 0"
    if int(cli.vram * GiB) <= CUDA_CONTEXT_BYTES:  # nothing would be left to plan with (int: as the reserve rounds)
        return (f"--vram {cli.vram:g}: the card's memory in GiB must be more than the "
                f"{CUDA_CONTEXT_BYTES / GiB:g} GiB the CUDA context takes")
    if cli.batch_size is not None and cli.batch_size < 1:
        return f"--batch_size {cli.batch_size}: must be >= 1"
    if cli.resolution is not None and not 16 <= cli.resolution <= MAX_SIDE:
        return f"--resolution {cli.resolution}: the side must be 16 to {MAX_SIDE} pixels"
    if cli.resolution is not None and cli.resolution % 16:
        near = max(16, cli.resolution // 16 * 16)
        return (f"--resolution {cli.resolution}: the side must be a multiple of 16 (the VAE's 8 x the 2x2 patch), "
                f"e.g. {near}" + (f" or {near + 16}" if near < cli.resolution else ""))
    return None


def check_references(family, count: int, where: str) -> None:
    """An edit family takes min_controls..max_controls references per image; the others none."""
    if not family.max_controls and count:
        from library.models.family import FAMILIES, family_class

        edit = ", ".join(name for name in FAMILIES if family_class(name).max_controls)
        raise ValueError(f"{where}: {count} reference image(s), but {family.name} takes none (edit models do: {edit})")
    if not family.min_controls <= count <= family.max_controls:
        raise ValueError(f"{where}: {count} reference image(s), but {family.name} takes "
                         f"{family.min_controls} to {family.max_controls} per image")


def check_base_precision(family, only: str | None) -> None:
    """--base_precision picks among the layouts a base can be stored in; a pre-quantized one has its own."""
    if only and (stored := family.stored_layout()):
        raise ValueError(f"--base_precision {only}: this base is stored as {stored} and is planned as stored; "
                         f"leave --base_precision out")


def what_to_plan(cli) -> tuple:
    """(family, run config, the step to plan: image_folders.LargestStep) from the command line; the step's
    reference_size and layers None where unknown (a preset, --references)."""
    if cli.gguf and not cli.preset:
        raise ValueError("--gguf plans a preset as a GGUF file; with --config_file the file's own layout is planned")
    if cli.preset:
        from library.precision.gguf_weights import GGUF_TYPES

        if cli.gguf and cli.gguf.upper() not in GGUF_TYPES:
            raise ValueError(f"--gguf {cli.gguf}: not a GGUF block type we read ({', '.join(GGUF_TYPES)})")
        family = PresetFamily(cli.preset, cli.gguf.upper() if cli.gguf else None)
        check_base_precision(family, cli.base_precision)
        side = cli.resolution or 1024
        references = family.plan_controls if cli.references is None else cli.references
        check_references(family, references, "--references")
        run = default_args(family.name)
        run.base_precision = cli.base_precision or run.base_precision  # the phases above the rows: that base
        return family, run, LargestStep(side, side, cli.batch_size or 1, references)
    from library.data.dataset_config import load_dataset_config
    from library.models.family import get_family
    from library.training.config import load_config
    from library.training.diffusion_checks import check_before_caching

    run = load_config(["--config_file", cli.config_file])
    family = get_family(run)
    check_before_caching(run, family)  # as train_lora.py checks it first: a config it refuses is no run to plan
    check_base_precision(family, cli.base_precision)
    if cli.base_precision and (why := refused_bases(family, run, (cli.base_precision,)).get(cli.base_precision)):
        raise ValueError(f"--base_precision {cli.base_precision}: {why}")
    step = largest_step(load_dataset_config(run.dataset_config), cli.references)
    check_references(family, step.references, "--references" if cli.references is not None else run.dataset_config)
    if cli.resolution:
        step = step._replace(width=cli.resolution, height=cli.resolution)
    return family, run, step._replace(batch=cli.batch_size or step.batch)


def sample_size_of(cli, run, size: tuple[int, int]) -> tuple[int, int] | None:
    """The largest sample the run renders (its sample_prompts at their --w / --h, the resolution where a line gives
    none; the training size before the file exists), the training size for a preset, None for a config without
    samples."""
    if cli.preset:
        return size
    if not run.sample_prompts:
        return None
    if not os.path.isfile(run.sample_prompts):  # a file a tool writes later (the quickstarts'): the training size
        return size
    from library.data.dataset_config import load_dataset_config
    from library.data.prompts import SamplePrompt, default_sample_size, read_prompt_file

    width, height = default_sample_size(load_dataset_config(run.dataset_config).datasets[0].resolution)
    prompts = read_prompt_file(run.sample_prompts, SamplePrompt("", width=width, height=height), decode=False)
    largest = max(prompts, key=lambda p: p.width * p.height, default=None)
    return (largest.width, largest.height) if largest else None


TILES_SAID = " (decoded in tiles: vae_tiling)"  # a card row whose samples decode in tiles ends so


def swapped_host_bytes(plan, blocks_to_swap: int | None) -> int:
    """The swapped blocks' weights, which live in host memory (pinned on a GPU) for the whole run (block_swap.py)."""
    return sum(plan.block_bytes[len(plan.block_bytes) - blocks_to_swap:]) if blocks_to_swap else 0


def fit_text(fit: int | None, peak: int, sample: tuple[int, bool] | None = None,
             sample_size: tuple[int, int] | None = None, host: int = 0) -> str:
    """A card row's verdict, as the web UI reads it (library/ui/commands.py PLAN_ROW), the host memory its swapped
    blocks hold (swapped_host_bytes: on a 12 GiB card a 20 B model swaps 33 GiB of bf16 blocks to the host, which a
    32 GB machine lacks) and its samples' peak (sampling_peak's (peak, in tiles))."""
    samples = ""
    if sample is not None:
        tiles = TILES_SAID if sample[1] else ""
        samples = f"; samples at {sample_size[0]}x{sample_size[1]} peak at {sample[0] / GiB:.1f} GiB{tiles}"
    if fit is None:
        return "does not fit" + (" with its samples" if sample is not None else "")
    held = f"; its swapped blocks hold {host / GiB:.1f} GiB of host memory" if host else ""
    return f"fits with blocks_to_swap = {fit} (peak {peak / GiB:.1f} GiB){held}" + samples


def caching_advice(family, run, step: LargestStep, vram_gib: float, caching) -> str | None:
    """What brings caching under the card where its plan is over (the VAE's batch, the text encoders' precision),
    or None where it fits: caching runs before training, so a run planned to fit stopped there. The web UI
    applies its "key = value" settings (library/ui/commands.py caching_keys)."""
    room = usable(vram_gib)
    if caching.peak <= room:
        return None
    count, _ = references_and_tokens(family, run, step)
    advice = []
    if max(v for k, v in caching.parts.items() if k.startswith("vae encode")) > room:
        trial = copy.copy(run)
        for batch in range(run.vae_batch_size - 1, 0, -1):
            trial.vae_batch_size = batch
            planned = caching_phase(family, trial, step.width, step.height, count, step.reference_size, vram_gib * GiB)
            if max(v for k, v in planned.parts.items() if k.startswith("vae encode")) <= room:
                advice.append(f"vae_batch_size = {batch}")
                break
        else:
            advice.append("a smaller resolution (the VAE encode of one image is over)")
    if next(v for k, v in caching.parts.items() if k.startswith("text encoders")) > room:
        trial = copy.copy(run)
        trial.text_encoder_precision = "fp8"
        fp8 = next(v for k, v in caching_phase(family, trial, step.width, step.height, count, step.reference_size,
                                               vram_gib * GiB).parts.items() if k.startswith("text"))
        advice.append("text_encoder_precision = \"fp8\"" if fp8 <= room else
                      f"a larger card for the text encoders ({fp8 / GiB:.2f} GiB in fp8)")
    return f"caching does not fit a {vram_gib:g} GiB card (usable {room / GiB:.1f}): set {' and '.join(advice)}"


def in_memory_caches_row(family, run) -> str:
    """What the run's in-memory caches (cache_latents_to_disk / cache_text_encoder_outputs_to_disk false, the
    defaults) hold in host memory, each process, against the memory available on this machine: train_lora.py stops
    at the first batch where they would not fit (caches.check_memory_room); this says it before the run."""
    import warnings

    from library.data.caches import MEMORY_SHARE, memory_available, plan_in_memory_caches
    from library.data.dataset_config import load_dataset_config
    from library.training.memory_plan import cache_entry_bytes

    with warnings.catch_warnings():  # the folders' notes (images in subfolders ...) are check_dataset.py's
        warnings.simplefilter("ignore")
        plan = plan_in_memory_caches(load_dataset_config(run.dataset_config), *cache_entry_bytes(family, run))
    kept = {"cache_latents_to_disk": (plan.latent_bytes, "latents"),
            "cache_text_encoder_outputs_to_disk": (plan.text_bytes, "text encoder outputs")}
    kept = {key: value for key, value in kept.items() if not getattr(run, key)}
    if not kept:
        return "\nHost memory: both caches on disk (cache_latents_to_disk, cache_text_encoder_outputs_to_disk)"
    variants = f", {plan.variants} of them caption_variants" if plan.variants else ""
    parts = [f"{what} up to {size / GiB:.2f} GiB" for size, what in kept.values()]
    line = (f"\nHost memory, each process: the in-memory caches of {plan.images} images ({plan.texts} texts{variants}): "
            f"{', '.join(parts)}")
    available, total = memory_available(), sum(size for size, _ in kept.values())
    if available is None:
        return line
    line += f"; {available / GiB:.1f} GiB available here"
    if total > MEMORY_SHARE * available:
        line += (f": over {MEMORY_SHARE:.0%} of it, set {' or '.join(f'{k} = true' for k, (size, _) in kept.items() if size)}"
                 f" (train_lora.py stops at the first batch otherwise)")
    return line


def kept_tensor_rows(family, args, step: LargestStep, vram_gib: float, planned: dict, extras: dict | None = None,
                     sample_size: tuple[int, int] | None = None) -> list[str]:
    """What each of KEEPING_KEYS (unset in args) would cost on this card, per base precision with
    checkpointing: one more plan each; none for a key that keeps nothing here (projections where no gate
    trains)."""
    rows = []
    for key, gain in KEEPING_KEYS.items():
        if getattr(args, key) is not None:
            continue  # true: the rows above plan it; false: the config's own choice (a row offered it all the same)
        for base in [base for base, ckpt in planned if ckpt]:
            trial = setting_args(family, args, base, True)
            setattr(trial, key, True)
            plan = step_plan(family, trial, step)
            extra = plan.phase(0).peak - planned[(base, True)].phase(0).peak
            if extra <= 0:
                break
            samples = extras[base, True] if extras else None
            fit = fewest_swaps(plan, vram_gib, samples)
            sample = None if samples is None else sampling_peak(plan, fit or 0, samples, usable(vram_gib))
            verdict = fit_text(fit, plan.phase(fit or 0).peak, sample, sample_size, swapped_host_bytes(plan, fit))
            rows.append(f"  {base:10s} gradient_checkpointing=true with {key} = true (+{extra / GiB:.2f} GiB, {gain}): "
                        f"{verdict}")
    if rows and any(getattr(args, key) is None for key in KEEPING_KEYS):
        rows.append(f"  (a key left unset: train_lora.py turns it on where the step with it fits the card, "
                    f"{KEEPING_MARGIN - 1:.0%} to spare)")
    return rows


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
        if bool(args.config_file) == bool(args.preset):
            raise ValueError("give --config_file or --preset")
        if problem := bad_value(args):
            raise ValueError(problem)
        with reusing_meta_models():  # every setting below plans one of a few models
            report(args, *what_to_plan(args))
    except (ValueError, OSError) as e:  # ConfigError and CheckpointError are ValueErrors; a file read while planning
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def report(args, family, run, step: LargestStep) -> None:
    """The plan's phases, then what fits the card, printed (what_to_plan's answer)."""
    refs = f", {step.references} reference(s) per image" if family.max_controls else ""
    print(f"{args.preset or args.config_file}: {step.width}x{step.height}, batch {step.batch}{refs}, LoRA rank "
          f"{run.network_dim}, {run.optimizer_type}; predicted peak device memory (tensors; add ~0.6 GiB of CUDA context):")
    planned = card_plans(family, run, step, args.vram, args.base_precision)
    samples = sample_size_of(args, run, (step.width, step.height))
    phases = plan_run(family, run, step, planned, samples, args.vram)
    for phase in phases:
        print("  " + phase.row())
    if "bf16 reference (base, lora)" in phases[-1].parts and phases[-1].peak > usable(args.vram):
        print(f"  sampling with the bf16 reference base does not fit a {args.vram:g} GiB card: train_lora.py turns "
              f"sample_bf16_reference off (unless the config sets it true)")
    if samples is None:
        print("  sampling  none (no sample_prompts)")
    if advice := caching_advice(family, run, step, args.vram, phases[0]):
        print("  " + advice)
    print(f"\nOn a {args.vram:g} GiB card (usable {usable(args.vram) / GiB:.1f} GiB), training"
          + (f" and samples of {samples[0]}x{samples[1]}:" if samples else ":"))
    extras = sampling_extras(family, run, planned, samples, step.references)
    rows = [f"  {base:10s} gradient_checkpointing={str(ckpt).lower():5s}: "
            f"{fit_text(fit, peak, sample, samples, swapped_host_bytes(planned[base, ckpt], fit))}"
            for base, ckpt, fit, peak, sample in fitting_settings(family, run, step, args.vram, planned, extras)]
    rows += [f"  {base:10s} left out: {why.removeprefix(f'{run.config_file}: ')}"
             for base, why in refused_bases(family, run, card_bases(family, run, args.vram, args.base_precision)).items()]
    rows += kept_tensor_rows(family, run, step, args.vram, planned, extras, samples)
    print("\n".join(rows))
    if not args.preset:
        print(in_memory_caches_row(family, run))
    if run.vae_tiling is None and any(row.endswith(TILES_SAID) for row in rows):
        vae = family.vae_on_meta()
        whole, tiles = (vae_pass_peak(vae, *samples, 1, decode=True, downsample=family.vae_downsample, tiled=tiled)
                        for tiled in (False, True))
        print(f"  (vae_tiling unset: train_lora.py decodes the samples in tiles where decoded whole they do not fit "
              f"the card: the decode's peak {whole / GiB:.2f} -> {tiles / GiB:.2f} GiB)")


if __name__ == "__main__":
    exit_without_collecting(main)
