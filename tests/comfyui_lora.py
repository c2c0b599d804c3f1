"""ComfyUI's LoRA loading restated as a test oracle (ComfyUI is not installed and is not vendored):
which LoRA file keys its key map takes, onto which model weight (and rows), and the weight it computes.

Read in Comfy-Org/ComfyUI (the stored versions; the `fetch` mirror, a125cd84, predates Z-Image):
- comfy/lora.py `model_lora_keys_unet` at ec93dcacb96b922f7cb1417b3ba22bccb082df32 (the Lumina2 branch
  the same at 17358c8f73b581a0d22facc3c385822f09b8bfb1): every model weight `diffusion_model.<p>.weight`
  is the target of `lora_unet_<p, '.' -> '_'>` and `diffusion_model.<p>`; for a Lumina2 model (Z-Image)
  each weight of `comfy.utils.z_image_to_diffusers(unet_config, output_prefix="diffusion_model.")` is
  also the target of `diffusion_model.<d>`, `transformer.<d>`, `lycoris_<d, '.' -> '_'>` and `<d>`.
- comfy/utils.py `z_image_to_diffusers` at 09708eae709a992a5684bed3595ce4d07e705b4e: per block (layers,
  context_refiner, noise_refiner; n_refiner_layers of each, default 2) attention.to_q / to_k / to_v
  -> rows (0, i * dim, dim) of attention.qkv, attention.to_out.0 -> attention.out, norm_q / norm_k ->
  q_norm / k_norm, feed_forward.w1-3 and adaLN_modulation.0 (every block kind) the same names;
  all_x_embedder.2-1 -> x_embedder, all_final_layer.2-1.* -> final_layer.*, cap_embedder / t_embedder
  the same names.
- comfy/lora.py `load_lora` and comfy/weight_adapter/lora.py `LoRAAdapter.load` / `calculate_weight`
  at a125cd84b054a57729b5eecab930ca9408719832: for each key-map name x, `x.alpha`, then the first
  (up, down) pair present of the suffixes below; weight (narrowed to the rows) += alpha / rank * up @
  down (alpha absent: 1), float32; with a `x.dora_scale`, comfy/weight_adapter/base.py `weight_decompose`
  (below). File keys no name consumed are "lora key not loaded".
"""

from __future__ import annotations

import torch

_PAIRS = ((".lora_up.weight", ".lora_down.weight"), ("_lora.up.weight", "_lora.down.weight"),
          (".lora_B.weight", ".lora_A.weight"), (".lora.up.weight", ".lora.down.weight"), (".lora_B", ".lora_A"),
          (".lora_linear_layer.up.weight", ".lora_linear_layer.down.weight"),
          (".lora_B.default.weight", ".lora_A.default.weight"))


def key_map(model_keys, diffusers_map: dict | None = None) -> dict:
    """LoRA name -> target (`diffusion_model.<key>`, or (key, (dim, start, size)) for rows of it), from
    ComfyUI's model keys without the `diffusion_model.` prefix and a family's diffusers table."""
    out = {}
    for key in model_keys:
        if key.endswith(".weight"):
            path = key[: -len(".weight")]
            out[f"lora_unet_{path.replace('.', '_')}"] = out[f"diffusion_model.{path}"] = f"diffusion_model.{key}"
    for d, target in (diffusers_map or {}).items():
        if d.endswith(".weight"):
            path = d[: -len(".weight")]
            for name in (f"diffusion_model.{path}", f"transformer.{path}", f"lycoris_{path.replace('.', '_')}", path):
                out[name] = target
    return out


