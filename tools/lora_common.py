"""What resize_lora, extract_lora, combine_loras and lora_info share: reading a LoRA file with its
layout, writing modules back in a layout, and the output error of two LoRAs on a (small) model.
The one parser of `path[:ratio]` LoRA arguments is tools/cli.py's parse_lora_spec (torch-free).

A LoRAFile keeps module names as the file spells them: kohya names (`lora_unet_double_blocks_0_
img_attn_qkv`, no model needed to resolve '_') or dotted paths with the prefix (`transformer.`,
`base_model.model.`, `diffusion_model.`) stripped and remembered, so a tool writes its result in
the layout it read. PEFT output has alpha / rank folded into lora_B (float32), as convert_lora
writes it, so every PEFT loader applies the right delta without an adapter config. ComfyUI's own
file of PEFT names (`diffusion_model.` prefix or a DoRA `dora_scale`: convert_lora --to comfy) is
"comfy_peft" and written back so (comfy_state_dict): ComfyUI reads no `lora_magnitude_vector`.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

import torch

if __package__ in (None, ""):  # run as a script: make `library` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from library.io import CheckpointError  # noqa: E402
from library.training.config import PRECISION_DTYPES  # noqa: E402
from networks.lora_files import (  # noqa: E402
    ADAPTER_METADATA_KEY,
    COMFY_PREFIXES,
    FOLDED_MARK,
    PACKED_EXPERTS_KEY,
    PEFT_CONFIG_FILE,
    comfy_state_dict,
    PEFT_PREFIXES,
    TEXT_ENCODER_PREFIXES,
    LoRAWeights,
    _split_key,
    beside_lora_note,
    input_files,
    non_finite_factor,
    parse_lora,
    peft_alpha_known,
    peft_state_dict,
    read_lora_tensors,
    split_beside_lora,
    write_lora_tensors,
)
from networks.lycoris_network import is_lycoris_file  # noqa: E402
from tools.cli import LoRASpec, Parser, one_line, parse_lora_spec  # noqa: E402,F401  (the LoRA tools' parser, error line, --lora)

DROPPED_METADATA = ("sshs_model_hash", "sshs_legacy_hash", ADAPTER_METADATA_KEY, FOLDED_MARK)
NAME_KEYS = ("ss_output_name", "modelspec.title")  # the name A1111 (alias) and SwarmUI (title) list a LoRA by
COMFY_ONLY_PREFIXES = tuple(p for p in COMFY_PREFIXES if p != "transformer.")  # diffusers' prefix is PEFT's too
# diffusers' and ComfyUI's text-encoder modules beside a transformer's (text_encoder.*): no transformer prefix
DOTTED_TEXT_ENCODERS = tuple(p for p in TEXT_ENCODER_PREFIXES if p.endswith("."))


@dataclass
class LoRAFile:
    path: str
    weights: dict[str, LoRAWeights]  # file module name (kohya name, or dotted path without prefix) -> LoRA
    metadata: dict[str, str]
    fmt: str  # "kohya" | "peft" | "comfy" (dotted lora_down / lora_up) | "comfy_peft" (ComfyUI's lora_A / lora_B)
    prefix: str  # stripped from dotted names ("" for kohya)
    dtype: torch.dtype
    shapes: dict[str, torch.Tensor] | None = None  # key -> meta tensor of the file's shape (tells the architecture)
    beside: dict[str, torch.Tensor] = field(default_factory=dict)  # with keep_beside: lora_files.BESIDE_LORA's tensors

    @property
    def has_dora(self) -> bool:
        return any(w.magnitude is not None for w in self.weights.values())


def read_lora_file(path: str, tool: str, keep_beside: bool = False) -> LoRAFile:
    """Read a down/up LoRA (kohya, PEFT/diffusers, ComfyUI; DoRA included) or a PEFT adapter folder
    (its adapter_config.json gives the alphas, also when `path` is the folder's
    adapter_model.safetensors). LyCORIS files are refused with one line naming `tool`; a PEFT file
    whose alpha is stored nowhere is read as alpha = rank with a warning, as convert_lora does. The tensors
    saved beside the LoRA (lora_files.BESIDE_LORA: ComfyUI's .diff_b ...) are left out with a warning, or, with
    keep_beside (a tool writing the file's own layout back), kept in `beside` as they are."""
    tensors, metadata, adapter_config = read_lora_tensors(path)
    tensors, diffs = split_beside_lora(tensors)
    if diffs and not keep_beside:
        print(f"warning: {path}: left out {beside_lora_note(diffs)}: {tool} works on the down/up modules only", file=sys.stderr)
    if is_lycoris_file(tensors):
        raise CheckpointError(f"{path}: a LyCORIS file (LoKr / LoHa / ...): {tool} works on LoRA (down/up) files only; "
                              "merge it into the base with tools/merge_lora.py instead")  # fmt: skip
    if PACKED_EXPERTS_KEY in metadata:  # its modules' ranks and deltas are per expert (networks/lora_packed.py)
        raise CheckpointError(f"{path}: a LoRA of packed experts (header {PACKED_EXPERTS_KEY}): {tool} works on "
                              f"LoRAs of Linears only")
    weights, fmt = parse_lora(tensors, metadata, None, source=path, adapter_config=adapter_config)
    check_finite(weights, path, tool)
    if not peft_alpha_known(tensors, metadata, adapter_config):
        warn_unknown_peft_alpha(path, "reading it")
    prefix = ""
    if fmt != "kohya":  # the transformer's prefix, stripped from its modules (a text encoder's keep their names)
        modules = list(dict.fromkeys(_split_key(k)[0] for k in tensors))
        body = [m for m in modules if not m.startswith(DOTTED_TEXT_ENCODERS)]
        prefixes = PEFT_PREFIXES if fmt == "peft" else COMFY_PREFIXES
        prefix = next((p for p in prefixes if body and all(m.startswith(p) for m in body)), "")
        if prefix and len(body) < len(modules):  # parse_lora kept every name whole: the prefix is not all modules'
            weights = {n if n.startswith(DOTTED_TEXT_ENCODERS) else n[len(prefix) :]: w for n, w in weights.items()}
    if fmt == "peft" and layout_name(tensors, fmt) == "comfy":  # the one rule of a ComfyUI lora_A / lora_B file
        fmt = "comfy_peft"
    dtype = next(iter(weights.values())).down.dtype
    shapes = {k: torch.empty(t.shape, device="meta") for k, t in tensors.items()}
    return LoRAFile(path, weights, dict(metadata), fmt, prefix, dtype, shapes, diffs if keep_beside else {})


def layout_name(keys, fmt: str) -> str:
    """The layout of a file of tensor names `keys` and detect_format's `fmt`, by the names convert_lora's --to takes:
    PEFT keys under ComfyUI's own prefix (or with a DoRA `dora_scale`) are ComfyUI's (--to comfy writes them), under
    `transformer.` diffusers'. detect_format calls every lora_A / lora_B file "peft": a converted ComfyUI file's
    header and line said it came from PEFT."""
    if fmt != "peft":
        return fmt
    modules = [_split_key(k)[0] for k in keys if not k.startswith(DOTTED_TEXT_ENCODERS)]
    comfy_named = bool(modules) and all(m.startswith(COMFY_ONLY_PREFIXES) for m in modules)
    if comfy_named or any(k.endswith(".dora_scale") for k in keys):
        return "comfy"
    return "diffusers" if modules and all(m.startswith("transformer.") for m in modules) else fmt


def check_finite(weights: dict[str, LoRAWeights], path: str, tool: str) -> None:
    """A NaN / inf in a factor (a diverged training's LoRA) is one line naming the module: the SVD of resize and
    combine --mode svd was a traceback (linalg.svd does not converge), concat wrote the NaN into a new file."""
    if problem := non_finite_factor(weights):
        raise CheckpointError(f"{path}: {problem}: a broken LoRA, which {tool} cannot work on")


def warn_unknown_peft_alpha(path: str, doing: str) -> None:
    """The tools' one warning for a PEFT file whose alpha is stored nowhere (peft_alpha_known)."""
    print(f"warning: {path}: PEFT file without '{ADAPTER_METADATA_KEY}' or alphas: the scale is unknown; "
          f"{doing} as alpha = rank (scale 1), which is what diffusers assumes", file=sys.stderr)


def layout_tensors(weights: dict[str, LoRAWeights], fmt: str, prefix: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Modules (named as LoRAFile names them) -> tensors of layout `fmt`; alpha a float32 scalar. A text encoder's
    modules (DOTTED_TEXT_ENCODERS) are written under their own names, without the transformer's prefix."""
    te = {n: w for n, w in weights.items() if n.startswith(DOTTED_TEXT_ENCODERS)}
    if fmt in ("peft", "comfy_peft"):
        body = {n: w for n, w in weights.items() if n not in te}
        if fmt == "peft":
            return {**peft_state_dict(body, prefix.rstrip("."), dtype), **peft_state_dict(te, "", dtype)}
        return {**comfy_state_dict(body, dtype, prefix.rstrip(".")), **comfy_state_dict(te, dtype, "")}
    out = {}
    for name, w in weights.items():
        key = name if name in te else prefix + name
        out[f"{key}.lora_down.weight"] = w.down.detach().to(dtype).contiguous()
        out[f"{key}.lora_up.weight"] = w.up.detach().to(dtype).contiguous()
        out[f"{key}.alpha"] = torch.tensor(float(w.alpha), dtype=torch.float32)
        if w.magnitude is not None:
            out[f"{key}.dora_scale"] = w.magnitude.detach().reshape(-1, 1).to(dtype)
    return out


def write_lora_file(path: str, weights: dict[str, LoRAWeights], fmt: str, prefix: str, dtype: torch.dtype,
                    metadata: dict[str, str], beside: dict[str, torch.Tensor] | None = None) -> None:
    """Atomic write in layout `fmt`; hashes and PEFT alpha headers of the input are dropped (they
    describe other tensors), PEFT output is marked as alpha-folded. beside: tensors written under their own
    keys after the LoRA's (LoRAFile.beside; floating ones in `dtype`)."""
    header = {k: v for k, v in metadata.items() if k not in DROPPED_METADATA}
    if fmt in ("peft", "comfy_peft"):
        header[FOLDED_MARK] = "true"
    extra = {k: t.to(dtype) if t.is_floating_point() else t for k, t in (beside or {}).items()}
    write_lora_tensors({**layout_tensors(weights, fmt, prefix, dtype), **extra}, path, header)


def named_as(metadata: dict[str, str], save_to: str) -> dict[str, str]:
    """The header with the name keys it has (NAME_KEYS) set to the output's: its file or folder name."""
    name = os.path.splitext(os.path.basename(save_to.rstrip(os.sep)))[0]
    return {**metadata, **{k: name for k in NAME_KEYS if k in metadata}}


def save_dtype(name: str | None, default: torch.dtype) -> torch.dtype:
    if name is None:
        return default
    if name not in PRECISION_DTYPES:
        raise ValueError(f"--save_precision {name!r}: expected one of {', '.join(PRECISION_DTYPES)}")
    return PRECISION_DTYPES[name]


def check_output_path(path: str, *inputs: str, flag: str = "--save_to") -> None:
    """The output is a .safetensors file that is none of the inputs (a PEFT adapter folder input
    counts with its adapter_model.safetensors)."""
    if not path.endswith(".safetensors"):
        raise ValueError(f"{flag} {path}: expected a .safetensors file (only safetensors is written)")
    if os.path.exists(path) and any(os.path.samefile(path, f) for f in input_files(inputs)):
        raise ValueError(f"{flag} {path}: is one of the inputs; write the result elsewhere")


def check_peft_folder_output(path: str, *inputs: str, flag: str = "--save_to") -> None:
    """A PEFT adapter folder written at `path` replaces it whole: never a folder that is or holds an input, nor
    one of other files than a PEFT adapter's (a user's `out/` given by mistake)."""
    real = os.path.realpath(path) + os.sep
    held = next((p for p in inputs if (os.path.realpath(p) + os.sep).startswith(real)), None)
    if held is not None:
        raise ValueError(f"{flag} {path}: is or holds the input {held}; write the PEFT folder elsewhere")
    if os.path.isdir(path) and os.listdir(path) and not os.path.isfile(os.path.join(path, PEFT_CONFIG_FILE)):
        raise ValueError(f"{flag} {path}: a folder of other files (no {PEFT_CONFIG_FILE}), which the PEFT folder "
                         f"would replace whole; name a new folder or a PEFT adapter folder")


# ----------------------------------------------------------------------------------------------
# Output error on a model (small models: the forward runs on the CPU in float32)


def load_model(model_path: str, tool: str = "resize_lora"):
    """(model float32 eval, family, forward kwargs) for a checkpoint of a registered family or an LLM;
    `tool` is named where its stored layout is refused (resize_lora --model: output_error's caller)."""
    from tools.merge_base import open_base

    base = open_base(model_path, tool)
    if base.family == "llm":
        from library.models.llm import load_llm

        model = load_llm(base.path)
        ids = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
        return model.eval(), "llm", {"input_ids": ids}
    from tools.precision_doctor import _loader, make_inputs

    model = _loader(base.family)(base.path).eval()
    kwargs = make_inputs(base.family, model.config, 64, 64, seed=0, text_len=16).make_kwargs(0.5)
    return model, base.family, kwargs


def output_error(model_path: str, reference: str):
    """A measure of LoRA files against LoRA `reference` on the model at `model_path`: the model is
    loaded and `reference` applied now (a bad --model is an error before anything is written), then
    measure(candidate) -> {"rel_to_lora_effect": ||y_c - y_r|| / ||y_r - y_base||, "rel_to_output":
    ||y_c - y_r|| / ||y_r||}, each LoRA applied unmerged."""
    from networks.lora import LoRANetwork

    model, family, kwargs = load_model(model_path)

    @torch.no_grad()  # (here: measure runs after this function returned, outside any no_grad of its own)
    def output_with(path: str | None) -> torch.Tensor:
        if path is None:
            return model(**kwargs).float()
        net = LoRANetwork.from_weights(model, family, path)
        net.apply()
        try:
            return model(**kwargs).float()
        finally:
            net.remove()

    base, ref = output_with(None), output_with(reference)

    def measure(candidate: str) -> dict[str, float]:
        diff = float((output_with(candidate) - ref).norm())
        return {"rel_to_lora_effect": diff / max(float((ref - base).norm()), 1e-30),
                "rel_to_output": diff / max(float(ref.norm()), 1e-30)}

    return measure
