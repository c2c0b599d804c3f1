"""sd-scripts' networks.lora_lumina network_args as ours (the spec's SD_SCRIPTS.lora_args, which
library/training/peers/sd_scripts.py calls): which Linears its create_network trains at which rank, read from its
code (48d368f), and our network_args that train the same modules at the same ranks.

Its LoRANetwork wraps every Linear of each JointTransformerBlock (the 26 `layers`, the 2 `noise_refiner` and the 2
`context_refiner` blocks) and of the FinalLayer at network_dim (train_blocks "all", its default); the embedders only
with embedder_dims [x, t, cap]. Its rank arguments (attn_dim, mlp_dim, mod_dim, refiner_dim) are tested in that
order against substrings of a module's kohya name ("attention", "mlp", "modulation", "refiner"), the first one given
that matches setting the rank (0 skips): attn_dim ranks the refiners' attention too, mod_dim the final layer's adaLN,
and "mlp" names no block Linear (the blocks' MLP is `feed_forward`), so mlp_dim ranks only the t_embedder's mlp.0 /
mlp.2, when embedder_dims trains it. train_blocks keeps the block modules whose name holds "layers_" (transformer:
the 26 layers, not the final layer), "noise_refiner", "context_refiner" or either (refiners). It never passes
train_block_indices on. Our modules carry the single file's names, as its (lora_unet_layers_0_attention_qkv), so one
kohya name per kind of module tells that kind's rank: ours' <type>_dim for each type, network_reg_dims for a kind
ranked otherwise than the rest of its type (the context refiners, the final layer's adaLN).
"""

from __future__ import annotations

# Our LoRA types (spec LORA) -> (a kohya name of each kind of module in it, minus lora_unet_; a regex that searches
# every module of that kind's kohya name, for network_reg_dims)
KINDS = {
    "attn": (("layers_0_attention_qkv", r"(^|_)layers_\d+_attention_"),),
    "ff": (("layers_0_feed_forward_w1", r"(^|_)layers_\d+_feed_forward_"),),
    "mod": (("layers_0_adaLN_modulation_1", r"(^|_)layers_\d+_adaLN_modulation_1"),),
    "refiner_attn": (("noise_refiner_0_attention_qkv", r"noise_refiner_\d+_attention_"),
                     ("context_refiner_0_attention_qkv", r"context_refiner_\d+_attention_")),
    "refiner_ff": (("noise_refiner_0_feed_forward_w1", r"noise_refiner_\d+_feed_forward_"),
                   ("context_refiner_0_feed_forward_w1", r"context_refiner_\d+_feed_forward_")),
    "refiner_mod": (("noise_refiner_0_adaLN_modulation_1", r"noise_refiner_\d+_adaLN_modulation_1"),),
    "final_layer": (("final_layer_linear", r"final_layer_linear"),
                    ("final_layer_adaLN_modulation_1", r"final_layer_adaLN_modulation_1")),
    "x_embedder": (("x_embedder", r"x_embedder"),),
    "t_embedder": (("t_embedder_mlp_0", r"t_embedder_mlp_"),),
    "cap_embedder": (("cap_embedder_1", r"cap_embedder_1"),),
}
OURS_ON = ("attn", "ff")  # the types ours trains at network_dim unless told (the rest: with a rank of their own)
RANK_ARGS = (("attn_dim", "attention"), ("mlp_dim", "mlp"), ("mod_dim", "modulation"), ("refiner_dim", "refiner"))
EMBEDDERS = ("x_embedder", "t_embedder", "cap_embedder")  # embedder_dims' order
BLOCK_FILTERS = {"all": ("",), "transformer": ("layers_",), "noise_refiner": ("noise_refiner",),
                 "context_refiner": ("context_refiner",), "refiners": ("noise_refiner", "context_refiner")}
READ = (*(name for name, _ in RANK_ARGS), "embedder_dims", "train_blocks", "split_qkv")


