"""sd-scripts' networks.lora_sd3 network_args that ours names otherwise (the spec's SD_SCRIPTS.lora_args, which
library/training/peers/sd_scripts.py calls): emb_dims, and conv_dim / conv_alpha where emb_dims makes them train the
patch convolution. Read from its code (48d368f).

Its LoRANetwork wraps every Linear of each SingleDiTBlock (a joint block's x_block and context_block: attn.qkv,
attn.proj, MMDiT-X's attn2.qkv / attn2.proj, mlp.fc1 / fc2, adaLN_modulation.1) at network_dim: ours' default, module
for module. Its type ranks (context_attn_dim ... x_mod_dim: "context_block" / "x_block" with "attn" (attn2 too),
"mlp" or "adaLN_modulation" in the kohya name, 0 skipping), train_block_indices (the joint blocks') and the dropouts
are ours by the same names: sd_scripts.py keeps them one by one. emb_dims [context_embedder, t_embedder, x_embedder,
y_embedder, final_layer_adaLN_modulation, final_layer_linear] adds those modules at their own ranks (0: none); ours
ranks the final layer's two Linears by one final_layer_dim (network_reg_dims gives one of them another rank) and
trains no LoRA on x_embedder.proj, the 2x2 patch convolution, which its conv_dim ranks in place of emb_dims' third
rank where both are given (its blocks have no other convolution).
"""

from __future__ import annotations

KEPT, RENAMED, DROPPED, NOT_CARRIED = "kept", "renamed", "dropped", "not carried"  # library/training/peers/rules.py
EMBEDDERS = ("context_embedder", "t_embedder", "x_embedder", "y_embedder", "final_mod", "final_linear")  # its order
FINAL_NAMES = {"final_mod": "final_layer_adaLN_modulation_1", "final_linear": "final_layer_linear"}  # kohya names


def _int(name: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"network_args {name}={text!r}: expected an integer (sd-scripts' int() stops on it)") from None


def emb_dims_of(text: str) -> dict[str, int]:
    """Its "[c, t, x, y, final_mod, final_linear]" (brackets optional) as {EMBEDDERS name: rank}."""
    inner = text.strip()
    if inner.startswith("[") and inner.endswith("]"):
        inner = inner[1:-1]
    dims = [_int("emb_dims", d) for d in inner.split(",")]
    if len(dims) != len(EMBEDDERS):
        raise ValueError(f"network_args emb_dims={text!r}: expected 6 ranks [context_embedder, t_embedder, x_embedder, "
                         f"y_embedder, final_mod, final_linear] (sd-scripts asserts so)")
    return dict(zip(EMBEDDERS, dims))


def network_args_of(args: dict[str, str], network_dim: int) -> tuple[list[str], dict[str, tuple[str, str]]]:
    """Our network_args items for its emb_dims (and conv_dim with it), and a (verdict, why) for each of those read
    here; the rest sd_scripts.py reads one by one (ours' same names)."""
    if "emb_dims" not in args:
        read = {name: (DROPPED, "its joint blocks have no convolution: it trains nothing without emb_dims")
                for name in ("conv_dim", "conv_alpha") if name in args}
        return [], read
    dims = emb_dims_of(args["emb_dims"])
    conv = _int("conv_dim", args["conv_dim"]) if "conv_dim" in args else None
    patch_rank = dims["x_embedder"] if conv is None else conv  # its conv_dim wins for the patch convolution
    items = [f"{name}_dim={dims[name]}" for name in ("context_embedder", "t_embedder", "y_embedder") if dims[name]]
    final = max(dims["final_mod"], dims["final_linear"])
    if final:
        items.append(f"final_layer_dim={final}")
        other = [f"{FINAL_NAMES[name]}={dims[name]}" for name in FINAL_NAMES if dims[name] != final]
        items += [f"network_reg_dims={other[0]}"] if other else []
    said = f"as {', '.join(items)}" if items else "all 0 (none trained, as ours)"
    if patch_rank:
        verdict = (NOT_CARRIED, f"its x_embedder rank {patch_rank} ({'conv_dim' if conv else 'emb_dims'}): ours trains "
                                f"no LoRA on the 2x2 patch convolution; the other ranks are carried {said}")
    else:
        verdict = (RENAMED, said)
    read = {"emb_dims": verdict}
    if "conv_dim" in args:
        read["conv_dim"] = (verdict[0], "its x_embedder's rank (said with emb_dims)") if conv else (DROPPED, "0: none")
    if "conv_alpha" in args:
        read["conv_alpha"] = (DROPPED, "goes with conv_dim" + (", not carried" if conv else " 0: none"))
    return items, read
