"""The whole FLUX.1-dev pipeline at full size on this CPU: train_lora.py end to end on random-weight
files in the released formats, with the peak memory of every phase. Qwen-Image as far as it fits.

    python bench/bench_full_pipeline_cpu.py --work /tmp/fullsize            # writes ~34 GB, then trains
    python bench/bench_full_pipeline_cpu.py --work /tmp/fullsize --skip-write
    python bench/bench_full_pipeline_cpu.py --family qwen_image --work /tmp/fullqwen --qwen-blocks 6
    python bench/bench_full_pipeline_cpu.py --family flux2 --work /tmp/fullklein       # klein 4B, ~16 GB
    python bench/bench_full_pipeline_cpu.py --family flux2 --work /tmp/fullklein --skip-write --references 2
    python bench/bench_full_pipeline_cpu.py --family zimage --work /tmp/fullzimage     # Z-Image-Turbo, ~20 GB
    python bench/bench_full_pipeline_cpu.py --family chroma --work /tmp/fullchroma     # Chroma1-HD, ~28 GB
    python bench/bench_full_pipeline_cpu.py --family qwen_image21 --work /tmp/fullqi21 # Qwen-Image-2.1, ~30 GB
    python bench/bench_full_pipeline_cpu.py --family krea2 --work /tmp/fullkrea2       # Krea 2 Raw, ~32 GB
    python bench/bench_full_pipeline_cpu.py --family ideogram4 --work /tmp/fullideo4   # Ideogram 4 fp8r, ~26 GB
    python bench/bench_full_pipeline_cpu.py --family qwen_image_layered --work /tmp/fulllayered --qwen-blocks 6
        # Qwen-Image-Layered as Qwen-Image (full width, 6 blocks), its RGBA VAE, composites with 2 layers
    python bench/bench_full_pipeline_cpu.py --family flux3 --work /tmp/fullflux3       # FLUX.3 [klein] base, ~19 GB
    python bench/bench_full_pipeline_cpu.py --family ernie_image --work /tmp/fullernie # ERNIE-Image, ~23 GB
    python bench/bench_full_pipeline_cpu.py --family nucleus_image --work /tmp/fullnucleus  # Nucleus-Image, 46.5 GB
        # measured with --train-steps 1 --sample-steps 2: 2 steps and a 4-step sample take ~80 min on 2 busy cores
    python bench/bench_full_pipeline_cpu.py --family anima --work /tmp/fullanima         # Anima, ~5.3 GB
    python bench/bench_full_pipeline_cpu.py --family lumina2 --work /tmp/fulllumina2     # Lumina Image 2.0, ~10 GB
    python bench/bench_full_pipeline_cpu.py --family hunyuan_image --work /tmp/fullhunyuan --hunyuan-blocks 4,8
        # HunyuanImage-2.1 at full width, 4 of 20 double and 8 of 40 single blocks; ~20 GB (13 drawn)
    python bench/bench_full_pipeline_cpu.py --family sd3 --work /tmp/fullsd3 --sd3-release medium  # ~16 GB
        # SD3.5-Medium whole (or --sd3-release large --sd3-blocks N: SD3.5-Large at full width, N of 38 blocks)
    python bench/bench_full_pipeline_cpu.py --family hidream --work /tmp/fullhidream --hidream-blocks 2,2
        # HiDream-I1 at full width, 2 of 16 double and 2 of 32 single blocks, the full-size text encoders; ~30 GB
    python bench/bench_full_pipeline_cpu.py --family hidream_o1 --work /tmp/fullo1 --sample-steps 2 --mixed-precision no
        # HiDream-O1-Image whole (7.6 B, pixel space: no VAE, no text encoder), Comfy-Org's single file; ~15 GB

The writers of the generic files and of FLUX.3's, ERNIE-Image's, Nucleus-Image's, Anima's, Lumina 2's and
HunyuanImage-2.1's, SD3.5's, HiDream-I1's and HiDream-O1-Image's are in bench/full_size_files.py.

Qwen-Image (20.4 B) does not fit this 24 GiB machine whole in fp8 with its 15 GB encoder, so: the
Qwen2.5-VL-7B language model at full size (bf16 HF folder, 15.2 GB) through caching, the full-size
VAE, and the transformer at full width but --qwen-blocks of its 60 blocks (diffusers folder); the
full depth comes from tools/plan_memory.py.

Files (each tensor drawn and written one at a time, so writing never holds a model):
  flux1-dev.safetensors  BFL single file, bf16, 11.9 B parameters (FLUX.1-dev's shapes; no metadata,
                         so the loader reads the config from the shapes as for the real file)
  ae.safetensors         BFL autoencoder layout, bf16 (diffusers' FLUX VAE config)
  clip_l/, t5xxl/        HF folders (config.json, model.safetensors in bf16, tokenizer files): CLIP-L
                         (123 M) and the T5-XXL encoder (4.76 B) at their released sizes
Weights are N(0, 0.02) (norm scales 1), enough to keep every activation finite. The tokenizers are the
small ones of tools/make_tiny_models.py: their ids are valid for the full vocabularies.

The run: 2 images at 256x256, fp8_scaled base quantized while streaming from the bf16 file, bf16
compute, gradient checkpointing, LoRA rank 16, AdamW, 2 steps, T5 at 512 tokens in bf16, one sample
(256x256, 4 steps, no bf16 reference: that would load a second, bf16 base) and the final save.

Memory: train_lora.py runs as a child process; a thread samples its /proc/<pid>/status every 0.2 s
(VmRSS; RssAnon = what the process allocated; RssFile = pages of mmapped checkpoint files it has
touched, which the kernel may drop at any time). Phases are cut at the lines the trainer prints:
VAE caching -> "latents:", text caching -> "captions:", loading the transformer -> the first
training step, training -> the LoRA's lr plot, sampling + save -> "saved". Results go to stdout and
<work>/result.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import threading
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from library.models.flux1.model import FLUX_DEV, Flux  # noqa: E402
from library.models.tiny_files import build_clip_tokenizer, build_t5_tokenizer, save_tokenizer  # noqa: E402
from tools.merge_lora import Entry, write_safetensors_streaming  # noqa: E402

from bench.full_size_files import (  # noqa: E402, F401 (meta_shapes, write_random: bench_planner_cpu.py's)
    ANIMA_FILE, ANIMA_TEXT_FILE, ERNIE_IMAGE_FILE, FLUX3_FILE, HIDREAM_FILE, HIDREAM_LLAMA_FOLDER, HIDREAM_TEXT_FILES,
    HIDREAM_O1_FILE, HIDREAM_VAE_FILE, HUNYUAN_IMAGE_FILE, HUNYUAN_IMAGE_GLYPH_FILE,
    HUNYUAN_IMAGE_TEXT_FILE, HUNYUAN_IMAGE_VAE_FILE, LUMINA2_FILE, LUMINA2_TEXT_FILE, GiB, QWEN3_VL_8B_TEXT,
    QWEN3_VL_8B_VISION, SD3_FILES, SD3_TEXT_FILES, meta_shapes, qwen3_vl_4b, random_tensor, write_anima_files,
    write_ernie_image_files, write_flux2_vae, write_flux3_files, write_flux_vae, write_hidream_files,
    write_hidream_o1_files,
    write_hunyuan_image_files,
    write_lumina2_files, write_nucleus_image_files, write_qwen3_vl_folder, write_qwen_image_vae, write_random,
    write_random_sharded, write_sd3_files)
PHASES = (("vae caching", "latents:"), ("text caching", "captions:"), ("transformer load", "training:"),
          ("training", "_lr.png"), ("sample + save", "saved "))


# ----------------------------------------------------------------------------------------------
# Random full-size files, tensor by tensor


def write_files(work: str):
    from transformers import CLIPTextConfig, CLIPTextModel

    os.makedirs(work, exist_ok=True)
    write_random(os.path.join(work, "flux1-dev.safetensors"), meta_shapes(lambda: Flux(FLUX_DEV)), 1, metadata={})
    write_flux_vae(work)
    clip_tok = build_clip_tokenizer()
    clip = CLIPTextConfig(vocab_size=49408, hidden_size=768, intermediate_size=3072, projection_dim=768,
                          num_hidden_layers=12, num_attention_heads=12, max_position_embeddings=77, hidden_act="quick_gelu",
                          bos_token_id=clip_tok.bos_token_id, eos_token_id=clip_tok.eos_token_id,
                          pad_token_id=clip_tok.pad_token_id)
    write_hf_encoder(work, "clip_l", clip, CLIPTextModel, clip_tok, "text_model.", "position_ids", 3)
    write_t5xxl_folder(work)


def write_t5xxl_folder(work: str):
    """<work>/t5xxl: the T5-XXL encoder (4.76 B) as an HF folder with the small T5 tokenizer."""
    from transformers import T5Config, T5EncoderModel

    t5 = T5Config(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                  feed_forward_proj="gated-gelu", tie_word_embeddings=False, pad_token_id=0, eos_token_id=1)
    write_hf_encoder(work, "t5xxl", t5, T5EncoderModel, build_t5_tokenizer(), "", "encoder.embed_tokens.weight", 4)


def write_hf_encoder(work: str, name: str, config, cls, tokenizer, prefix: str, skip: str, seed: int):
    folder = os.path.join(work, name)
    os.makedirs(folder, exist_ok=True)
    shapes = {prefix + k: s for k, s in meta_shapes(lambda: cls(config)).items() if not k.endswith(skip)}
    write_random(os.path.join(folder, "model.safetensors"), shapes, seed)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"architectures": [cls.__name__], **config.to_dict(), "torch_dtype": "bfloat16"}, f, indent=2)
    save_tokenizer(tokenizer, folder)


def write_chroma_files(work: str):
    """Chroma1-HD at its released size: the BFL-style single file people download for ComfyUI (8.9 B,
    bf16, no metadata: the loader reads the config from the shapes), FLUX.1's ae.safetensors, T5-XXL."""
    from library.models.chroma.model import CHROMA, Chroma

    os.makedirs(work, exist_ok=True)
    write_random(os.path.join(work, "Chroma1-HD.safetensors"), meta_shapes(lambda: Chroma(CHROMA)), 1, metadata={})
    write_flux_vae(work)
    write_t5xxl_folder(work)


