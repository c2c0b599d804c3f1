"""HiDream-O1-Image's transformer in the tiny real-format model set:

  hidream_o1/hidream-o1-tiny.safetensors   the transformer as Comfy-Org's single file names it (`model.*`), bf16,
                                           with a few tiny `model.visual.*` tensors the loader must skip, and our
                                           config in the metadata (the tiny tokenizer's vocabulary and tms id are
                                           not the released ones, which a file without it would be read as)

Width 64 = 4 query heads / 2 key-value heads of 16 (M-RoPE sections (4, 2, 2): the released proportions,
released_mrope_sections), 2 decoder layers, SwiGLU 128, the bottleneck 64 / 4 = 16; the patch stays the released
32 (3072 values a token: the pixel cache's layout). About 0.4 M parameters, 0.9 MB. Seed offset 140 is this file's
(140-146: the family's).
"""

from __future__ import annotations

import os

from library.models.tiny_files import seed_component

WIDTH, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 64, 2, 4, 2, 16
TINY_VOCAB = 1088  # the tiny tokenizer's ids fit (its writer passes its own size and tms id)
# a few of the vision tower's tensors, as the released file holds them beside the transformer's (tiny shapes)
VISUAL = {"model.visual.patch_embed.proj.weight": (8, 3, 2, 4, 4), "model.visual.blocks.0.norm1.weight": (8,),
          "model.visual.deepstack_merger_list.0.linear_fc2.weight": (WIDTH, 32)}


def tiny_config(vocab_size: int = TINY_VOCAB, tms_token_id: int | None = None):
    """The tiny transformer's config; tms_token_id None: the vocabulary's last id."""
    from library.models.hidream_o1.model import HiDreamO1Config, released_mrope_sections

    return HiDreamO1Config(hidden_size=WIDTH, num_layers=LAYERS, num_heads=HEADS, num_kv_heads=KV_HEADS,
                           head_dim=HEAD_DIM, intermediate_size=2 * WIDTH,
                           mrope_section=released_mrope_sections(HEAD_DIM), vocab_size=vocab_size,
                           bottleneck_dim=WIDTH // 4,
                           tms_token_id=vocab_size - 1 if tms_token_id is None else tms_token_id)


def random_hidream_o1(config):
    """A HiDreamO1 as built (torch's init: final_layer2 is not zero as released, so the output moves) with its
    q / k RMSNorm weights N(1, 0.1) (the released ones are learned), from torch's generator as seeded."""
    import torch

    from library.models.hidream_o1.model import HiDreamO1

    model = HiDreamO1(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and name.endswith(("q_norm.weight", "k_norm.weight")):
                p.normal_(1.0, 0.1)
    return model


def write_tiny_hidream_o1(out: str, seed: int = 0, vocab_size: int = TINY_VOCAB,
                          tms_token_id: int | None = None) -> dict[str, str]:
    """The transformer as Comfy-Org's single file (bf16, `model.*` keys, tiny `model.visual.*` tensors beside) with
    our config in the metadata. vocab_size / tms_token_id: the tiny tokenizer's (None: the last id is tms)."""
    import torch

    from library.models.hidream_o1.checkpoint import save_hidream_o1_single_file

    seed_component(seed, 140)
    config = tiny_config(vocab_size, tms_token_id)
    weights = {k: v.to(torch.bfloat16) for k, v in random_hidream_o1(config).state_dict().items()}
    visual = {k: torch.randn(shape).to(torch.bfloat16) for k, shape in VISUAL.items()}
    path = os.path.join(out, "hidream_o1", "hidream-o1-tiny.safetensors")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_hidream_o1_single_file(weights, path, config, passthrough=visual)
    return {"hidream_o1": path}


def write_hidream_o1(out: str, seed: int) -> dict[str, str]:
    """The tiny set's HiDream-O1: the tokenizer (tiny_text.py) in a tokenizer/ folder beside the transformer's single
    file, where the family finds it as beside Comfy-Org's file; the transformer's vocabulary and tms id are the
    tokenizer's."""
    from library.models.hidream_o1.text_encoder import TMS_TOKEN
    from library.models.hidream_o1.tiny_text import build_hidream_o1_tokenizer, write_hidream_o1_tokenizer

    paths = write_hidream_o1_tokenizer(out, seed)
    tokenizer = build_hidream_o1_tokenizer()
    vocab = -(-len(tokenizer) // 64) * 64  # rounded up, as released vocabularies are padded
    return {**paths, **write_tiny_hidream_o1(out, seed, vocab, tokenizer.convert_tokens_to_ids(TMS_TOKEN))}
