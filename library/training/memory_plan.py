"""The memory planner: each phase of a run simulated on `meta`, from the checkpoints' headers.

No weight is read. The transformer is built exactly as train_lora.py builds it (the family's loader
with read_weights=False: config from the file, fp8 layers prepared, the file's own fp8 layout if
pre-quantized), the LoRA network is the real one, and one real training step (the family's
training_loss, backward) runs on meta tensors under LiveBytes, a dispatch mode that adds up the
bytes of every live tensor storage and records the peak: what torch.cuda.max_memory_allocated
reports for the same step, minus the allocator's rounding. Where the meta run differs from a real
device, the plan says how it models it:
- attention: meta SDPA takes the math path ([B, H, L, L] scores); the plan runs the fused kernels'
  ops instead (flash without a mask, memory-efficient with one), as CUDA and CPU SDPA do;
- block swap: swapped blocks' weights are counted off the device and block_swap_prefetch + 1 of them
  back (the schedule of library/models/block_swap.py keeps at most that many resident);
- optimizer state: bytes per LoRA parameter of the optimizer (AdamW 8, AdamW8bit 2, Prodigy 16, ...),
  added at the end of the step where the real optimizer allocates it.
Phases: caching (the VAE encoding vae_batch_size images of the largest bucket, as cache_latents
does; the text encoders' weights in their precision), training (an edit family's references add
their latent tokens, and where its text encoder sees them, their text tokens), sampling (the
resident training state, the VAE, the forward at the sample size, the VAE decode; on an fp8 base
with sample_bf16_reference also the bf16 copy of the base that each render loads beside it, and any
model the family's sampling loads for itself).
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from library.data.image_folders import LargestStep
from library.models.core import checkpointing
from library.models.family import Preservation
from library.models.registry import spec_of
from library.training.config_schema import KEEPING_KEYS
from library.training.meta_cache import META_KERNELS
from library.training.preservation import multiplier as preservation_multiplier, network_off, preserving

GiB = 2**30

# Optimizer state per trainable parameter (fp32 LoRA parameters), bytes; an unknown name plans 8. Where the
# state depends on the optimizer's args the larger is planned: SGD with momentum, Adafactor unfactored,
# Prodigy's p0 whole (a zero-initialised lora_up keeps a 0-dim p0: 14 bytes measured on a fresh LoRA).
OPTIMIZER_STATE_BYTES = {
    "adamw": 8, "adam": 8, "adamw32bit": 8, "pagedadamw": 8, "pagedadamw32bit": 8, "lion": 4, "ademamix": 12,
    "prodigy": 16,  # exp_avg, exp_avg_sq, s, p0
    "adafactor": 4, "sgd": 4, "sgdnesterov": 4, "rmsprop": 4, "adagrad": 4,
    "adamwschedulefree": 8, "radamschedulefree": 8, "sgdschedulefree": 4,  # z (+ exp_avg_sq)
    # bitsandbytes' 8-bit states: a byte each, and a float32 absmax per block of 256
    **dict.fromkeys(("adamw8bit", "pagedadamw8bit"), 2 * (1 + 4 / 256)),
    **dict.fromkeys(("lion8bit", "pagedlion8bit", "sgd8bit"), 1 + 4 / 256),
    **dict.fromkeys(("ademamix8bit", "pagedademamix8bit"), 3 * (1 + 4 / 256)),
}
CUDA_CONTEXT_BYTES = int(0.6 * GiB)  # the CUDA context and cuBLAS workspaces, outside max_memory_allocated


class LiveBytes(TorchDispatchMode):
    """Adds up the bytes of every tensor storage on `device_type` created while active (and of those
    given to track()); storages leave the count when they are freed. `peak` is the high-water mark.
    On "cpu" it counts a real run's tensors without the kernels' workspaces and the allocator's
    slack (bench/bench_planner_cpu.py --live-tensors: the plan against what a GPU would count)."""

    def __init__(self, device_type: str = "meta"):
        super().__init__()
        self.device_type = device_type
        self.live = self.peak = 0
        # id(storage) -> a weak reference whose callback, when the storage is freed, drops the entry
        # and its bytes (a callback runs before the id can be reused)
        self._seen: dict[int, weakref.ref] = {}

    @classmethod
    def _should_skip_dynamo(cls):
        # Not wrapped in torch._dynamo.disable (TorchDispatchMode's default, ~10 us per op): no step
        # under the planner is compiled.
        return False

    def track(self, t: torch.Tensor):
        storage = t.untyped_storage()
        key = id(storage)
        if key in self._seen:
            return
        size = storage.nbytes()
        self._seen[key] = weakref.ref(storage, lambda _, key=key, size=size: self._free(key, size))
        self.live += size
        if self.live > self.peak:
            self.peak = self.live

    def ignore(self, t: torch.Tensor):
        """A storage that is not on the device (a swapped block's weight): its views count nothing."""
        storage = t.untyped_storage()
        key = id(storage)
        if key not in self._seen:
            self._seen[key] = weakref.ref(storage, lambda _, key=key: self._free(key, 0))

    def _free(self, key: int, size: int):
        self._seen.pop(key, None)
        self.live -= size

    def add(self, size: int):
        """Bytes that exist on the device but not as meta tensors (optimizer state, swap buffers)."""
        self.live += size
        self.peak = max(self.peak, self.live)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # On meta, the kernels' answers are memoized (meta_cache.py): the same block ops recur per
        # block and per planned setting; the outputs' storages are new either way.
        out = META_KERNELS(func, args, kwargs or {}) if self.device_type == "meta" else func(*args, **(kwargs or {}))
        if type(out) is torch.Tensor:  # most ops: one tensor, no tree to flatten
            if out.device.type == self.device_type:
                self.track(out)
            return out
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == self.device_type:
                self.track(t)
        return out


def _fused_sdpa(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False, **_):
    """The fused kernels' ops (and memory) on meta: flash without a mask, memory-efficient with
    an additive bias the size of the mask (what CUDA SDPA turns a boolean mask into). The fused kernels take
    [B, H, L, D] only: other shapes (diffusers' single-head VAE attention, [B, L, C]) run the math path there,
    the [B, L, L] scores included."""
    if q.dim() != 4:
        return torch.ops.aten._scaled_dot_product_attention_math(q, k, v, attn_mask, 0.0, is_causal)[0]
    if attn_mask is None:
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal)[0]
    bias = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device)
    bias = bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, is_causal)[0]


