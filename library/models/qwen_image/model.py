"""Qwen-Image: the 60-block dual-stream MMDiT, with diffusers' module names, built on library/core.

Module names mirror diffusers' QwenImageTransformer2DModel (`img_in`, `txt_norm`, `txt_in`,
`time_text_embed.timestep_embedder.linear_1`, `transformer_blocks.N.attn.to_q`, `...img_mod.1`,
`...img_mlp.net.0.proj`, `norm_out.linear`, `proj_out`), so a diffusers checkpoint loads with a plain
state dict and kohya LoRA names are the diffusers module paths.

Precision boundaries (see shared/DESIGN.md):
- RoPE positions are int64 ids built here; `core.rope_tables` turns them into float32 cos/sin
  (angles in float64) once per forward. They never pass through the compute dtype.
- Timesteps arrive as float sigma in [0, 1]; the sinusoidal embedding is float32 and is cast to
  `compute_dtype` only at `timestep_embedder.linear_1`.
- Activations run in `compute_dtype` (explicit attribute, default float32): inputs are cast at entry.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, fields
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from library.models import core
from library.models.qwen_image.spec import FP8
from library.precision.stored_layouts import read_stored_layout, stored_extras
from library.io import (
    CheckpointError, CheckpointReader, PrefixedReader, check_keys_and_shapes, component_folder, save_diffusers_folder,
)
from library.models.checkpoint_files import fill_meta_model, without_prefix

# ----------------------------------------------------------------------------------------------
# Config


@dataclass(frozen=True)
class QwenImageConfig:
    """Constructor arguments of diffusers' QwenImageTransformer2DModel (defaults = Qwen-Image)."""

    patch_size: int = 2
    in_channels: int = 64
    out_channels: int = 16
    num_layers: int = 60
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 3584
    axes_dims_rope: tuple[int, int, int] = (16, 56, 56)
    # Qwen-Image-Edit-2511: the condition images' tokens are modulated with the embedding of t = 0.
    zero_cond_t: bool = False
    # Qwen-Image-Layered: a learned 2-row embedding (`additional_t_cond` 0/1) added to the timestep's.
    use_additional_t_cond: bool = False
    # Qwen-Image-Layered: image i of a sample takes frame position i, the last (the condition image)
    # frame -1, and the text starts after max(h//2, w//2, images - 1) (diffusers' QwenEmbedLayer3DRope).
    use_layer3d_rope: bool = False
    rope_theta: float = 10000.0  # fixed in diffusers (QwenEmbedRope(theta=10000)), not in its config

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    def __post_init__(self):
        object.__setattr__(self, "axes_dims_rope", tuple(self.axes_dims_rope))
        if sum(self.axes_dims_rope) != self.attention_head_dim:
            raise ValueError(
                f"axes_dims_rope {self.axes_dims_rope} must sum to attention_head_dim {self.attention_head_dim}"
            )

    @classmethod
    def from_diffusers(cls, config: dict, source: str = "config") -> "QwenImageConfig":
        """From a diffusers config.json dict."""
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in config.items() if k in names}
        if kwargs.get("out_channels") is None:
            kwargs["out_channels"] = kwargs.get("in_channels", cls.in_channels)
        return cls(**kwargs)

    def to_diffusers(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k != "rope_theta"}
        d["axes_dims_rope"] = list(self.axes_dims_rope)
        return {"_class_name": "QwenImageTransformer2DModel", "_diffusers_version": _diffusers_version(),
                **d, "guidance_embeds": False}


QWEN_IMAGE = QwenImageConfig()


def _diffusers_version() -> str:
    try:
        from importlib.metadata import version

        return version("diffusers")
    except Exception:  # the version only feeds diffusers' "saved with" warning
        return "0.35.0"


# ----------------------------------------------------------------------------------------------
# Positions (int64 ids; angles are computed by core.rope_tables)


