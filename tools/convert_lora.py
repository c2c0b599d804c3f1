"""Convert a diffusion family's LoRA between kohya, diffusers/PEFT and ComfyUI layouts, and an LLM
LoRA between a kohya file and a PEFT adapter folder.

    python tools/convert_lora.py IN OUT --to kohya|diffusers|comfy|peft [--model_type TYPE] [--alpha X] [--model BASE]

The source layout (kohya `lora_unet_*`, PEFT `transformer.*.lora_A/B`, ComfyUI `diffusion_model.*`)
and the architecture are told from the tensor names: each architecture's spec lists the names only
it has (library/models/<folder>/spec.py, LORA_FILES.markers). An architecture that shares another's
names (LORA_FILES.names_of) is told apart by its markers, its header (model_versions) or its shapes
(`recognise`): networks/lora_arch.py variant_of; --model_type settles a LoRA that names only modules two models have, such
as attention projections.

- Models with BFL names: kohya files use BFL module names (`double_blocks.0.img_attn.qkv`),
  diffusers files diffusers names (`transformer_blocks.0.attn.to_q`). Fused modules are split by
  output rows (the down matrix is shared) or joined back, through the family's module map
  (LORA_FILES.module_map), sized from the LoRA's own block indices and shapes.
- Models with diffusers names: the module names are the same; only the prefix changes.
- --to comfy (the families whose spec lists the layout): `diffusion_model.<path>.lora_A/B` as
  ai-toolkit writes it, alpha folded as for diffusers, each path one that ComfyUI's LoRA key map
  (comfy/lora.py model_lora_keys_unet) takes: the BFL names for models with them, else ours (for a
  model whose ComfyUI twin fuses q / k / v, ComfyUI patches them into the fused rows). A LoRA in
  ComfyUI's own names of such a model (kohya or dotted) reads as ours, a fused module split by rows
  (the spec's LORA_FILES.comfy_map); for a model ComfyUI renames (its key map taking its own names only), --to
  comfy writes those (LORA_FILES.comfy_names), and where it fuses modules ours has apart, the fused ones
  (LORA_FILES.comfy_fuse: a fused attention qkv).

Alpha: a kohya file stores it per module (`.alpha`); a diffusers/PEFT file written by diffusers
stores its adapter config in the safetensors header (`lora_adapter_metadata`, lora_alpha /
alpha_pattern / use_rslora). kohya output keeps alpha (or sets it to --alpha, rescaling up so the
delta is unchanged); diffusers output has alpha/rank folded into lora_B (float32 math), since a PEFT
file without an adapter config is loaded with scale 1. A PEFT file with neither is read as alpha =
rank (what diffusers does) with a warning. Tensors keep the source dtype.

LLM (Llama / Qwen2): kohya files (`lora_te_model_layers_0_self_attn_q_proj...`, what train_lora.py
wrote before PEFT folders became the default) <-> PEFT adapter folders (`OUT/adapter_config.json` +
`OUT/adapter_model.safetensors`, keys `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`,
what PeftModel.from_pretrained, vLLM and llama.cpp's convert_lora_to_gguf.py read). Nothing is folded:
the PEFT config carries lora_alpha (the most common alpha) and r, with rank_pattern / alpha_pattern
for modules that differ, so kohya -> PEFT -> kohya gives back the same tensors bit for bit. Its lora_dropout
is the dropout the LoRA trained with (a PEFT source's own, sd-scripts' ss_network_dropout, or the `dropout` of
ss_network_args, where our trainer's network_dropout goes), and its base_model_name_or_path --model's, as
training writes it (a local base: its folder, absolute; a hub id as given); without --model a PEFT source's
own, else the header's ss_sd_model_name (a local base's folder name only). A local vision-language --model
(Qwen2.5-VL, Qwen3-VL, Mistral 3: config.json with vision_config) has its modules named at model.language_model,
as training names them for it.

A mixture's packed experts (a LoRA of [E, K, N] weights: networks/lora_packed.py) are in PEFT's ParamWrapper layout in
every layout (lora_down = lora_A [r E, N], lora_up = lora_B [K, r E]): converting renames their keys and folds alpha /
r into lora_B, r per expert from the header's expert counts (lora_packed_experts), which a file without them is
refused for.

DoRA: the magnitude travels along (`dora_scale` [out, 1] in kohya and ComfyUI files, which is what
ComfyUI reads, `lora_magnitude_vector` [out] in diffusers/PEFT files); it is per output row, so fused modules split and join exactly
(joining needs every part).

LyCORIS (LoKr, LoHa, ...): --to comfy writes `diffusion_model.<path>.lokr_w1` (LoHa: `.hada_w1_a`) ... (tensors
and alpha as they are, the path as for a LoRA), ai-toolkit's layout, which diffusers converts for the families whose
spec names diffusers_lokr (a fused qkv of BFL names included: it fuses the model's q / k / v for it). Other families
are refused: diffusers loads no LoKr for them and ComfyUI reads the file as saved. The other layouts are refused with
the reason: a Kronecker or Hadamard factor is no down / up pair.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys

if __package__ in (None, ""):  # run as a script: make `library` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from library.models.registry import FAMILIES, OTHER_ARCHS  # noqa: E402
from tools.cli import Parser, check_command_line, exit_without_collecting  # noqa: E402


# musubi-tuner's convert_lora.py flags -> ours
PEER_FLAGS = {"--input": "the first argument (input)", "--output": "the second argument (output)",
              "--target": "--to (musubi-tuner's default: kohya; other: comfy, its diffusion_model.* names; other "
                          "with --diffusers_prefix transformer: diffusers)",
              "--diffusers_prefix": "--to comfy (diffusion_model.*) or --to diffusers (transformer.*)"}


def build_parser() -> Parser:
    parser = Parser(description=__doc__.split("\n\n")[0], peer_flags=PEER_FLAGS)
    parser.add_argument("input", help="LoRA .safetensors (kohya, PEFT/diffusers or ComfyUI) or PEFT adapter folder (LLM)")
    parser.add_argument("output", help="converted LoRA .safetensors, or the PEFT adapter folder for --to peft")
    parser.add_argument("--to", required=True, choices=["kohya", "diffusers", "comfy", "peft"],
                        help="comfy: ComfyUI's diffusion_model.* (the families that list it); peft: LLM LoRAs only")
    parser.add_argument("--model_type", choices=[*FAMILIES, *OTHER_ARCHS], default=None,
                        help="default: told from the names (where two architectures share names, also metadata "
                             "and shapes); a variant's LoRA has its base architecture's layout")
    parser.add_argument("--alpha", type=float, default=None, help="kohya output: store this alpha (up rescaled)")
    parser.add_argument("--model", default=None,
                        help="--to peft: the base LLM (its folder, .safetensors or index file, or a hub id 'org/name') "
                             "that adapter_config.json's base_model_name_or_path names (a local one: its folder, "
                             "absolute, as training writes it); default: the source's own, else its ss_sd_model_name")
    return parser


# The arguments are checked before torch and the library load (seconds): --help and a bad flag answer at once.
if __name__ == "__main__":
    check_command_line(build_parser)

from library.io import CheckpointError  # noqa: E402
from library.models.llm_lora_files import NESTED, nested_path, nests_language_model, peft_base_path  # noqa: E402
from library.models.family import lora_arch  # noqa: E402
from library.models.registry import arch_spec  # noqa: E402
from library.models.spec import load_symbol  # noqa: E402
from networks.lora_files import (  # noqa: E402
    ADAPTER_METADATA_KEY,
    FOLDED_MARK,
    KOHYA_TEXT_ENCODERS,
    LYCORIS_COMFY_PREFIX,
    PACKED_EXPERTS_KEY,
    LoRAWeights,
    beside_lora_note,
    comfy_state_dict,
    detect_format,
    dim_and_alpha,
    kohya_state_dict,
    lycoris_kind,
    lycoris_kohya_names,
    naming,
    packed_experts_header,
    peft_alpha_known,
    peft_state_dict,
    read_lora_tensors,
    refuse_non_finite_tensors,
    rescaled_up,
    split_beside_lora,
    split_text_encoders,
    text_encoder_note,
    write_lora_tensors,
)
from networks.lora_peft_folder import write_peft_folder  # noqa: E402
from networks.lora_module_map import bfl_to_diffusers, diffusers_to_bfl  # noqa: E402
from networks.lora_reader import lora_in_our_names, lycoris_module_paths  # noqa: E402
from networks.lycoris_network import is_lycoris_file  # noqa: E402
from networks.lora_arch import detect_arch, lora_files, module_of_key, text_encoder_labels, title_list  # noqa: E402
from tools.lora_common import (check_finite, check_output_path, check_peft_folder_output, layout_name,  # noqa: E402
                               warn_unknown_peft_alpha)

DROPPED_METADATA = ("sshs_model_hash", ADAPTER_METADATA_KEY, FOLDED_MARK, "format")
LAYOUT_ADVICE = {"diffusers": "--to diffusers", "comfy": "--to comfy", "peft": "--to peft (a PEFT adapter folder)"}


# ----------------------------------------------------------------------------------------------
# Conversion


def read_source(path: str, tensors: dict, metadata: dict, adapter_config: dict | None, model_type: str | None):
    """A LoRA's tensors (read_lora_tensors) -> (weights by dotted module path, metadata, format, model type (its
    arch), alpha known?, block counts, the text encoders' tensors as read: split_text_encoders). The layouts are
    read by networks/lora_reader.py, the reader every LoRA-applying tool shares."""
    tensors, te = split_text_encoders(tensors)
    if te and not tensors:
        raise CheckpointError(f"{path}: holds only {text_encoder_note(te, text_encoder_labels(model_type))}; convert_lora converts a transformer's LoRA")
    tensors, diffs = split_beside_lora(tensors)
    if diffs:
        print(f"warning: {path}: left out {beside_lora_note(diffs)}: convert_lora writes the down/up modules only",
              file=sys.stderr)
    try:
        detect_format(tensors)  # a key of no layout is named before the architecture is looked for
        model_type = model_type or detect_arch(tensors, metadata)
    except CheckpointError as e:
        raise naming(path, e) from None
    weights, fmt, counts, _ = lora_in_our_names(tensors, metadata, adapter_config, model_type, source=path)
    refuse_unsized_packed(weights, model_type, path)
    fmt = layout_name(tensors, fmt)  # the --to name: a ComfyUI file's lora_A / lora_B keys are no PEFT adapter's
    return weights, metadata, fmt, model_type, peft_alpha_known(tensors, metadata, adapter_config), counts, te


def refuse_unsized_packed(weights: dict[str, LoRAWeights], model_type: str, path: str) -> None:
    """A module of a packed weight (the spec's LoRATargets.packed_types) whose expert count the header does not say
    (PACKED_EXPERTS_KEY) is a CheckpointError: its rank r and scale alpha / r are unknown (the shapes hold r E)."""
    lora = arch_spec(model_type).lora
    packed = [re.compile(lora.targets[t]) for t in lora.packed_types] if lora else []
    if unsized := next((p for p, w in weights.items() if not w.experts and any(r.fullmatch(p) for r in packed)), None):
        raise CheckpointError(f"{path}: module '{unsized}' is a packed weight's LoRA and the header names no expert "
                              f"count ({PACKED_EXPERTS_KEY}): its rank per expert is unknown; load it on the model "
                              f"(networks read the count from the weight) or restore the header")


# A diverged training's NaN / inf, refused as every other LoRA tool refuses it (convert_lora wrote it on, exit 0)
NOT_CONVERTED = "which convert_lora cannot work on"


def lycoris_refusal(tensors: dict) -> str:
    """Why the LyCORIS file of `tensors` does not convert, naming its kind and first key part as the file holds
    them (a LoHa's hada_w1_a: a fixed lokr_w1 misnamed it) and the models diffusers loads LoKr for (from the specs)."""
    files = lora_files()
    loaded = [f.diffusers_lokr for f in files.values() if f.diffusers_lokr]
    not_loaded = [arch_spec(a).title for a, f in files.items() if "diffusers" in f.layouts and not f.diffusers_lokr]
    parts = sorted(key.rsplit(".", 1)[-1] for key in tensors if lycoris_kind(key))
    kinds = "/".join(sorted({lycoris_kind(part) for part in parts}))
    return (f"a LyCORIS file ({kinds}) has no kohya/diffusers LoRA form: its own keys (lora_unet_*.{parts[0]} ...) "
            f"are what ComfyUI and LyCORIS load; diffusers 0.42.1 loads LoKr only for {' and '.join(loaded)} (not "
            f"{title_list(not_loaded)}), in ai-toolkit's diffusion_model.* names: --to comfy writes those for them; "
            f"else merge it with tools/merge_lora.py")


def convert_lycoris(src: str, dst: str, to: str, tensors: dict, metadata: dict, model_type: str | None) -> dict:
    """A LyCORIS file in ai-toolkit's names, `diffusion_model.<module path>.<part>` (--to comfy, the families whose
    spec names diffusers_lokr): the tensors and alphas as they are, each kohya name resolved to its path by the
    readers' resolution (our names: the BFL ones for models with them, as ComfyUI's key map takes them). diffusers
    converts LoKr from these names (lora_state_dict's is_lokr branches: alpha baked in as LyCORIS scales);
    ComfyUI reads LyCORIS keys under any name its key map takes. A LyCORIS factor is no rows of a fused module's,
    so the other layouts are refused with the reason."""
    if to != "comfy":
        raise CheckpointError(f"{src}: {lycoris_refusal(tensors)}")
    tensors, te = split_text_encoders(lycoris_kohya_names(tensors))  # a converted file converts again
    try:
        model_type = model_type or detect_arch(tensors, metadata)
    except CheckpointError as e:
        raise naming(src, e) from None
    if not getattr(lora_files().get(model_type), "diffusers_lokr", None):  # names a header does not settle: --model_type
        title = arch_spec(model_type).title
        raise CheckpointError(f"{src}: read as {title}'s: {lycoris_refusal(tensors)}")
    if te:
        print(f"warning: {src}: left out {text_encoder_note(te, text_encoder_labels(model_type))}: --to comfy holds the "
              f"transformer's modules only", file=sys.stderr)
    paths = lycoris_module_paths(tensors, model_type, src)
    out = {}
    for key, tensor in tensors.items():
        module = module_of_key(key)
        out[LYCORIS_COMFY_PREFIX + paths[module] + key[len(module) :]] = tensor  # `.lokr_w1`, `.alpha` ... as they are
    header = {k: v for k, v in metadata.items() if k not in DROPPED_METADATA}
    write_lora_tensors(out, dst, {**header, "lora_converted_from": "lycoris"})
    return {"from": "lycoris", "to": to, "model_type": model_type, "modules": len(paths), "scale_known": True}


def with_alpha(weights: dict[str, LoRAWeights], alpha: float) -> dict[str, LoRAWeights]:
    """Same deltas with every alpha set to `alpha`: up *= old_alpha / alpha (float32 math). An up that
    this leaves non-finite in its dtype (a tiny alpha) is an error: it was written as inf."""
    out = {}
    for p, w in weights.items():
        if (up := rescaled_up(w.up, w.alpha / alpha, w.up.dtype)) is None:
            raise ValueError(f"--alpha {alpha:g}: module {p}'s lora_up times its alpha {w.alpha:g} / {alpha:g} "
                             f"overflows {str(w.up.dtype).removeprefix('torch.')}; give an alpha nearer the file's")
        out[p] = dataclasses.replace(w, up=up, alpha=alpha)
    return out


def check_destination(src: str, dst: str, to: str) -> None:
    """`dst` never replaces or holds the input: a .safetensors file that is not `src` (nor the
    weights of a PEFT folder `src`), or for --to peft a folder that neither is `src` nor contains it
    (the folder is replaced whole), nor holds other files than a PEFT adapter's."""
    if to != "peft":
        check_output_path(dst, src, flag="output")
        return
    if dst.endswith((".safetensors", ".gguf")) or (os.path.exists(dst) and not os.path.isdir(dst)):
        raise ValueError(f"output {dst}: --to peft writes a PEFT adapter folder; expected a folder name, not a file")
    check_peft_folder_output(dst, src, flag="output")


def convert_lora(src: str, dst: str, to: str, model_type: str | None = None, alpha: float | None = None,
                 base_model: str | None = None) -> dict:
    """Convert `src` to layout `to` ("kohya" | "diffusers" | "comfy" | "peft") at `dst`; returns what was done.
    base_model: --model, the base a PEFT folder names (given_base)."""
    if to not in ("kohya", "diffusers", "comfy", "peft"):
        raise ValueError(f"--to {to!r}: expected kohya, diffusers, comfy or peft")
    if alpha is not None and (to != "kohya" or not 0 < alpha < float("inf")):  # inf rescaled every up to 0
        raise ValueError(f"--alpha {alpha}: only for --to kohya, and must be a finite number > 0 (diffusers output "
                         f"has alpha folded in)")
    base_model = given_base(base_model, to)  # before the LoRA is read: a typo fails at once
    check_destination(src, dst, to)
    model_type = model_type and lora_arch(model_type)
    tensors, metadata, adapter_config = read_lora_tensors(src)  # a file, or a PEFT adapter folder
    if is_lycoris_file(tensors):
        refuse_non_finite_tensors(tensors, src, NOT_CONVERTED)
        return convert_lycoris(src, dst, to, tensors, metadata, model_type)
    weights, metadata, fmt, model_type, known, counts, te = read_source(src, tensors, metadata, adapter_config, model_type)
    check_finite(weights, src, "convert_lora")
    refuse_non_finite_tensors(te, src, NOT_CONVERTED)  # a LoRA's factors by check_finite, above
    kept_te = {k: v for k, v in te.items() if k.startswith(KOHYA_TEXT_ENCODERS)} if to == "kohya" else {}
    if left_te := {k: v for k, v in te.items() if k not in kept_te}:
        print(f"warning: {src}: left out {text_encoder_note(left_te, text_encoder_labels(model_type))}: --to {to} holds the transformer's modules only "
              "(--to kohya keeps sd-scripts' lora_te1_ / lora_te2_ / lora_te3_)", file=sys.stderr)  # fmt: skip
    files = lora_files()[model_type]
    if to not in files.layouts:
        want = " or ".join(LAYOUT_ADVICE[layout] for layout in files.layouts if layout != "kohya")
        raise ValueError(f"--to {to}: {arch_spec(model_type).title} LoRAs convert with {want} or --to kohya")
    if not known:
        warn_unknown_peft_alpha(src, "converting")
    dtype = next(iter(weights.values())).down.dtype
    if to == "diffusers" and files.diffusers_refuses and (why := load_symbol(files.diffusers_refuses)(list(weights))):
        raise ValueError(f"--to diffusers: {src}: {why}")
    if files.module_map:
        module_map = load_symbol(files.module_map)(weights, counts)
        bfl_named = all(p in module_map for p in weights)
        if to in ("kohya", "comfy") and not bfl_named:  # ComfyUI's models have the BFL names
            weights = diffusers_to_bfl(weights, module_map)
        elif to == "diffusers" and bfl_named:
            weights = bfl_to_diffusers(weights, module_map)
        elif to == "diffusers":  # already diffusers' names, each of them (one left in ours was written as it was)
            theirs = {name for parts in module_map.values() for name, _, _ in parts}
            if unmapped := [p for p in weights if p not in theirs]:
                raise ValueError(f"--to diffusers: {src}: module '{unmapped[0]}' has no diffusers name in the "
                                 f"{arch_spec(model_type).title} module map ({len(unmapped)} such)")
    weights = with_alpha(weights, alpha) if alpha else weights
    if to == "comfy" and files.comfy_names:  # ComfyUI's model renames ours: its key map takes its own names only
        rename = load_symbol(files.comfy_names)
        weights = {rename(p): w for p, w in weights.items()}
    if to == "comfy" and files.comfy_fuse:  # ComfyUI's model fuses modules ours has apart (an attention qkv)
        fused = load_symbol(files.comfy_fuse)(weights, counts)
        if not all(p in fused for p in weights):  # already in its names (ai-toolkit's file): as they are
            weights = diffusers_to_bfl(weights, fused)
    header = {k: v for k, v in metadata.items() if k not in DROPPED_METADATA}
    header["lora_converted_from"] = fmt
    if {"ss_network_dim", "ss_network_alpha"} & set(header):  # parts joined (rank summed) or --alpha: as written
        header["ss_network_dim"], header["ss_network_alpha"] = dim_and_alpha([w.rank for w in weights.values()],
                                                                             [w.alpha for w in weights.values()])
    if to == "kohya":
        prefix = arch_spec(model_type).lora.kohya_prefix  # what networks/lora.py writes
        tensors = kohya_state_dict(weights, dtype, prefix)
        header.update(packed_experts_header(weights))
        write_lora_tensors({**tensors, **kept_te}, dst, header)  # sd-scripts' text-encoder modules as they were
    elif to == "peft":
        write_peft_folder(names_in_base(weights, base_model), dst, dtype=dtype, metadata=header,
                          base_model=base_model or source_base(src, metadata, adapter_config),
                          lora_dropout=trained_dropout(src, metadata, adapter_config))
    else:  # alpha / rank folded into lora_B; comfy: DoRA's magnitude named and shaped as ComfyUI reads it
        try:
            tensors = comfy_state_dict(weights, dtype) if to == "comfy" else peft_state_dict(weights, "transformer", dtype)
        except ValueError as e:  # a folded lora_B overflowing the file's dtype
            raise naming(src, e) from None
        write_lora_tensors(tensors, dst, {**header, FOLDED_MARK: "true", **packed_experts_header(weights)})
    return {"from": fmt, "to": to, "model_type": model_type, "modules": len(weights), "scale_known": known}


# A Hugging Face Hub repo id: a name, or an owner and a name ("Qwen/Qwen2.5-0.5B"); a path would have more parts
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def given_base(model: str | None, to: str) -> str | None:
    """--model as adapter_config.json's base_model_name_or_path, as training writes it: a local base (its folder,
    its .safetensors or its index file, config.json beside) as its folder, absolute (peft_base_path); a hub id
    as given. Only for --to peft."""
    if model is None:
        return None
    if to != "peft":
        raise ValueError(f"--model {model}: only for --to peft (the base adapter_config.json names); --to {to} "
                         f"writes no base")
    if os.path.exists(model):
        if not os.path.isfile(os.path.join(peft_base_path(model), "config.json")):
            raise ValueError(f"--model {model}: no config.json beside it; expected the base LLM's folder (or its "
                             f".safetensors / index file)")
        return peft_base_path(model)
    if not HUB_ID.fullmatch(model):
        raise ValueError(f"--model {model}: no such file or folder (nor a hub id, 'org/name')")
    return model


def names_in_base(weights: dict, base_model: str | None) -> dict:
    """Our module paths as --model's class names them, as training saves them: a local vision-language base's
    language model sits at model.language_model (llm_lora_files.nested_path; PeftModel found none of our
    model.layers.N there and the adapter did nothing). A hub id's config is not read: the names stay."""
    folder = base_model if base_model and os.path.isdir(base_model) else None
    if folder is None:
        return weights
    with open(os.path.join(folder, "config.json")) as f:  # given_base checked it is there
        config = json.load(f)
    if not nests_language_model(config):
        return weights
    return {p if p.startswith(NESTED) else nested_path(p): w for p, w in weights.items()}


def source_base(src: str, metadata: dict, adapter_config: dict | None) -> str | None:
    """The base a PEFT folder names without --model: a PEFT source's own, else the header's ss_sd_model_name,
    which for a local base is its folder's name alone (the header keeps no path: networks/lora_metadata.py):
    warned, since from_pretrained reads such a name as a hub id."""
    if (adapter_config or {}).get("base_model_name_or_path"):
        return adapter_config["base_model_name_or_path"]
    name = metadata.get("ss_sd_model_name")
    if name and "/" not in name:
        print(f"warning: {src}: adapter_config.json's base_model_name_or_path is the header's ss_sd_model_name "
              f"{name!r}, a local base's folder name without its path (the header keeps none); pass --model with "
              f"the base's folder for AutoPeftModelForCausalLM to find it", file=sys.stderr)
    return name


def trained_dropout(src: str, metadata: dict, adapter_config: dict | None) -> float:
    """adapter_config.json's lora_dropout: the dropout the LoRA trained with, as training writes it (networks/lora.py
    save_peft): a PEFT source's own lora_dropout, sd-scripts' ss_network_dropout or the `dropout` of ss_network_args
    (where our network_dropout goes), the first one set; 0.0 for none (sd-scripts writes "None" when unset)."""
    try:
        network_args = json.loads(metadata.get("ss_network_args") or "{}")
    except ValueError:  # a header we do not convert from: its other keys still convert
        network_args = {}
    said = (("adapter_config.json lora_dropout", (adapter_config or {}).get("lora_dropout")),
            ("ss_network_dropout", metadata.get("ss_network_dropout")),
            ("ss_network_args 'dropout'", network_args.get("dropout") if isinstance(network_args, dict) else None))
    for key, value in said:
        if value in (None, "None", ""):
            continue
        try:
            dropout = float(value)
        except (TypeError, ValueError):
            dropout = None
        if dropout is None or not 0 <= dropout < 1:  # nan too
            raise CheckpointError(f"{src}: {key} = {value!r} is no dropout; expected a number in [0, 1)")
        return dropout
    return 0.0


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
        done = convert_lora(args.input, args.output, args.to, args.model_type, args.alpha, args.model)
    except (ValueError, OSError) as e:  # CheckpointError is a ValueError
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print(f"{done['model_type']} LoRA: {done['from']} -> {done['to']}, {done['modules']} modules -> {args.output}")
    return 0


if __name__ == "__main__":
    exit_without_collecting(main)