@contextlib.contextmanager
def fused_attention_on_meta():
    """Our attention (core.sdpa) and diffusers' (the VAE's mid-block calls F.sdpa) on the fused ops."""
    import torch.nn.functional as F

    from library.models import core

    original, core.sdpa = core.sdpa, _fused_sdpa
    original_f, F.scaled_dot_product_attention = F.scaled_dot_product_attention, _fused_sdpa
    try:
        yield
    finally:
        core.sdpa, F.scaled_dot_product_attention = original, original_f


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def module_bytes(module: nn.Module) -> int:
    return tensor_bytes([*module.parameters(), *module.buffers()])


# ----------------------------------------------------------------------------------------------
# Phases


@dataclass
class Phase:
    name: str
    parts: dict[str, int] = field(default_factory=dict)  # what is resident, bytes
    peak: int = 0  # the predicted peak of device memory (tensors), bytes

    def row(self) -> str:
        parts = ", ".join(f"{k} {v / GiB:.2f}" for k, v in self.parts.items())
        return f"{self.name:9s} peak {self.peak / GiB:6.2f} GiB  ({parts})"


def text_tokens_for(family, args, references: int = 0, width: int = 1024, height: int = 1024) -> int:
    """Text tokens a planned sample carries: the length the family's text encoder pads a caption to
    (its text_options' length where the config or checkpoint sets one, else the spec's planner
    text_tokens), plus what each reference adds where the text encoder sees it."""
    planner = spec_of(family.name).planner
    length = family.text_options(args).get(planner.text_length_option) if planner.text_length_option else None
    return (length or planner.text_tokens) + references * family.reference_text_tokens(width, height)


def references_and_tokens(family, args, step: LargestStep) -> tuple[int, int]:
    """(references per image, text tokens) a plan sizes `step`'s samples with; step.references None: the family's
    plan_controls (one for edit presets); each reference of planned_reference's size."""
    count = family.plan_controls if step.references is None else step.references
    reference = planned_reference(family, (step.width, step.height), step.reference_size)
    return count, text_tokens_for(family, args, count, *reference)


def planned_reference(family, bucket: tuple[int, int], reference_size: tuple[int, int] | None) -> tuple[int, int]:
    """(w, h) of the reference image a plan of a `bucket` target sizes: the dataset's largest (reference_size), else
    the largest the family encodes (family.largest_reference). Its latents are at planned_control's size."""
    return tuple(reference_size or family.largest_reference(bucket))


