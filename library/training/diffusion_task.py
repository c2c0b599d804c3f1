"""What train_lora.py needs to train a diffusion LoRA: data with caches, the frozen base
(bf16, fp8 or fp8_scaled), the LoRA network, the loss, and sample images.

Order of memory use follows the user's 24 GB card: the VAE and text encoders are loaded, used to
fill the caches, and freed before the transformer is loaded.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import time
import warnings

import torch
import torch.nn as nn

from library.data.captions import drops_captions, tag_frequency
from library.data.caches import (cache_empty_caption, cache_folder, cache_latents, cache_prompts, cache_summary,
                                 cache_text, hold_cache_folders, loaded_on_first_call, remove_unused_caches)
from library.data.check import (TokenLimit, references_sized_apart, refuse_long_captions, training_warnings, upscaled,
                                warn)
from library.data.dataset import BucketBatchSampler, EpochBatches, ImageDataset, collate_batch
from library.data.image_folders import (caption_as_written, largest_step, refuse_large_buckets, scan_images,
                                       split_validation)
from library.data.controls import check_family_takes, references_missing
from library.data.dataset_config import check_token_side, load_dataset_config
from library.models.core import checkpointing, compile_block, compile_limit_hits
from library.models.family import Preservation, get_family, stack_text, warn_unread_prompt_options
from library.models.registry import spec_of
from library.data.prompts import (SamplePrompt, default_sample_size, read_prompt_file, sample_file_name,
                                  seed_or_random)
from library.training import fsdp, memory_plan, preservation
from library.training.host_memory import release_freed_memory
from library.training.config import (ConfigError, base_precision, compute_dtype, lora_network_args,
                                     network_modules_from, slow_cpu_compute_line, where_set)
from library.training.config_schema import KEEPING_KEYS
from library.training.run_length import check_planned_steps, plan_steps
from library.training.lora_inputs import load_network_weights
from library.training.diffusion_checks import check_before_caching, check_config_against_data
from library.training.state import SavedState, check_resumed_fit, sample_seed
from library.training.validation import validation_loss
from networks.factory import build_network



class LoRALoss(nn.Module):
    """The module accelerate prepares (DDP wraps it): it owns only the LoRA network, so only LoRA
    tensors are broadcast and all-reduced; the frozen base is held outside the module tree."""

    def __init__(self, family, base: nn.Module, network: nn.Module, args):
        super().__init__()
        self.network = network
        self._base = [base]
        self.preservation_losses = []
        self.family, self.args = family, args

    @property
    def base(self) -> nn.Module:
        return self._base[0]

    def forward(self, latents: torch.Tensor, text: dict, generators: list[torch.Generator],
                mask: torch.Tensor | None = None, sample_weights: torch.Tensor | None = None,
                control: list[torch.Tensor] | None = None, preservation_text: dict | None = None,
                preserved: torch.Tensor | None = None, strata: list[int] | None = None) -> torch.Tensor:
        kept = None
        if preservation_text is not None:  # output preservation's second prompt (library/training/preservation.py)
            kept = Preservation(preservation_text, preserved, preservation.multiplier(self.args),
                                lambda: preservation.network_off(self.network))
        loss, _ = self.family.training_loss(self.base, latents, text, self.args, generators, mask, sample_weights,
                                            control, kept, strata)
        if kept is not None:
            self.preservation_losses.append(float(kept.loss))
        elif preservation.preserving(self.args):  # a batch without a second prompt: its term is 0, not computed
            self.preservation_losses.append(0.0)
        return loss

    preservation_losses: list[float]  # this optimizer step's terms, for the log (DiffusionTask.step_extras)


# torch_compile unset: compiled where it was measured (bench/RESULTS.md, H100 2026-11-26: the full-size step of
# the two families measured x0.43-0.49 of eager, block swap x1.00-1.03 on top, memory as eager), eager elsewhere.
COMPILED_BASES = ("bf16", "fp8", "fp8_scaled")


COMPILED_MIN_PARAMETERS = 10**9  # a tiny model compiles for longer than it trains (the quickstart: 11 s eager)


def compile_by_default(args, device_type: str, triton: bool, stored_precision: str | None,
                       processes: int, parameters: int, dora: bool) -> tuple[bool, str]:
    """(compile?, why) for an unset torch_compile; parameters: the transformer's; dora: the built
    network's (network_args spell it dora / use_dora, true / yes / 1 ...)."""
    if device_type != "cuda":
        return False, f"not on CUDA ({device_type})"
    if not triton:
        return False, "Triton is not installed: torch.compile needs it on CUDA"
    if parameters < COMPILED_MIN_PARAMETERS:
        return False, f"a {parameters / 1e6:.0f} M-parameter model: compiling would take longer than it saves"
    if processes > 1:
        return False, f"{processes} processes: measured on one"
    if args.network_module != "networks.lora":
        return False, f"{args.network_module}: measured on LoRA"
    if dora:
        return False, f"{args.network_module} with DoRA: measured on LoRA"
    precision = base_precision(args)
    if stored_precision and stored_precision not in COMPILED_BASES or precision not in COMPILED_BASES:
        return False, f"a {stored_precision or precision} base: measured on {', '.join(COMPILED_BASES)}"
    if args.checkpoint_saves_dequantized:
        return False, "checkpoint_saves_dequantized: an eager lever (a compiled region plans its own recompute)"
    return True, "each transformer block compiled on CUDA; the first steps take a minute or two longer"


