"""Random-weight files at the released sizes, tensor by tensor, for bench/bench_full_pipeline_cpu.py (which
imports them; bench/bench_planner_cpu.py too): the generic writers (one file, sharded, a Qwen3-VL folder, FLUX.1's,
FLUX.2's and Qwen-Image's VAEs) and the per-family writers of FLUX.3 [klein], ERNIE-Image, Nucleus-Image, Anima,
Lumina Image 2.0, HunyuanImage-2.1, SD3.5, HiDream-I1 and HiDream-O1-Image.

Weights are N(0, 0.02), norm scales 1 (random_tensor); writing never holds a model (each tensor drawn and written
one at a time by tools/merge_lora.write_safetensors_streaming). Tensors a run never reads can be written as holes
(write_holes: the header lists them, their bytes are a sparse file's unwritten range, so they take no disk).
"""

from __future__ import annotations

import json
import os
import re
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from library.models.tiny_files import save_tokenizer  # noqa: E402
from tools.merge_lora import Entry, safetensors_header, write_safetensors_streaming  # noqa: E402

GiB = 1024**3


ONES = ("cap_embedder.0.weight",)  # norm scales whose names do not say so (Z-Image's caption RMSNorm)


def random_tensor(name: str, shape: tuple[int, ...], generator: torch.Generator,
                  ones: tuple[str, ...] = (), dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """N(0, 0.02) in `dtype` (bf16); 1-D norm scales ones (and 1-D tensors whose names end with one of `ones`)."""
    norm = "norm" in name or name.endswith(("scale", ".g", "running_var", *ones)) or name in ONES
    if len(shape) == 1 and norm:
        return torch.ones(shape, dtype=dtype)
    return (torch.randn(shape, generator=generator) * 0.02).to(dtype)


def write_random(path: str, shapes: dict[str, tuple[int, ...]], seed: int, metadata: dict[str, str] | None = None,
                 ones: tuple[str, ...] = (), dtype: torch.dtype = torch.bfloat16,
                 extra: dict[str, torch.Tensor] | None = None):
    """`shapes` drawn by random_tensor in `dtype` (a file released in fp16: torch.float16), then `extra` as given
    (small non-weight tensors a released file holds, e.g. a stored tokenizer's bytes)."""
    generator = torch.Generator().manual_seed(seed)
    extra = extra or {}
    entries = [Entry(k, dtype, tuple(s)) for k, s in shapes.items()]
    entries += [Entry(k, v.dtype, tuple(v.shape)) for k, v in extra.items()]
    tensors = ((e.key, extra[e.key] if e.key in extra else random_tensor(e.key, e.shape, generator, ones, dtype))
               for e in entries)
    tmp = path + ".tmp"
    write_safetensors_streaming(tmp, entries, tensors, metadata or {"format": "pt"})
    os.replace(tmp, path)
    print(f"wrote {path}: {sum(e.nbytes for e in entries) / GiB:.2f} GiB", flush=True)


def write_holes(path: str, shapes: dict[str, tuple[int, ...]]):
    """A bf16 safetensors file whose header lists `shapes` and whose data is never written: the file is extended
    to its full size by truncate, a sparse hole that reads as zeros and takes no disk. For tensors no loader of the
    run reads (a text encoder's layers past the hidden state it keeps, its head, its vision tower)."""
    entries = [Entry(key, torch.bfloat16, tuple(shape)) for key, shape in shapes.items()]
    head, offset = safetensors_header(entries, {"format": "pt"}), sum(e.nbytes for e in entries)
    with open(path + ".tmp", "wb") as f:
        f.write(head)
        f.truncate(len(head) + offset)
    os.replace(path + ".tmp", path)
    print(f"wrote {path}: {offset / GiB:.2f} GiB as a hole (never read)", flush=True)


def write_random_sharded(folder: str, stem: str, shapes: dict[str, tuple[int, ...]], seed: int, shards: int,
                         ones: tuple[str, ...] = (), holes: dict[str, tuple[int, ...]] | None = None):
    """<folder>/<stem>-0000i-of-0000n.safetensors + <stem>.safetensors.index.json, as the released
    repos shard (keys in order, cut into `shards` files of about equal bytes); tensor by tensor. `holes`: tensors
    listed in one more, last shard written by write_holes (never read by the run)."""
    os.makedirs(folder, exist_ok=True)
    total = sum(Entry(k, torch.bfloat16, tuple(s)).nbytes for k, s in shapes.items())
    groups, size = [[]], 0
    for key, shape in shapes.items():
        if size >= total * len(groups) / shards and len(groups) < shards:
            groups.append([])
        groups[-1].append(key)
        size += Entry(key, torch.bfloat16, tuple(shape)).nbytes
    count = len(groups) + bool(holes)
    weight_map = {}
    for i, keys in enumerate(groups):
        name = f"{stem}-{i + 1:05d}-of-{count:05d}.safetensors"
        write_random(os.path.join(folder, name), {k: shapes[k] for k in keys}, seed * 100 + i, ones=ones)
        weight_map.update({k: name for k in keys})
    if holes:
        name = f"{stem}-{count:05d}-of-{count:05d}.safetensors"
        write_holes(os.path.join(folder, name), holes)
        weight_map.update({k: name for k in holes})
        total += sum(Entry(k, torch.bfloat16, tuple(s)).nbytes for k, s in holes.items())
    with open(os.path.join(folder, f"{stem}.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def meta_shapes(build) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        module = build()
    return {k: tuple(v.shape) for k, v in module.state_dict().items()}


def write_flux_vae(work: str):
    """<work>/ae.safetensors: the FLUX.1 VAE at its released size, BFL layout (no config: the built-in one)."""
    from diffusers import AutoencoderKL

    from library.models.flux1.vae import FLUX_VAE_CONFIG
    from library.models.vae import autoencoder_kl_to_ldm_state_dict

    with torch.device("meta"):
        vae_sd = AutoencoderKL(**FLUX_VAE_CONFIG).state_dict()
    ldm = autoencoder_kl_to_ldm_state_dict(vae_sd, len(FLUX_VAE_CONFIG["block_out_channels"]))
    os.makedirs(work, exist_ok=True)
    write_random(os.path.join(work, "ae.safetensors"), {k: tuple(v.shape) for k, v in ldm.items()}, 2, metadata={})


def write_flux2_vae(work: str):
    """<work>/vae: FLUX.2's AutoencoderKLFlux2 at diffusers' defaults (its released size)."""
    from diffusers import AutoencoderKLFlux2

    with torch.device("meta"):
        vae = AutoencoderKLFlux2()
    folder = os.path.join(work, "vae")
    os.makedirs(folder, exist_ok=True)
    write_random(os.path.join(folder, "diffusion_pytorch_model.safetensors"),  # running_var 1, no step counter
                 {k: tuple(v.shape) for k, v in vae.state_dict().items() if not k.endswith("num_batches_tracked")}, 2)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"_class_name": "AutoencoderKLFlux2",
                   **{k: v for k, v in vae.config.items() if not k.startswith("_")}}, f)


def write_qwen_image_vae(work: str, config: dict | None = None):
    """<work>/vae: the Qwen-Image VAE (AutoencoderKLQwenImage at diffusers' defaults = its released size)."""
    from diffusers import AutoencoderKLQwenImage

    with torch.device("meta"):
        vae = AutoencoderKLQwenImage(**(config or {}))
    folder = os.path.join(work, "vae")
    os.makedirs(folder, exist_ok=True)
    write_random(os.path.join(folder, "diffusion_pytorch_model.safetensors"),
                 {k: tuple(v.shape) for k, v in vae.state_dict().items()}, 2)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"_class_name": "AutoencoderKLQwenImage",
                   **{k: v for k, v in vae.config.items() if not k.startswith("_")}}, f)


