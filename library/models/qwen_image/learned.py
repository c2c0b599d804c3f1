"""Qwen-Image's learned tiny base (spec.LearnedBase; tools/pretrain_tiny_base.py --model_type qwen_image
trains it, learned/qwen_image/ ships it): a Qwen-Image transformer (4 MMDiT blocks, hidden 128, 4 heads
of 32, RoPE axes (8, 12, 12)) as a diffusers folder in bf16; a VAE of the released
AutoencoderKLQwenImage architecture with small channels (base_dim 8: 8/16/32/32, 16 latent channels)
(one residual block per level) as a diffusers folder in float32; make_tiny_models' frozen tiny Qwen2-style text encoder (seed 0) with
its tokenizer. write_edit_text_encoder makes that encoder the Qwen2.5-VL folder Qwen-Image-Edit reads, for an
edit LoRA on this base (tests/test_learning.py)."""

from __future__ import annotations

import json
import math
import os

import torch
import torch.nn.functional as F
from diffusers import AutoencoderKLQwenImage
from diffusers.models.autoencoders.autoencoder_kl_qwenimage import QwenImageCausalConv3d, QwenImageRMS_norm
from diffusers.models.autoencoders.vae import DecoderOutput

from library.models import spec as S
from library.models.tiny_files import TINY, build_qwen_tokenizer, write_lm

VAE_CONFIG = {"base_dim": 8, "z_dim": 16, "num_res_blocks": 1}
DIT = dict(num_layers=4, num_attention_heads=4, attention_head_dim=32, axes_dims_rope=(8, 12, 12))


def family(paths: dict[str, str]):
    from library.models.qwen_image.family import QwenImageFamily

    return QwenImageFamily(paths["pretrained_model_name_or_path"], paths["ae"], text_encoder=paths["text_encoder"])


def write_text_encoders(paths: dict[str, str]) -> None:
    folder = paths["text_encoder"]
    write_lm(os.path.join(folder, "text_encoder"), build_qwen_tokenizer(), 0, 7, os.path.join(folder, "tokenizer"))


class SingleFrameCausalConv3d(QwenImageCausalConv3d):
    """The causal Conv3d on one frame without a cache: its two front-padded zero frames meet every time
    tap but the last, so it is the 2-D convolution with that tap (the same sums; the other taps get no
    gradient, as in the padded Conv3d). Pretraining only: half the VAE step's time on this CPU."""

    def forward(self, x, cache_x=None):
        if x.shape[2] != 1 or cache_x is not None:
            return super().forward(x, cache_x)
        padding = (self._padding[2], self._padding[0])  # (H, W) of F.pad's (W, W, H, H, T, 0)
        return F.conv2d(x[:, :, 0], self.weight[:, :, -1], self.bias, self.stride[1:], padding)[:, :, None]


class SumSquaresRMSNorm(QwenImageRMS_norm):
    """QwenImageRMS_norm (F.normalize over channels x sqrt(C) x gamma + bias) as x * rsqrt(sum x^2):
    F.normalize's vector norm over the channel axis of a [B, C, T, H, W] tensor was a fifth of a
    pretraining step on this CPU. float32 only (the pretrainer's dtype); equal to rounding."""

    def forward(self, x):
        if x.dtype != torch.float32:
            return super().forward(x)
        axis = 1 if self.channel_first else -1
        squares = (x * x).sum(axis, keepdim=True).clamp_min(1e-24)  # F.normalize's eps 1e-12, squared
        return x * torch.rsqrt(squares) * self.scale * self.gamma + self.bias


class OneFrameImages:
    """A video VAE (a diffusers AutoencoderKL... before it in the bases) spoken to in images for pretraining: encode /
    decode take and give [B, C, H, W], a time axis of 1 added and dropped (as library/models/qwen_image/vae.py does
    at use)."""

    def encode(self, x, return_dict=True):
        out = super().encode(x[:, :, None], return_dict)
        dist = out.latent_dist if return_dict else out[0]
        dist.mean, dist.std, dist.logvar, dist.var = (t[:, :, 0] for t in (dist.mean, dist.std, dist.logvar, dist.var))
        dist.parameters = dist.parameters[:, :, 0]
        return out

    def decode(self, z, return_dict=True):
        out = super().decode(z[:, :, None], return_dict)
        if return_dict:
            out.sample = out.sample[:, :, 0]
            return out
        return (out[0][:, :, 0],)