def cache_share(accelerator) -> tuple[int, int]:
    """(this process, processes): which cache files this process encodes (caches.owned_by)."""
    return accelerator.process_index, accelerator.num_processes


def encoded_by_all(accelerator, encoded: int, to_disk: bool) -> int:
    """After a cache pass, every process waits for the others' (their files are read next) and
    learns how many entries they encoded together; kept in memory, each encoded every entry for
    itself and reads no other's: its own count, no wait."""
    if accelerator.num_processes == 1 or not to_disk:
        return encoded
    from accelerate.utils import gather_object

    return sum(gather_object([encoded]))  # a collective: each process's count, once all have finished


def scan_family_images(blueprint, family, held_out_sets: bool = False) -> list:
    """scan_images with the family's rule for reference images (sized by control_bucket, stretched, covered or
    cropped from reference_resize, loaded in reference_mode): training and tools/precision_matrix.py evaluate the
    same references."""
    return scan_images(blueprint, held_out_sets, control_bucket=family.control_bucket,
                       stretch_controls=family.stretches_references, control_mode=family.reference_mode,
                       control_resize=family.reference_resize)


class DiffusionTask:
    def __init__(self, args, accelerator, state: SavedState | None = None, held: contextlib.ExitStack | None = None):
        """state: the one a resumed run loaded (None: a new run), checked against the data before caching;
        held: what the run holds to its end (its cache folders' locks)."""
        self.args, self.accelerator = args, accelerator
        self.device = accelerator.device
        self.family = get_family(args)
        self.stored_precision, self.widened_precision = check_before_caching(args, self.family)
        self._say_unreferenced_samples()
        self._say_idle_block_swap()
        self.compute_dtype = compute_dtype(args)
        if line := slow_cpu_compute_line(args, self.device):
            self.accelerator.print(line, file=sys.stderr)
        self.blueprint = load_dataset_config(args.dataset_config)
        self._refuse_output_in_image_dirs()
        limit = self.family.caption_token_limit(args)  # captions and sample prompts, as the text encoder counts them
        largest = self.family.largest_image()  # training images and sample prompts, as the transformer takes them
        self.dataset, self.validation_set = self._read_images(limit, largest)
        check_config_against_data(args, bool(self.validation_set),
                                  any(item.subset.is_reg for item in self.dataset.items))  # before minutes of caching
        self.sampler = BucketBatchSampler(self.dataset, seed=args.seed, timestep_buckets=args.num_timestep_buckets)
        self._loader = None  # the DataLoader kept across epochs (persistent_data_loader_workers)
        check_planned_steps(args, plan_steps(args, self.batches_per_epoch(), state.progress if state else None))
        if state:
            check_resumed_fit(args.resume, state.progress, args, self.batches_per_epoch(), self.data_items(),
                              self.epoch_settings())
        self.prompts = self._read_prompts(limit, largest)
        self._hold_cache_folders(contextlib.ExitStack() if held is None else held)
        self._settle_sampling()  # before minutes of caching
        self._settle_keeping_keys()
        self._fill_caches()  # also encodes the sample prompts, then frees the encoders
        self.base = self._load_base()
        if args.fp8_compute:
            self._enable_fp8_compute()
        self.base.gradient_checkpointing = checkpointing(args.gradient_checkpointing, args.checkpoint_saves_projections,
                                                         args.checkpoint_saves_attention,
                                                         args.checkpoint_saves_dequantized)
        self.network = self._make_network()  # on the CPU base: DoRA's norms read the weights
        self._to_device(self.base)
        if self._compiles():
            self._compile_blocks()
        self.module = LoRALoss(self.family, self.base, self.network, args)

    # -- setup ---------------------------------------------------------------------------------
    def _refuse_output_in_image_dirs(self):
        """output_dir that is an image_dir: the run writes its samples and loss plot (PNGs) there, which the next
        run on this dataset trained as images (or stopped on, uncaptioned; a resume found other batches).
        sd-scripts and musubi-tuner keep samples in output_dir/sample."""
        out = os.path.realpath(self.args.output_dir)
        for spec in self.blueprint.datasets + self.blueprint.validation_datasets:
            for subset in spec.subsets:
                if os.path.realpath(subset.image_dir) == out:
                    raise ConfigError(f"{self.args.dataset_config}: image_dir '{subset.image_dir}' is the output_dir: "
                                      f"the run's sample images and loss plot would be read as training images by "
                                      f"the next run; give output_dir another folder")

    def _say_unreferenced_samples(self):
        """A pre-quantized checkpoint (fp8, GGUF) is trained on as it is stored: the LoRA's metadata and the samples
        name the stored layout (trained_precision()), the base really trained on, alone: it loads as stored in any
        precision, so it has no bf16 reference copy."""
        if self.stored_precision and self.args.sample_prompts and self.args.sample_bf16_reference is None:
            self.accelerator.print(f"samples render on the {self.stored_precision} base alone: no bf16 reference beside "
                                   f"it (sample_bf16_reference), {self.args.pretrained_model_name_or_path} is stored "
                                   f"pre-quantized and has no bf16 base to load")

    def _say_idle_block_swap(self):
        """On the CPU the swapped blocks' weights sit in the same host memory as the rest: swapping saves nothing
        and its copies cost time every step; said before caching."""
        if self.args.blocks_to_swap and self.device.type == "cpu":
            self.accelerator.print(f"{where_set(self.args, 'blocks_to_swap')}: blocks_to_swap = "
                                   f"{self.args.blocks_to_swap} on the CPU saves no memory (its weights are in host "
                                   f"memory either way) and costs time every step; 0 trains the same", file=sys.stderr)

    def _read_images(self, limit: TokenLimit | None, largest: tuple[int, int] | None) -> tuple[ImageDataset, ImageDataset]:
        """(training set, validation set): the validation_split share of each subset and every
        [[validation_datasets]] image go to validation only; a bucket over the model's largest image is refused."""
        bp = self.blueprint
        check_token_side(bp, self.family.vae_downsample * self.family.patch, spec_of(self.family.name).title)
        train, held_out = split_validation(scan_family_images(bp, self.family), bp)
        validation = held_out + scan_family_images(bp, self.family, held_out_sets=True)
        check_family_takes(train + validation, self.family.name, self.family.max_controls, self.family.min_controls,
                           self.family.takes_layers, self.family.reference_vl_size)
        refuse_long_captions(train + validation, limit)  # on every process, as the scan's errors
        refuse_large_buckets(train + validation, largest, bp.source)
        if self.accelerator.is_main_process:  # once, before caching; the scan warned about image sizes itself
            warn(training_warnings(train, validation, limit))
            subsets = [item.subset for item in train]
            if self.family.edits_without_references_warn and (said := references_missing(subsets, self.family.name)):
                warnings.warn(f"{self.args.dataset_config}: {said}", stacklevel=2)
            enlarged = upscaled(train + validation)
            if enlarged:
                self.accelerator.print(f"{self.args.dataset_config}: {enlarged}")
            if apart := references_sized_apart(train, self.family.sample_control_bucket):
                warnings.warn(f"{self.args.dataset_config}: {apart}", stacklevel=2)
        if validation:
            self.accelerator.print(f"validation: {len(validation)} images held out, {len(train)} for training")
        if said := preservation.set_preservation_captions(train, self.args, limit, self.args.dataset_config):
            self.accelerator.print(said)
        return (ImageDataset(bp, seed=self.args.seed, items=train),
                ImageDataset(bp, seed=self.args.seed, items=validation, validation=True))

    def _read_prompts(self, limit: TokenLimit | None, largest: tuple[int, int] | None = None) -> list[SamplePrompt]:
        """The sample prompts; one the text encoder refuses (limit) or larger than the transformer takes (largest)
        is named now, not after caching (a negative is encoded, and checked, where the family runs true CFG)."""
        if not self.args.sample_prompts:
            return []
        width, height = default_sample_size(self.blueprint.datasets[0].resolution)
        defaults = SamplePrompt("", width=width, height=height, steps=self.family.sample_steps,
                                guidance=self.family.sample_guidance)
        prompts = read_prompt_file(self.args.sample_prompts, defaults,
                                   guidance_is_cfg=self.family.guidance_is_cfg_scale(), token_limit=limit,
                                   negatives=self.family.true_cfg, largest=largest)  # --ci: check_before_caching
        warn_unread_prompt_options(self.family, prompts, self.args.sample_prompts)
        return prompts

    def _settle_sampling(self):
        """The largest sample prompt against the card (memory_plan.settle_sampling): on an fp8 base samples also
        render on a bf16 copy of it (sample_bf16_reference), turned off where unset and the copy does not fit;
        a sample over the card without it is one warning line before caching, not an out-of-memory error at the
        first sample. No card (the CPU) or a sharded base (FSDP): not planned."""
        if not self.prompts or fsdp.uses_fsdp(self.accelerator):
            return
        card = memory_plan.device_memory(self.device)
        if card is None:
            return
        largest = max(self.prompts, key=lambda p: p.width * p.height)
        references = max(len(p.control_images) for p in self.prompts)
        warning = memory_plan.settle_sampling(self.family, self.args, card, largest.width, largest.height, references)
        if warning:
            self.accelerator.print(warning, file=sys.stderr)

    def _settle_keeping_keys(self):
        """checkpoint_saves_attention / _projections left unset: on a CUDA card, each on where the memory
        plan of the largest training step (image_folders.largest_step) fits the card with it (one line
        says what was chosen); off on the CPU and with a sharded base (FSDP: not planned)."""
        args, keys = self.args, KEEPING_KEYS
        planned = args.gradient_checkpointing and any(getattr(args, key) is None for key in keys)
        card = memory_plan.device_memory(self.device) if planned and not fsdp.uses_fsdp(self.accelerator) else None
        if card is None:
            for key in keys:
                setattr(args, key, bool(getattr(args, key)))
            return
        said = memory_plan.settle_keeping_keys(self.family, args, card, largest_step(self.blueprint))
        if said:
            self.accelerator.print(said)

    def _hold_cache_folders(self, held: contextlib.ExitStack):
        """The main process holds each cache folder's lock shared until `held` closes (the run's end;
        caches.hold_cache_folders), beside any other run over the same images: two runs caching the
        same file write it twice (atomically), which is lost time, not harm. What harms is a removal
        of the files another run reads, so the unused ones are removed only in a folder this run has
        alone (_remove_unused_caches). The other processes wait until the locks are held: a file
        they find current before then could be removed by a run that has the folder alone."""
        args, self._cache_locks = self.args, {}
        if not (args.cache_latents_to_disk or args.cache_text_encoder_outputs_to_disk):
            return  # the caches live in memory: no file is shared
        if self.accelerator.is_main_process:  # the lock is the run's; only the main process removes caches
            self._cache_locks = hold_cache_folders(self.dataset.items + self.validation_set.items, held)
        if self.accelerator.num_processes > 1:
            self.accelerator.wait_for_everyone()

    def _fill_caches(self):
        """Latents, captions, then the empty caption and the sample prompts. On several processes each
        encodes its share of the cache files (caches.owned_by) and waits for the others' (encoded_by_all);
        the prompts' files are written by the main process first, then read by the others."""
        self._cache_latents()  # the VAE is freed when this returns
        args, items = self.args, self.dataset.drawn_items() + self.validation_set.items
        options = self.family.text_options(args)
        precision = args.text_encoder_precision  # part of the cache key: another precision re-encodes
        text_key = self.family.text_cache_key(options, precision)
        turns = memory_plan.text_encoder_turns(self.family, precision, memory_plan.device_memory(self.device))
        if turns:  # not in the cache key: the outputs are the same
            self.accelerator.print(turns)
        placement = {"one_at_a_time": True} if turns else {}
        encode_text = loaded_on_first_call(lambda: self.family.load_text_encoder(precision, self.device, **options,
                                                                                 **placement))
        sees = self.family.text_sees_controls  # text per (caption, references)
        to_disk = args.cache_text_encoder_outputs_to_disk
        encoded = cache_text(items, encode_text, text_key, batch_size=args.text_encoder_batch_size, to_disk=to_disk,
                             with_references=sees, share=cache_share(self.accelerator))
        encoded = encoded_by_all(self.accelerator, encoded, to_disk)
        variants = sum(len(item.caption_variants) for item in items)
        self.accelerator.print(cache_summary("captions", encoded, items, "text_cache", to_disk)
                               + (f"; {variants} augmented variants cached with them" if variants else ""))
        with self.accelerator.main_process_first() if to_disk else contextlib.nullcontext():
            prompt_files = self._cache_prompt_texts(encode_text, text_key, sees)
        del encode_text  # the encoders go before the transformer loads
        self._remove_unused_caches(items, prompt_files)
        release_freed_memory()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _cache_prompt_texts(self, encode_text, text_key: str, sees: bool) -> list[str | None]:
        """The empty caption (caption dropout's, as the dataset's empty_text) and the sample prompts'
        texts (self.prompt_texts: the encoders are gone by the time samples render; true-CFG
        families always need a, possibly empty, negative prompt), kept beside the first image's
        caches. Returns their files."""
        folder, files = self._prompt_folder(), []
        blank = any(item.preservation_caption == "" for item in self.dataset.items)  # blank_prompt_preservation's
        if not sees and (blank or any(drops_captions(item.subset) for item in self.dataset.items)):  # else: per item
            files.append(cache_empty_caption(self.dataset, encode_text, text_key, folder))
        negatives = [self.family.sample_negative(p.negative) if self.family.true_cfg else None  # CFG's only
                     for p in self.prompts]
        sizes = [self.family.sample_text_size(p.control_images, p.width, p.height) if sees else None
                 for p in self.prompts]
        jobs = [(text, p.control_images, size) for p, negative, size in zip(self.prompts, negatives, sizes)
                for text in (p.prompt, *([negative] if negative is not None else []))]
        encodings, prompt_files = cache_prompts(jobs, encode_text, text_key, folder, sees)
        texts = iter(encodings)
        self.prompt_texts = [(stack_text([next(texts)]), stack_text([next(texts)]) if negative is not None else None)
                             for negative in negatives]
        return files + prompt_files

    def _remove_unused_caches(self, items: list, prompt_files: list[str | None]) -> None:
        """Cache files of this family in this run's cache folders that no entry uses (an old setting's,
        a removed image's) are deleted, once, by the main process, in the folders no other run holds
        (each held exclusive meanwhile); keep_cache = true keeps them."""
        args = self.args
        if args.keep_cache or not self.accelerator.is_main_process:
            return
        used = {c for item in items for c in (item.latent_cache, item.text_cache) if isinstance(c, str)}
        used |= {f for f in prompt_files if f}
        folders = {cache_folder(item) for item in items}
        with contextlib.ExitStack() as alone:  # removals only where no other run holds the folder
            shared = [f for f in sorted(folders) if f in self._cache_locks
                      and not alone.enter_context(self._cache_locks[f].alone())]
            for folder in (f for f in shared if self._cache_locks[f].held):  # unopened / no flock: said when opened
                self.accelerator.print(f"{folder}: another run is using these caches; unused cache files are left "
                                       f"for a run that has the folder alone")
            removed, freed = remove_unused_caches(folders - set(shared), self.family.name, used,
                                                  args.cache_latents_to_disk, args.cache_text_encoder_outputs_to_disk)
        if removed:
            size = f"{freed / 2**20:.1f} MiB" if freed >= 2**20 else f"{freed / 2**10:.0f} KiB"
            self.accelerator.print(f"caches: {removed} files no entry uses were removed ({size} freed; "
                                   f"keep_cache = true keeps them)")

    def _prompt_folder(self) -> str | None:
        """Where the empty caption's and the sample prompts' encodings are kept: the folder of the
        first image's text cache (None: text caches are not kept on disk)."""
        items = self.dataset.items + self.validation_set.items
        if not (self.args.cache_text_encoder_outputs_to_disk and items):
            return None
        return cache_folder(items[0])

    def _cache_latents(self):
        items, latent_key = self.dataset.drawn_items() + self.validation_set.items, self.family.latent_cache_key()

        def load():
            vae = self.family.load_vae(torch.float32)
            vae.vae.to(self.device)
            return lambda x: vae.encode(x.to(self.device))

        to_disk = self.args.cache_latents_to_disk
        encoded = cache_latents(items, loaded_on_first_call(load), latent_key, batch_size=self.args.vae_batch_size,
                                to_disk=to_disk, share=cache_share(self.accelerator))
        encoded = encoded_by_all(self.accelerator, encoded, to_disk)
        self.accelerator.print(cache_summary("latents", encoded, items, "latent_cache", to_disk))

    def _load_base(self) -> nn.Module:
        """The frozen transformer, on the CPU: LoRA goes on it there, then _to_device moves it."""
        base = self._frozen_transformer(base_precision(self.args))
        if self.args.base_loras:
            self.accelerator.print(f"base_loras: {len(self.args.base_loras)} merged into the frozen base")
        return base

    def _frozen_transformer(self, precision: str) -> nn.Module:
        """The transformer stored as `precision`, base_loras merged into it first (library/training/base_loras.py),
        frozen, on the CPU: the training base, and the bf16 reference of samples, which differs from it by
        precision only."""
        if not self.args.base_loras:
            return self.family.load_transformer(self.compute_dtype, precision).requires_grad_(False).eval()
        from library.training.base_loras import base_lora_specs, load_merged_base

        base = load_merged_base(self.family, self.compute_dtype, precision, base_lora_specs(self.args.base_loras))
        return base.requires_grad_(False).eval()

    def _enable_fp8_compute(self):
        """Before the LoRA wraps the base's Linears (library/precision/fp8_compute.py)."""
        from library.precision.fp8_compute import enable_fp8_compute, fp8_gemm_available

        if not fp8_gemm_available(self.device):
            raise ConfigError(f"fp8_compute: {self.device} has no fp8 GEMMs with per-row scales under torch {torch.__version__} "
                              f"(CUDA compute capability >= 8.9: Ada, Hopper, Blackwell; the CPU from torch 2.13); "
                              f"set fp8_compute = false")
        turned = enable_fp8_compute(self.base)
        self.accelerator.print(f"fp8_compute: {turned} base Linears run as fp8 GEMMs (per-row scales), the LoRA in bf16")

    def _to_device(self, base: nn.Module) -> nn.Module:
        """Swapped blocks' weights move to pinned CPU memory first, so the base is never on the
        device whole (a 24 GB card could not hold it). Under FSDP the base is sharded over the
        processes instead, block by block (library/training/fsdp.py)."""
        from library.models.block_swap import enable_block_swap

        if fsdp.uses_fsdp(self.accelerator):
            return fsdp.shard_base(base, self.accelerator)
        try:
            enable_block_swap(base, self.args.blocks_to_swap, self.device, self.args.block_swap_prefetch)
        except ValueError as e:
            raise ConfigError(f"{self.args.pretrained_model_name_or_path}: {e}") from None
        return base.to(self.device)

    def _make_network_for(self, base: nn.Module) -> nn.Module:
        args = self.args
        network = build_network(args.network_module, base, self.family.arch, args.network_dim, args.network_alpha,
                                network_args=lora_network_args(args), modules_from=network_modules_from(args))
        network.apply()
        return network.to(self.device)

    def _make_network(self) -> nn.Module:
        network = self._make_network_for(self.base)
        if self.args.network_weights:
            said, self.loaded = load_network_weights(network, self.args)
            self.accelerator.print(said)
            if "network_alpha" in self.loaded:
                self.accelerator.print(f"network_weights: its alpha ({self.loaded['network_alpha']}) is kept; "
                                       f"network_alpha applies only to modules the file lacks")
        return network

    def _compiles(self) -> bool:
        """torch_compile as set, or when unset as compile_by_default decides (said in one line on CUDA)."""
        if self.args.torch_compile is not None:
            return self.args.torch_compile
        triton = self.device.type == "cuda" and importlib.util.find_spec("triton") is not None
        parameters = sum(t.numel() for t in (*self.base.parameters(), *self.base.buffers()))  # fp8 codes: buffers
        on, why = compile_by_default(self.args, self.device.type, triton, self.stored_precision,
                                     self.accelerator.num_processes, parameters, getattr(self.network, "dora", False))
        if self.device.type == "cuda" and self.accelerator.is_main_process:
            print(f"torch_compile unset: {'on' if on else 'off'} ({why}; torch_compile = {str(not on).lower()} "
                  f"to change it)", flush=True)
        self.args.torch_compile = on  # the run's metadata and a resumed state see what ran
        return on

    def _compile_blocks(self):
        """Compile each transformer block (core.compile_block: in place, so LoRA files and state dicts
        are unchanged, and its checkpointed call as one region); after the LoRA is applied, so the
        compiled forward includes it. The blocks are the model's swappable_blocks(): every family's
        transformer lists its repeated blocks there, in run order."""
        for block in self.base.swappable_blocks():
            compile_block(block)
        self._compile_limit_hits = compile_limit_hits()

    # -- what the loop uses --------------------------------------------------------------------
    def param_groups(self, lr: float) -> list[dict]:
        return self.network.param_groups(lr)

    def loss_weight(self, epoch: int, batch: int, step_batches: range) -> tuple[float, float]:
        # Every micro-batch's mean counts alike, over the step's own count: an epoch's last, shorter step is the mean of
        # its micro-batches too (accelerate divides by gradient_accumulation_steps always: k/N of it in the peers).
        return 1, len(step_batches)

    def batches_per_epoch(self) -> int:
        return len(EpochBatches(self.sampler, 0, self.accelerator.process_index, self.accelerator.num_processes))

    def data_items(self) -> list[str]:
        return [f"{it.dataset_index}/{it.subset_index}/{os.path.basename(it.image_path)} {os.path.getsize(it.image_path)}"
                for it in self.dataset.items]

    def epoch_settings(self) -> list:
        """Each dataset's global batch (batch_size x processes: N processes draw the batches one process
        draws with an N-times batch) and its subsets' num_repeats: another batch_size and num_repeats can
        give as many batches per epoch, of other images."""
        world = self.accelerator.num_processes
        return [[d.batch_size * world, [s.num_repeats for s in d.subsets]] for d in self.blueprint.datasets]

    def epoch_batches(self, epoch: int, skip: int = 0):
        """This process's batches of `epoch`, after the first `skip`. With persistent_data_loader_workers
        one DataLoader serves every epoch (its batch sampler is handed each epoch's batches), so its
        workers live on from epoch to epoch; a DataLoader per epoch would start them anew each time."""
        shard = EpochBatches(self.sampler, epoch, self.accelerator.process_index, self.accelerator.num_processes, skip)
        workers = self.args.max_data_loader_n_workers
        persistent = self.args.persistent_data_loader_workers and workers > 0
        if persistent and self._loader is not None:
            self._loader.batch_sampler.batches = shard.batches
            return self._loader
        # Its own generator: an iterator draws its workers' base seed from it, which from the global RNG moved
        # every later dropout draw of a resumed run (restored RNG, then the draw) off the uninterrupted run's.
        # (Neither the batches nor the workers' draws depend on it: dataset.py draws by seed, epoch and entry.)
        loader = torch.utils.data.DataLoader(
            self.dataset, batch_sampler=shard, collate_fn=collate_batch, num_workers=workers,
            persistent_workers=persistent, pin_memory=self.device.type == "cuda",
            generator=torch.Generator().manual_seed(self.args.seed),
        )
        if persistent:
            self._loader = loader
        return loader

    def batch_inputs(self, batch: dict, step: int) -> tuple:
        """(latents, text, one generator per sample seeded from the optimizer step and the
        sample's key: its dataset, subset, path inside the subset and repeat number, so every
        occurrence of an image in a step gets its own draw, equal on 1 or N processes and after a
        move or resume;
        loss masks, sample weights, reference latents, output preservation's prompts and samples, the samples'
        num_timestep_buckets strata): LoRALoss.forward's arguments."""
        latents = batch["latents"].to(self.device)
        text = {k: v.to(self.device) for k, v in batch["text"].items()}
        gens = [torch.Generator().manual_seed(sample_seed(self.args.seed, step, key)) for key in batch["keys"]]
        mask = batch["masks"].to(self.device) if "masks" in batch else None
        weights = None  # regularization images: their loss times prior_loss_weight (sd-scripts' loss_weights)
        if batch["is_reg"].any():
            weights = torch.where(batch["is_reg"], self.args.prior_loss_weight, 1.0).to(self.device)
        control = [c.to(self.device) for c in batch["controls"]] if "controls" in batch else None
        kept = preserved = None
        if "preservation_text" in batch and batch["preserved"].any():  # no sample with a term: no second forward
            kept = {k: v.to(self.device) for k, v in batch["preservation_text"].items()}
            preserved = batch["preserved"].float().to(self.device)
        return latents, text, gens, mask, weights, control, kept, preserved, batch.get("strata")

    def trainable_parameters(self) -> list[nn.Parameter]:
        return self.network.trainable_parameters()

    def named_trainable_parameters(self) -> dict[str, nn.Parameter]:
        return {name: p for name, p in self.network.named_parameters() if p.requires_grad}

    def validation_size(self) -> int:
        return len(self.validation_set)

    def validation_loss(self) -> float:
        """library/training/validation.py: fixed sigmas and noise, plain MSE, no grad."""
        return validation_loss(self.family, self.base, self.validation_set, self.args.guidance_scale, self.accelerator)

    def trainable_tensors(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.network.state_dict().items()}

    def load_trainable_tensors(self, tensors: dict[str, torch.Tensor]):
        self.network.load_state_dict(tensors)

    def scale_weight_norms(self, max_norm: float) -> dict:
        return self.network.scale_weight_norms(max_norm)

    def step_extras(self) -> dict:
        """The step's mean output-preservation term (loss_preservation, included in loss), when there is one."""
        if not preservation.preserving(self.args):
            return {}
        terms, self.module.preservation_losses = self.module.preservation_losses, []
        mean = torch.tensor([sum(terms) / max(len(terms), 1)], device=self.device)  # the processes' mean, as `loss`
        return {"loss_preservation": self.accelerator.reduce(mean, reduction="mean").item()}

    _said_compile_limit = False  # after_step's warning, once a run
    _compile_limit_hits = 0  # core.compile_limit_hits() when the blocks were compiled (an earlier run in this process)

    def after_step(self, step: int, output_dir: str):
        if self.args.torch_compile and not self._said_compile_limit and compile_limit_hits() > self._compile_limit_hits:
            self._said_compile_limit = True
            warnings.warn(f"torch_compile: torch._dynamo hit its recompile_limit "
                          f"({torch._dynamo.config.recompile_limit}) by step {step}: the transformer calls it "
                          f"could not compile run eager from now on, slower than torch_compile = false (torch's "
                          f"'hit config.recompile_limit' line above names the function and the reason); "
                          f"please report it", stacklevel=2)

    def evaluates_after(self, step: int) -> bool:
        return False

    def save(self, path: str, metadata: dict, dtype: torch.dtype):
        self.network.save(path, dtype=dtype, metadata=metadata)

    def finish(self, output_dir: str, stop=None) -> list[str]:
        """End of training: the final samples (their paths)."""
        return self.render_samples(output_dir, "final", stop) if self.prompts else []

    # -- metadata ------------------------------------------------------------------------------
    def trained_precision(self) -> str:
        """The base trained on, as the LoRA's metadata and the samples' panels name it: bf16 / fp8 /
        fp8_scaled / nf4 ..., or the layout of a pre-quantized file (e.g. fp8_tensor_scaled) or of a plain
        e5m2 one (fp8_e5m2, widened exactly to the compute dtype)."""
        return self.stored_precision or self.widened_precision or base_precision(self.args)

    def metadata(self) -> dict:
        from library.training.base_loras import base_loras_metadata

        datasets, args = self.blueprint.datasets, self.args
        return {
            "base_model_version": self.family.model_version(self.base),
            "base_precision": self.trained_precision(),
            "fp8_compute": "true" if args.fp8_compute else None,
            "resolution": ",".join(f"{d.resolution[0]}x{d.resolution[1]}" for d in datasets),
            "batch_size": self._total_batch_size(),
            "timestep_sampling": args.timestep_sampling or self.family.default_timestep_sampling(self.base),
            "guidance": args.guidance_scale,  # ss_guidance_scale: a diffusion key; an LLM's task gives none
            "dataset": self._dataset_summary(),
            **self._folder_facts(),
            "base_loras": base_loras_metadata(args.base_loras),
            "output_preservation": preservation.metadata(args),
            "trained_keys": {k.key: getattr(args, k.key) for k in spec_of(args.model_type).config_keys
                             if k.renders and getattr(args, k.key, None) is not None} or None,
            **getattr(self, "loaded", {}),  # network_dim / network_alpha where network_weights set them
        }

    def _total_batch_size(self) -> str:
        """Images per optimizer step (ss_total_batch_size): each dataset's batch (no more than its entries
        an epoch: images x num_repeats, which batches are cut from) x processes x accumulation; datasets
        of different batches are listed each."""
        per_step = self.accelerator.num_processes * self.args.gradient_accumulation_steps
        entries = [0] * len(self.blueprint.datasets)
        for i in self.dataset.entries:
            entries[self.dataset.items[i].dataset_index] += 1
        sizes = dict.fromkeys(min(d.batch_size, n or d.batch_size) * per_step
                              for d, n in zip(self.blueprint.datasets, entries))
        return ",".join(str(size) for size in sizes)

    def _dataset_summary(self) -> list[dict]:
        return [
            {"resolution": list(d.resolution), "batch_size": d.batch_size, "buckets": d.enable_bucket,
             "subsets": [{"image_dir": os.path.basename(os.path.normpath(s.image_dir)), "num_repeats": s.num_repeats,
                          "images": sum(1 for it in self.dataset.items if it.subset is s)} for s in d.subsets]}
            for d in self.blueprint.datasets
        ]

    def _folder_facts(self) -> dict:
        """sd-scripts' per-folder header keys as its train_network.py writes them: ss_dataset_dirs (each
        training folder's num_repeats and images; a folder met again is "name (2)"), ss_tag_frequency (each
        folder's tags over its captions as written, regularization folders too; a folder in two datasets
        counted once) and ss_num_train_images / ss_num_reg_images (images x num_repeats)."""
        dirs, tags, images = {}, {}, {False: 0, True: 0}
        for d, dataset in enumerate(self.blueprint.datasets):
            folder_tags: dict[str, list[str]] = {}
            for s, subset in enumerate(dataset.subsets):
                items = [it for it in self.dataset.items if it.dataset_index == d and it.subset_index == s]
                name = os.path.basename(os.path.normpath(subset.image_dir))
                images[subset.is_reg] += len(items) * subset.num_repeats
                folder_tags.setdefault(name, []).extend(caption_as_written(it.caption, subset) for it in items)
                if not subset.is_reg:
                    key, n = name, 2
                    while key in dirs:
                        key, n = f"{name} ({n})", n + 1
                    dirs[key] = {"n_repeats": subset.num_repeats, "img_count": len(items)}
            for name, captions in folder_tags.items():
                tags.setdefault(name, tag_frequency(captions))
        return {"dataset_dirs": dirs, "tag_frequency": tags, "num_train_images": images[False],
                "num_reg_images": images[True]}

    # -- samples -------------------------------------------------------------------------------
    def render_samples(self, out_dir: str, tag: str, stop=None, first: int = 0) -> list[str]:
        """One PNG per prompt: the training base (bf16 or the fp8 base the user deploys) and,
        on an fp8 base with sample_bf16_reference, the bf16 base beside it; then the prompt's
        reference images (--ci, edit families), as the model saw them. Ends before a prompt
        where `stop()` is true (asked once before each), from prompt `first` on. What the family's sampling
        loaded for itself is released after, failed or not: it must not stay on the device through the training
        steps."""
        try:
            return self._render_samples(out_dir, tag, stop, first)
        finally:
            self.family.release_sample_models()

    @torch.no_grad()
    def _render_samples(self, out_dir: str, tag: str, stop=None, first: int = 0) -> list[str]:
        if len(self.prompts) <= first:
            return []
        from library.data.images import save_side_by_side
        from library.models.vae import decoding_in_tiles

        # Names first: a process that fails loading below must not leave the others in this broadcast
        stamp, seeds = self._render_names()
        bases = [(self.trained_precision(), self.base)]  # the layout loaded
        if memory_plan.renders_bf16_reference(self.family, self.args):
            # The same LoRA on a bf16 copy of the base (its base_loras merged), streamed from disk for this render only.
            reference = self._frozen_transformer("bf16")
            reference_net = self._make_network_for(reference)
            reference_net.load_weights(self.network.state_dict())
            self._to_device(reference)
            bases = [("bf16", reference)] + bases
        vae = self.family.load_vae(torch.float32)
        vae.vae.to(self.device)
        written = []
        for i, (prompt, (text, negative)) in enumerate(zip(self.prompts, self.prompt_texts)):
            if i < first:
                continue
            if stop is not None and stop():
                break
            images = []
            width, height, references = self.family.sample_references(prompt.control_images, prompt.width,
                                                                      prompt.height)
            control = [vae.encode(r.to(self.device)) for r in references] or None  # float32 [1, 16, h, w]
            for label, model in bases:
                latents = self.family.sample_latents(
                    model, {k: v.to(self.device) for k, v in text.items()}, width, height, prompt.steps,
                    seeds[i], prompt.guidance,
                    {k: v.to(self.device) for k, v in negative.items()} if negative else None, control=control,
                    flow_shift=prompt.flow_shift,
                )
                with decoding_in_tiles(vae.vae, bool(self.args.vae_tiling)):
                    images.append((label, vae.decode(latents)[0]))
            names = ["reference"] if len(references) == 1 else [f"reference {k}" for k in range(len(references))]
            images += [(name, r[0]) for name, r in zip(names, references)]
            path = os.path.join(out_dir, sample_file_name(self.args.output_name, tag, i, stamp, seeds[i]))
            # generate.py's names: `generate.py --seed ... --steps ...` with the saved LoRA renders it again
            info = {**self.family.rendered_settings(prompt, width, height, seeds[i]),
                    "model": os.path.basename(os.path.normpath(self.args.pretrained_model_name_or_path)),
                    "model_type": self.args.model_type, "lora": f"{self.args.output_name} {tag}"}
            save_side_by_side(images, path, prompt.prompt, info)
            written.append(path)
        return written

    def _render_names(self) -> tuple[str, list[int]]:
        """This render's time (YYYYmmddHHMMSS) and each prompt's seed (its --d, else a random one), as
        the main process draws them: every process renders the same images into the same files."""
        plan = [time.strftime("%Y%m%d%H%M%S"), [seed_or_random(p.seed) for p in self.prompts]]
        if self.accelerator.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            plan = broadcast_object_list(plan)
        return plan[0], plan[1]