# Qwen3-VL-8B's language model and vision tower (Qwen-Image-2.1's and Ideogram 4's text encoder); the
# pad token comes from the tokenizer written beside it.
QWEN3_VL_8B_TEXT = {
    "vocab_size": 151936, "hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 12288, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 262144, "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "mrope_section": [24, 20, 20], "mrope_interleaved": True,
                        "rope_theta": 5000000.0}}
QWEN3_VL_8B_VISION = {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16,
                      "out_hidden_size": 4096, "num_position_embeddings": 2304, "deepstack_visual_indexes": [8, 16, 24],
                      "patch_size": 16}


def write_qwen3_vl_folder(folder: str, text: dict, vision: dict, tokenizer, shards: int, conditional: bool = False,
                          read_layers: int | None = None, **ids):
    """A Qwen3-VL text-encoder folder (Qwen3VLModel, or Qwen3VLForConditionalGeneration when `conditional`)
    with random bf16 weights for the language model only (text-to-image never reads the vision tower or
    lm_head), in `shards` shards, and its config.json. read_layers: every tensor of the model is listed, as a
    released folder's index lists them, and those the encoder reads (the embeddings, decoder layers below
    read_layers, the final norm) are drawn; the deeper layers, lm_head and the vision tower are holes."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLModel

    config = Qwen3VLConfig(text_config={**text, "pad_token_id": tokenizer.pad_token_id}, vision_config=vision, **ids)
    cls, prefix = ((Qwen3VLForConditionalGeneration, "model.language_model.") if conditional
                   else (Qwen3VLModel, "language_model."))
    every = meta_shapes(lambda: cls(config))
    shapes = {k: v for k, v in every.items() if k.startswith(prefix)}
    if read_layers is not None:
        deeper = re.compile(re.escape(prefix) + r"layers\.(\d+)\.")
        shapes = {k: v for k, v in shapes.items() if not (m := deeper.match(k)) or int(m.group(1)) < read_layers}
    holes = None if read_layers is None else {k: v for k, v in every.items() if k not in shapes}
    write_random_sharded(folder, "model", shapes, 3, shards, holes=holes)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"architectures": [cls.__name__], **config.to_dict(), "torch_dtype": "bfloat16"}, f, indent=2)


def qwen3_vl_4b() -> tuple[dict, dict]:
    """Qwen3-VL-4B's text_config and vision_config (Krea 2's and FLUX.3's text encoder), from llm.QWEN3_VL_4B."""
    from library.models.llm import QWEN3_VL_4B as c

    text = {"vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "num_hidden_layers": c.num_layers,
            "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
            "intermediate_size": c.intermediate_size, "rms_norm_eps": c.rms_norm_eps, "tie_word_embeddings": True,
            "max_position_embeddings": c.max_position_embeddings,
            "rope_parameters": {"rope_type": "default", "mrope_section": list(c.mrope_section),
                                "mrope_interleaved": True, "rope_theta": c.rope_theta}}
    vision = {"depth": 24, "hidden_size": 1024, "intermediate_size": 4096, "num_heads": 16, "out_hidden_size": 2560,
              "num_position_embeddings": 2304, "deepstack_visual_indexes": [5, 11, 17], "patch_size": 16}
    return text, vision


# ----------------------------------------------------------------------------------------------
# FLUX.3 [klein] and ERNIE-Image

FLUX3_FILE = "flux-3-image-klein-base.safetensors"
ERNIE_IMAGE_FILE = "ernie-image.safetensors"


def write_flux3_files(work: str):
    """FLUX.3 [klein] base at its released size: the transformer as BFL's single file (FLUX3_IMAGE, 5,538,458,368
    parameters, bf16, no metadata: the loader reads the config from the shapes), FLUX.2's VAE as vae/,
    text_encoder/ (a Qwen3VLForConditionalGeneration folder with Qwen3-VL-4B's config, as FLUX.3's repo holds it;
    only the language model's weights, 4.02 B: text never reads the vision tower or lm_head) and tokenizer/ (the
    processor's files: the small Qwen tokenizer with the vision tokens and Qwen3-VL's chat template)."""
    from library.models.flux3.model import FLUX3_IMAGE, Flux3Transformer
    from library.models.flux3.text_encoder import QWEN3_VL_USER_PROMPT
    from library.models.qwen_image21.tiny import QWEN3_VL_CHAT_TEMPLATE
    from library.models.tiny_files import build_qwen_tokenizer, save_vl_processor

    os.makedirs(work, exist_ok=True)
    write_random(os.path.join(work, FLUX3_FILE), meta_shapes(lambda: Flux3Transformer(FLUX3_IMAGE)), 1, metadata={})
    write_flux2_vae(work)
    tokenizer = build_qwen_tokenizer(vision_templates=(QWEN3_VL_USER_PROMPT,))
    ids = {k: tokenizer.convert_tokens_to_ids(t) for k, t in (("image_token_id", "<|image_pad|>"),
           ("video_token_id", "<|video_pad|>"), ("vision_start_token_id", "<|vision_start|>"),
           ("vision_end_token_id", "<|vision_end|>"))}
    text, vision = qwen3_vl_4b()
    write_qwen3_vl_folder(os.path.join(work, "text_encoder"), text, vision, tokenizer, 2, conditional=True, **ids)
    tokenizer.chat_template = QWEN3_VL_CHAT_TEMPLATE
    save_vl_processor(os.path.join(work, "tokenizer"), {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
                      "min_pixels": 32 * 32, "max_pixels": 1024 * 1024}, "Qwen3VLProcessor", tokenizer)