def write_qwen_transformer_and_vae(work: str, config, vae_config: dict | None = None):
    """<work>/transformer (a diffusers folder of the QwenImageConfig `config`) and <work>/vae (the
    Qwen-Image VAE at its released size; vae_config: constructor arguments that differ)."""
    from library.models.qwen_image.model import QwenImage

    folder = os.path.join(work, "transformer")
    os.makedirs(folder, exist_ok=True)
    write_random(os.path.join(folder, "diffusion_pytorch_model.safetensors"), meta_shapes(lambda: QwenImage(config)), 1)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config.to_diffusers(), f, indent=2)
    write_qwen_image_vae(work, vae_config)


def write_qwen_files(work: str, blocks: int, layered: bool = False):
    """Qwen-Image (or Qwen-Image-Layered: its transformer flags and the RGBA VAE) at full width, `blocks` blocks."""
    from library.models.llm import QWEN2_5_7B
    from library.models.qwen_image.layered import LAYERED_VAE_CONFIG, QWEN_IMAGE_LAYERED
    from library.models.qwen_image.model import QWEN_IMAGE
    from library.models.tiny_files import build_qwen_tokenizer

    os.makedirs(work, exist_ok=True)
    write_qwen_transformer_and_vae(work, dataclasses.replace(QWEN_IMAGE_LAYERED if layered else QWEN_IMAGE,
                                                             num_layers=blocks), LAYERED_VAE_CONFIG if layered else {})
    tokenizer, folder = build_qwen_tokenizer(), os.path.join(work, "text_encoder")
    os.makedirs(folder, exist_ok=True)
    hf = {**QWEN2_5_7B.to_hf(), "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    from transformers import Qwen2Config, Qwen2ForCausalLM

    shapes = meta_shapes(lambda: Qwen2ForCausalLM(Qwen2Config(**{k: v for k, v in hf.items() if k != "architectures"})))
    write_random(os.path.join(folder, "model.safetensors"), shapes, 3)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    save_tokenizer(tokenizer, os.path.join(work, "tokenizer"))


def write_flux2_files(work: str):
    """FLUX.2 [klein] 4B at its released size: the transformer as a BFL single file (3.88 B), the
    Qwen3-4B text encoder as an HF folder without lm_head (tied, as released; 4.02 B), the
    AutoencoderKLFlux2 VAE as a diffusers folder, and the small klein tokenizer (valid ids)."""
    from library.models.flux2.model import FLUX2_KLEIN_4B, Flux2

    os.makedirs(work, exist_ok=True)
    write_random(os.path.join(work, "flux-2-klein-4b.safetensors"), meta_shapes(lambda: Flux2(FLUX2_KLEIN_4B)), 1,
                 metadata={})
    write_flux2_vae(work)
    write_qwen3_4b_folder(work)


def write_qwen3_4b_folder(work: str, shards: int = 1):
    """<work>/text_encoder (Qwen3-4B as an HF folder without lm_head: tied, as released; 4.02 B) and
    <work>/tokenizer (the small Qwen3 tokenizer with its chat template: valid ids)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from library.models.llm import QWEN3_4B
    from library.models.tiny_files import build_qwen3_tokenizer

    tokenizer, folder = build_qwen3_tokenizer(), os.path.join(work, "text_encoder")
    os.makedirs(folder, exist_ok=True)
    hf = {**QWEN3_4B.to_hf(), "bos_token_id": None, "eos_token_id": tokenizer.eos_token_id,
          "pad_token_id": tokenizer.pad_token_id}
    shapes = meta_shapes(lambda: Qwen3ForCausalLM(Qwen3Config(**{k: v for k, v in hf.items() if k != "architectures"})))
    shapes = {k: v for k, v in shapes.items() if k != "lm_head.weight"}
    if shards > 1:
        write_random_sharded(folder, "model", shapes, 3, shards)
    else:
        write_random(os.path.join(folder, "model.safetensors"), shapes, 3)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    save_tokenizer(tokenizer, os.path.join(work, "tokenizer"))


def write_zimage_files(work: str, single_file: bool = False):
    """Z-Image-Turbo at its released size, laid out as the Tongyi-MAI repo: transformer/ (config.json +
    3 bf16 shards with the index; 6.15 B parameters, 11.46 GiB) or, with single_file, ComfyUI's
    z_image_turbo_bf16.safetensors (fused qkv, `model.diffusion_model.` names), text_encoder/ (Qwen3-4B,
    36 layers of which the loader reads 35, 3 shards), tokenizer/, scheduler/ (shift 3.0: Turbo), and
    FLUX.1's VAE as ae.safetensors (the repo's vae/ is the same AutoencoderKL)."""
    from library.models.zimage.checkpoint import diffusers_config, single_file_key
    from library.models.zimage.model import ZIMAGE_TURBO, ZImage

    os.makedirs(work, exist_ok=True)
    shapes = meta_shapes(lambda: ZImage(ZIMAGE_TURBO))
    if single_file:
        sf = {}
        for key, shape in shapes.items():
            if key.endswith(".attention.to_k.weight") or key.endswith(".attention.to_v.weight"):
                continue
            if key.endswith(".attention.to_q.weight"):
                sf["model.diffusion_model." + key[: -len(".to_q.weight")] + ".qkv.weight"] = (3 * shape[0], *shape[1:])
            else:
                sf["model.diffusion_model." + single_file_key(key)] = shape
        write_random(os.path.join(work, "z_image_turbo_bf16.safetensors"), sf, 1, metadata={})
    else:
        folder = os.path.join(work, "transformer")
        write_random_sharded(folder, "diffusion_pytorch_model", shapes, 1, 3)
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(diffusers_config(ZIMAGE_TURBO), f, indent=2)
    os.makedirs(os.path.join(work, "scheduler"), exist_ok=True)
    with open(os.path.join(work, "scheduler", "scheduler_config.json"), "w") as f:
        json.dump({"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0,
                   "use_dynamic_shifting": False}, f, indent=2)
    write_flux_vae(work)
    write_qwen3_4b_folder(work, shards=3)


def write_qwen_image21_files(work: str):
    """Qwen-Image-2.1 at its released size, laid out as the Qwen/Qwen-Image-2.1 repo: transformer/
    (config.json + 3 bf16 shards; 7.12 B), vae/ (AutoencoderKLQwenImage21 at diffusers' defaults = the
    released RGBA 16x VAE), text_encoder/ (a Qwen3VLForConditionalGeneration folder with Qwen3-VL-8B's
    config; only the language model's weights are written, 7.57 B: text-to-image never reads the vision
    tower or lm_head) and processor/ (the small Qwen tokenizer with the vision tokens and chat template)."""
    from diffusers import AutoencoderKLQwenImage21

    from library.models.qwen_image21.checkpoint import diffusers_config
    from library.models.qwen_image21.model import QWEN_IMAGE21, QwenImage21
    from library.models.qwen_image21.text_encoder import QWEN_IMAGE21_TEMPLATE
    from library.models.qwen_image21.tiny import QWEN3_VL_CHAT_TEMPLATE
    from library.models.tiny_files import build_qwen_tokenizer, save_vl_processor

    os.makedirs(work, exist_ok=True)
    folder = os.path.join(work, "transformer")
    write_random_sharded(folder, "diffusion_pytorch_model", meta_shapes(lambda: QwenImage21(QWEN_IMAGE21)), 1, 3)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(diffusers_config(QWEN_IMAGE21), f, indent=2)
    with torch.device("meta"):
        vae = AutoencoderKLQwenImage21()
    folder = os.path.join(work, "vae")
    os.makedirs(folder, exist_ok=True)
    write_random(os.path.join(folder, "diffusion_pytorch_model.safetensors"),
                 {k: tuple(v.shape) for k, v in vae.state_dict().items()}, 2)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"_class_name": "AutoencoderKLQwenImage21", **{k: v for k, v in vae.config.items() if not k.startswith("_")}}, f)
    tokenizer = build_qwen_tokenizer(vision_templates=(QWEN_IMAGE21_TEMPLATE,))
    ids = {k: tokenizer.convert_tokens_to_ids(t) for k, t in (("image_token_id", "<|image_pad|>"),
           ("video_token_id", "<|video_pad|>"), ("vision_start_token_id", "<|vision_start|>"),
           ("vision_end_token_id", "<|vision_end|>"))}
    write_qwen3_vl_folder(os.path.join(work, "text_encoder"), QWEN3_VL_8B_TEXT, QWEN3_VL_8B_VISION, tokenizer, 4,
                          conditional=True, **ids)
    tokenizer.chat_template = QWEN3_VL_CHAT_TEMPLATE
    save_vl_processor(os.path.join(work, "processor"), {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
                      "min_pixels": 32 * 32, "max_pixels": 1024 * 1024}, "Qwen3VLProcessor", tokenizer)


def write_krea2_files(work: str):
    """Krea 2 Raw at its released size: raw.safetensors as released (original names, bf16, no metadata:
    the loader reads the config from the shapes; 12,820,073,036 parameters, 23.9 GiB), the Qwen-Image VAE as
    vae/, text_encoder/ (a Qwen3VLModel folder with Qwen3-VL-4B's config: only the language model's weights,
    4.02 B; text never reads the vision tower), tokenizer/ and model_index.json (the released taps)."""

    from library.models.krea2.model import KREA2_RAW, Krea2
    from library.models.krea2.text_encoder import KREA2_TAPS
    from library.models.tiny_files import build_qwen_tokenizer, write_json

    os.makedirs(work, exist_ok=True)
    write_random(os.path.join(work, "raw.safetensors"), meta_shapes(lambda: Krea2(KREA2_RAW)), 1, metadata={})
    write_qwen_image_vae(work)
    tokenizer = build_qwen_tokenizer()
    text, vision = qwen3_vl_4b()
    write_qwen3_vl_folder(os.path.join(work, "text_encoder"), text, vision, tokenizer, 2)
    save_tokenizer(tokenizer, os.path.join(work, "tokenizer"))
    write_json(os.path.join(work, "model_index.json"), {
        "_class_name": "Krea2Pipeline", "is_distilled": False, "patch_size": 2, "text_encoder_select_layers": list(KREA2_TAPS),
        "text_encoder": ["transformers", "Qwen3VLModel"], "tokenizer": ["transformers", "Qwen2TokenizerFast"],
        "transformer": ["diffusers", "Krea2Transformer2DModel"], "vae": ["diffusers", "AutoencoderKLQwenImage"]})


def write_fp8r_folder(folder: str, shapes: dict[str, tuple[int, ...]], quantized, config: dict, seed: int):
    """A diffusers folder in BFL's fp8r layout, tensor by tensor: each Linear weight that `quantized` matches
    drawn in bf16 and stored as its fp8 rows + float32 row scales (bfl_weights.quantize_fp8r), the rest bf16."""
    from library.precision.bfl_weights import quantize_fp8r

    entries, plan = [], []
    for key, shape in shapes.items():
        if quantized.fullmatch(key) and len(shape) == 2:
            stem = key[: -len(".weight")]
            entries += [Entry(key, torch.float8_e4m3fn, shape), Entry(stem + ".weight_scale", torch.float32, shape[:1])]
        else:
            entries.append(Entry(key, torch.bfloat16, shape))
        plan.append((key, shape))

    def tensors():
        generator = torch.Generator().manual_seed(seed)
        for key, shape in plan:
            tensor = random_tensor(key, shape, generator)
            if quantized.fullmatch(key) and len(shape) == 2:
                q = quantize_fp8r(tensor)
                yield key, q["weight"]
                yield key[: -len(".weight")] + ".weight_scale", q["weight_scale"]
            else:
                yield key, tensor

    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "diffusion_pytorch_model.safetensors")
    write_safetensors_streaming(path + ".tmp", entries, tensors(), {"format": "pt"})
    os.replace(path + ".tmp", path)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    print(f"wrote {path}: {sum(e.nbytes for e in entries) / GiB:.2f} GiB", flush=True)


def write_ideogram4_files(work: str):
    """Ideogram 4 at its released size and stored layout: transformer/ in BFL fp8r (every Linear of the
    blocks fp8 with row scales, the rest bf16; 9,279,288,448 parameters), FLUX.2's VAE as vae/,
    text_encoder/ (a Qwen3VLModel folder with Qwen3-VL-8B's config; only the language model's weights,
    7.57 B) and tokenizer/ (the small Qwen tokenizer with a chat template). No unconditional_transformer/:
    a second 9.3 B transformer in the compute dtype does not fit this 24 GiB machine beside the first
    (the sample then uses the trained transformer without text, as the family says once)."""

    from library.models.ideogram4.checkpoint import diffusers_config
    from library.models.ideogram4.model import IDEOGRAM4, Ideogram4
    from library.models.ideogram4.tiny import QUANTIZED, TINY_CHAT_TEMPLATE
    from library.models.tiny_files import build_qwen_tokenizer

    write_fp8r_folder(os.path.join(work, "transformer"), meta_shapes(lambda: Ideogram4(IDEOGRAM4)), QUANTIZED,
                      diffusers_config(IDEOGRAM4), 1)
    write_flux2_vae(work)
    tokenizer = build_qwen_tokenizer()
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    write_qwen3_vl_folder(os.path.join(work, "text_encoder"), QWEN3_VL_8B_TEXT, QWEN3_VL_8B_VISION, tokenizer, 4)
    save_tokenizer(tokenizer, os.path.join(work, "tokenizer"))


# How the pipeline benches train (bench/bench_planner_cpu.py too): fp8_scaled base, bf16 compute,
# checkpointing, rank 16, AdamW, 2 steps.
RUN_SETTINGS = """fp8_base = true
fp8_scaled = true
mixed_precision = "bf16"
gradient_checkpointing = true
network_dim = 16
network_alpha = 16
optimizer_type = "AdamW"
learning_rate = 1e-4
max_train_steps = 2
"""


def write_references(work: str, images: str, count: int) -> None:
    """`count` 256x256 reference images per target in <work>/references (name_0.png, ...), the subset's
    control_directory, and the sample prompt given image 0's references (--ci each)."""
    from PIL import Image

    folder = os.path.join(work, "references")
    os.makedirs(folder, exist_ok=True)
    for i in range(2):
        for k in range(count):
            Image.new("RGB", (256, 256), (60 + 60 * k, 120, 60 * i)).save(os.path.join(folder, f"{i}_{k}.png"))
    with open(os.path.join(work, "dataset.toml"), "a") as f:
        f.write(f'control_directory = "{folder}"\n')
    cis = " ".join(f"--ci {folder}/0_{k}.png" for k in range(count))
    with open(os.path.join(work, "prompts.txt"), "w") as f:
        f.write(f"a red square {cis} --w 256 --h 256 --s 4 --d 7\n")