def planned_control(family, bucket: tuple[int, int], reference_size: tuple[int, int] | None) -> tuple[int, int]:
    """(w, h) the planned reference (planned_reference) is encoded at for a `bucket` target: family.control_bucket,
    the plan's largest bucket standing for the dataset's resolution (its area, to a grid step)."""
    return tuple(family.control_bucket(bucket, planned_reference(family, bucket, reference_size)))


_REUSED: dict | None = None  # reusing_meta_models' builds, while one is open


@contextlib.contextmanager
def reusing_meta_models():
    """Within: each (family, model settings) is built on meta once (~1 s for a full-size model) and
    handed back, as built, to every later plan of it: the settings that differ only in checkpointing
    or in a keeping key use the same transformer and network."""
    global _REUSED
    outer = _REUSED
    _REUSED = {} if outer is None else outer
    try:
        yield
    finally:
        _REUSED = outer


def network_tensors(network: nn.Module) -> list[torch.Tensor]:
    """The network's tensors as they sit on the device: its parameters and buffers (not its state_dict, which
    LyCORIS computes for algo=full: the trained weight minus a CPU copy, which fails on meta)."""
    return [*network.parameters(), *network.buffers()]


def meta_model_and_network(family, args):
    """The transformer on meta as train_lora.py builds it (the family's loader without weights) and
    the run's LoRA network applied to it (the planner's, and the run's check of network_weights' ranks)."""
    from library.training.config import base_precision, compute_dtype, lora_network_args, network_modules_from

    key = (id(family), compute_dtype(args), base_precision(args), args.network_module, args.network_dim,
           args.network_alpha, repr(lora_network_args(args)), network_modules_from(args))
    if _REUSED is None:
        return _build_model_and_network(family, args)
    if key not in _REUSED:
        model, network = _build_model_and_network(family, args)
        built = [(m, m.training) for m in (*model.modules(), *network.modules())]
        # the family is kept with its build so that its id, in the key, names no other object meanwhile
        _REUSED[key] = (family, model, network, built, getattr(model, "gradient_checkpointing", False))
    _, model, network, built, checkpointing_as_built = _REUSED[key]
    for module, training in built:  # as built: a plan's step leaves its modes, checkpointing and LoRA grads
        module.training = training
    model.gradient_checkpointing = checkpointing_as_built
    for p in (*model.parameters(), *network.parameters()):
        p.grad = None
    return model, network


def _build_model_and_network(family, args):
    from library.training.config import base_precision, compute_dtype, lora_network_args, network_modules_from
    from networks.factory import build_network

    model = family.load_transformer(compute_dtype(args), base_precision(args), read_weights=False)
    model.requires_grad_(False).eval()
    with torch.device("meta"):
        network = build_network(args.network_module, model, family.arch, args.network_dim, args.network_alpha,
                                network_args=lora_network_args(args), modules_from=network_modules_from(args))
    network.apply()
    return model, network


def optimizer_state_bytes(optimizer_type: str, kwargs: dict) -> float:
    """Bytes of optimizer state per trainable parameter: the table's, and the buffers its args add (amsgrad's
    max_exp_avg_sq, RMSprop's momentum and centered averages: planned 1.5-3x short before)."""
    name = optimizer_type.lower().rsplit(".", 1)[-1]
    extra = 4 * bool(kwargs.get("amsgrad")) if name in ("adam", "adamw") else 0
    if name == "rmsprop":
        extra = 4 * bool(kwargs.get("momentum")) + 4 * bool(kwargs.get("centered"))
    return OPTIMIZER_STATE_BYTES.get(name, 8) + extra


def _optimizer_bytes(network: nn.Module, args) -> int:
    from library.training.config import optimizer_kwargs

    trainable = sum(p.numel() for p in network.parameters() if p.requires_grad)
    return int(trainable * optimizer_state_bytes(args.optimizer_type, optimizer_kwargs(args)))


def _ema_bytes(network: nn.Module, args) -> int:
    """The EMA's float32 copy of the trainable weights where it lives beside them (ema_device "same"); the
    planner left it out until 2026-11-27 (a 12 B model's rank-64 LoRA: ~0.3 GiB)."""
    if not args.ema_decay or args.ema_device != "same":
        return 0
    return 4 * sum(p.numel() for p in network.parameters() if p.requires_grad)