# Pixtral's vision tower as Ministral 3 3B's config nests it (config.json only: its weights are never written)
MINISTRAL_3_VISION = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24,
                      "num_attention_heads": 16, "head_dim": 64, "patch_size": 14, "image_size": 1540}


def write_ernie_image_files(work: str):
    """ERNIE-Image at its released size: the transformer as its single file in diffusers' names (ERNIE_IMAGE,
    8,033,490,048 parameters, bf16, no metadata: the config from the shapes; the adaLN RMSNorm scales `*_ln.weight`
    ones), FLUX.2's VAE as vae/, text_encoder/ (a transformers Mistral3Model folder with Ministral 3 3B's
    text_config: only the language model's weights, 3.43 B with the 26th layer and the final norm the encoder
    never applies; the Pixtral tower never read nor written) and tokenizer/ (the small Mistral-style tokenizer)."""
    from transformers import Mistral3Config, Mistral3Model

    from library.models.ernie_image.model import ERNIE_IMAGE, ErnieImage
    from library.models.ernie_image.text_encoder import MINISTRAL_3_3B_TEXT_CONFIG
    from library.models.tiny_files import build_mistral_tokenizer

    os.makedirs(work, exist_ok=True)
    write_random(os.path.join(work, ERNIE_IMAGE_FILE), meta_shapes(lambda: ErnieImage(ERNIE_IMAGE)), 1, metadata={},
                 ones=("_ln.weight",))
    write_flux2_vae(work)
    tokenizer = build_mistral_tokenizer(("{}",))
    text = {**MINISTRAL_3_3B_TEXT_CONFIG, "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    config = Mistral3Config(text_config=text, vision_config=MINISTRAL_3_VISION)
    folder = os.path.join(work, "text_encoder")
    shapes = {k: v for k, v in meta_shapes(lambda: Mistral3Model(config)).items() if k.startswith("language_model.")}
    write_random_sharded(folder, "model", shapes, 3, 2)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"architectures": ["Mistral3Model"], **config.to_dict(), "torch_dtype": "bfloat16"}, f, indent=2)
    save_tokenizer(tokenizer, os.path.join(work, "tokenizer"))


# ----------------------------------------------------------------------------------------------
# Nucleus-Image


def write_nucleus_image_files(work: str, config=None, text: dict = QWEN3_VL_8B_TEXT,
                              vision: dict = QWEN3_VL_8B_VISION):
    """Nucleus-Image at its released size, laid out as NucleusAI/Nucleus-Image: transformer/ (the diffusers folder:
    config.json with the released config, 7 bf16 shards and the index; NUCLEUS_IMAGE, 16,922,679,296 parameters,
    31.52 GiB, 15.3 B of them the packed experts), Qwen-Image's AutoencoderKLQwenImage as vae/, text_encoder/ (a
    Qwen3VLForConditionalGeneration folder with Qwen3-VL-8B's config, own lm_head: the 6.22 B weights the encoder
    reads, the embeddings, decoder layers 0-28 (hidden_states[-8] of 36) and the final norm, drawn in 4 shards; the
    layers 29-35, lm_head and the vision tower listed in the index and a fifth shard whose data is a sparse hole:
    never read, no disk) and processor/ (the small Qwen tokenizer with the pipeline's chat text and Qwen3-VL's chat
    template, as the tiny set's). config (a NucleusImageConfig), text, vision: other sizes, for a dry run."""
    from library.models.llm import hidden_state_index
    from library.models.nucleus_image.checkpoint import diffusers_config
    from library.models.nucleus_image.model import NUCLEUS_IMAGE, NucleusImage
    from library.models.nucleus_image.text_encoder import NUCLEUS_CHAT_TEXT, NUCLEUS_HIDDEN_STATE, NUCLEUS_SYSTEM_PROMPT
    from library.models.qwen_image21.tiny import QWEN3_VL_CHAT_TEMPLATE
    from library.models.tiny_files import build_qwen_tokenizer, save_vl_processor

    config = config or NUCLEUS_IMAGE
    folder = os.path.join(work, "transformer")
    write_random_sharded(folder, "diffusion_pytorch_model", meta_shapes(lambda: NucleusImage(config)), 1, 7)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(diffusers_config(config), f, indent=2)
    write_qwen_image_vae(work)
    tokenizer = build_qwen_tokenizer(vision_templates=(NUCLEUS_CHAT_TEXT.format(NUCLEUS_SYSTEM_PROMPT, "{}"),))
    ids = {k: tokenizer.convert_tokens_to_ids(t) for k, t in (("image_token_id", "<|image_pad|>"),
           ("video_token_id", "<|video_pad|>"), ("vision_start_token_id", "<|vision_start|>"),
           ("vision_end_token_id", "<|vision_end|>"))}
    read = hidden_state_index(NUCLEUS_HIDDEN_STATE, text["num_hidden_layers"])
    write_qwen3_vl_folder(os.path.join(work, "text_encoder"), text, vision, tokenizer, 4,
                          conditional=True, read_layers=read, **ids)
    tokenizer.chat_template = QWEN3_VL_CHAT_TEMPLATE
    save_vl_processor(os.path.join(work, "processor"), {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
                      "min_pixels": 32 * 32, "max_pixels": 1024 * 1024}, "Qwen3VLProcessor", tokenizer)