def write_run_config(work: str, family: str = "flux", single_file: bool = False, mixed_precision: str = "bf16",
                     references: int = 0, train_steps: int = 2, sample_steps: int = 4, bf16_base: bool = False,
                     sd3_release: str = "medium") -> str:
    from PIL import Image

    images = os.path.join(work, "images")
    os.makedirs(images, exist_ok=True)
    for i, color in enumerate(((200, 40, 40), (40, 40, 200))):
        Image.new("RGB", (256, 256), color).save(os.path.join(images, f"{i}.png"))
        with open(os.path.join(images, f"{i}.txt"), "w") as f:
            f.write(f"a {'red' if i == 0 else 'blue'} square on a plain background, studio photo")
    with open(os.path.join(work, "dataset.toml"), "w") as f:
        f.write(f'[[datasets]]\nresolution = 256\nbatch_size = 1\n[[datasets.subsets]]\nimage_dir = "{images}"\n')
    with open(os.path.join(work, "prompts.txt"), "w") as f:
        f.write("a red square --w 256 --h 256 --s 4 --d 7\n")
    if family == "qwen_image_layered":  # each image with 2 RGBA layers beside it; the sample decomposes image 0
        for i in range(2):
            Image.new("RGBA", (256, 256), (240, 240, 240, 255)).save(os.path.join(images, f"{i}_1.png"))
            Image.new("RGBA", (256, 256), (200, 40, 40, 128)).save(os.path.join(images, f"{i}_2.png"))
        with open(os.path.join(work, "dataset.toml"), "a") as f:
            f.write("multiple_target = true\n")
        with open(os.path.join(work, "prompts.txt"), "w") as f:
            f.write(f"a red square --ci {images}/0.png --w 256 --h 256 --s 4 --d 7\n")
    if references:
        write_references(work, images, references)
    if family == "hunyuan_image":  # image 0's caption and the sample quote a sign: byT5 encodes it; image 1's none
        with open(os.path.join(images, "0.txt"), "w") as f:
            f.write('a red square on a plain background with a sign that reads "OPEN", studio photo')
        with open(os.path.join(work, "prompts.txt"), "w") as f:
            f.write('a red square with the word "OPEN" --w 256 --h 256 --s 4 --d 7\n')
    transformer = f"{work}/z_image_turbo_bf16.safetensors" if single_file else work  # work: the repo layout
    models = {  # what differs between the families; the run settings below are shared
        "qwen_image": f'''model_type = "qwen_image"
pretrained_model_name_or_path = "{work}/transformer"
ae = "{work}/vae"
text_encoder = "{work}/text_encoder"
output_name = "full_qwen"
''',
        "qwen_image_layered": f'''model_type = "qwen_image_layered"
pretrained_model_name_or_path = "{work}/transformer"
ae = "{work}/vae"
text_encoder = "{work}/text_encoder"
layers = 2
output_name = "full_layered"
''',
        "flux2": f'''model_type = "flux2"
pretrained_model_name_or_path = "{work}/flux-2-klein-4b.safetensors"
ae = "{work}/vae"
text_encoder = "{work}"
output_name = "full_klein4b"
''',
        "zimage": f'''model_type = "zimage"
pretrained_model_name_or_path = "{transformer}"
ae = "{work}/ae.safetensors"
text_encoder = "{work}"
output_name = "full_zimage"
timestep_sampling = "zimage_shift"
''',
        "chroma": f'''model_type = "chroma"
pretrained_model_name_or_path = "{work}/Chroma1-HD.safetensors"
ae = "{work}/ae.safetensors"
t5xxl = "{work}/t5xxl"
output_name = "full_chroma"
''',
        "ideogram4": f'''model_type = "ideogram4"
pretrained_model_name_or_path = "{work}"
ae = "{work}/vae"
text_encoder = "{work}"
output_name = "full_ideogram4"
''',
        "krea2": f'''model_type = "krea2"
pretrained_model_name_or_path = "{work}/raw.safetensors"
ae = "{work}/vae"
text_encoder = "{work}"
output_name = "full_krea2"
''',
        "flux3": f'''model_type = "flux3"
pretrained_model_name_or_path = "{work}/{FLUX3_FILE}"
ae = "{work}/vae"
text_encoder = "{work}"
output_name = "full_flux3"
''',
        "ernie_image": f'''model_type = "ernie_image"
pretrained_model_name_or_path = "{work}/{ERNIE_IMAGE_FILE}"
ae = "{work}/vae"
text_encoder = "{work}"
output_name = "full_ernie_image"
''',
        "nucleus_image": f'''model_type = "nucleus_image"
pretrained_model_name_or_path = "{work}"
ae = "{work}/vae"
text_encoder = "{work}"
output_name = "full_nucleus_image"
''',
        "anima": f'''model_type = "anima"
pretrained_model_name_or_path = "{work}/{ANIMA_FILE}"
ae = "{work}/vae"
text_encoder = "{work}/{ANIMA_TEXT_FILE}"
t5_tokenizer = "{work}/t5_tokenizer"
output_name = "full_anima"
''',
        "lumina2": f'''model_type = "lumina2"
pretrained_model_name_or_path = "{work}/{LUMINA2_FILE}"
ae = "{work}/vae/ae.safetensors"
text_encoder = "{work}/{LUMINA2_TEXT_FILE}"
output_name = "full_lumina2"
''',
        "hunyuan_image": f'''model_type = "hunyuan_image"
pretrained_model_name_or_path = "{work}/{HUNYUAN_IMAGE_FILE}"
ae = "{work}/{HUNYUAN_IMAGE_VAE_FILE}"
text_encoder = "{work}/{HUNYUAN_IMAGE_TEXT_FILE}"
byt5 = "{work}/{HUNYUAN_IMAGE_GLYPH_FILE}"
output_name = "full_hunyuan_image"
''',
        "sd3": f'''model_type = "sd3"
pretrained_model_name_or_path = "{work}/{SD3_FILES[sd3_release]}"
ae = "{work}"
clip_l = "{work}/{SD3_TEXT_FILES['clip_l']}"
clip_g = "{work}/{SD3_TEXT_FILES['clip_g']}"
t5xxl = "{work}/{SD3_TEXT_FILES['t5xxl']}"
output_name = "full_sd3"
''',
        "hidream": f'''model_type = "hidream"
pretrained_model_name_or_path = "{work}/{HIDREAM_FILE}"
ae = "{work}/{HIDREAM_VAE_FILE}"
clip_l = "{work}/{HIDREAM_TEXT_FILES['clip_l']}"
clip_g = "{work}/{HIDREAM_TEXT_FILES['clip_g']}"
t5xxl = "{work}/{HIDREAM_TEXT_FILES['t5xxl']}"
llama = "{work}/{HIDREAM_LLAMA_FOLDER}"
output_name = "full_hidream"
''',
        "hidream_o1": f'''model_type = "hidream_o1"
pretrained_model_name_or_path = "{work}/{HIDREAM_O1_FILE}"
output_name = "full_hidream_o1"
''',
        "qwen_image21": f'''model_type = "qwen_image21"
pretrained_model_name_or_path = "{work}"
ae = "{work}/vae"
text_encoder = "{work}"
output_name = "full_qwen_image21"
''',
        "flux": f'''model_type = "flux"
pretrained_model_name_or_path = "{work}/flux1-dev.safetensors"
ae = "{work}/ae.safetensors"
clip_l = "{work}/clip_l"
t5xxl = "{work}/t5xxl"
output_name = "full_flux"
''',
    }
    settings = RUN_SETTINGS.replace('mixed_precision = "bf16"', f'mixed_precision = "{mixed_precision}"')
    settings = settings.replace("max_train_steps = 2", f"max_train_steps = {train_steps}")
    with open(os.path.join(work, "prompts.txt")) as f:
        prompts = f.read()
    with open(os.path.join(work, "prompts.txt"), "w") as f:
        f.write(prompts.replace(" --s 4 ", f" --s {sample_steps} "))
    if family == "ideogram4" or bf16_base:  # ideogram4's released files are pre-quantized (BFL fp8r): as stored
        settings = settings.replace("fp8_base = true\nfp8_scaled = true\n", "fp8_base = false\n")
    # Qwen2.5-VL-7B, T5-XXL and Llama-3.1-8B in scaled fp8 as configs/hunyuan_image.toml, sd3.toml and hidream.toml
    # cache them; the others' bf16
    text_precision = "fp8_scaled" if family in ("hunyuan_image", "sd3", "hidream") else "bf16"
    config = os.path.join(work, "train.toml")
    with open(config, "w") as f:
        f.write(models[family] + f"""dataset_config = "{work}/dataset.toml"
sample_prompts = "{work}/prompts.txt"
sample_bf16_reference = false
output_dir = "{work}/out"
text_encoder_precision = "{text_precision}"
""" + settings)
    return config