class ImageQwenVAE(OneFrameImages, AutoencoderKLQwenImage):
    """The video VAE spoken to in images (OneFrameImages), the one frame run without the frame cache, the
    convolutions and norms as their single-frame float32 equivalents above (2.5x faster a step;
    tests/test_learned_bases.py checks it against the released class). Saved as a plain AutoencoderKLQwenImage."""

    def __init__(self, **config):
        super().__init__(**config)
        for module in self.modules():
            if type(module) is QwenImageCausalConv3d:
                module.__class__ = SingleFrameCausalConv3d
            elif type(module) is QwenImageRMS_norm:
                module.__class__ = SumSquaresRMSNorm

    def _encode(self, x):
        if x.shape[2] != 1 or self.use_tiling:
            return super()._encode(x)
        return self.quant_conv(self.encoder(x))  # the first chunk of the cached loop: no frame before it

    def _decode(self, z, return_dict=True):
        if z.shape[2] != 1 or self.use_tiling:
            return super()._decode(z, return_dict)
        out = torch.clamp(self.decoder(self.post_quant_conv(z)), min=-1.0, max=1.0)
        return DecoderOutput(sample=out) if return_dict else (out,)


def new_vae(image_size: int):
    vae = ImageQwenVAE(**VAE_CONFIG)
    one_frame_init(vae)
    return vae


def one_frame_init(vae) -> None:
    """Each causal Conv3d's kernel at nn.Conv2d's init for the one frame it sees: Conv3d draws it for a
    fan-in of C x T x 3 x 3, but only the last time tap meets data (the others meet the zero padding), so
    the effective 2-D kernel and bias came out sqrt(T) too small: a third of Conv2d's variance at T = 3.
    Scaled by sqrt(T) (the same draws), the VAE fits faster (1 thread, compiled, 1500 steps: recon MSE
    0.0177 -> 0.0127, scenes right 201 -> 262 of 360)."""
    with torch.no_grad():
        for module in vae.modules():
            if isinstance(module, QwenImageCausalConv3d) and module.kernel_size[0] > 1:
                scale = math.sqrt(module.kernel_size[0])
                module.weight[:, :, -1] *= scale
                if module.bias is not None:
                    module.bias *= scale


def save_vae(vae, paths: dict[str, str], diffusers: bool) -> None:
    """A diffusers AutoencoderKLQwenImage folder, float32 (save_per_channel_vae)."""
    save_per_channel_vae(vae, paths["ae"], "AutoencoderKLQwenImage")


def save_per_channel_vae(vae, folder: str, class_name: str) -> None:
    """A diffusers folder of `class_name`, float32 (Qwen-Image's VAE, Qwen-Image-2.1's). The pretrainer's global
    normalisation (shift_factor, scaling_factor: latents = (z - shift) * scale) written as the per-channel
    latents_mean / latents_std those formats hold (latents = (z - mean) / std), every channel the same."""
    from library.io import save_diffusers_folder

    dropped = ("shift_factor", "scaling_factor")
    config = {k: v for k, v in vae.config.items() if not k.startswith("_") and k not in dropped}
    channels = int(config["z_dim"])
    if "shift_factor" in vae.config:
        config["latents_mean"] = [float(vae.config.shift_factor)] * channels
        config["latents_std"] = [round(1.0 / float(vae.config.scaling_factor), 6)] * channels
    save_diffusers_folder({k: v.contiguous() for k, v in vae.state_dict().items()},
                          {"_class_name": class_name, **config}, folder)


def new_transformer(text: dict[str, torch.Tensor]):
    from library.models.qwen_image.model import QwenImage, QwenImageConfig

    channels = TINY["latent_channels"]
    return QwenImage(QwenImageConfig(in_channels=4 * channels, out_channels=channels,
                                     joint_attention_dim=text["embeds"].shape[2], **DIT))


def save_transformer(model, paths: dict[str, str], diffusers: bool) -> None:
    """The released format is a diffusers folder already (bf16, as released)."""
    from library.models.qwen_image.model import save_qwen_image_diffusers

    sd = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    save_qwen_image_diffusers(sd, model.config, paths["pretrained_model_name_or_path"])