# ----------------------------------------------------------------------------------------------
# Anima

ANIMA_FILE = "diffusion_models/anima-preview2.safetensors"  # ComfyUI's split_files layout, as configs/anima.toml
ANIMA_TEXT_FILE = "text_encoders/qwen_3_06b_base.safetensors"


def write_anima_files(work: str):
    """Anima at its released size, in the single files people download (ComfyUI's split_files): the DiT and its
    LLM adapter as diffusion_models/anima-preview2.safetensors ("net." prefix, the original names, bf16, no metadata:
    the loader reads the config from the shapes; ANIMA, 2,091,068,928 parameters, 3.89 GiB), Qwen3-0.6B as
    text_encoders/qwen_3_06b_base.safetensors (Qwen3ForCausalLM's `model.*` keys, tied: no head; 596,049,920
    parameters) with the small Qwen3 tokenizer beside it (valid ids), t5_tokenizer/ (the small T5 tokenizer: its ids
    stay below the adapter's 32128 rows) and the Qwen-Image VAE as vae/ (the diffusers folder: ComfyUI's Wan-layout
    qwen_image_vae.safetensors holds the same tensors, converted on load by diffusers' convert_wan_vae_to_diffusers)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from library.models.anima.model import ANIMA, Anima
    from library.models.anima.text_encoder import QWEN3_0_6B
    from library.models.tiny_files import build_qwen3_tokenizer, build_t5_tokenizer

    for folder in ("diffusion_models", "text_encoders"):
        os.makedirs(os.path.join(work, folder), exist_ok=True)
    dit = {"net." + k: v for k, v in meta_shapes(lambda: Anima(ANIMA)).items()}
    write_random(os.path.join(work, ANIMA_FILE), dit, 1, metadata={})
    tokenizer = build_qwen3_tokenizer()
    hf = {**QWEN3_0_6B.to_hf(), "bos_token_id": None, "eos_token_id": tokenizer.eos_token_id,
          "pad_token_id": tokenizer.pad_token_id}
    llm = meta_shapes(lambda: Qwen3ForCausalLM(Qwen3Config(**{k: v for k, v in hf.items() if k != "architectures"})))
    write_random(os.path.join(work, ANIMA_TEXT_FILE), {k: v for k, v in llm.items() if k != "lm_head.weight"}, 3,
                 metadata={})
    save_tokenizer(tokenizer, os.path.join(work, "text_encoders"))
    save_tokenizer(build_t5_tokenizer(), os.path.join(work, "t5_tokenizer"))
    write_qwen_image_vae(work)


# ----------------------------------------------------------------------------------------------
# Lumina Image 2.0

# Comfy-Org/Lumina_Image_2.0_Repackaged's split_files layout, as configs/lumina2.toml names them
LUMINA2_FILE = "diffusion_models/lumina_2_model_bf16.safetensors"
LUMINA2_TEXT_FILE = "text_encoders/gemma_2_2b_fp16.safetensors"
GEMMA_SPIECE_BYTES = 4_241_003  # ~google/gemma-2-2b's tokenizer.model: ComfyUI stores it as uint8 spiece_model


def write_lumina2_files(work: str):
    """Lumina Image 2.0 at its released size, in the single files people download (Comfy-Org's split_files): the
    NextDiT as diffusion_models/lumina_2_model_bf16.safetensors (the original names, no prefix, bf16, no metadata:
    the loader reads the config from the shapes; LUMINA2, 2,609,769,152 parameters, and the unused
    `norm_final.weight` the released file holds: 4.86 GiB), Gemma-2-2B as text_encoders/gemma_2_2b_fp16.safetensors
    (fp16 as released: Gemma2ForCausalLM's `model.*` keys, tied: no head, 2,614,341,888 parameters, 4.87 GiB, and
    `spiece_model`: zeros the size of the sentencepiece file ComfyUI stores there; no config.json: shaped by its
    tensors), tokenizer/ beside text_encoders/ (the small Gemma-style tokenizer of library/models/lumina2/tiny_text.py:
    the released special ids, valid ids for the 256,000 rows) and FLUX.1's AE as vae/ae.safetensors (BFL layout).
    Gemma's norm weights are offsets (x * (1 + w)): random_tensor's ones make them scales of 2, still finite."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from library.models.llm import GEMMA2_2B
    from library.models.lumina2.model import LUMINA2, Lumina2
    from library.models.lumina2.tiny_text import build_gemma_tokenizer, save_gemma_tokenizer

    for folder in ("diffusion_models", "text_encoders"):
        os.makedirs(os.path.join(work, folder), exist_ok=True)
    dit = {**meta_shapes(lambda: Lumina2(LUMINA2)), "norm_final.weight": (LUMINA2.dim,)}
    write_random(os.path.join(work, LUMINA2_FILE), dit, 1, metadata={})
    hf = {**GEMMA2_2B.to_hf(), "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0}
    gemma = meta_shapes(lambda: Gemma2ForCausalLM(Gemma2Config(**{k: v for k, v in hf.items()
                                                                   if k != "architectures"})))
    spiece = torch.zeros(GEMMA_SPIECE_BYTES, dtype=torch.uint8)
    write_random(os.path.join(work, LUMINA2_TEXT_FILE), {k: v for k, v in gemma.items() if k != "lm_head.weight"}, 3,
                 metadata={}, dtype=torch.float16, extra={"spiece_model": spiece})
    save_gemma_tokenizer(build_gemma_tokenizer(), os.path.join(work, "tokenizer"))
    write_flux_vae(os.path.join(work, "vae"))


# ----------------------------------------------------------------------------------------------
# HunyuanImage-2.1

# The files configs/hunyuan_image.toml names: tencent/HunyuanImage-2.1's dit/ and Comfy-Org/HunyuanImage_2.1_ComfyUI's
# split_files (text_encoders/, vae/); Qwen2.5-VL's tokenizer in tokenizer/ beside text_encoders/
HUNYUAN_IMAGE_FILE = "dit/hunyuanimage2.1.safetensors"
HUNYUAN_IMAGE_FP8_FILE = "dit/hunyuanimage2.1_fp8_scaled.safetensors"  # our fp8_scaled layout of the same weights
HUNYUAN_IMAGE_TEXT_FILE = "text_encoders/qwen_2.5_vl_7b.safetensors"
HUNYUAN_IMAGE_GLYPH_FILE = "text_encoders/byt5_small_glyphxl_fp16.safetensors"
HUNYUAN_IMAGE_VAE_FILE = "vae/hunyuan_image_2.1_vae_fp16.safetensors"
# Qwen2.5-VL-7B's vision tower as ComfyUI's file holds it (`visual.*`; never read by a text-to-image run: a hole)
QWEN2_5_VL_7B_VISION = {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                        "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
                        "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31]}


def write_random_with_holes(path: str, shapes: dict[str, tuple[int, ...]], holes: dict[str, tuple[int, ...]],
                            seed: int, dtype: torch.dtype = torch.bfloat16):
    """One file as a released single file lists its tensors: `shapes` drawn by random_tensor in `dtype`, then `holes`
    (tensors no loader of the run reads) whose bytes are the file's sparse tail (write_holes' trick: no disk)."""
    generator = torch.Generator().manual_seed(seed)
    drawn = [Entry(k, dtype, tuple(s)) for k, s in shapes.items()]
    entries = drawn + [Entry(k, dtype, tuple(s)) for k, s in holes.items()]
    head = safetensors_header(entries, {})
    with open(path + ".tmp", "wb") as f:
        f.write(head)
        for e in drawn:
            f.write(random_tensor(e.key, e.shape, generator, dtype=dtype).reshape(-1).view(torch.uint8).numpy().data)
        f.truncate(len(head) + sum(e.nbytes for e in entries))
    os.replace(path + ".tmp", path)
    print(f"wrote {path}: {sum(e.nbytes for e in drawn) / GiB:.2f} GiB drawn, "
          f"{sum(e.nbytes for e in entries[len(drawn):]) / GiB:.2f} GiB as a hole (never read)", flush=True)


def write_fp8_scaled_random(path: str, shapes: dict[str, tuple[int, ...]], seed: int, quantized) -> None:
    """A transformer single file pre-quantized in our fp8_scaled layout (what merge_lora --save_precision fp8_scaled
    writes): each Linear weight `quantized(key)` accepts drawn in bf16, then stored as e4m3 codes with its bf16
    `<Linear>.weight_scale` [out, in/64] (fp8.quantize_weight); every other tensor bf16. No metadata."""
    from library.precision.fp8 import FP8_DTYPE, SCALE_DTYPE, quantize_weight, scale_shape

    generator = torch.Generator().manual_seed(seed)
    entries = []
    for key, shape in shapes.items():
        if quantized(key):
            entries += [Entry(key, FP8_DTYPE, shape), Entry(key[: -len("weight")] + "weight_scale", SCALE_DTYPE,
                                                             scale_shape(*shape))]
        else:
            entries.append(Entry(key, torch.bfloat16, shape))

    def tensors():
        for key, shape in shapes.items():
            tensor = random_tensor(key, shape, generator)
            if quantized(key):
                codes, scale = quantize_weight(tensor, "fp8_scaled")
                yield key, codes
                yield key[: -len("weight")] + "weight_scale", scale
            else:
                yield key, tensor

    write_safetensors_streaming(path + ".tmp", entries, tensors(), {})
    os.replace(path + ".tmp", path)
    print(f"wrote {path}: {sum(e.nbytes for e in entries) / GiB:.2f} GiB (fp8_scaled)", flush=True)


def write_hunyuan_image_files(work: str, double_blocks: int = 20, single_blocks: int = 40, fp8_scaled: bool = False):
    """HunyuanImage-2.1 in the single files people download (configs/hunyuan_image.toml's paths):
    dit/hunyuanimage2.1.safetensors (Tencent's names, no prefix, bf16, no metadata: the loader reads the config from
    the shapes; HUNYUAN_IMAGE at full width with `double_blocks` of 20 and `single_blocks` of 40; with fp8_scaled,
    dit/hunyuanimage2.1_fp8_scaled.safetensors instead: our pre-quantized layout, the Linears fp8_scaled quantizes),
    text_encoders/qwen_2.5_vl_7b.safetensors (ComfyUI's keys: `model.*` = Qwen2ForCausalLM's language model with
    Qwen2.5-7B's shapes, `lm_head.weight`, `visual.*`; bf16, no config.json: read as Qwen2.5-VL-7B; the embeddings
    and decoder layers 0-25 drawn, layers 26-27, the final norm, lm_head and the vision tower a sparse hole, as
    hidden_states[-3] never reads them), text_encoders/byt5_small_glyphxl_fp16.safetensors (byT5-small's encoder with
    the glyph vocabulary, `shared.weight` + `encoder.*`, fp16, shaped by its tensors), tokenizer/ (the small
    Qwen2.5-VL-style tokenizer of hunyuan_image/tiny_text.py: valid ids for the 152,064 rows) and
    vae/hunyuan_image_2.1_vae_fp16.safetensors (the 405.6 M VAE in Tencent's names, fp16, no metadata)."""
    import dataclasses

    from diffusers import AutoencoderKLHunyuanImage
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2Config, Qwen2ForCausalLM
    from transformers import T5Config, T5EncoderModel

    from library.models.hunyuan_image.model import HUNYUAN_IMAGE, HunyuanImage
    from library.models.hunyuan_image.spec import FP8
    from library.models.hunyuan_image.text_encoder import BYT5_SMALL_GLYPH_CONFIG
    from library.models.hunyuan_image.vae import HUNYUAN_IMAGE_VAE_CONFIG, diffusers_to_single_file
    from library.models.llm import QWEN2_5_7B
    from library.models.tiny_files import build_qwen_tokenizer
    from library.precision.fp8 import is_high_precision

    for folder in ("dit", "text_encoders", "vae"):
        os.makedirs(os.path.join(work, folder), exist_ok=True)
    config = dataclasses.replace(HUNYUAN_IMAGE, depth=double_blocks, depth_single=single_blocks)
    dit = meta_shapes(lambda: HunyuanImage(config))
    if fp8_scaled:
        linears = {f"{n}.weight" for n, m in meta_modules(lambda: HunyuanImage(config))
                   if isinstance(m, torch.nn.Linear)}
        write_fp8_scaled_random(os.path.join(work, HUNYUAN_IMAGE_FP8_FILE), dit, 1,
                                lambda k: k in linears and not is_high_precision(k[: -len(".weight")], FP8))
    else:
        write_random(os.path.join(work, HUNYUAN_IMAGE_FILE), dit, 1, metadata={})

    tokenizer = build_qwen_tokenizer(vision_templates=())
    hf = {**QWEN2_5_7B.to_hf(), "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    llm = meta_shapes(lambda: Qwen2ForCausalLM(Qwen2Config(**{k: v for k, v in hf.items() if k != "architectures"})))
    read = re.compile(r"model\.(embed_tokens\.|layers\.([0-9]|1[0-9]|2[0-5])\.)")  # hidden_states[-3] of 28
    vision = Qwen2_5_VLConfig(vision_config=QWEN2_5_VL_7B_VISION)
    visual = {"visual." + k.removeprefix("model.visual."): v for k, v in
              meta_shapes(lambda: Qwen2_5_VLForConditionalGeneration(vision)).items() if k.startswith("model.visual.")}
    drawn = {k: v for k, v in llm.items() if read.match(k)}
    write_random_with_holes(os.path.join(work, HUNYUAN_IMAGE_TEXT_FILE), drawn,
                            {**{k: v for k, v in llm.items() if k not in drawn}, **visual}, 3)
    save_tokenizer(tokenizer, os.path.join(work, "tokenizer"))

    byt5 = meta_shapes(lambda: T5EncoderModel(T5Config(**BYT5_SMALL_GLYPH_CONFIG)))
    write_random(os.path.join(work, HUNYUAN_IMAGE_GLYPH_FILE),
                 {k: v for k, v in byt5.items() if k != "encoder.embed_tokens.weight"}, 4, metadata={},
                 dtype=torch.float16)
    with torch.device("meta"):
        vae = AutoencoderKLHunyuanImage(**HUNYUAN_IMAGE_VAE_CONFIG).state_dict()
    write_random(os.path.join(work, HUNYUAN_IMAGE_VAE_FILE),
                 {k: tuple(v.shape) for k, v in diffusers_to_single_file(vae, HUNYUAN_IMAGE_VAE_CONFIG).items()}, 2,
                 metadata={}, dtype=torch.float16)


def meta_modules(build) -> list[tuple[str, torch.nn.Module]]:
    with torch.device("meta"):
        module = build()
    return list(module.named_modules())


# ----------------------------------------------------------------------------------------------
# SD3 / SD3.5

# stabilityai/stable-diffusion-3.5-large's (and -medium's) layout, as configs/sd3.toml names it: the SAI single file at
# the repo's root, text_encoders/ beside it, the repo's tokenizer*/ and vae/ folders
SD3_FILES = {"large": "sd3.5_large.safetensors", "medium": "sd3.5_medium.safetensors"}
SD3_TEXT_FILES = {"clip_l": "text_encoders/clip_l.safetensors", "clip_g": "text_encoders/clip_g.safetensors",
                  "t5xxl": "text_encoders/t5xxl_fp16.safetensors"}


def sd3_release_config(release: str, blocks: int | None = None):
    """SD35_LARGE or SD35_MEDIUM, with `blocks` of its joint blocks (None: all; MMDiT-X's attn2 blocks kept below
    the last)."""
    import dataclasses

    from library.models.sd3.model import SD35_LARGE, SD35_MEDIUM

    config = {"large": SD35_LARGE, "medium": SD35_MEDIUM}[release]
    if blocks is None or blocks == config.depth:
        return config
    dual = tuple(i for i in config.dual_attention_layers if i < blocks - 1)
    return dataclasses.replace(config, depth=blocks, dual_attention_layers=dual)


def write_clip_t5_files(work: str, files: dict[str, str], clip_positions: int = 77) -> None:
    """CLIP-L and CLIP-G (with their projections, `clip_positions` positions: Long-CLIP's 248 for HiDream-I1) and
    T5-XXL's encoder as fp16 single files without config.json at files["clip_l" / "clip_g" / "t5xxl"] under `work`,
    the repos' tokenizer/, tokenizer_2/ (pad "!") and tokenizer_3/ beside them."""
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    from library.models.text_encoders import CLIP_G_CONFIG, CLIP_L_CONFIG, T5_XXL_CONFIG
    from library.models.tiny_files import build_clip_tokenizer, build_t5_tokenizer

    tokenizer_l, tokenizer_g = build_clip_tokenizer(), build_clip_tokenizer()
    tokenizer_g.pad_token = "!"  # the released tokenizer_2/'s pad (id 0)
    for seed, (name, released, tokenizer, folder) in enumerate((
            ("clip_l", CLIP_L_CONFIG, tokenizer_l, "tokenizer"), ("clip_g", CLIP_G_CONFIG, tokenizer_g, "tokenizer_2")),
            start=3):
        config = CLIPTextConfig(**{**released, "max_position_embeddings": clip_positions})
        shapes = meta_shapes(lambda: CLIPTextModelWithProjection(config))
        tensors = {k: v for k, v in shapes.items() if not k.endswith("position_ids")}
        write_random(os.path.join(work, files[name]), tensors, seed, metadata={}, dtype=torch.float16)
        save_tokenizer(tokenizer, os.path.join(work, folder))
    t5 = meta_shapes(lambda: T5EncoderModel(T5Config(**T5_XXL_CONFIG)))
    tensors = {k: v for k, v in t5.items() if k != "encoder.embed_tokens.weight"}  # tied to shared.weight
    write_random(os.path.join(work, files["t5xxl"]), tensors, 5, metadata={}, dtype=torch.float16)
    save_tokenizer(build_t5_tokenizer(), os.path.join(work, "tokenizer_3"))


def write_sd3_files(work: str, release: str = "medium", blocks: int | None = None):
    """SD3.5-Large or -Medium as people download them (configs/sd3.toml's paths): sd3.5_large.safetensors /
    sd3.5_medium.safetensors (SAI's names under `model.diffusion_model.`, bf16, no metadata: the loader reads the
    config from the shapes) with its `pos_embed` [1, N^2, width] as SAI's grid (the table the loader computes, N 192
    for Large, 384 for Medium: the loader checks it and runs its own float32 window), the qk RMSNorm scales ones;
    text_encoders/clip_l.safetensors (CLIP-L with projection, `text_model.*` + `text_projection.weight`, fp16),
    clip_g.safetensors (CLIP-G with projection, fp16) and t5xxl_fp16.safetensors (`shared.weight` + `encoder.*`,
    fp16), no config.json (the released configs); tokenizer/ (the small CLIP tokenizer, EOT pad), tokenizer_2/ (pad
    "!" as the released one), tokenizer_3/ (the small T5 tokenizer): valid ids for the released vocabularies; vae/
    (the 16-channel AutoencoderKL with SD3's factors as a diffusers folder)."""
    from diffusers import AutoencoderKL

    from library.models.sd3.model import SD3, pos_embed_table
    from library.models.sd3.vae import SD3_VAE_CONFIG

    os.makedirs(os.path.join(work, "text_encoders"), exist_ok=True)
    config = sd3_release_config(release, blocks)
    prefix = "model.diffusion_model."
    dit = {prefix + k: v for k, v in meta_shapes(lambda: SD3(config)).items()}
    table = pos_embed_table(config).to(torch.bfloat16)[None]  # float64 positions -> float32 -> the file's bf16
    write_random(os.path.join(work, SD3_FILES[release]), dit, 1, metadata={}, ones=("ln_q.weight", "ln_k.weight"),
                 extra={prefix + "pos_embed": table})
    del table

    write_clip_t5_files(work, SD3_TEXT_FILES)

    with torch.device("meta"):
        vae = AutoencoderKL(**SD3_VAE_CONFIG)
    folder = os.path.join(work, "vae")
    os.makedirs(folder, exist_ok=True)
    write_random(os.path.join(folder, "diffusion_pytorch_model.safetensors"),
                 {k: tuple(v.shape) for k, v in vae.state_dict().items()}, 2)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"_class_name": "AutoencoderKL", **SD3_VAE_CONFIG}, f, indent=2)


def write_sd3_transformer_holes(path: str, release: str = "large") -> None:
    """The release's whole SAI single file (`model.diffusion_model.`, bf16, no metadata) with its true `pos_embed`
    drawn first and every weight a sparse hole (zeros, no disk): for measuring the full-depth load's memory (fp8
    quantization while loading reads every tensor) where drawing 16 GB is not needed."""
    from library.models.sd3.model import SD3, pos_embed_table

    config = sd3_release_config(release)
    prefix = "model.diffusion_model."
    table = pos_embed_table(config).to(torch.bfloat16)[None].contiguous()
    entries = [Entry(prefix + "pos_embed", torch.bfloat16, tuple(table.shape))]
    entries += [Entry(prefix + k, torch.bfloat16, v) for k, v in meta_shapes(lambda: SD3(config)).items()]
    head = safetensors_header(entries, {})
    with open(path + ".tmp", "wb") as f:
        f.write(head)
        f.write(table.reshape(-1).view(torch.uint8).numpy().data)
        f.truncate(len(head) + sum(e.nbytes for e in entries))
    os.replace(path + ".tmp", path)
    print(f"wrote {path}: {sum(e.nbytes for e in entries) / GiB:.2f} GiB, all but pos_embed a hole", flush=True)


# ----------------------------------------------------------------------------------------------
# HiDream-I1

# Comfy-Org/HiDream-I1_ComfyUI's split_files as configs/hidream.toml's comment names them (diffusion_models/,
# text_encoders/, vae/ae.safetensors), the CLIP / T5 tokenizers in the diffusers repo's tokenizer*/ folders beside
# text_encoders/, and meta-llama/Llama-3.1-8B-Instruct as its transformers folder
HIDREAM_FILE = "diffusion_models/hidream_i1_full_fp16.safetensors"
HIDREAM_FULL_DEPTH_FILE = "diffusion_models/hidream_i1_full_fp16_holes.safetensors"  # every block, every byte a hole
HIDREAM_TEXT_FILES = {"clip_l": "text_encoders/clip_l_hidream.safetensors",
                      "clip_g": "text_encoders/clip_g_hidream.safetensors",
                      "t5xxl": "text_encoders/t5xxl_fp16.safetensors"}
HIDREAM_LLAMA_FOLDER = "Llama-3.1-8B-Instruct"
HIDREAM_VAE_FILE = "vae/ae.safetensors"


def hidream_release_config(double_blocks: int = 16, single_blocks: int = 32):
    """HIDREAM_I1 at its width with `double_blocks` of 16 and `single_blocks` of 32 (the released Llama-layer rule)."""
    import dataclasses

    from library.models.hidream.model import HIDREAM_I1, released_llama_layers

    return dataclasses.replace(HIDREAM_I1, num_layers=double_blocks, num_single_layers=single_blocks,
                               llama_layers=released_llama_layers(double_blocks + single_blocks))


def write_hidream_files(work: str, double_blocks: int = 16, single_blocks: int = 32):
    """HiDream-I1 as people download it (HIDREAM_FILE ...): the transformer as ComfyUI's bare single file (fp16, no
    metadata: the loader reads the config from the shapes) at the released width with `double_blocks` of 16 and
    `single_blocks` of 32; CLIP-L and CLIP-G with their projections as Long-CLIP towers of 248 positions (`text_model.*`
    + `text_projection.weight`, fp16, no config: the released configs, the positions read from the file); T5-XXL's
    encoder (`shared.weight` + `encoder.*`, fp16); tokenizer/, tokenizer_2/ (pad "!"), tokenizer_3/ beside
    text_encoders/ (the small CLIP / T5 tokenizers: valid ids for the released vocabularies); Llama-3.1-8B-Instruct
    as its transformers folder (LlamaForCausalLM at LLAMA3_1_8B's config with the llama3 rope scaling, 4 bf16 shards
    + index, `lm_head.weight` a sparse hole: the text encoder never reads the head; the small Llama-3-style tokenizer
    inside, eos <|eot_id|>); FLUX.1's ae.safetensors in vae/."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from library.models.hidream.model import HiDream
    from library.models.hidream.text_encoder import HIDREAM_CLIP_POSITIONS, LLAMA3_1_8B
    from library.models.hidream.tiny_text import build_llama3_tokenizer

    for folder in ("diffusion_models", "text_encoders", "vae"):
        os.makedirs(os.path.join(work, folder), exist_ok=True)
    config = hidream_release_config(double_blocks, single_blocks)
    write_random(os.path.join(work, HIDREAM_FILE), meta_shapes(lambda: HiDream(config)), 1, metadata={},
                 dtype=torch.float16)
    write_clip_t5_files(work, HIDREAM_TEXT_FILES, HIDREAM_CLIP_POSITIONS)

    tokenizer = build_llama3_tokenizer()
    hf = {**LLAMA3_1_8B.to_hf(), "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    llama = meta_shapes(lambda: LlamaForCausalLM(LlamaConfig(**{k: v for k, v in hf.items() if k != "architectures"})))
    folder = os.path.join(work, HIDREAM_LLAMA_FOLDER)
    write_random_sharded(folder, "model", {k: v for k, v in llama.items() if k != "lm_head.weight"}, 6, 4,
                         holes={"lm_head.weight": llama["lm_head.weight"]})
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({**hf, "torch_dtype": "bfloat16"}, f, indent=2)
    save_tokenizer(tokenizer, folder)
    write_flux_vae(os.path.join(work, "vae"))


def write_hidream_transformer_holes(path: str) -> None:
    """The whole HiDream-I1 single file's header (17.1 B, fp16, bare names, no metadata) with every tensor a sparse
    hole (zeros, no disk): for measuring the full-depth load's memory (fp8 quantization while loading reads every
    tensor) where drawing 34 GB is not needed."""
    from library.models.hidream.model import HiDream

    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_random_with_holes(path, {}, meta_shapes(lambda: HiDream(hidream_release_config())), 1, dtype=torch.float16)


# ----------------------------------------------------------------------------------------------
# HiDream-O1-Image

# Comfy-Org/HiDream-O1-Image's checkpoints/hidream_o1_image_bf16.safetensors, the processor's tokenizer in tokenizer/
# beside it (configs/hidream_o1.toml's single-file layout)
HIDREAM_O1_FILE = "hidream_o1_image_bf16.safetensors"
# The released tokenizer's special tokens at their ids: Qwen2.5 / Qwen3-VL's (<|endoftext|> 151643 ...) and HiDream-O1's
# five after them; a file without metadata is read with the released config, whose tms id is 151673
HIDREAM_O1_TOKEN_IDS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645,
                        "<|vision_start|>": 151652, "<|vision_end|>": 151653, "<|image_pad|>": 151655,
                        "<|video_pad|>": 151656, "<|boi_token|>": 151669, "<|bor_token|>": 151670,
                        "<|eor_token|>": 151671, "<|bot_token|>": 151672, "<|tms_token|>": 151673}


def write_hidream_o1_tokenizer(folder: str) -> None:
    """The tiny HiDream-O1 processor files (hidream_o1/tiny_text.py: its BPE, chat template and added tokens) with
    each special token at its released id (HIDREAM_O1_TOKEN_IDS): tokenizer.json's BPE vocabulary gets them at
    those ids, so the tokenizers library keeps them there (an added token's own id it would renumber after the
    vocabulary's). The learned tokens keep their small ids, valid for the 151,936 rows; the template's text
    tokenizes as before, only the special ids differ."""
    from library.models.hidream_o1.tiny_text import build_hidream_o1_tokenizer, save_hidream_o1_processor

    tokenizer = build_hidream_o1_tokenizer()
    special = [t.content for t in tokenizer.added_tokens_decoder.values()]
    if sorted(special) != sorted(HIDREAM_O1_TOKEN_IDS):
        raise ValueError(f"the tiny HiDream-O1 tokenizer's special tokens {special} are not "
                         f"{list(HIDREAM_O1_TOKEN_IDS)}")
    save_hidream_o1_processor(folder, tokenizer)
    path = os.path.join(folder, "tokenizer.json")
    with open(path) as f:
        spec = json.load(f)
    spec["model"]["vocab"].update(HIDREAM_O1_TOKEN_IDS)
    for token in spec["added_tokens"]:
        token["id"] = HIDREAM_O1_TOKEN_IDS[token["content"]]
    with open(path, "w") as f:
        json.dump(spec, f, ensure_ascii=False)
    config_path = os.path.join(folder, "tokenizer_config.json")  # its added_tokens_decoder, if any, by the new ids
    with open(config_path) as f:
        config = json.load(f)
    if config.get("added_tokens_decoder"):
        config["added_tokens_decoder"] = {str(HIDREAM_O1_TOKEN_IDS[v["content"]]): v
                                          for v in config["added_tokens_decoder"].values()}
        with open(config_path, "w") as f:
            json.dump(config, f, indent=2)


def write_hidream_o1_files(work: str) -> None:
    """HiDream-O1-Image as people download it for ComfyUI / musubi-tuner: HIDREAM_O1_FILE (Comfy-Org's single file:
    `model.language_model.*`, `model.t_embedder1.*`, `model.x_embedder.*`, `model.final_layer2.*` drawn in bf16,
    HIDREAM_O1's 7,606,169,600 parameters, 14.17 GiB; no lm_head; no metadata: the loader reads the config from
    the shapes) with the vision tower `model.visual.*` at Qwen3-VL-8B's shapes (transformers'
    Qwen3VLForConditionalGeneration with QWEN3_VL_8B_VISION, deepstack mergers included: 576 M parameters, 1.07 GiB)
    listed after them as a sparse hole (the loader skips it: text-to-image never runs it), and tokenizer/ beside it
    (write_hidream_o1_tokenizer: the released special ids)."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from library.models.hidream_o1.model import HIDREAM_O1, HiDreamO1

    os.makedirs(work, exist_ok=True)
    released = Qwen3VLConfig(text_config=QWEN3_VL_8B_TEXT, vision_config=QWEN3_VL_8B_VISION)
    visual = {k: v for k, v in meta_shapes(lambda: Qwen3VLForConditionalGeneration(released)).items()
              if k.startswith("model.visual.")}
    write_random_with_holes(os.path.join(work, HIDREAM_O1_FILE), meta_shapes(lambda: HiDreamO1(HIDREAM_O1)), visual, 1)
    write_hidream_o1_tokenizer(os.path.join(work, "tokenizer"))
