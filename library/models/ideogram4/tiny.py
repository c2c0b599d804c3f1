"""Ideogram 4's tiny real-format files for tests: a diffusers transformer folder in fp32 or in the
released BFL layouts (fp8r, nvfp4), and the original single-file layout (fused `attention.qkv`,
`attention.o`, under a prefix). Which Linears are quantized: every Linear of the blocks (attention,
feed-forward, adaLN), as BFL's quantizer leaves embedders and the final layer in high precision."""

from __future__ import annotations

import re

import torch

from library.io import save_safetensors
from library.models.ideogram4.model import Ideogram4, Ideogram4Config
from library.precision.bfl_weights import quantize_fp8r, quantize_nvfp4

QUANTIZED = re.compile(r"layers\.\d+\..*\.weight")
QUANTIZERS = {"fp8r": quantize_fp8r, "nvfp4": quantize_nvfp4}


def tiny_config() -> Ideogram4Config:
    """2 heads of 64 (M-RoPE sections (6, 5, 5) over 32 frequencies), 2 blocks, 48 text features;
    every Linear width divisible by 16 (nvfp4's block)."""
    return Ideogram4Config(in_channels=128, num_layers=2, attention_head_dim=64, num_attention_heads=2,
                           intermediate_size=96, adaln_dim=32, llm_features_dim=48, mrope_section=(6, 5, 5))


def random_ideogram4(config: Ideogram4Config, seed: int = 0) -> Ideogram4:
    g = torch.Generator().manual_seed(seed)
    model = Ideogram4(config)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.2 * torch.randn(p.shape, generator=g))
    return model.eval()


def quantized(sd: dict[str, torch.Tensor], layout: str) -> dict[str, torch.Tensor]:
    """`sd` as a file of `layout` ("fp32", "fp8r", "nvfp4") stores it: each blocks' Linear weight
    replaced by its quantized tensors."""
    if layout == "fp32":
        return dict(sd)
    out = {}
    for key, tensor in sd.items():
        if QUANTIZED.fullmatch(key) and tensor.dim() == 2:
            out.update({f"{key[: -len('.weight')]}.{leaf}": t for leaf, t in QUANTIZERS[layout](tensor).items()})
        else:
            out[key] = tensor
    return out


def stored_state_dict(model: Ideogram4, layout: str) -> dict[str, torch.Tensor]:
    """The diffusers folder's tensors of `model` in `layout`."""
    return quantized({k: v.detach().clone() for k, v in model.state_dict().items()}, layout)


def original_state_dict(model: Ideogram4, layout: str) -> dict[str, torch.Tensor]:
    """The original single-file tensors: q, k, v rows stacked in `attention.qkv` (quantized as one
    Linear, one global nvfp4 scale), `attention.to_out.0` named `attention.o`."""
    sd, out = {k: v.detach().clone() for k, v in model.state_dict().items()}, {}
    for key, tensor in sd.items():
        if m := re.fullmatch(r"(layers\.\d+\.attention)\.to_q\.weight", key):
            out[f"{m.group(1)}.qkv.weight"] = torch.cat([sd[f"{m.group(1)}.{p}.weight"] for p in ("to_q", "to_k", "to_v")])
        elif not re.search(r"\.attention\.to_[kv]\.", key):
            out[key.replace(".attention.to_out.0.", ".attention.o.")] = tensor
    return quantized(out, layout)


def write_single_file(sd: dict[str, torch.Tensor], path: str, prefix: str = "") -> str:
    save_safetensors({prefix + k: v.contiguous() for k, v in sd.items()}, path)
    return path


# A Qwen3-VL-style chat template for the tiny tokenizer (the released tokenizer carries Qwen3-VL's own;
# the encoder and the pipeline both apply whichever the tokenizer has).
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% for c in m.content %}{{ c.text }}{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TINY_TAPS = (0, 1, 3)  # decoder layers of the tiny 4-layer encoder; 3 is the last (tapped before the final norm)


def write_ideogram4_text_encoder(out: str, seed: int) -> dict[str, str]:
    """text_encoder/ (a transformers Qwen3VLModel: a tiny vision tower and a Qwen3 language model of
    width lm_hidden, 4 layers, head_dim 16, interleaved M-RoPE (2, 3, 3)) and tokenizer/ (the tiny
    Qwen2-style tokenizer with TINY_CHAT_TEMPLATE). Seed offset 41 is this family's."""
    import os

    from transformers import Qwen3VLModel

    from library.models.tiny_files import build_qwen_tokenizer, save_tokenizer, seed_component, tiny_qwen3_vl_config

    tokenizer = build_qwen_tokenizer()
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    seed_component(seed, 41)
    model = Qwen3VLModel(tiny_qwen3_vl_config(tokenizer, 4))
    root = os.path.join(out, "ideogram4")
    folder, tok_folder = os.path.join(root, "text_encoder"), os.path.join(root, "tokenizer")
    model.save_pretrained(folder, safe_serialization=True)
    save_tokenizer(tokenizer, tok_folder)
    return {"ideogram4_text_encoder": folder, "ideogram4_tokenizer": tok_folder}


TINY_TEXT_FEATURES = 2 * 32  # the tiny encoder's taps (0, 3) x its width (family.taps)


def write_ideogram4(out: str, seed: int) -> dict[str, str]:
    """The tiny set's transformer as released: a diffusers folder in BFL nvfp4, with the unconditional
    transformer beside it (fp8r), under ideogram4/ (the text encoder's writer fills the same folder)."""
    import dataclasses
    import os

    from library.models.ideogram4.checkpoint import save_ideogram4_diffusers
    from library.models.tiny_files import seed_component

    seed_component(seed, 40)
    config = dataclasses.replace(tiny_config(), llm_features_dim=TINY_TEXT_FEATURES)
    root = os.path.join(out, "ideogram4")
    save_ideogram4_diffusers(stored_state_dict(random_ideogram4(config, seed), "nvfp4"), config,
                             os.path.join(root, "transformer"))
    save_ideogram4_diffusers(stored_state_dict(random_ideogram4(config, seed + 1), "fp8r"), config,
                             os.path.join(root, "unconditional_transformer"))
    return {"ideogram4": os.path.join(root, "transformer"),
            "ideogram4_unconditional": os.path.join(root, "unconditional_transformer")}


def write_sized_ideogram4(folder: str, hidden: int, depth: int, seed: int) -> str:
    """Ideogram 4 at width `hidden` (heads of 128, M-RoPE (20, 20, 20)), 2 x `depth` blocks, the MLP
    8/3 wide, random N(0, 0.02) weights, as a float32 diffusers folder (the spec's TINY.sized)."""
    import dataclasses
    import os

    from library.models.ideogram4.checkpoint import save_ideogram4_diffusers
    from library.models.tiny_files import random_init

    config = dataclasses.replace(tiny_config(), num_layers=2 * depth, attention_head_dim=128,
                                 num_attention_heads=hidden // 128, intermediate_size=8 * hidden // 3,
                                 mrope_section=(20, 20, 20), llm_features_dim=TINY_TEXT_FEATURES)
    torch.manual_seed(seed)
    path = os.path.join(folder, "ideogram4_sized")
    save_ideogram4_diffusers(random_init(Ideogram4(config), seed).state_dict(), config, path)
    return path