def resident_parts(base: int, block_bytes: list[int], lora: int, optimizer: int, blocks_to_swap: int,
                   prefetch: int = 1, ema: int = 0) -> dict[str, int]:
    """What stays on the device between steps: the base less its swapped blocks (counted off the
    device, prefetch + 1 of them back, or all of them where fewer are swapped: the schedule of
    library/models/block_swap.py), the LoRA, its optimizer state and, where it lives there, its EMA."""
    if not 0 <= blocks_to_swap <= len(block_bytes):  # (a count past the blocks wrapped round the list)
        raise ValueError(f"blocks_to_swap {blocks_to_swap}: the model has {len(block_bytes)} blocks")
    swapped = block_bytes[len(block_bytes) - blocks_to_swap:] if blocks_to_swap else []
    parts = {"base": base - sum(swapped), "swap buffers": swap_buffer_bytes(swapped, prefetch),
             "lora": lora, "optimizer": optimizer}
    return {**parts, "ema": ema} if ema else parts


def swap_buffer_bytes(swapped: list[int], prefetch: int) -> int:
    """The most swapped blocks' bytes on the device at once: BlockSwap holds block i and the next `prefetch`
    in run order (forward: i..i+p; backward: i..i-p), so the largest run of prefetch + 1 consecutive ones."""
    run = min(len(swapped), prefetch + 1)
    return max((sum(swapped[i:i + run]) for i in range(len(swapped) - run + 1)), default=0)


@dataclass
class TrainingPlan:
    """One simulated training step without swapping; any blocks_to_swap is derived from it (the
    swap changes only which weights are resident: its schedule keeps prefetch + 1 swapped blocks on the device)."""
    base: int  # every weight of the transformer, bytes
    block_bytes: list[int]  # per block in run order
    lora: int
    lora_grads: int
    optimizer: int
    activations: int  # the step's peak above everything resident (activations, LoRA grads, temporaries)
    inputs: int
    prefetch: int = 1  # block_swap_prefetch
    ema: int = 0  # the EMA's bytes on the device (ema_device "same")

    def resident(self, blocks_to_swap: int = 0) -> dict[str, int]:
        """What stays on the device at this swap between steps (and through a sample): resident_parts."""
        return resident_parts(self.base, self.block_bytes, self.lora, self.optimizer, blocks_to_swap, self.prefetch,
                              self.ema)

    def phase(self, blocks_to_swap: int = 0) -> Phase:
        parts = {**self.resident(blocks_to_swap), "activations + lora grads (peak)": self.activations}
        return Phase("training", parts, sum(parts.values()) + self.inputs)