def z_image_diffusers_map(n_layers: int, dim: int, n_refiner_layers: int = 2) -> dict:
    """Z-Image's diffusers weight names -> ComfyUI's model keys (as z_image_to_diffusers with
    output_prefix "diffusion_model."; weights only, which is all the key map reads)."""
    out = {}
    blocks = ([f"layers.{i}" for i in range(n_layers)] + [f"context_refiner.{i}" for i in range(n_refiner_layers)]
              + [f"noise_refiner.{i}" for i in range(n_refiner_layers)])
    renamed = {"attention.norm_q": "attention.q_norm", "attention.norm_k": "attention.k_norm",
               "attention.to_out.0": "attention.out"}
    same = ("attention_norm1", "attention_norm2", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3",
            "ffn_norm1", "ffn_norm2", "adaLN_modulation.0")
    for block in blocks:
        for i, part in enumerate(("to_q", "to_k", "to_v")):
            out[f"{block}.attention.{part}.weight"] = (f"diffusion_model.{block}.attention.qkv.weight", (0, i * dim, dim))
        for d, c in {**renamed, **{s: s for s in same}}.items():
            out[f"{block}.{d}.weight"] = f"diffusion_model.{block}.{c}.weight"
    basic = {"all_final_layer.2-1.linear": "final_layer.linear",
             "all_final_layer.2-1.adaLN_modulation.1": "final_layer.adaLN_modulation.1",
             "all_x_embedder.2-1": "x_embedder", "cap_embedder.1": "cap_embedder.1",
             "t_embedder.mlp.0": "t_embedder.mlp.0", "t_embedder.mlp.2": "t_embedder.mlp.2"}
    for d, c in basic.items():
        out[f"{d}.weight"] = f"diffusion_model.{c}.weight"
    return out


def load_lora(tensors: dict[str, torch.Tensor], names: dict) -> tuple[dict, set[str]]:
    """-> ({target: (up, down, alpha or None, dora_scale or None)}, the file keys ComfyUI would report
    as not loaded). `x.dora_scale` is the only DoRA magnitude name ComfyUI's load_lora reads."""
    patches, loaded = {}, set()
    for x, target in names.items():
        alpha, dora = tensors.get(f"{x}.alpha"), tensors.get(f"{x}.dora_scale")
        loaded |= {k for k in (f"{x}.alpha", f"{x}.dora_scale") if k in tensors}
        for up, down in _PAIRS:
            if x + up in tensors:
                patches[target] = (tensors[x + up], tensors[x + down], None if alpha is None else float(alpha), dora)
                loaded |= {x + up, x + down}
                break
    return patches, set(tensors) - loaded


def patched(state_dict: dict[str, torch.Tensor], patches: dict, strength: float = 1.0) -> dict[str, torch.Tensor]:
    """ComfyUI's weights (keys without `diffusion_model.`) after the LoRA at `strength`, float32; a
    target the model lacks is an error here (ComfyUI skips it silently)."""
    out = {k: v.float().clone() for k, v in state_dict.items()}
    for target, (up, down, alpha, dora) in patches.items():
        key, rows = (target, None) if isinstance(target, str) else target
        key = key.removeprefix("diffusion_model.")
        weight = out[key] if rows is None else out[key].narrow(*rows)
        scale = 1.0 if alpha is None else alpha / down.shape[0]
        diff = up.float() @ down.float()
        if dora is None:
            weight += strength * scale * diff
        else:
            weight.copy_(weight_decompose(dora.float(), weight, diff, scale, strength))
    return out


def weight_decompose(dora_scale: torch.Tensor, weight: torch.Tensor, diff: torch.Tensor, alpha: float,
                     strength: float) -> torch.Tensor:
    """comfy/weight_adapter/base.py `weight_decompose` (a125cd84, unchanged through v0.3.77), float32: the
    output-axis branch (dora_scale [out, 1], our layout) divides by the norm of the base weight W, not of
    W + dW as DoRA (PEFT, LyCORIS, our merge) does; Comfy-Org/ComfyUI#15458 (open) would change that.
    The input-axis branch ([1, in]) is not restated: we never write it."""
    assert dora_scale.shape[0] == weight.shape[0], "input-axis dora_scale is not restated here"
    calc = weight + alpha * diff
    norm = weight.norm(dim=1, keepdim=True) + torch.finfo(weight.dtype).eps
    calc = calc * (dora_scale / norm)
    return weight + strength * (calc - weight) if strength != 1.0 else calc