# ----------------------------------------------------------------------------------------------
# Running train_lora.py with a memory monitor


def read_status(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out


def run_trainer(config: str) -> dict:
    # glibc maps every buffer of 1 MiB or more and unmaps it on free, so RSS follows the live tensors
    # (library/training/host_memory.py): what the planner predicts; its default heap kept ~2 GiB more.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "train_lora.py"), "--config_file", config], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    start, samples, lines = time.time(), [], []

    def monitor():
        while proc.poll() is None:
            try:
                samples.append((time.time() - start, read_status(proc.pid)))
            except (OSError, ValueError):
                break
            time.sleep(0.2)

    thread = threading.Thread(target=monitor, daemon=True)
    thread.start()
    pending = ""
    while True:  # tqdm redraws with "\r" and no newline: cut on both, as the bytes arrive
        chunk = os.read(proc.stdout.fileno(), 4096).decode(errors="replace")
        if not chunk:
            break
        *parts, pending = (pending + chunk).replace("\r", "\n").split("\n")
        for part in parts:
            if part.strip():
                lines.append((time.time() - start, part))
                print(f"[{time.time() - start:7.1f} s] {part}", flush=True)
    code = proc.wait()
    thread.join()
    return {"code": code, "samples": samples, "lines": lines, "seconds": time.time() - start}


def _started(t: float, line: str) -> float:
    """When a tqdm line's run began: its arrival minus the elapsed time it shows ([mm:ss<...]),
    since a piped tqdm may reach us only with a later redraw."""
    match = re.search(r"\[(\d+):(\d\d)<", line)
    return t - (60 * int(match.group(1)) + int(match.group(2))) if match else t


def phase_peaks(result: dict) -> list[dict]:
    cuts, t0 = [], 0.0
    for name, marker in PHASES:
        t1 = min((_started(t, line) for t, line in result["lines"] if marker in line and t >= t0), default=None)
        if t1 is None:
            break
        cuts.append((name, t0, t1))
        t0 = t1
    rows = []
    for name, a, b in cuts:
        inside = [s for t, s in result["samples"] if a <= t <= b]
        if inside:
            rows.append({"phase": name, "seconds": round(b - a, 1),
                         **{f"peak_{k}_gib": round(max(s.get(k, 0) for s in inside) / GiB, 2)
                            for k in ("VmRSS", "RssAnon", "RssFile")}})
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--work", default="/tmp/fullsize")
    p.add_argument("--skip-write", action="store_true")
    p.add_argument("--family", choices=["flux", "qwen_image", "flux2", "zimage", "chroma", "qwen_image21", "krea2",
                                        "ideogram4", "qwen_image_layered", "flux3", "ernie_image", "nucleus_image",
                                        "anima", "lumina2", "hunyuan_image", "sd3", "hidream", "hidream_o1"],
                   default="flux",
                   help="flux: FLUX.1-dev; qwen_image: --qwen-blocks of 60; flux2: FLUX.2 [klein] 4B, whole; "
                        "zimage: Z-Image-Turbo, whole; chroma: Chroma1-HD, whole; qwen_image21: Qwen-Image-2.1, "
                        "whole; krea2: Krea 2 Raw, whole; ideogram4: Ideogram 4 (fp8r), whole; qwen_image_layered: "
                        "--qwen-blocks of 60, RGBA VAE, 2 layers; flux3: FLUX.3 [klein] base, whole; ernie_image: "
                        "ERNIE-Image, whole; nucleus_image: Nucleus-Image, whole; anima: Anima, whole; "
                        "lumina2: Lumina Image 2.0, whole; hunyuan_image: HunyuanImage-2.1, --hunyuan-blocks of "
                        "20,40; sd3: --sd3-release (Large or Medium), --sd3-blocks of it; hidream: HiDream-I1 Full, "
                        "--hidream-blocks of 16,32; hidream_o1: HiDream-O1-Image, whole")
    p.add_argument("--single-file", action="store_true",
                   help="zimage: the transformer as ComfyUI's single file instead of the repo's transformer/ folder")
    p.add_argument("--qwen-blocks", type=int, default=6, help="Qwen-Image transformer blocks written (of 60)")
    p.add_argument("--hunyuan-blocks", default="4,8",
                   help="HunyuanImage-2.1 double,single blocks written (of 20,40): the whole 17 B base would take ~1 h "
                        "a step on 2 cores")
    p.add_argument("--sd3-release", choices=["large", "medium"], default="medium",
                   help="sd3: SD3.5-Medium (2.5 B, MMDiT-X, the 384^2 table) or SD3.5-Large (8.1 B, the 192^2 table)")
    p.add_argument("--sd3-blocks", type=int, default=None,
                   help="sd3: joint blocks written at the release's width (default all: 24 Medium, 38 Large)")
    p.add_argument("--hidream-blocks", default="2,2",
                   help="HiDream-I1 double,single blocks written at the released width (of 16,32): the whole 17 B "
                        "base would take most of an hour a step on 2 cores")
    p.add_argument("--mixed-precision", choices=["bf16", "no"], default="bf16",
                   help="the transformer's compute dtype; 'no' (float32) on a CPU without native bf16, where bf16 "
                        "matmuls run ~3-5x slower than float32 and a backward's grad @ W ~100x (0.1-0.2 GFLOPS on an "
                        "AMD EPYC without avx512_bf16; the text encoder stays bf16 either way)")
    p.add_argument("--references", type=int, default=0,
                   help="flux2: reference images per target (256x256, control_directory) and in the sample")
    p.add_argument("--train-steps", type=int, default=2,
                   help="training steps; 1 where the CPU is too slow for 2 (the optimizer's state is made at its "
                        "end, so the phase holds what a second step would: 17.33 vs 17.36 GiB on Nucleus-Image)")
    p.add_argument("--sample-steps", type=int, default=4, help="steps of the 256x256 sample")
    p.add_argument("--bf16-base", action="store_true",
                   help="the base in bf16 (fp8_base = false) instead of fp8_scaled quantized while loading")
    args = p.parse_args(argv)
    if args.references and args.family != "flux2":
        p.error("--references: the flux2 bench trains with references")
    if not args.skip_write:
        t = time.time()
        if args.family == "flux":
            write_files(args.work)
        elif args.family == "flux2":
            write_flux2_files(args.work)
        elif args.family == "zimage":
            write_zimage_files(args.work, args.single_file)
        elif args.family == "chroma":
            write_chroma_files(args.work)
        elif args.family == "qwen_image21":
            write_qwen_image21_files(args.work)
        elif args.family == "krea2":
            write_krea2_files(args.work)
        elif args.family == "ideogram4":
            write_ideogram4_files(args.work)
        elif args.family == "flux3":
            write_flux3_files(args.work)
        elif args.family == "ernie_image":
            write_ernie_image_files(args.work)
        elif args.family == "nucleus_image":
            write_nucleus_image_files(args.work)
        elif args.family == "anima":
            write_anima_files(args.work)
        elif args.family == "lumina2":
            write_lumina2_files(args.work)
        elif args.family == "hunyuan_image":
            double, single = (int(n) for n in args.hunyuan_blocks.split(","))
            write_hunyuan_image_files(args.work, double, single)
        elif args.family == "sd3":
            write_sd3_files(args.work, args.sd3_release, args.sd3_blocks)
        elif args.family == "hidream":
            double, single = (int(n) for n in args.hidream_blocks.split(","))
            write_hidream_files(args.work, double, single)
        elif args.family == "hidream_o1":
            write_hidream_o1_files(args.work)
        else:
            write_qwen_files(args.work, args.qwen_blocks, layered=args.family == "qwen_image_layered")
        print(f"files written in {time.time() - t:.0f} s", flush=True)
    result = run_trainer(write_run_config(args.work, args.family, args.single_file, args.mixed_precision,
                                          args.references, args.train_steps, args.sample_steps, args.bf16_base,
                                          args.sd3_release))
    rows = phase_peaks(result)
    print(f"\ntrain_lora.py exit {result['code']} after {result['seconds']:.0f} s")
    print(f"{'phase':18s} {'seconds':>8s} {'VmRSS':>7s} {'RssAnon':>8s} {'RssFile':>8s}  (peak GiB)")
    for r in rows:
        print(f"{r['phase']:18s} {r['seconds']:8.1f} {r['peak_VmRSS_gib']:7.2f} {r['peak_RssAnon_gib']:8.2f} "
              f"{r['peak_RssFile_gib']:8.2f}")
    with open(os.path.join(args.work, "result.json"), "w") as f:
        json.dump({"code": result["code"], "seconds": result["seconds"], "phases": rows,
                   "torch_threads": torch.get_num_threads(), "lines": result["lines"],
                   "samples": [(round(t, 1), s) for t, s in result["samples"]]}, f)


if __name__ == "__main__":
    main()