def image_positions(frames: int, height: int, width: int, frame_index: int = 0) -> torch.Tensor:
    """int64 [frames*height*width, 3] ids (frame, row, col) of one image's patch grid, row-major.

    Rows and columns are centred as diffusers' QwenEmbedRope(scale_rope=True): height h gives
    -(h - h//2) ... h//2 - 1, so the border patches carry the largest |position|."""
    f = torch.arange(frames, dtype=torch.int64) + frame_index
    h = torch.arange(height, dtype=torch.int64) - (height - height // 2)
    w = torch.arange(width, dtype=torch.int64) - (width - width // 2)
    grid = torch.meshgrid(f, h, w, indexing="ij")
    return torch.stack(grid, dim=-1).reshape(-1, 3)


def _images_of(shape) -> list[tuple[int, int, int]]:
    """One sample's img_shapes entry: (f, h, w) or a list of them (diffusers' pipeline form)."""
    if len(shape) == 3 and all(isinstance(v, int) for v in shape):
        return [tuple(shape)]
    return [tuple(s) for s in shape]


def joint_positions(img_shapes: list, text_len: int, layer3d: bool = False) -> torch.Tensor:
    """int64 [B, text_len + L, 3] ids for the joint sequence [text, image].

    Images of a sample take frame index 0, 1, ... in order; text token j gets id max_index + j on
    every axis, where max_index = max(h//2, w//2) over the sample's images (diffusers' txt_freqs).
    layer3d (Qwen-Image-Layered): the last image is the condition image at frame -1, and max_index
    is at least the number of images before it. Unlike diffusers, which uses the first sample's
    shapes for the whole batch, each sample here gets its own ids (identical when all shapes agree)."""
    per_sample = []
    for shape in img_shapes:
        images = _images_of(shape)
        frames = [-1 if layer3d and i == len(images) - 1 else i for i in range(len(images))]
        img = torch.cat([image_positions(f, h, w, k) for k, (f, h, w) in zip(frames, images)])
        start = max(max(h // 2, w // 2) for _, h, w in images)
        if layer3d:
            start = max(start, len(images) - 1)
        txt = (start + torch.arange(text_len, dtype=torch.int64))[:, None].expand(text_len, 3)
        per_sample.append(torch.cat([txt, img]))
    if len({p.shape[0] for p in per_sample}) != 1:
        raise ValueError(f"img_shapes {img_shapes} give different token counts per sample")
    return torch.stack(per_sample)


def _target_tokens(img_shapes: list) -> int:
    """Token count of the target (first) image, the same for every sample (zero_cond_t splits there)."""
    counts = {f * h * w for f, h, w in (_images_of(shape)[0] for shape in img_shapes)}
    if len(counts) != 1:
        raise ValueError(f"img_shapes {img_shapes}: the target images differ in token count across the batch")
    return counts.pop()


# ----------------------------------------------------------------------------------------------
# Model


class TimestepEmbedder(nn.Module):
    """linear_2(silu(linear_1(sinusoid(sigma)))), diffusers TimestepEmbedding names."""

    def __init__(self, dim: int, freq_dim: int = 256):
        super().__init__()
        self.freq_dim = freq_dim
        self.linear_1 = nn.Linear(freq_dim, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, sigma: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # float32 embedding of sigma * 1000 (diffusers Timesteps(scale=1000) on timestep / 1000),
        # cast to the compute dtype only here.
        freqs = core.timestep_embedding(sigma, self.freq_dim, time_factor=1000.0, scale_first=False).to(dtype)  # diffusers' order
        return self.linear_2(F.silu(self.linear_1(freqs)))


class TimeTextEmbed(nn.Module):
    """The timestep embedding, plus (Qwen-Image-Layered) a learned row picked by additional_t_cond."""

    def __init__(self, dim: int, use_additional_t_cond: bool = False):
        super().__init__()
        self.timestep_embedder = TimestepEmbedder(dim)
        self.addition_t_embedding = nn.Embedding(2, dim) if use_additional_t_cond else None

    def forward(self, sigma: torch.Tensor, dtype: torch.dtype, additional_t_cond: torch.Tensor | None) -> torch.Tensor:
        temb = self.timestep_embedder(sigma, dtype)
        if self.addition_t_embedding is None:
            return temb
        if additional_t_cond is None:
            raise ValueError("this model has use_additional_t_cond=True: pass additional_t_cond (int64 0/1 per sample)")
        return temb + self.addition_t_embedding(additional_t_cond.to(temb.device)).to(dtype)



def random_inputs(config: "QwenImageConfig", h: int, w: int, text_len: int, generator: torch.Generator):
    """The conditioning of one forward at an h x w patch grid with random text (tools/precision_doctor.py):
    text embeddings N(0, 1) whose last quarter is padding (masked), as a short caption's would be."""
    from library.models.spec import RandomInputs

    mask = torch.arange(text_len)[None] < max(1, (3 * text_len + 3) // 4)
    fixed = dict(txt=torch.randn(1, text_len, config.joint_attention_dim, generator=generator), txt_mask=mask,
                 img_shapes=[(1, h, w)])
    if config.use_additional_t_cond:  # Qwen-Image-Layered: an RGB(A) target's row (0, as its pipeline's)
        fixed["additional_t_cond"] = torch.zeros(1, dtype=torch.int64)
    positions = joint_positions(fixed["img_shapes"], text_len, config.use_layer3d_rope)  # as forward computes them
    return RandomInputs(fixed, positions, tuple(config.axes_dims_rope),
                        float(config.rope_theta))

@dataclass
class SplitModulation:
    """zero_cond_t: the first `split` image tokens (the target image) take `target`, the rest (the
    condition images) take `condition`, the modulation of t = 0. Same interface as core.Modulation."""

    target: core.Modulation
    condition: core.Modulation
    split: int

    def modulate(self, x: torch.Tensor) -> torch.Tensor:
        n = self.split
        return torch.cat([self.target.modulate(x[:, :n]), self.condition.modulate(x[:, n:])], dim=1)

    def gated(self, y: torch.Tensor) -> torch.Tensor:
        n = self.split
        return torch.cat([self.target.gated(y[:, :n]), self.condition.gated(y[:, n:])], dim=1)

    def gated_projection(self, proj: nn.Module, h: torch.Tensor) -> torch.Tensor:
        needed = self.target.gate.requires_grad or self.condition.gate.requires_grad
        return self.gated(core.residual_projection(proj, h, needed))


class JointAttention(nn.Module):
    """Image (`to_*`) and text (`add_*`) projections, QK RMSNorm, RoPE, one joint SDPA over
    [text, image] with text padding masked out as keys."""

    def __init__(self, dim: int, heads: int, head_dim: int):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim) for _ in range(3))
        self.add_q_proj, self.add_k_proj, self.add_v_proj = (nn.Linear(dim, dim) for _ in range(3))
        self.norm_q, self.norm_k = core.RMSNorm(head_dim), core.RMSNorm(head_dim)
        self.norm_added_q, self.norm_added_k = core.RMSNorm(head_dim), core.RMSNorm(head_dim)
        self.to_out = nn.ModuleList([nn.Linear(dim, dim)])
        self.to_add_out = nn.Linear(dim, dim)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (self.heads, self.head_dim)).transpose(1, 2)  # B L (H D) -> B H L D

    def forward(self, img, txt, cos, sin, key_mask):
        """img: [B, L, D], txt: [B, T, D]; cos/sin: float32 [B, T + L, head_dim / 2];
        key_mask: bool [B, T + L] or None. Returns (img_out [B, L, D], txt_out [B, T, D])."""
        txt_q, img_q = self.norm_added_q(self._heads(self.add_q_proj(txt))), self.norm_q(self._heads(self.to_q(img)))
        txt_k, img_k = self.norm_added_k(self._heads(self.add_k_proj(txt))), self.norm_k(self._heads(self.to_k(img)))
        q, k = torch.cat([txt_q, img_q], dim=2), torch.cat([txt_k, img_k], dim=2)  # joint order [text, image]
        v = torch.cat([self._heads(self.add_v_proj(txt)), self._heads(self.to_v(img))], dim=2)
        q, k = core.apply_rope(q, cos, sin, interleaved=True), core.apply_rope(k, cos, sin, interleaved=True)
        out = core.attention(q, k, v, mask=key_mask)  # [B, T + L, H * D]
        text_len = txt.shape[1]
        return self.to_out[0](out[:, text_len:]), self.to_add_out(out[:, :text_len])


class QwenImageBlock(nn.Module):
    """One dual-stream block: each stream has its own modulation, norms and MLP; attention is joint."""

    def __init__(self, dim: int, heads: int, head_dim: int):
        super().__init__()
        self.img_mod = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        self.txt_mod = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        self.img_norm1, self.img_norm2 = core.LayerNormNoAffine(dim), core.LayerNormNoAffine(dim)
        self.txt_norm1, self.txt_norm2 = core.LayerNormNoAffine(dim), core.LayerNormNoAffine(dim)
        self.attn = JointAttention(dim, heads, head_dim)
        self.img_mlp = core.FeedForward(dim, 4 * dim)
        self.txt_mlp = core.FeedForward(dim, 4 * dim)

    def _image_modulations(self, temb, cond_temb, target_len):
        """(attention, MLP) modulations of the image stream; with cond_temb (zero_cond_t) the tokens
        after the first target_len are modulated by cond_temb."""
        img_attn_mod, img_mlp_mod = core.split_modulation(self.img_mod(temb), 2)
        if cond_temb is None:
            return img_attn_mod, img_mlp_mod
        cond_attn_mod, cond_mlp_mod = core.split_modulation(self.img_mod(cond_temb), 2)
        return SplitModulation(img_attn_mod, cond_attn_mod, target_len), SplitModulation(img_mlp_mod, cond_mlp_mod, target_len)

    def forward(self, img, txt, temb, cos, sin, key_mask, cond_temb=None, target_len=0):
        # diffusers chunks img_mod(temb) as (shift, scale, gate) for attention, then for the MLP.
        img_attn_mod, img_mlp_mod = self._image_modulations(temb, cond_temb, target_len)
        txt_attn_mod, txt_mlp_mod = core.split_modulation(self.txt_mod(temb), 2)

        img_out, txt_out = self.attn(
            img_attn_mod.modulate(self.img_norm1(img)), txt_attn_mod.modulate(self.txt_norm1(txt)), cos, sin, key_mask
        )
        img = img + img_attn_mod.gated(img_out)
        txt = txt + txt_attn_mod.gated(txt_out)

        img_h = self.img_mlp.hidden(img_mlp_mod.modulate(self.img_norm2(img)))
        img = img + img_mlp_mod.gated_projection(self.img_mlp.net[2], img_h)
        txt_h = self.txt_mlp.hidden(txt_mlp_mod.modulate(self.txt_norm2(txt)))
        txt = txt + txt_mlp_mod.gated_projection(self.txt_mlp.net[2], txt_h)
        return img, txt


class OutputNorm(nn.Module):
    """diffusers AdaLayerNormContinuous: linear(silu(temb)) -> (scale, shift), in that order."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = core.LayerNormNoAffine(dim)
        self.linear = nn.Linear(dim, 2 * dim)

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        scale, shift = self.linear(F.silu(temb))[:, None].chunk(2, dim=-1)
        return (1 + scale) * self.norm(x) + shift


class QwenImage(nn.Module):
    def __init__(self, config: QwenImageConfig = QWEN_IMAGE):
        super().__init__()
        self.config = config
        dim = config.inner_dim
        self.compute_dtype = torch.float32
        self.gradient_checkpointing = False
        self.block_swap = None  # a BlockSwap once enable_block_swap() is called
        self.time_text_embed = TimeTextEmbed(dim, config.use_additional_t_cond)
        self.txt_norm = core.RMSNorm(config.joint_attention_dim)
        self.img_in = nn.Linear(config.in_channels, dim)
        self.txt_in = nn.Linear(config.joint_attention_dim, dim)
        self.transformer_blocks = nn.ModuleList(
            QwenImageBlock(dim, config.num_attention_heads, config.attention_head_dim) for _ in range(config.num_layers)
        )
        self.norm_out = OutputNorm(dim)
        self.proj_out = nn.Linear(dim, config.patch_size**2 * config.out_channels)

    def rope(self, img_shapes: list, text_len: int, device: torch.device):
        """float32 cos/sin [B, T + L, head_dim / 2] from int64 ids (angles in float64)."""
        positions = joint_positions(img_shapes, text_len, self.config.use_layer3d_rope).to(device)
        return core.rope_tables(positions, self.config.axes_dims_rope, self.config.rope_theta)

    def forward(self, img, txt, txt_mask, timesteps, img_shapes, additional_t_cond=None):
        """img: [B, L, in_channels] packed latents (edit models: the target's tokens, then each
        condition image's); txt: [B, T, joint_attention_dim]; txt_mask: [B, T] (True/1 = real
        token) or None; timesteps: [B] sigma in [0, 1] (any float dtype, used in float32);
        img_shapes: per sample (frames, h, w) in patches, or a list of them (target first);
        additional_t_cond: int64 [B] (0/1), only for use_additional_t_cond models.
        Returns [B, L, patch_size**2 * out_channels] in compute_dtype (all image tokens)."""
        batch, img_len, text_len = img.shape[0], img.shape[1], txt.shape[1]
        if len(img_shapes) != batch:
            raise ValueError(f"img_shapes has {len(img_shapes)} entries for a batch of {batch}")
        cos, sin = self.rope(img_shapes, text_len, img.device)
        if cos.shape[1] != text_len + img_len:
            raise ValueError(f"img_shapes {img_shapes} give {cos.shape[1] - text_len} image tokens, img has {img_len}")
        key_mask = None
        # An all-true mask (batch 1, or captions of one length) is dropped: with any mask CUDA's SDPA
        # takes the memory-efficient kernel, not flash (bench/RESULTS.md, GPU). One host sync per call.
        # On meta (the memory planner) there are no values: the mask is kept, the costlier case.
        if txt_mask is not None and (txt_mask.is_meta or not bool(txt_mask.all())):  # bool [B, T + L]: text padding masked as keys
            image_visible = torch.ones(batch, img_len, dtype=torch.bool, device=img.device)
            key_mask = torch.cat([txt_mask.to(img.device).bool(), image_visible], dim=1)

        sigma = timesteps.reshape(-1).expand(batch)
        temb = self.time_text_embed(sigma, self.compute_dtype, additional_t_cond)
        cond_temb, target_len = None, 0
        if self.config.zero_cond_t:  # condition tokens see t = 0 (the clean image they are)
            cond_temb = self.time_text_embed(torch.zeros_like(sigma), self.compute_dtype, additional_t_cond)
            target_len = _target_tokens(img_shapes)
        img = self.img_in(img.to(self.compute_dtype))
        txt = self.txt_in(self.txt_norm(txt.to(self.compute_dtype)))
        for i, block in enumerate(self.transformer_blocks):
            img, txt = core.run_block(block, self.gradient_checkpointing, img, txt, temb, cos, sin, key_mask,
                                      cond_temb, target_len, swap=self.block_swap, index=i)
        return self.proj_out(self.norm_out(img, temb))

    def swappable_blocks(self) -> list[nn.Module]:
        """The blocks in run order (block swap moves the last N of these)."""
        return list(self.transformer_blocks)


# ----------------------------------------------------------------------------------------------
# Loading and saving

CHECKPOINT_PREFIXES = ("model.diffusion_model.", "diffusion_model.")
_BLOCK = re.compile(r"transformer_blocks\.(\d+)\.")


def infer_config(reader: CheckpointReader, prefix: str = "") -> QwenImageConfig:
    """Config from tensor shapes (for files without config.json). Patch size 2 is assumed; RoPE
    axes are (16, 56, 56) for head dim 128, other head dims need an explicit config."""

    def shape(name: str) -> tuple[int, ...]:
        if prefix + name not in reader:
            raise CheckpointError(f"{reader.path}: no key '{prefix + name}'; not a Qwen-Image transformer checkpoint")
        return reader.shape(prefix + name)

    dim, in_channels = shape("img_in.weight")
    _, joint_dim = shape("txt_in.weight")
    blocks = {int(m.group(1)) for k in reader.keys() if (m := _BLOCK.match(k[len(prefix):]))}
    head_dim = shape("transformer_blocks.0.attn.norm_q.weight")[0] if blocks else 128
    if head_dim != sum(QWEN_IMAGE.axes_dims_rope):
        raise CheckpointError(f"{reader.path}: head dim {head_dim} has no known RoPE axes; pass a QwenImageConfig")
    patch = QWEN_IMAGE.patch_size
    return QwenImageConfig(
        patch_size=patch,
        in_channels=in_channels,
        out_channels=shape("proj_out.weight")[0] // patch**2,
        num_layers=len(blocks),
        attention_head_dim=head_dim,
        num_attention_heads=dim // head_dim,
        joint_attention_dim=joint_dim,
        use_additional_t_cond=prefix + "time_text_embed.addition_t_embedding.weight" in reader,
    )  # zero_cond_t and use_layer3d_rope change no tensor: a single Edit-2511 or Layered file needs
    # config= (the family's model_version / model_type)


def _resolve(path: str) -> tuple[str, QwenImageConfig | None]:
    """(checkpoint path, config from config.json or None) for a pipeline folder, a transformer
    folder, or a single file."""
    path = component_folder(path, "transformer")
    config_file = os.path.join(path, "config.json")
    if not (os.path.isdir(path) and os.path.isfile(config_file)):
        return path, None
    with open(config_file) as f:
        config = json.load(f)
    if "_class_name" not in config and config.get("architectures"):  # a transformers model, e.g. an LLM
        raise CheckpointError(f"{config_file}: a transformers {config['architectures'][0]} config, "
                              f"expected a diffusers QwenImageTransformer2DModel")
    name = config.get("_class_name", "QwenImageTransformer2DModel")
    if name != "QwenImageTransformer2DModel":
        raise CheckpointError(f"{config_file}: _class_name is {name!r}, expected 'QwenImageTransformer2DModel'")
    return path, QwenImageConfig.from_diffusers(config, source=config_file)


def _transformer_prefix(keys: list[str]) -> str:
    """The ComfyUI prefix the transformer's keys carry ('' for none). A ComfyUI full checkpoint also
    bundles the text encoder and VAE under other prefixes: those keys are not the transformer's."""
    return next((p for p in CHECKPOINT_PREFIXES if any(k.startswith(p + "transformer_blocks.") for k in keys)), "")


def load_qwen_image(
    path: str,
    dtype: torch.dtype = torch.float32,
    config: QwenImageConfig | None = None,
    convert: Callable[[str, torch.Tensor], dict[str, torch.Tensor]] | None = None,
    prepare: Callable[[nn.Module], Callable | None] | None = None,
    read_weights: bool = True,
) -> QwenImage:
    """Load a Qwen-Image transformer: a diffusers pipeline folder (uses `transformer/`), a
    transformer folder (config.json + safetensors, sharded or not) or a single safetensors file
    with diffusers key names, optionally prefixed `model.diffusion_model.` / `diffusion_model.`.

    Built on `meta`, filled tensor by tensor. dtype: storage and compute dtype (float32, bfloat16
    or float16). fp8: `prepare` runs on the meta model (e.g. to swap Linears for FP8Linear); a
    callable it returns becomes the `convert` hook (per-tensor quantization while loading):
    `prepare=fp8_prepare("fp8_scaled", "qwen_image")` (library/models/family.py)."""
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype {dtype} is not a compute dtype (float32/bfloat16/float16); fp8 goes through convert")
    path, file_config = _resolve(path)
    reader = CheckpointReader(path)
    stored = read_stored_layout(reader, path)  # a pre-quantized file (fp8, GGUF) is used as it is
    prefix = _transformer_prefix(reader.keys())
    config = config or file_config or infer_config(reader, prefix)
    with torch.device("meta"):
        model = QwenImage(config)
    # every key and shape from the header, before caching (the load named them after it)
    check_keys_and_shapes(PrefixedReader(reader, prefix), model.state_dict(), config, stored_extras(stored))
    return fill_meta_model(model, reader, without_prefix(prefix), path, dtype, stored=stored, keep_rules=FP8,
                           prepare=prepare, convert=convert, read_weights=read_weights, loader="load_qwen_image")


def save_qwen_image_diffusers(state_dict: dict[str, torch.Tensor], config: QwenImageConfig, folder: str) -> None:
    """Write a diffusers transformer folder (config.json + diffusion_pytorch_model.safetensors),
    each file atomically, that QwenImageTransformer2DModel.from_pretrained and load_qwen_image read."""
    save_diffusers_folder(state_dict, config.to_diffusers(), folder)
