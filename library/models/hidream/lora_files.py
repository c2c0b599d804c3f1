"""HiDream-I1 LoRA files: the module paths tools/convert_lora.py, tools/lora_info.py and tools/merge_lora.py check a
LoRA's names against (through the spec's LORA_FILES).

One naming: our modules have the released names, which are diffusers' and ComfyUI's, so a kohya file
(lora_unet_double_stream_blocks_0_block_attn1_to_q), a PEFT file under transformer. (HiDreamImageLoraLoaderMixin) and
ai-toolkit's / ComfyUI's diffusion_model. file name the same modules: converting changes the prefix only.
"""

from __future__ import annotations

import torch

from library.models.hidream.model import HiDream, HiDreamConfig


def module_paths(counts: dict[str, int]) -> list[str]:
    """Every Linear path of a HiDream model with as many double and single blocks as a LoRA names (a small width: only
    the names matter; the released 4 experts)."""
    double, single = counts.get("double_stream_blocks", 0), counts.get("single_stream_blocks", 0)
    config = HiDreamConfig(num_layers=double, num_single_layers=single, attention_head_dim=8, num_attention_heads=1,
                           axes_dims_rope=(4, 2, 2), t5_dim=8, llama_dim=8, text_emb_dim=8,
                           llama_layers=(0,) * (double + single))
    with torch.device("meta"):
        model = HiDream(config)
    return [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