def _int(name: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"network_args {name}={text!r}: expected an integer (sd-scripts' int() stops on it)") from None


def _embedder_dims(text: str | None) -> list[int] | None:
    """Its "[x, t, cap]" (brackets optional), three ranks, as its create_network parses them."""
    if text is None:
        return None
    dims = [_int("embedder_dims", d) for d in text.strip().removeprefix("[").removesuffix("]").split(",")]
    if len(dims) != 3:
        raise ValueError(f"network_args embedder_dims={text!r}: expected 3 ranks [x, t, cap] (sd-scripts asserts so)")
    return dims


def their_rank(name: str, args: dict[str, str], network_dim: int) -> int:
    """The rank networks.lora_lumina's create_network gives the module of kohya name lora_unet_<name> (0: none)."""
    train_blocks = args.get("train_blocks", "all")
    if train_blocks not in BLOCK_FILTERS:
        raise ValueError(f"network_args train_blocks={train_blocks!r}: expected one of {', '.join(BLOCK_FILTERS)} "
                         f"(sd-scripts asserts so)")
    embedders = _embedder_dims(args.get("embedder_dims"))
    embedder = next((i for i, e in enumerate(EMBEDDERS) if name.startswith(e)), None)
    if embedder is not None:  # its embedders: created apart from the blocks, only with embedder_dims
        if embedders is None:
            return 0
        rank = embedders[embedder]
    elif any(word in name for word in BLOCK_FILTERS[train_blocks]):
        rank = network_dim
    else:
        return 0
    ranks = {arg: _int(arg, args[arg]) for arg, _ in RANK_ARGS if arg in args}
    return next((ranks[arg] for arg, word in RANK_ARGS if arg in ranks and word in name), rank)


def network_args_of(args: dict[str, str], network_dim: int) -> tuple[list[str], dict[str, tuple[str, str]]]:
    """Our network_args items that train the modules networks.lora_lumina trains with `args` at their ranks, and a
    (verdict, why) for each of its arguments read here (sd_scripts.py says the rest: dropouts, LoRA+, verbose)."""
    dims, regex_ranks = {}, []
    for mtype, kinds in KINDS.items():
        ranks = [(regex, their_rank(name, args, network_dim)) for name, regex in kinds]
        rank = max(r for _, r in ranks)  # the type's; a kind ranked lower (0: dropped) by network_reg_dims
        if rank != (network_dim if mtype in OURS_ON else 0):
            dims[mtype] = rank
        regex_ranks += [f"{regex}={r}" for regex, r in ranks if r != rank]
    items = []
    if dims.get("mod") == network_dim:
        items.append("train_modulation=true")
        del dims["mod"]
    if "refiner_attn" in dims and dims.get("refiner_attn") == dims.get("refiner_ff"):
        items.append(f"refiner_dim={dims.pop('refiner_attn')}")
        del dims["refiner_ff"]
    items += [f"{mtype}_dim={rank}" for mtype, rank in dims.items()]
    if regex_ranks:
        items.append("network_reg_dims=" + ",".join(regex_ranks))
    return items, {name: _verdict(name, args) for name in READ if name in args}


def _verdict(name: str, args: dict[str, str]) -> tuple[str, str]:
    said = "in our network_args' type ranks (network_args says them)"
    if name == "split_qkv":
        if args[name] != "True":  # its test: the string True only
            return "dropped", "off (sd-scripts turns it on only with the string True)"
        return ("not carried", "its LoRA modules stay fused (create_modules passes no split_dims), so its state_dict "
                               "finds no split q/k/v weights and its first save stops; ours trains the fused qkv")
    if name == "mlp_dim" and "embedder_dims" not in args:
        return "dropped", ("its identifier 'mlp' names no block Linear (the MLP is feed_forward): it ranks only the "
                           "t_embedder's mlp.0 / mlp.2, which it makes only with embedder_dims")
    return "renamed", said