def training_plan(family, args, width: int, height: int, batch: int, text_tokens: int,
                  references: int | None = None, reference_size: tuple[int, int] | None = None,
                  layers: int | None = None) -> TrainingPlan:
    """One training step of `family` under `args` (the train_lora config) at width x height, on meta.
    references: reference images per sample of an edit family (default: family.plan_controls), each of
    reference_size (planned_reference); layers: a layered target's (the dataset's; None: the family's own)."""
    model, network = meta_model_and_network(family, args)
    model.gradient_checkpointing = checkpointing(args.gradient_checkpointing, args.checkpoint_saves_projections,
                                                 args.checkpoint_saves_attention,
                                                 args.checkpoint_saves_dequantized)
    network.train()
    lora = [p for p in network.parameters() if p.requires_grad]
    optimizer, ema = _optimizer_bytes(network, args), _ema_bytes(network, args)
    down = family.vae_downsample
    latents = family.target_on_meta(batch, height // down, width // down, layers)
    # Edit families: the references (at the family's size for them) add their tokens to every block.
    count = family.plan_controls if references is None else references
    rw, rh = planned_control(family, (width, height), reference_size)
    control = [torch.empty(batch, family.latent_channels, rh // down, rw // down, device="meta") for _ in range(count)]
    text = family.text_on_meta(model, batch, text_tokens)
    kept = None  # output preservation: a second prompt, two more forwards, two graphs held until the backward
    if preserving(args):
        kept = Preservation(family.text_on_meta(model, batch, text_tokens), torch.ones(batch, device="meta"),
                            preservation_multiplier(args), lambda: network_off(network))
    inputs = [latents, *control, *text.values(), *(kept.text.values() if kept else ())]
    generators = [torch.Generator().manual_seed(i) for i in range(batch)]
    with LiveBytes() as live, fused_attention_on_meta():
        for t in (*model.parameters(), *model.buffers(), *network_tensors(network), *inputs):
            live.track(t)
        live.add(optimizer + ema)  # from the first optimizer step on, resident during every step
        resident = live.live
        if args.gradient_accumulation_steps > 1:  # train_lora.py zeroes the grads after the step's last micro-batch:
            for p in lora:  # a later one runs its forward and backward with the earlier ones' LoRA grads held
                p.grad = torch.zeros_like(p)
        with no_module_dropout(network):  # the step that drops no module: the largest, and the same each plan
            loss, _ = family.training_loss(model, latents, text, args, generators, control=control or None,
                                           preservation=kept)
            loss.backward()
        del loss
    return TrainingPlan(
        base=module_bytes(model), block_bytes=[module_bytes(b) for b in model.swappable_blocks()],
        lora=tensor_bytes(network_tensors(network)), lora_grads=tensor_bytes(lora), optimizer=optimizer,
        activations=live.peak - resident, inputs=tensor_bytes(inputs),
        prefetch=args.block_swap_prefetch, ema=ema,
    )


@contextlib.contextmanager
def no_module_dropout(network: nn.Module):
    """Within: no LoRA module skips its branch (module_dropout draws at random: a plan drew a step with some
    modules skipped, their activations uncounted, and each plan another)."""
    modules = [m for m in network.modules() if getattr(m, "module_dropout", None)]
    rates = [m.module_dropout for m in modules]
    for m in modules:
        m.module_dropout = None
    try:
        yield
    finally:
        for m, rate in zip(modules, rates):
            m.module_dropout = rate


def vae_pass_peak(vae, width: int, height: int, batch: int, decode: bool, downsample: int = 8, tiled: bool = False) -> int:
    """Peak bytes of one VAE encode (images -> latents) or decode (latents of a `downsample`x VAE; tiled:
    in tiles, vae_tiling), fp32, no grad, on meta."""
    from library.models.vae import decoding_in_tiles

    with torch.no_grad(), LiveBytes() as live, fused_attention_on_meta():
        for t in (*vae.vae.parameters(), *vae.vae.buffers()):
            live.track(t)
        if decode:
            with decoding_in_tiles(vae.vae, tiled):
                vae.decode(torch.empty(batch, vae.latent_channels, height // downsample, width // downsample,
                                       device="meta"))
        else:
            vae.encode(torch.empty(batch, 3, height, width, device="meta"))
    return live.peak


def step_plan(family, args, step: LargestStep) -> TrainingPlan:
    """training_plan of `step` (image_folders.LargestStep: size, batch, references, their size, layers)."""
    count, tokens = references_and_tokens(family, args, step)
    return training_plan(family, args, step.width, step.height, step.batch, tokens, count, step.reference_size,
                         step.layers)


def caching_phase(family, args, width: int, height: int, references: int = 0,
                  reference_size: tuple[int, int] | None = None, card_bytes: int | None = None) -> Phase:
    """cache_latents: the VAE (float32) encodes vae_batch_size images of the largest bucket at a time,
    then their references (each at the family's control_bucket size) the same way, one after another;
    each encode's latents leave the device before the next, so the VAE's peak is its largest single
    encode (a reference of reference_size: planned_reference). Then, the VAE freed, the text encoders
    encode the captions: the phase's peak is the larger. On a card (card_bytes) that cannot hold them
    together, a family's text encoders take turns (text_encoders_one_at_a_time)."""
    vae = family.vae_on_meta()
    batch = args.vae_batch_size
    phase = Phase("caching")
    target = phase.parts[f"vae encode (batch {batch})"] = vae_pass_peak(vae, width, height, batch, decode=False)
    if references:
        size = planned_control(family, (width, height), reference_size)
        peak = target if size == (width, height) else vae_pass_peak(vae, *size, batch, decode=False)
        phase.parts[f"vae encode of {references} reference(s) ({size[0]}x{size[1]}, batch {batch}, each)"] = peak
    precision = args.text_encoder_precision
    # Weights as each loader keeps them in this precision (its fp8 Linears, what it keeps float32 in fp16); the
    # encoders' activations at batch 8 (a few hundred MB at most) are left out: the weights dominate by 20x.
    together, turns = text_encoder_bytes(family, precision)
    if text_encoders_one_at_a_time(family, together, card_bytes):
        phase.parts[f"text encoders ({precision}, one at a time)"] = turns
    else:
        phase.parts[f"text encoders ({precision})"] = together
    phase.peak = max(phase.parts.values())
    return phase


def text_encoder_bytes(family, precision: str) -> tuple[int, int]:
    """The text encoders' weights on the device at once, as their loaders keep them in `precision` (one read of
    their headers): (all of them together, taking turns: the first, which stays, with the largest other)."""
    weights = [w.bytes(precision) for w in family.text_encoder_weights()]
    together = sum(weights)
    return together, (weights[0] + max(weights[1:]) if len(weights) > 1 else together)


def text_encoders_one_at_a_time(family, together: int, card_bytes: int | None) -> bool:
    """Whether the text encoders take turns on this card (None: no card, the CPU): where the family's can
    (text_encoders_take_turns) and `together` (text_encoder_bytes') is over what a plan may use (usable_bytes)."""
    return card_bytes is not None and family.text_encoders_take_turns and together > usable_bytes(card_bytes)


def text_encoder_turns(family, precision: str, card_bytes: int | None) -> str | None:
    """The line train_lora.py says where the text encoders take turns on this card, else None."""
    if card_bytes is None or not family.text_encoders_take_turns:  # no header read where none can take turns
        return None
    together, turns = text_encoder_bytes(family, precision)
    if not text_encoders_one_at_a_time(family, together, card_bytes):
        return None
    return (f"text encoders ({precision}): {together / GiB:.2f} GiB together, over the card's usable "
            f"{usable_bytes(card_bytes) / GiB:.1f}; they take turns on it ({turns / GiB:.2f} GiB at most, each "
            f"copied in once per batch of text_encoder_batch_size captions)")


def cache_entry_bytes(family, args) -> tuple[float, int]:
    """(bytes a cached latent holds per pixel of its image, bytes a cached caption holds at the planned length,
    text_tokens_for's) as library/data/caches.py stores them (floating tensors in CACHE_DTYPE): the in-memory
    caches' plan (caches.plan_in_memory_caches)."""
    from library.data.caches import CACHE_DTYPE

    model, _ = meta_model_and_network(family, args)  # the plans' own build (reusing_meta_models)
    text = family.text_on_meta(model, 1, text_tokens_for(family, args)).values()
    per_text = sum(t.numel() * (CACHE_DTYPE.itemsize if t.is_floating_point() else t.element_size()) for t in text)
    return family.latent_channels * CACHE_DTYPE.itemsize / family.vae_downsample**2, per_text


def renders_bf16_reference(family, args) -> bool:
    """Whether samples also render on a bf16 copy of the base (DiffusionTask.render_samples): on an
    fp8 / nf4 / int8 base, unless sample_bf16_reference is false (unset counts as on; settle_sampling).
    Never on a pre-quantized file (family.stored_layout()): it loads as stored in any precision, so its
    "bf16" copy would be the same base again."""
    from library.training.config import base_precision

    return (base_precision(args) != "bf16" and getattr(args, "sample_bf16_reference", True) is not False
            and not family.stored_layout())


def _bf16_reference_bytes(family, args, lora: int) -> int:
    """The copy of the base render_samples loads for each render (bf16, i.e. the compute dtype),
    swapped as the base is, with its LoRA."""
    return bf16_reference_by_swap(family, args, lora)[args.blocks_to_swap]


def bf16_reference_by_swap(family, args, lora: int) -> list[int]:
    """_bf16_reference_bytes at each blocks_to_swap from 0 to the model's blocks (one meta build)."""
    from library.training.config import compute_dtype

    model = family.load_transformer(compute_dtype(args), "bf16", read_weights=False)
    blocks = [module_bytes(b) for b in model.swappable_blocks()]
    return [sum(resident_parts(module_bytes(model), blocks, lora, 0, n, args.block_swap_prefetch).values())
            for n in range(len(blocks) + 1)]


def sampling_phase(family, args, width: int, height: int, text_tokens: int, references: int | None = None) -> Phase:
    """A sample during training (DiffusionTask.render_samples): the training state stays resident
    (base, LoRA, optimizer state; the step's activations are gone); with renders_bf16_reference the
    bf16 copy of the base and its LoRA load beside it; then the VAE loads, encodes the prompt's
    references (each at the family's sample_control_bucket size for a square one) and stays through every
    forward (batch 1 at the sample size) and the decode; a model the family's sampling loads for itself
    (sample_model_bytes: a second transformer it guides with) stays from the first forward to the end."""
    from library.training.config import compute_dtype

    model, network = meta_model_and_network(family, args)
    lora = tensor_bytes(network_tensors(network))
    blocks = [module_bytes(b) for b in model.swappable_blocks()]
    ema = _ema_bytes(network, args)
    resident = resident_parts(module_bytes(model), blocks, lora, _optimizer_bytes(network, args), args.blocks_to_swap,
                              args.block_swap_prefetch, ema)
    raw = 0
    if args.ema_decay and args.sample_with_ema:  # the raw weights wait on the device while the EMA's render
        raw = tensor_bytes([p for p in network.parameters() if p.requires_grad])
    count = family.plan_controls if references is None else references
    rw, rh = family.sample_control_bucket((width, height), (width, height))
    forward = _sample_forward_peak(family, model, network, width, height, text_tokens, count)
    vae = family.vae_on_meta()
    phase = Phase("sampling", {"resident (base, lora, optimizer)": sum(resident.values())})
    if raw:  # a part of its own: the resident training state is resident_parts' sum (plan_memory's sampling_peak)
        phase.parts["raw weights (sample_with_ema)"] = raw
    if renders_bf16_reference(family, args):
        phase.parts["bf16 reference (base, lora)"] = _bf16_reference_bytes(family, args, lora)
    if sampler := family.sample_model_bytes(compute_dtype(args)):  # from the first forward to the round's end
        phase.parts["sampling's own models (weights)"] = sampler
    phase.parts["vae (weights)"] = module_bytes(vae.vae)
    phase.parts["forward (peak)"] = forward
    tiled = bool(getattr(args, "vae_tiling", False))
    vae_peak = vae_pass_peak(vae, width, height, 1, decode=True, downsample=family.vae_downsample, tiled=tiled)
    phase.parts["vae decode in tiles (peak)" if tiled else "vae decode (peak)"] = vae_peak
    if count:
        phase.parts["vae encode of references (peak)"] = vae_pass_peak(vae, rw, rh, 1, decode=False)
        vae_peak = max(vae_peak, phase.parts["vae encode of references (peak)"])
    # vae_pass_peak counts the VAE's weights; they are resident during the forward too.
    phase.peak = (phase.parts["resident (base, lora, optimizer)"] + phase.parts.get("bf16 reference (base, lora)", 0)
                  + raw + sampler + max(phase.parts["vae (weights)"] + forward, vae_peak))
    return phase


def _sample_forward_peak(family, model, network, width: int, height: int, text_tokens: int, count: int) -> int:
    """The peak bytes of one sampling forward (batch 1, no grad) above the model's and network's own tensors.
    Within reusing_meta_models it is simulated once per (model, size, tokens, references) and answered from
    then on: a sample runs no backward, so the settings that differ only in checkpointing or in a keeping key
    sample alike, and a sample decoded whole or in tiles differs only in its VAE decode (plan_memory asked for
    4 such samples of each base; a full-size forward on meta is seconds)."""
    from library.models.family import control_kwargs

    key = ("sample forward", id(model), width, height, text_tokens, count)
    if _REUSED is not None and key in _REUSED:
        return _REUSED[key]
    down = family.vae_downsample
    rw, rh = family.sample_control_bucket((width, height), (width, height))
    latents = family.target_on_meta(1, height // down, width // down)
    text = family.text_on_meta(model, 1, text_tokens)
    with torch.no_grad(), LiveBytes() as live, fused_attention_on_meta():
        for t in (*model.parameters(), *model.buffers(), *network_tensors(network)):
            live.ignore(t)  # counted in the phase's resident part
        control = control_kwargs([torch.empty(1, family.latent_channels, rh // down, rw // down, device="meta")
                                  for _ in range(count)])
        family.predict(model, family.pack_target(latents), torch.ones(1, device="meta"), text, height // (down * family.patch),
                       width // (down * family.patch), None, **control)
    if _REUSED is not None:  # the model it keys on is kept there as long as this answer
        _REUSED[key] = live.peak
    return live.peak


# ----------------------------------------------------------------------------------------------
# The card


def device_memory(device) -> int | None:
    """The card's memory in bytes; None where there is no card to plan for (the CPU)."""
    device = torch.device(device)
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None


def usable_bytes(card_bytes: float) -> float:
    """What a plan may use of a card: 95% of its memory less the CUDA context."""
    return 0.95 * (card_bytes - CUDA_CONTEXT_BYTES)


def settle_sampling(family, args, card_bytes: int, width: int, height: int, references: int = 0) -> str | None:
    """The samples of width x height against the card (the sampling phase: the training state stays
    resident). Over the card, unset sample_bf16_reference turns the bf16 reference copy of an fp8 base
    off, then, still over, unset vae_tiling turns tiled decoding on (args is changed; the order
    plan_memory plans samples in: without the copy, decoded whole where that fits); explicit values
    stay. A sample over the card even so is said too (training fitting says nothing of the VAE decode
    at the sample size). Returns the lines to print, None where the samples fit as configured."""
    tokens = text_tokens_for(family, args, references, width, height)

    def planned(**changes) -> Phase:
        trial = copy.copy(args)
        vars(trial).update(changes)
        return sampling_phase(family, trial, width, height, tokens, references)

    phase, usable = planned(), usable_bytes(card_bytes)
    if phase.peak <= usable:
        return None
    over = f"over the {usable / GiB:.2f} GiB usable of this {card_bytes / GiB:.1f} GiB card"
    reference = phase.parts.get("bf16 reference (base, lora)", 0)
    plan = (f"sampling with the bf16 reference base ({reference / GiB:.2f} GiB) is planned to peak at "
            f"{phase.peak / GiB:.2f} GiB ({(phase.peak - reference) / GiB:.2f} without it), {over}")
    said, dropped = [], bool(reference) and args.sample_bf16_reference is None
    if dropped:
        args.sample_bf16_reference, phase = False, planned(sample_bf16_reference=False)
        said.append(f"warning: sample_bf16_reference turned off: {plan}; samples render on the fp8 base only (set "
                    f"sample_bf16_reference = true to render it anyway)")
    if phase.peak > usable and args.vae_tiling is None:
        tiled = planned(vae_tiling=True)
        if tiled.peak < phase.peak:
            whole, tiles = phase.parts["vae decode (peak)"], tiled.parts["vae decode in tiles (peak)"]
            args.vae_tiling, phase = True, tiled
            said.append(f"vae_tiling turned on: samples at {width}x{height} decode in tiles (the decode's peak "
                        f"{whole / GiB:.2f} -> {tiles / GiB:.2f} GiB; set vae_tiling = false to decode them whole)")
    if phase.peak > usable:
        still = (f": the first sample will likely run out of memory (raise blocks_to_swap, or sample at a smaller "
                 f"--w / --h than {width}x{height})")
        if dropped:
            said[0] += "; even so" + still
        elif reference:  # set true
            said.append(f"warning: sample_bf16_reference = true, but {plan}" + still.replace(" (raise", " (set it false, or raise"))
        else:
            said.append(f"warning: sampling at {width}x{height} is planned to peak at {phase.peak / GiB:.2f} GiB, {over}" + still)
    return "\n".join(said)


# A KEEPING_KEYS key (config.py) left unset is turned on where the training step planned with it fits
# the card with KEEPING_MARGIN to spare: the planner's peaks were within 0.96-1.05 of the measured ones
# (bench/RESULTS.md).
KEEPING_MARGIN = 1.05


def settle_keeping_keys(family, args, card_bytes: int, step: LargestStep) -> str | None:
    """KEEPING_KEYS left unset (None), against the card, for `step` (image_folders.largest_step's):
    with gradient checkpointing, each is turned on where the step planned with it (at the run's
    blocks_to_swap) fits with KEEPING_MARGIN to spare, and off otherwise; set keys stay as set (args is
    changed). Returns the line that says what was chosen (None: nothing was unset, or checkpointing off)."""
    unset = [key for key in KEEPING_KEYS if getattr(args, key) is None]
    for key in unset:
        setattr(args, key, False)
    if not (unset and args.gradient_checkpointing):
        return None
    usable = usable_bytes(card_bytes)

    def peak(trial) -> int:
        return step_plan(family, trial, step).phase(args.blocks_to_swap).peak

    with reusing_meta_models():  # one model for every trial
        current, said = peak(args), []
        for key in unset:
            trial = copy.copy(args)
            setattr(trial, key, True)
            planned = peak(trial)
            if planned <= current:
                continue  # keeps nothing in this model (no trained gate) or at this size
            fits = planned * KEEPING_MARGIN <= usable
            plan = f"+{(planned - current) / GiB:.2f} GiB, the step planned at {planned / GiB:.2f} GiB"
            said.append(f"{key} on ({plan} of {usable / GiB:.2f} usable)" if fits else
                        f"{key} off ({plan}: over {usable / KEEPING_MARGIN / GiB:.2f}, the usable {usable / GiB:.2f} "
                        f"less {KEEPING_MARGIN - 1:.0%})")
            if fits:
                setattr(args, key, True)
                current = planned
    if not said:
        return None
    return (f"gradient checkpointing on this {card_bytes / GiB:.1f} GiB card: {'; '.join(said)}; "
            f"set a key true or false to choose")
