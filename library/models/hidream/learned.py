"""HiDream-I1's learned tiny base (spec.LearnedBase; tools/pretrain_tiny_base.py --model_type hidream trains it,
learned/hidream/ ships it): a HiDream-I1 transformer WITH its mixture of experts, as the released single file (the
bare diffusers / ComfyUI names, bf16; our config in the metadata as save_hidream_single_file writes it); FLUX.1's
learned VAE recipe whole (flux1/learned.py: HiDream's VAE IS FLUX.1's AutoencoderKL, its scale and shift included,
so the pretrainer trains the same bytes as learned/flux/ae.safetensors on the same CPU); the tiny set's frozen text
encoders (hidream/tiny_text.py, seed 0): CLIP-L, CLIP-G and T5 in the diffusers repo's layout (text_encoder/ +
tokenizer/, text_encoder_2/ + tokenizer_2/, text_encoder_3/ + tokenizer_3/), Llama 3.1 as its transformers folder
(llama/, its tokenizer inside), T5's and Llama's tokenizers saying model_max_length TEXT_TOKENS (48). Captions are
encoded as the family caches them (HiDreamImagePipeline.encode_prompt): T5's 48 tokens, the Llama's 3 hidden states
of 48 tokens (hidden_states[1:]), both CLIPs' projected pooled outputs (32 + 32); a block sees 16 image tokens
beside 96 carried text tokens and, in each block, 48 of its Llama layer's.

The transformer (DIT): the tiny writer's shapes (hidream/tiny.py: width 128 = 1 head of 128, the released RoPE axes
(64, 32, 32), which a file without metadata implies), 2 double + 2 single blocks, 4 routed experts picked top-2 plus
the shared one as released; the context widths the tiny T5's and Llama's 64, pooled 64; blocks read Llama layers
by the released rule (block i: layer min(i, 2) of the 3 hidden states: 0, 1, 2, 2). torch's init (the gates as
HiDream draws them, the q / k RMSNorm weights ones). 5,091,264 parameters, the feed-forwards most of them: per block
the 4 routed experts' 3 x 128 x 512 (swiglu_width(4 x 128) = 512) = 786,432 (3,145,728 in all), the shared expert's
3 x 128 x 256 = 98,304, a double block's text SwiGLU 3 x 128 x 512; 10.2 MB in bf16 (SD3's learned base 5.1 MB: the
MoE is what a smaller HiDream cannot shed, its expert width fixed at 4 x the width).
"""

from __future__ import annotations

import os

import torch

from library.models import spec as S
from library.models.flux1.learned import VAE_RECIPE as FLUX1_VAE_RECIPE

DOUBLE, SINGLE = 2, 2  # blocks (released 16 + 32)
# T5's and Llama's tokens: the tokenizers' model_max_length, which the pipeline's min(max_sequence_length 128,
# tokenizer_3 / tokenizer_4.model_max_length) and the family honour. The longest caption (a scene with the concept's
# trigger) has 39 T5 and 40 Llama tokens; at 128 each a block saw 16 image + 384 text tokens and a step took ~2.5x
# as long (> 2.4 s at batch 32 on the loaded 2 cores).
TEXT_TOKENS = 48
TEXT_FOLDERS = {"hidream_clip_l": "text_encoder", "hidream_tokenizer": "tokenizer",
                "hidream_clip_g": "text_encoder_2", "hidream_tokenizer_2": "tokenizer_2",
                "hidream_t5xxl": "text_encoder_3", "hidream_tokenizer_3": "tokenizer_3", "hidream_llama": "llama"}


def family(paths: dict[str, str]):
    from library.models.hidream.family import HiDreamFamily

    return HiDreamFamily(paths["pretrained_model_name_or_path"], paths["ae"],
                         **{key: paths[key] for key in HiDreamFamily.text_path_keys})


def write_text_encoders(paths: dict[str, str]) -> None:
    """tiny_text.write_hidream_text_encoders' repo folders and Llama folder (make_tiny_models' seed 0) moved into the
    base's folder (its ComfyUI single-file copies of the same weights dropped)."""
    from library.models.hidream.tiny_text import write_hidream_text_encoders
    from library.models.tiny_files import place_written

    folder = os.path.dirname(paths["clip_l"])
    place_written(write_hidream_text_encoders, 0,
                  {key: os.path.join(folder, name) for key, name in TEXT_FOLDERS.items()})
    for tokenizer in (os.path.join(folder, TEXT_FOLDERS["hidream_tokenizer_3"]), paths["llama"]):
        limit_tokenizer(tokenizer, TEXT_TOKENS)


def limit_tokenizer(folder: str, tokens: int) -> None:
    """Set the tokenizer_config.json's model_max_length in `folder` (TEXT_TOKENS says why)."""
    import json

    from library.models.tiny_files import write_json

    path = os.path.join(folder, "tokenizer_config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    write_json(path, {**config, "model_max_length": tokens})


def new_transformer(text: dict[str, torch.Tensor]):
    """The tiny HiDream (float32, torch's init) of the widths text["t5"] [N, L, D], text["llama"] [N, layers, L, D]
    and text["pooled"] [N, P] give, each block reading its Llama layer by the released rule."""
    from library.models.hidream.model import HiDream, HiDreamConfig, released_llama_layers
    from library.models.hidream.tiny import WIDTH

    llama_states = text["llama"].shape[1]
    return HiDream(HiDreamConfig(
        num_layers=DOUBLE, num_single_layers=SINGLE, num_attention_heads=WIDTH // 128, t5_dim=text["t5"].shape[2],
        llama_dim=text["llama"].shape[3], text_emb_dim=text["pooled"].shape[1],
        llama_layers=released_llama_layers(DOUBLE + SINGLE, llama_states)))


def save_transformer(model, paths: dict[str, str], diffusers: bool) -> None:
    """The released single file (bf16, bare keys, our config in the metadata); with `diffusers` also diffusers'
    transformer/ under diffusers/."""
    from library.models.hidream.checkpoint import save_hidream_diffusers, save_hidream_single_file
    from library.models.tiny_files import save_learned_transformer

    save_learned_transformer(model, paths, diffusers, save_hidream_single_file, save_hidream_diffusers)


LEARNED = S.LearnedBase(
    module=__name__,
    files=(("pretrained_model_name_or_path", "hidream-learned.safetensors"), ("ae", "ae.safetensors"),
           ("clip_l", "text_encoder"), ("clip_g", "text_encoder_2"), ("t5xxl", "text_encoder_3"), ("llama", "llama")),
    config="quickstart_hidream.toml",
    # tests/test_learning.py's concept LoRA, measured (2026-12-02, the 1000-step base at 192/216; a loaded machine), 60
    # steps: 0/18 before, 13/18 after, 10 of 10 kept (134 s with the caching and the renders at a load of 4-7).
    learning_test=(60, 0.5, 0.7),
    **FLUX1_VAE_RECIPE,  # its VAE recipe whole: class, files, learning rate, steps, compiled loss
    # The family's own draw (hidream_shift, k = 3: sigmoid(randn) shifted to 3 s / (1 + 2 s)) favours the high-noise
    # sigmas where a 16-token render's layout is decided: no dit_sampling override. Measured (2026-12-02, seed 0, the
    # VAE and encoders reused, 1 thread, 2 cores shared with other sessions at a load of 4-7): 1000 steps at batch 32
    # (the shipped base; 929 s wall, 715 s CPU, ~0.9 s a step) colour 100%, shape 89%, position 100%: 192 of 216 base
    # prompts right. At 128 text tokens (before TEXT_TOKENS) a step took > 2.4 s on 2 threads.
)