_HERE = __name__ + ":"
# The VAE recipe whole (its class and files, learning rate, steps, compiled loss): a family that ships Qwen-Image's
# VAE spreads it into its LearnedBase, so the pretrainer trains the same bytes as learned/qwen_image/vae.
# The Qwen-Image VAE (RMS norms over channels, causal 3-D convolutions) is slower to fit at these widths
# than FLUX.1's AutoencoderKL. Measured (seed 0, 1 thread): 1.5e-3 for 800 steps gave grey blobs; 3e-3
# for 2000 steps reconstructs colour and shape right in 188 of 360 scenes, for 4000 steps in 320 (the
# shipped base); base_dim 12 at 1.5e-3 and two residual blocks at 3e-3 trailed (0.14 / 0.46 at step 1200).
# With ImageQwenVAE's single-frame path (2 threads): 4000 steps 553 s; 6e-3 for 2000 steps 140 / 360;
# batch 8 for 4000 steps 269 / 360 (338 s).
# torch.compile fuses the norms, SiLUs and the residual adds around the tiny convolutions: a step
# 0.125 -> 0.078 s (2 threads, batch 16) for ~50 s of compiling; FLUX.1's GroupNorm VAE gains 10%
# (0.104 -> 0.093 s), less than its compile costs over 1500 steps. Compiled (2 threads, one run each):
# 4000 steps 300 / 360 scenes reconstructed right, base 166 / 216; 5000 steps (428 s) 336 / 360, base
# 185 / 216 (the eager 4000-step one before it: 342 / 360, 177 / 216, 553 s).
# one_frame_init (the causal kernels at Conv2d's init) fits faster: 3500 steps (281 s warm, 329 s cold)
# 317 / 360, MSE 0.0061, base 183 / 216, its quickstart 14 / 18 (the shipped base; 5000 steps without
# it: 333 / 360, 0.0049 read the same way, 185 / 216, 12 / 18); 3000 steps: base 164 / 216.
VAE_RECIPE = dict(new_vae=_HERE + "new_vae", save_vae=_HERE + "save_vae", vae_lr=3e-3, vae_steps=3500, compile_vae=True)
LEARNED = S.LearnedBase(
    module=__name__,
    files=(("pretrained_model_name_or_path", "transformer"), ("ae", "vae"), ("text_encoder", "text_encoder")),
    config="quickstart_qwen_image.toml",
    # tests/test_learning.py's concept LoRA, measured (2026-11-25, the base regenerated that day, 2 threads; a weaker
    # VAE at these widths), 120 steps: 13/18 after, 8 of 10 kept (with 10 regularisation images instead of 200 and the
    # base before, 2026-11-24: 9/18, 6 of 10 kept).
    learning_test=(120, 0.35, 0.5),
    **VAE_RECIPE,
)


def write_edit_text_encoder(text_encoder: str, out: str, seed: int = 0) -> str:
    """The learned base's text encoder (`text_encoder`: its text_encoder/ + tokenizer/) as the Qwen2.5-VL
    folder Qwen-Image-Edit loads, in `out` (returned: text_encoder/ + processor/, its text_encoder path):
    the language model's tensors as they are, under M-RoPE, which on text alone is its plain RoPE; make_tiny_models'
    tiny vision tower (random, from `seed`) and image processor; the tokenizer with the vision tokens after its
    vocabulary (rows its embedding has: the vocabulary is rounded up). The learned base has no vision tower of
    its own, and the edit encoder reads the prompt with the references through one."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from library.data.vlm_inputs import VISION_TOKENS
    from library.models.qwen_image.tiny import TINY_IMAGE_PROCESSOR, TINY_VISION
    from library.models.tiny_files import save_vl_processor, seed_component, vision_token_ids

    lm_folder = os.path.join(text_encoder, "text_encoder")
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(text_encoder, "tokenizer"), local_files_only=True)
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    with open(os.path.join(lm_folder, "config.json")) as f:
        lm = json.load(f)
    if len(tokenizer) > lm["vocab_size"]:
        raise ValueError(f"{lm_folder}: {len(tokenizer)} tokens with the vision ones, {lm['vocab_size']} embeddings")
    half = lm["hidden_size"] // lm["num_attention_heads"] // 2  # RoPE frequencies per head
    sections = [half - 2 * (3 * half // 8), 3 * half // 8, 3 * half // 8]  # (t, h, w): Qwen2.5-VL's (16, 24, 24) of 64
    text = {**{k: v for k, v in lm.items() if k not in ("architectures", "model_type", "rope_theta")},
            "rope_parameters": {"rope_type": "mrope", "mrope_section": sections, "rope_theta": lm["rope_theta"]}}
    seed_component(seed, 12)  # the tiny set's Qwen-Image-Edit encoder's offset
    config = Qwen2_5_VLConfig(text_config=text, vision_config={**TINY_VISION, "out_hidden_size": lm["hidden_size"]},
                              tie_word_embeddings=False, **vision_token_ids(tokenizer))
    model = Qwen2_5_VLForConditionalGeneration(config)
    learned = load_file(os.path.join(lm_folder, "model.safetensors"))
    model.lm_head.load_state_dict({"weight": learned.pop("lm_head.weight")})
    model.model.language_model.load_state_dict({k.removeprefix("model."): v for k, v in learned.items()})
    model.save_pretrained(os.path.join(out, "text_encoder"), safe_serialization=True)
    save_vl_processor(os.path.join(out, "processor"), TINY_IMAGE_PROCESSOR, "Qwen2_5_VLProcessor", tokenizer)
    return out
