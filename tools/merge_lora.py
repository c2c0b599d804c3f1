"""Merge LoRAs into a base checkpoint, one tensor at a time, and save it in the base's own layout.

    python tools/merge_lora.py --model BASE --lora a.safetensors:0.8 b.safetensors:1.0 --save_to OUT \
        [--save_precision fp32|bf16|fp16|fp8|gguf_q8_0|...] [--fp8_layout comfy|plain|block64] [--[no-]stochastic_rounding] [--seed N]
        [--allow_unmatched]

BASE: a diffusion transformer's single file (ComfyUI prefixes too; bf16, fp8 or scaled fp8) or
diffusers folder (or the pipeline folder holding `transformer/`), or a Hugging Face LLM folder / file.
The architecture is told from the tensor names: each family says which checkpoints are its own and
how they name the model's modules (DiffusionFamily.checkpoint_names). OUT has the layout of BASE: a
file for a file; for a folder, a folder with the same shard names and index plus the folder's small
files (config.json, tokenizer files) copied. A pipeline folder gives a transformer folder.

Each LoRA is `path[:ratio]` (ratio 1 when left out); any layout networks/lora_reader.py reads, the
reader every LoRA-applying tool shares (kohya, OneTrainer's lora_transformer_, PEFT/diffusers, ComfyUI's
layouts and own names; for an LLM also a PEFT adapter folder, read with its adapter_config.json); a
LoRA whose names are another model's is refused naming it as tools/lora_info.py does; one of the model
whose names a variant shares, where the variant's model takes that one's LoRAs (LoRAFiles.takes_base_loras),
merges less the modules the variant lacks, with one warning (header or not, as training reads it). Where a model's
checkpoints come in two namings (BFL names and diffusers'), a LoRA may use either whatever the base's
naming: fused modules (qkv, linear1) are split or joined by row through the family's module map.
The base and each LoRA's deltas by its weight keys: tools/merge_base.py; the plan and the writers: here.

Streaming: the output header is computed up front from shapes and dtypes, then each tensor is read,
merged and written before the next is read, so peak memory is about two tensors of the largest size
(the float32 weight and its output copy) plus the LoRAs, whatever the model size.

DoRA files (`dora_scale` / `lora_magnitude_vector`) merge as W + ratio * (m * (W + dW) / ||W + dW|| - W)
(LoRAWeights.merged); LyCORIS files (LoKr `lokr_w1`..., LoHa `hada_w1_a`...) merge
through LyCORIS' own get_merged_weight (parts of a fused weight, a file's to_q / to_k / to_v into a single
file's qkv, each into its rows; a fused module into a folder's split parts, each its rows of the whole delta).
Whole deltas, `<module>.diff` (a weight, norms' 1-D ones too) and `.diff_b` (a
bias), beside down / up (ComfyUI's Extract and Save Lora) or alone (LyCORIS' full type), merge as ComfyUI patches
them: W + ratio * diff, by rows into or out of a fused module (networks/lora_reader.py WholeDelta). Several LoRAs
are applied in the order given.

A LoRA of a mixture's packed experts ([E, K, N] weights used as x @ W[e]: networks/lora_packed.py) adds each
expert's delta[e] to its weight in float32 (one batched GEMM), in any base and output: a high-precision or fp8 base,
written in high precision or fp8 as a Linear's merged weight is (below).

Precision: a merged weight is W (read in its file dtype, widened to float32) + sum_i ratio_i *
(alpha_i / rank_i) * up_i @ down_i, accumulated in float32; only then is it cast to --save_precision
(default: each tensor keeps its file dtype). fp8 stores float8_e4m3fn Linear weights (round to nearest,
or unbiased stochastic rounding with --stochastic_rounding) in one of three layouts (--fp8_layout):
  comfy    ComfyUI's scaled fp8 (the default for diffusion single files): every Linear weight
           e4m3 with a float32 0-dim `X.scale_weight` (absmax / 448), Linear biases e4m3, other float
           tensors bf16, and the `scaled_fp8` marker (e4m3, 2 elements: ComfyUI's "no fp8 matmul" flag,
           so ComfyUI computes with the dequantized weights rather than fp8-quantized activations).
           ComfyUI builds every Linear of such a model in fp8 (ops.scaled_fp8_ops), so embedders and the
           final layer are quantized too (per tensor) and biases are what ComfyUI would round them to.
  plain    e4m3 Linear weights without scales (sd-scripts' fp8; the default for folders and LLMs);
           modules its architecture's fp8 rules keep and every other float tensor bf16.
  block64  ours (`--save_precision fp8_scaled` is the same): e4m3 + bf16 `X.weight_scale` per 64 input
           columns (library/precision/fp8.py), high-precision modules bf16. Only our loaders read it.
A mixture's packed experts ([E, K, N] weights, no Linear; the family's model built on meta names them:
Base.packed_weights) are written in the layout too, unless its fp8 rules keep them: e4m3 codes + `<name>_scale`
(comfy: one fp32 number, block64: bf16 [E, K/64, N], plain: none; fp8.quantize_packed_weight, each expert as
FP8Linear's weight), from W[e] + the deltas in float32, rounded as the Linear weights are.
Each loads back as it is through the family's transformer loader (train_lora.py, generate.py); a layout
and naming that loader does not read as stored (its spec's FP8Rules.stored: a diffusers folder whose
fused rows are split, a family that quantizes only while loading) is refused before anything is written.

An fp8 BASE (plain e4m3, our fp8_scaled, ComfyUI's per-tensor scaled fp8 with its `scaled_fp8` marker or
comfy_quant; library/precision/fp8_checkpoints.py) is merged into as ComfyUI patches one: each merged
weight is dequantized to float32 (codes * scale), the deltas added there, and a delta is never added to
fp8 values. Without --save_precision the output keeps the base's layout: only the merged weights are
re-quantized (fresh scale; a packed weight in the layout its stored scale says, one number, our bf16 blocks
[E, K/64, N] or none; rounded stochastically, as ComfyUI's patching rounds, unless --no-stochastic_rounding: a
merged weight starts on the fp8 grid, and round to nearest gives most codes back where a delta is under half a
step, a LoRA at ratio 0.1 keeping 17-43% of its effect, an experts LoRA at 0.05 53-57%), every other
tensor is copied byte for byte; with bf16/fp16/fp32 every weight is dequantized (packed experts too, with their
`<name>_scale`) and the scales and markers left out (comfy_quant's `_quantization_metadata` header too).
Another fp8 layout is refused (it would re-round every weight). Keys outside the transformer (text
encoders and VAE bundled in a ComfyUI checkpoint, an "all in one" file) are copied byte for byte
whatever --save_precision says (ComfyUI loads them in their own precisions). fp8 bases only in the model's
own names (BFL names, not a diffusers folder's split rows).

GGUF (`--save_precision gguf_q8_0`, `gguf_q5_1`, `gguf_q5_0`, `gguf_q4_1`, `gguf_q4_0`: the block types
the `gguf` package can quantize; it only dequantizes the K-quants): one .gguf file in ComfyUI-GGUF's
layout for the family (library/precision/gguf_writer.py: its general.architecture, the base's key names
without the ComfyUI prefix, each tensor's type as city96's convert.py and llama.cpp quantize patch give
it for the family's arch), each merged weight quantized from float32 by gguf and written before the
next is read. From a bf16 / fp16 / fp32 single file of a family with a ComfyUI-GGUF name
(its spec's gguf layout); keys outside the transformer are left out, as ComfyUI-GGUF's convert.py does.

Errors (bad ratio, missing file, LoRA for another model, shape mismatch, unmatched modules without
--allow_unmatched, fp8 layout change, --save_to naming an input or a file name whose extension is not
the format written: .gguf for GGUF, else .safetensors; a merged weight past what the output holds: fp16's
65504, unscaled e4m3's 448, a GGUF block's fp16 scale) are one line on stderr, exit status 2, and no
output is left behind.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import shutil
import sys
from dataclasses import dataclass
from typing import Iterator

if __package__ in (None, ""):  # run as a script: make `library` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from library.training.config_schema import PRECISION_NAMES  # noqa: E402
from library.errors import printed_warnings  # noqa: E402
from tools.cli import Parser, check_command_line, save_precision_name, exit_without_collecting  # noqa: E402
from library.models.registry import arch_spec, arch_specs  # noqa: E402

FP8_PRECISIONS = ("fp8", "fp8_scaled")  # --save_precision values stored as float8_e4m3fn
FP8_LAYOUTS = {"comfy": "fp8_tensor_scaled", "plain": "fp8", "block64": "fp8_scaled"}  # --fp8_layout -> fp8.MODES
GGUF_PRECISIONS = ("gguf_q8_0", "gguf_q5_1", "gguf_q5_0", "gguf_q4_1", "gguf_q4_0")  # gguf_writer.WRITE_TYPES


# sd-scripts' and musubi-tuner's LoRA-merge scripts' flags -> ours (a model's own, --<name>_model: its spec's)
# (sd-scripts' --models without a base merges LoRAs into one: tools/combine_loras.py)
INTO_ONE = "--lora PATH:RATIO ... (LoRAs into one LoRA: tools/combine_loras.py --lora PATH:RATIO ...)"
PEER_FLAGS = {"--dit": "--model", "--models": INTO_ONE, "--ratios": INTO_ONE, "--concat": "tools/combine_loras.py",
              "--shuffle": "none (tools/combine_loras.py --mode concat stacks the factors as they are)",
              "--lora_weight": "--lora PATH:RATIO ...", "--lora_multiplier": "--lora PATH:RATIO ...",
              "--save_merged_model": "--save_to"}


def peer_flags() -> dict[str, str]:
    models = [spec.peer_models.get("sd-scripts") for spec in arch_specs().values()]
    return {**PEER_FLAGS, **{k: v for m in models if m is not None for k, v in m.merge_flags.items()}}


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(description=__doc__.split("\n\n")[0], peer_flags=peer_flags())
    parser.add_argument("--model", required=True, help="base checkpoint: file or folder")
    parser.add_argument("--lora", required=True, nargs="+", help="LoRA files as path[:ratio]")
    parser.add_argument("--save_to", required=True, help="output file (file base) or folder (folder base)")
    parser.add_argument("--save_precision", type=save_precision_name, choices=[*PRECISION_NAMES, *FP8_PRECISIONS, *GGUF_PRECISIONS],
                        default=None, help="default: keep each tensor's dtype (float: fp32, as sd-scripts says)")
    parser.add_argument("--fp8_layout", choices=list(FP8_LAYOUTS), default=None,
                        help="with --save_precision fp8: comfy (ComfyUI scaled fp8; default for single files), plain, "
                             "block64; an fp8 base's own layout by default (a block64 base stays block64: only our "
                             "loaders read it, --fp8_layout comfy for ComfyUI)")
    parser.add_argument("--stochastic_rounding", action=argparse.BooleanOptionalAction, default=None,
                        help="fp8 outputs: unbiased stochastic rounding (default: on into an fp8 base, as ComfyUI "
                             "patches one; off for a high-precision base quantized to fp8)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the stochastic rounding")
    parser.add_argument("--allow_unmatched", action="store_true", help="skip LoRA modules the base has no weight for")
    return parser


# The arguments are checked before torch and the library load (seconds): --help and a bad flag answer at once.
if __name__ == "__main__":
    check_command_line(build_parser)

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402

from library.precision import fp8  # noqa: E402
from library.precision.fp8_checkpoints import PACKED_FILE_SCALE_SUFFIXES  # noqa: E402
from library.precision.gguf_writer import (  # noqa: E402
    FP16_MAX, FP16_OVERFLOW, OVERFLOWS_AT, GgufEntry, output_type, save_precision_type, write_gguf_streaming)
from library.atomic_files import write_text  # noqa: E402
from library.io import ST_DTYPES, atomic_folder, atomic_path  # noqa: E402
from library.training.config import PRECISION_DTYPES  # noqa: E402
from networks.lora_files import MODELSPEC_HASH, LoRAWeights, input_files, merge_into_weight  # noqa: E402
from tools.cli import LoRASpec, parse_lora_spec  # noqa: E402,F401 (parse_lora_spec: merge_lora's callers use it)
from tools.merge_base import Base, lora_deltas, open_base  # noqa: E402

PRECISIONS = {**PRECISION_DTYPES, **dict.fromkeys(FP8_PRECISIONS, fp8.FP8_DTYPE), **dict.fromkeys(GGUF_PRECISIONS)}
FP8_MODES = tuple(FP8_LAYOUTS.values())
COMFY_MARKER_VALUE = torch.zeros(2, dtype=fp8.FP8_DTYPE)  # 2 elements: ComfyUI's "no fp8 matmul"
HIGH_PRECISION_DTYPE = torch.bfloat16  # fp8 modes: everything that is not an fp8 Linear weight
NOT_COPIED = (".safetensors", ".index.json", ".bin", ".pt", ".pth", ".ckpt", ".gguf")  # folder files left behind

# safetensors dtype names <-> torch dtypes
ST_NAMES = {v: k for k, v in ST_DTYPES.items()}


def cast_checked(key: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`tensor` in `dtype`, refused (ValueError naming the key) where fp16 would write a value past its range
    as inf: a LoRA that grew a weight past 65504 was written as inf with exit status 0."""
    if dtype == torch.float16:
        check_in_range(key, tensor, FP16_OVERFLOW, FP16_MAX, "fp16", "save bf16 or fp32")
    return tensor.to(dtype)


def check_in_range(key: str, tensor: torch.Tensor, overflow: float, largest: float, dtype_name: str,
                   instead: str) -> None:
    """One line naming the weight a dtype cannot hold: its largest |value| is `overflow` or more, what the dtype
    writes as inf or clips (below it, the value rounds to at most `largest`). NaN is the LoRA reader's check."""
    peak = tensor.detach().abs().amax().item() if tensor.numel() else 0.0
    if peak >= overflow:
        raise ValueError(f"'{key}' reaches {peak:.4g}, past the largest value {largest:g} of {dtype_name}: it cannot "
                         f"be written as it is; {instead}, or merge the LoRAs at a lower ratio")


# ----------------------------------------------------------------------------------------------
# Streaming safetensors writer


@dataclass(frozen=True)
class Entry:
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        count = 1
        for d in self.shape:
            count *= d
        return count * self.dtype.itemsize


def safetensors_header(entries: list[Entry], metadata: dict[str, str]) -> bytes:
    """A safetensors file's first bytes for `entries` stored in order: 8-byte little-endian header length, the JSON
    header (dtype, shape, data_offsets; `__metadata__`) padded with spaces to a multiple of 8."""
    header, offset = {}, 0
    for e in entries:
        header[e.key] = {"dtype": ST_NAMES[e.dtype], "shape": list(e.shape), "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    if metadata:
        header["__metadata__"] = metadata
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    return len(blob).to_bytes(8, "little") + blob


def write_safetensors_streaming(path: str, entries: list[Entry], tensors: Iterator[tuple[str, torch.Tensor]], metadata: dict[str, str]):
    """Write a safetensors file whose header is known before its tensors (safetensors_header), then each tensor's
    raw bytes in `entries` order. `tensors` must yield exactly `entries` (key, dtype, shape), one at a time; each
    is written and dropped."""
    with open(path, "wb") as f:
        f.write(safetensors_header(entries, metadata))
        for e in entries:
            key, tensor = next(tensors)
            if key != e.key or tensor.dtype != e.dtype or tuple(tensor.shape) != e.shape:
                raise RuntimeError(f"streaming writer: got {key} {tensor.dtype} {tuple(tensor.shape)}, planned {e}")
            f.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)
        if next(tensors, None) is not None:
            raise RuntimeError("streaming writer: more tensors than planned")


# ----------------------------------------------------------------------------------------------
# Planning and merging


@dataclass
class Plan:
    base: Base
    precision: str | None  # None: keep each tensor's file dtype
    deltas: dict[str, list[tuple[float, LoRAWeights]]]  # checkpoint key -> [(ratio, lora)]
    stochastic: bool = False
    seed: int = 0
    keeps_layout = False  # a high-precision base: no fp8 layout of the base's is kept (Fp8BasePlan may keep one)

    def __post_init__(self):
        self.generator = torch.Generator().manual_seed(self.seed)  # one stream across all shards

    @property
    def comfy(self) -> bool:
        return self.precision == "fp8_tensor_scaled"

    def _is_linear_weight(self, key: str) -> bool:
        name = self.base.to_model(key)
        return bool(name) and name.endswith(".weight") and len(self.base.reader.shape(key)) == 2

    def is_fp8_weight(self, key: str) -> bool:
        if self.precision not in FP8_MODES or not self._is_linear_weight(key):
            return False
        if self.comfy:  # ComfyUI makes every Linear fp8; ours keep some in bf16
            return True
        # matched in the spec's names (a single file's renamed embedder is kept as the model's module it is);
        # a fused module stays high precision where any of its parts does
        names = self.base.spec_names(self.base.to_model(key)[: -len(".weight")])
        return not any(fp8.is_high_precision(name, arch_spec(self.base.family).fp8) for name in names)

    @functools.cached_property
    def packed_fp8(self) -> frozenset[str]:
        """Checkpoint keys of the packed weights (a mixture's experts [E, K, N], no Linear: Base.packed_weights)
        written in fp8: those the family's fp8 keep rules do not keep, where the output is fp8."""
        if self.precision not in FP8_MODES:
            return frozenset()
        rules = arch_spec(self.base.family).fp8
        return frozenset(key for key, name in self.base.packed_weights.items() if not fp8.keeps_packed(name, rules))

    def is_fp8_bias(self, key: str) -> bool:
        """comfy: a Linear's bias, which ComfyUI holds in fp8 with its weight (stored so, not rounded on load)."""
        return self.comfy and key.endswith(".bias") and self._is_linear_weight(key[: -len("bias")] + "weight")

    def scale_key(self, weight_key: str) -> str:
        return weight_key[: -len("weight")] + ("scale_weight" if self.comfy else "weight_scale")

    def entries(self, key: str) -> list[Entry]:
        """What `key` becomes in the output (one tensor, or fp8 weight + scale)."""
        shape, dtype = self.base.reader.shape(key), ST_DTYPES[self.base.reader.dtype_name(key)]
        if self.is_fp8_weight(key):
            out = [Entry(key, fp8.FP8_DTYPE, shape)]
            if self.precision == "fp8_scaled":
                out.append(Entry(self.scale_key(key), fp8.SCALE_DTYPE, fp8.scale_shape(*shape)))
            elif self.comfy:
                out.append(Entry(self.scale_key(key), fp8.TENSOR_SCALE_DTYPE, ()))
            return out
        if key in self.packed_fp8:  # codes + `<name>_scale` (bf16 blocks [E, K/64, N], or one fp32 for comfy)
            scales = {"fp8_scaled": (fp8.SCALE_DTYPE, fp8.packed_scale_shape(*shape)),
                      "fp8_tensor_scaled": (fp8.TENSOR_SCALE_DTYPE, ())}  # fmt: skip
            scale = scales.get(self.precision)
            return [Entry(key, fp8.FP8_DTYPE, shape)] + ([] if scale is None else
                                                         [Entry(key + fp8.PACKED_SCALE_SUFFIX, *scale)])
        if self.is_fp8_bias(key):
            return [Entry(key, fp8.FP8_DTYPE, shape)]
        if self.base.family != "llm" and self.base.to_model(key) is None:  # a bundled text encoder / VAE: as stored
            return [Entry(key, dtype, shape)]
        if dtype.is_floating_point and self.precision is not None:
            dtype = HIGH_PRECISION_DTYPE if self.precision.startswith("fp8") else PRECISIONS[self.precision]
        return [Entry(key, dtype, shape)]

    def merged(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """The LoRAs of `key` added to its float32 weight (a copy: never in fp8/bf16)."""
        return merge_into_weight(tensor, self.deltas[key])  # [out, in]; in the order given (DoRA normalises what is there)

    def tensors(self, keys: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """Merged, cast tensors of `keys`, one at a time (peak: the float32 weight + its output)."""
        for key in keys:
            tensor = self.base.reader.get(key)  # a view of the mmapped file: never written to
            if key in self.deltas:
                tensor = self.merged(key, tensor)
            if self.is_fp8_weight(key):
                yield from self.quantized(key, tensor, self.precision).items()
            elif key in self.packed_fp8:
                yield from self.quantized_packed(key, tensor).items()
            elif self.is_fp8_bias(key):  # e4m3 has no inf: saturate rather than turn a huge bias into NaN
                yield key, tensor.float().clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8_DTYPE)
            else:
                yield key, cast_checked(key, tensor, self.entries(key)[0].dtype)
            del tensor

    def trailer(self, shard: str) -> list[tuple[Entry, torch.Tensor]]:
        """Tensors written after a shard's own: ComfyUI's marker, at the transformer's prefix."""
        if not self.comfy or self.base.fp8 is not None or shard != os.path.basename(self.base.reader.files[0]):
            return []
        key = next(k for k in self.base.reader.keys() if self.base.to_model(k))
        marker = key[: len(key) - len(self.base.to_model(key))] + "scaled_fp8"
        return [(Entry(marker, fp8.FP8_DTYPE, tuple(COMFY_MARKER_VALUE.shape)), COMFY_MARKER_VALUE)]

    def check_unscaled(self, key: str, w: torch.Tensor) -> None:
        """Unscaled e4m3 clamps to +-448, which would change such a weight silently: one line naming the key."""
        instead = "save bf16" if self.base.fp8 is not None else "use a scaled fp8 layout (--fp8_layout comfy, block64)"
        check_in_range(key, w, fp8.FP8_OVERFLOW, fp8.FP8_MAX, "float8_e4m3fn without a scale", instead)

    def quantized(self, key: str, w: torch.Tensor, mode: str) -> dict[str, torch.Tensor]:
        """float weight -> {key: float8_e4m3fn [, key_scale]} from its float32 values, in fp8.MODES `mode`."""
        if mode == "fp8":
            self.check_unscaled(key, w)
        q, scale = self.rounded(w, mode)
        out = {key: q}
        if scale is not None:
            out[self.scale_key(key)] = scale
        return out

    def rounded(self, w: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """float weight [out, in] -> (float8_e4m3fn codes, scale or None) in fp8.MODES `mode`: fp8.quantize_weight,
        or with stochastic rounding its scales (absmax / 448; bf16 blocks rounded up) and unbiased codes."""
        if not self.stochastic:
            return fp8.quantize_weight(w, mode)
        if mode == "fp8":
            return fp8.stochastic_round_to_fp8(w, self.generator), None
        _, scale = fp8.quantize_weight(w, mode)
        rows, blocks = scale.shape if scale.dim() == 2 else (1, 1)
        blocked = w.float().reshape(rows, blocks, -1) / scale.float().reshape(rows, blocks, 1)
        return fp8.stochastic_round_to_fp8(blocked, self.generator).reshape(w.shape), scale

    def quantized_packed(self, key: str, w: torch.Tensor, mode: str | None = None) -> dict[str, torch.Tensor]:
        """A packed weight [E, K, N] -> {key: float8_e4m3fn codes [, key_scale]} in fp8.MODES `mode` (the output's by
        default) as the loaders store it: fp8.quantize_packed_weight, each expert as FP8Linear's weight w[e]^T
        (comfy: one fp32 scale for the whole tensor). Round to nearest, or stochastically (--stochastic_rounding,
        an fp8 base's default) as `quantized` rounds a Linear's weight, with round to nearest's scales: rounded to
        nearest, a merged expert's delta under half an fp8 step is lost, as a Linear's is."""
        mode = mode or self.precision
        if mode == "fp8":
            self.check_unscaled(key, w)
        if not self.stochastic:
            codes, scale = fp8.quantize_packed_weight(w, mode)
            return {key: codes} if scale is None else {key: codes, key + fp8.PACKED_SCALE_SUFFIX: scale}
        # Expert by expert: stochastic rounding holds ~8 fp32 copies of what it rounds (1390 MiB above 8 experts' 168
        # MiB, 88 MiB one at a time), ~11 GiB for a whole full-size gate_up_proj [64, 2048, 2688], ~180 MiB an expert.
        codes, scale = torch.empty(w.shape, dtype=fp8.FP8_DTYPE), None
        if mode == "fp8_scaled":  # each expert's [N, K/64] transposed to [K/64, N]
            scale = torch.empty(fp8.packed_scale_shape(*w.shape), dtype=fp8.SCALE_DTYPE)
        elif mode == "fp8_tensor_scaled":  # one fp32 scale for every expert, fp8.quantize_packed_weight's
            scale = (w.detach().abs().amax().float() / fp8.FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
        for e in range(w.shape[0]):
            if mode == "fp8_tensor_scaled":
                codes[e] = self.rounded(w[e].float() / scale, "fp8")[0]
                continue
            q, s = self.rounded(w[e].T, mode)
            codes[e] = q.T
            if s is not None:
                scale[e] = s.T
        return {key: codes} if scale is None else {key: codes, key + fp8.PACKED_SCALE_SUFFIX: scale}


def bf16_tensor_scale(merged: torch.Tensor) -> torch.Tensor:
    """A merged weight's per-tensor scale stored as one bf16 number (musubi-tuner's): absmax / 448 rounded up to
    bf16, so that no code of merged / scale passes 448."""
    return fp8.round_up_to_bf16((merged.float().abs().amax() / fp8.FP8_MAX).clamp_min(torch.finfo(torch.bfloat16).tiny))


class Fp8BasePlan(Plan):
    """A pre-quantized base (ours, ComfyUI's fp8 / scaled fp8; fp8_checkpoints.py). Each merged fp8
    weight is first dequantized to float32 exactly as ComfyUI's LoRA patching does (codes.float() *
    scale: ComfyUI's convert_weight on a float32 copy), the deltas are added in float32, then:
      - precision None (or the base's own layout): the output keeps the layout. Only merged weights
        are re-quantized (stochastic rounding unless --no-stochastic_rounding; a fresh absmax / 448 scale per
        tensor or per block; a packed weight's as its stored scale says, _requantized_packed); every other
        tensor (codes, scales, markers) is copied byte for byte.
      - bf16 / fp16 / fp32: every fp8 tensor is dequantized (float32; a packed weight with its scale,
        fp8.dequantize_packed_weight) and cast; scales, markers and activation scales are left out (and
        comfy_quant's `_quantization_metadata` header), so the output is a plain high-precision checkpoint.
    Tensors outside the transformer (a ComfyUI file's bundled text encoders and VAE) are copied as
    they are. Another fp8 layout is refused: it would re-round every weight of the base."""

    @property
    def keeps_layout(self) -> bool:
        return self.precision in (None, self.base.fp8.layout)

    def _name(self, key: str) -> str | None:
        return self.base.to_model(key)  # None: not the transformer's

    def _scale_key(self, weight_key: str) -> str:
        suffix = self.base.fp8.scale_suffix or ".weight_scale"  # ours: bf16 blocks
        return weight_key[: -len(".weight")] + suffix

    def _is_fp8(self, key: str) -> bool:
        return self.base.reader.dtype_name(key) == "F8_E4M3"

    def _is_scale_or_marker(self, name: str) -> bool:
        return self.base.fp8.is_dropped(name) or name.endswith(".weight_scale") or name in self.base.fp8.packed_scales

    def _packed_scale_key(self, key: str) -> str | None:
        """The checkpoint key of a packed fp8 weight's scale (`P_scale`, or a Linear's suffix), None if it has none."""
        name = self._name(key)
        if name is None:
            return None
        suffix = next((s for s in PACKED_FILE_SCALE_SUFFIXES if name + s in self.base.fp8.packed_scales), None)
        return None if suffix is None else key + suffix

    def entries(self, key: str) -> list[Entry]:
        shape, dtype = self.base.reader.shape(key), ST_DTYPES[self.base.reader.dtype_name(key)]
        name = self._name(key)
        if self.keeps_layout or name is None:
            return [Entry(key, dtype, shape)]
        if self._is_scale_or_marker(name):
            return []
        return [Entry(key, PRECISIONS[self.precision] if dtype.is_floating_point else dtype, shape)]

    def dequantized(self, key: str) -> torch.Tensor:
        """The float32 weight the fp8 codes (and their scale) stand for; other tensors widened."""
        tensor, scale_key = self.base.reader.get(key), self._scale_key(key) if key.endswith(".weight") else None
        if self._is_fp8(key) and (packed_scale := self._packed_scale_key(key)) is not None:  # [E, K, N] experts
            scale = self.base.reader.get(packed_scale)  # one number (ComfyUI's), or our bf16 blocks [E, K/64, N]
            scale = scale.reshape(()) if scale.numel() == 1 else scale
            return fp8.dequantize_packed_weight(tensor, scale, torch.float32)
        if not self._is_fp8(key) or scale_key not in self.base.reader:
            return tensor.float()
        scale = self.base.reader.get(scale_key)
        if scale.numel() == 1:  # ComfyUI's (or musubi's) per-tensor scale
            return tensor.float() * scale.float().reshape(())
        return fp8.dequantize_weight(tensor, scale.reshape(scale.shape[0], -1).to(fp8.SCALE_DTYPE), torch.float32)

    def _requantized_packed(self, key: str) -> dict[str, torch.Tensor]:
        """{key: codes [, its scale key: scale]} of a merged packed weight [E, K, N] in the base's layout, which its
        stored scale says (as the loader reads it): none plain e4m3, one number per tensor (ComfyUI's), bf16 blocks
        [E, K/64, N] ours; a fresh scale of the merged weight, stored in the base's key, dtype and shape."""
        merged = self.merged(key, self.dequantized(key))
        scale_key = self._packed_scale_key(key)
        if scale_key is None:
            return self.quantized_packed(key, merged, "fp8")
        stored, shape = ST_DTYPES[self.base.reader.dtype_name(scale_key)], self.base.reader.shape(scale_key)
        per_tensor = len(shape) < 3
        if per_tensor and stored == torch.bfloat16:  # a bf16 number: the codes divide by it as stored
            scale = bf16_tensor_scale(merged)
            return {**self.quantized_packed(key, merged / scale.float(), "fp8"), scale_key: scale.reshape(shape)}
        out = self.quantized_packed(key, merged, "fp8_tensor_scaled" if per_tensor else "fp8_scaled")
        out[scale_key] = out.pop(key + fp8.PACKED_SCALE_SUFFIX).to(stored).reshape(shape)
        return out

    def _requantized(self, weight_key: str) -> dict[str, torch.Tensor]:
        """{weight key: codes [, its scale key: scale]} of a merged weight, in the base's layout."""
        if weight_key in self.base.packed_weights:
            return self._requantized_packed(weight_key)
        merged = self.merged(weight_key, self.dequantized(weight_key))
        scale_key = self._scale_key(weight_key) if weight_key.endswith(".weight") else None  # an e4m3 bias: no scale
        if scale_key not in self.base.reader:  # plain codes (or a ComfyUI layer without scale: 1.0)
            return self.quantized(weight_key, merged, "fp8")
        per_tensor = self.base.fp8.layout == "fp8_tensor_scaled"
        stored, shape = ST_DTYPES[self.base.reader.dtype_name(scale_key)], self.base.reader.shape(scale_key)
        if per_tensor and stored == torch.bfloat16:
            # musubi-tuner's bf16 per-tensor scale: the codes divide by the scale as stored (rounded up, so no code
            # passes 448); codes of an fp32 scale times its bf16 rounding scaled every merged weight by up to 0.4%
            scale = bf16_tensor_scale(merged)
            out = self.quantized(weight_key, merged.float() / scale.float(), "fp8")
            out[scale_key] = scale.reshape(shape)
            return out
        out = self.quantized(weight_key, merged, "fp8_tensor_scaled" if per_tensor else "fp8_scaled")
        scale = out.pop(next(k for k in out if k != weight_key))
        out[scale_key] = scale.to(stored).reshape(shape)
        return out

    def tensors(self, keys: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        stash: dict[str, torch.Tensor] = {}  # the other half (codes or scale) of a re-quantized weight
        by_scale = {self._scale_key(k): k for k in self.deltas if self._is_fp8(k) and k.endswith(".weight")}
        by_scale.update({scale: k for k in self.deltas if self._is_fp8(k) and (scale := self._packed_scale_key(k))})
        for key in keys:
            entries = self.entries(key)
            if not entries:
                continue
            if self._name(key) is None:
                yield key, self.base.reader.get(key)
            elif self.keeps_layout and (key in by_scale or (key in self.deltas and self._is_fp8(key))):
                if key not in stash:
                    stash.update(self._requantized(by_scale.get(key, key)))
                yield key, stash.pop(key)
            elif self.keeps_layout and key not in self.deltas:
                yield key, self.base.reader.get(key)
            else:
                tensor = self.base.reader.get(key) if self.keeps_layout else self.dequantized(key)
                tensor = self.merged(key, tensor) if key in self.deltas else tensor
                yield key, cast_checked(key, tensor, entries[0].dtype)


def _shard_keys(base: Base) -> dict[str, list[str]]:
    """Checkpoint file basename -> its keys (file order of the reader)."""
    shards: dict[str, list[str]] = {os.path.basename(f): [] for f in base.reader.files}
    for key in base.reader.keys():
        shards[base.reader.file_of(key)].append(key)
    return shards


def _metadata(base: Base, shard: str, specs: list[LoRASpec], precision: str | None, keeps_layout: bool) -> dict[str, str]:
    """The base shard's header, less what is no longer true of the output, plus what was merged."""
    source = os.path.join(os.path.dirname(base.reader.files[0]), shard)
    with safe_open(source, framework="pt") as f:
        metadata = dict(f.metadata() or {})
    for stale in ("sshs_model_hash", "sshs_legacy_hash", MODELSPEC_HASH):  # hashes of the base's tensors, not the merged
        metadata.pop(stale, None)
    if not keeps_layout:  # comfy_quant's per-layer formats: ComfyUI would load the written bf16 Linears as fp8 layers
        metadata.pop("_quantization_metadata", None)
    metadata["merged_loras"] = json.dumps([{"file": os.path.basename(s.path), "ratio": s.ratio} for s in specs])
    metadata["save_precision"] = precision or "as input"
    return metadata


def write_merged(plan: Plan, specs: list[LoRASpec], out: str) -> list[str]:
    """Write every shard of the plan into folder `out` (or the file `out` for a single file)."""
    written = []
    for shard, keys in _shard_keys(plan.base).items():
        trailer = plan.trailer(shard)
        entries = [e for k in keys for e in plan.entries(k)] + [e for e, _ in trailer]
        tensors = itertools.chain(plan.tensors(keys), ((e.key, t) for e, t in trailer))
        target = os.path.join(out, shard) if plan.base.is_folder else out
        metadata = _metadata(plan.base, shard, specs, plan.precision, plan.keeps_layout)
        write_safetensors_streaming(target, entries, tensors, metadata)
        written.append(target)
    if plan.base.is_folder:
        _write_index(plan, out)
        for name in os.listdir(plan.base.path):
            source = os.path.join(plan.base.path, name)
            if name == "config.json" and plan.precision in PRECISION_DTYPES:
                _write_config(source, os.path.join(out, name), PRECISION_DTYPES[plan.precision])
            elif os.path.isfile(source) and not name.endswith(NOT_COPIED):
                shutil.copyfile(source, os.path.join(out, name))  # new files, as the umask says (copy2 kept the source's mode)
    return written


def _write_config(source: str, target: str, dtype: torch.dtype):
    """A Hugging Face config.json whose dtype / torch_dtype say the merged weights' float dtype: transformers
    loads a model in it, so an fp32 base merged to bf16 loaded as float32 (twice the memory)."""
    with open(source) as f:
        config = json.load(f)
    name = str(dtype).removeprefix("torch.")
    # a vision-language config repeats it in text_config, for its language model
    for part in (config, config.get("text_config")):
        for key in ("dtype", "torch_dtype"):
            if isinstance(part, dict) and isinstance(part.get(key), str):
                part[key] = name
    write_text(target, json.dumps(config, indent=2) + "\n")


def _write_index(plan: Plan, out: str):
    indexes = [f for f in os.listdir(plan.base.path) if f.endswith(".safetensors.index.json")]
    if not indexes:
        return
    with open(os.path.join(plan.base.path, indexes[0])) as f:
        index = json.load(f)
    weight_map, total = {}, 0
    for shard, keys in _shard_keys(plan.base).items():
        for e in (e for k in keys for e in plan.entries(k)):
            weight_map[e.key] = shard
            total += e.nbytes
    index["metadata"] = {**index.get("metadata", {}), "total_size": total}
    index["weight_map"] = dict(sorted(weight_map.items()))
    with open(os.path.join(out, indexes[0]), "w") as f:
        json.dump(index, f, indent=2)
        f.write("\n")


def write_merged_gguf(plan: Plan, specs: list[LoRASpec], out: str, qtype: str) -> None:
    """The merged transformer as one GGUF file `out` in ComfyUI-GGUF's layout (module docstring);
    `plan` yields float32 tensors (precision "fp32"), each encoded as it comes."""
    base, layout = plan.base, arch_spec(plan.base.family).gguf
    keys = [k for k in base.reader.keys() if base.to_model(k)]
    entries = []
    for key in keys:
        name, shape = base.to_model(key), tuple(base.reader.shape(key))
        entries.append(GgufEntry(name, shape, output_type(name, shape, base.reader.dtype_name(key), qtype, layout)))
    tensors = _in_range(plan.tensors(keys), {e.name: e.ggml_type for e in entries}, base)
    metadata = _metadata(base, os.path.basename(base.reader.files[0]), specs, f"gguf_{qtype.lower()}", keeps_layout=False)
    write_gguf_streaming(out, layout.arch, qtype, entries, tensors, metadata)


def _in_range(tensors: Iterator[tuple[str, torch.Tensor]], types: dict[str, str], base: Base):
    """(GGUF name, tensor) of each checkpoint tensor, refused where its GGUF type cannot hold its values."""
    for key, tensor in tensors:
        name = base.to_model(key)
        overflow = OVERFLOWS_AT.get(types[name])
        if overflow is not None:  # the largest value written: a 1/127 ... of the overflow rounds to fp16's 65504
            largest = overflow * FP16_MAX / FP16_OVERFLOW
            check_in_range(key, tensor, overflow, largest, f"GGUF {types[name]}",
                           "save a safetensors file (bf16 or fp32)")
        yield name, tensor


def _check_gguf_output(base: Base, save_precision: str, fp8_layout: str | None, stochastic_rounding: bool) -> None:
    """A GGUF output needs a single high-precision file of a family ComfyUI-GGUF names, in its names."""
    layout = None if base.family == "llm" else arch_spec(base.family).gguf
    named = [spec.title for name, spec in arch_specs().items() if spec.gguf]
    if layout is None:
        raise ValueError(f"--save_precision {save_precision}: ComfyUI-GGUF has no layout for a {base.family} base "
                         f"({base.path}); GGUF is written for {', '.join(named)}")
    if base.is_folder or not base.native:
        raise ValueError(f"--save_precision {save_precision}: GGUF is written from a single file in the names "
                         f"ComfyUI-GGUF reads ({base.naming} names of {base.path} are not); give the single-file checkpoint")
    if base.fp8 is not None:
        raise ValueError(f"--save_precision {save_precision}: {base.path} is a pre-quantized {base.fp8.layout} base; "
                         f"quantizing its fp8 values again compounds their rounding: give the bf16 / fp16 / fp32 file")
    if fp8_layout is not None or stochastic_rounding:
        raise ValueError(f"--save_precision {save_precision}: --fp8_layout and --stochastic_rounding are for fp8 outputs")
    unreadable = [k for k in base.reader.keys() if base.to_model(k) and not ST_DTYPES[base.reader.dtype_name(k)].is_floating_point]
    if unreadable:
        raise ValueError(f"--save_precision {save_precision}: '{unreadable[0]}' is {base.reader.dtype_name(unreadable[0])}; "
                         f"GGUF is written from float tensors")


# ----------------------------------------------------------------------------------------------
# Command line


def _output_precision(base: Base, save_precision: str | None, fp8_layout: str | None) -> str | None:
    """--save_precision + --fp8_layout -> Plan.precision: a PRECISION_DTYPES name, an fp8.MODES layout, or
    None (keep each tensor's dtype; an fp8 base keeps its layout). fp8 defaults to ComfyUI's layout for
    a diffusion transformer's single file (what people render with), plain e4m3 elsewhere, and an fp8
    base's own layout for an fp8 base."""
    if fp8_layout is not None and fp8_layout not in FP8_LAYOUTS:
        raise ValueError(f"--fp8_layout {fp8_layout!r}: expected one of {', '.join(FP8_LAYOUTS)}")
    if "fp8_scaled" in (save_precision, FP8_LAYOUTS.get(fp8_layout)) and base.family == "llm":
        # transformers loads the e4m3 codes and drops their weight_scale ("UNEXPECTED"): logits off by ~0.7
        raise ValueError(f"--save_precision {save_precision} --fp8_layout block64: {base.path} is an LLM folder, which "
                         f"transformers loads without the scales; use bf16, fp16, fp32 or plain fp8")
    if save_precision == "fp8_scaled":
        if fp8_layout not in (None, "block64"):
            raise ValueError(f"--save_precision fp8_scaled is --fp8_layout block64, not {fp8_layout}; use --save_precision fp8")
        return "fp8_scaled"
    if save_precision != "fp8":
        if fp8_layout is not None:
            raise ValueError(f"--fp8_layout {fp8_layout} needs --save_precision fp8, got {save_precision}")
        return save_precision
    single_file = not base.is_folder and base.family != "llm"
    if fp8_layout is None:
        fp8_layout = ("comfy" if single_file else "plain") if base.fp8 is None else \
            next(k for k, v in FP8_LAYOUTS.items() if v == base.fp8.layout)
    if fp8_layout == "comfy" and not single_file:
        raise ValueError(f"--fp8_layout comfy: ComfyUI's scaled fp8 is a diffusion transformer's single-file layout and "
                         f"{base.path} is a {base.family} {'folder' if base.is_folder else 'file'}; use plain or block64")
    return FP8_LAYOUTS[fp8_layout]


def _check_fp8_output(base: Base, precision: str | None, save_precision: str | None) -> None:
    """An fp8 output (written, or an fp8 base's layout kept) only where the family's loader reads it as
    stored (FP8Rules.stored): the merge would otherwise end well and train_lora / generate refuse its file."""
    layout = base.fp8.layout if precision is None and base.fp8 is not None else precision
    if layout not in FP8_MODES:
        return
    spec = arch_spec(base.family)
    if layout in spec.fp8.stored.get(base.naming, ()):
        return
    flag = next(k for k, v in FP8_LAYOUTS.items() if v == layout)
    namings = [naming for naming, layouts in spec.fp8.stored.items() if layout in layouts]
    instead = f"merge into a checkpoint in {' or '.join(namings)} names" if namings else "save bf16"
    raise ValueError(f"--save_precision {save_precision or 'as input'} (--fp8_layout {flag}): the {spec.title} loader "
                     f"does not read a stored {layout} checkpoint in {base.naming} names ({base.path}); {instead}, "
                     f"or let training quantize a bf16 base while loading (base_precision fp8 / fp8_scaled)")


def _check_save_to(save_to: str, model: str, base: Base, loras: list[LoRASpec], qtype: str | None) -> None:
    """The output is neither the base nor a LoRA (a PEFT folder counts with its weights file), and a
    file output's extension says what is written (.gguf for GGUF, else .safetensors)."""
    if os.path.exists(save_to) and os.path.realpath(save_to) in (os.path.realpath(model), os.path.realpath(base.path)):
        raise ValueError(f"--save_to {save_to}: is the base checkpoint itself; write the merge elsewhere")
    if os.path.exists(save_to) and any(os.path.samefile(save_to, f) for f in input_files(s.path for s in loras)):
        raise ValueError(f"--save_to {save_to}: is one of the --lora inputs; write the merge elsewhere")
    if os.path.exists(save_to) and os.path.isdir(save_to) != base.is_folder:
        kind = "folder" if base.is_folder else "file"
        raise ValueError(f"--save_to {save_to}: exists and is not a {kind} like the base {base.path}")
    if base.is_folder and os.path.isdir(save_to):  # the output folder replaces save_to whole (atomic_folder)
        _check_replaced_folder(save_to, [model, base.path, *(s.path for s in loras)])
    suffix = ".gguf" if qtype else ".safetensors"
    if base.is_folder and save_to.endswith((".safetensors", ".gguf")):  # a folder was written under the file's name
        raise ValueError(f"--save_to {save_to}: the base {base.path} is a folder and so is the merge; name a folder")
    if not base.is_folder and not save_to.endswith(suffix):
        written = "a GGUF file" if qtype else "a safetensors file"
        raise ValueError(f"--save_to {save_to}: expected a {suffix} name ({written} is written)")


def _check_replaced_folder(save_to: str, inputs: list[str]) -> None:
    """An existing --save_to folder is replaced whole: it must hold none of the inputs and be a checkpoint
    folder (safetensors files beside small ones, no subfolder), such as an earlier merge wrote."""
    inside = os.path.realpath(save_to) + os.sep
    held = next((p for p in inputs if (os.path.realpath(p) + os.sep).startswith(inside)), None)
    if held is not None:
        raise ValueError(f"--save_to {save_to}: holds the input {held}, and the merged folder would replace it whole; "
                         f"write the merge elsewhere")
    names = os.listdir(save_to)
    if names and (any(os.path.isdir(os.path.join(save_to, n)) for n in names) or not any(n.endswith(".safetensors") for n in names)):
        raise ValueError(f"--save_to {save_to}: a folder of other files (no checkpoint: subfolders, or no .safetensors), "
                         f"which the merged folder would replace whole; name a new folder")


def merge_lora(model: str, loras: list[LoRASpec], save_to: str, save_precision: str | None = None,
               stochastic_rounding: bool | None = None, seed: int = 0, allow_unmatched: bool = False,
               fp8_layout: str | None = None) -> Plan:
    """Check everything, then write the merged checkpoint to `save_to` atomically."""
    if save_precision is not None and save_precision not in PRECISIONS:
        raise ValueError(f"--save_precision {save_precision!r}: expected one of {', '.join(PRECISIONS)}")
    base = open_base(model)
    qtype = save_precision_type(save_precision)
    if qtype:
        _check_gguf_output(base, save_precision, fp8_layout, stochastic_rounding)
    precision = "fp32" if qtype else _output_precision(base, save_precision, fp8_layout)  # GGUF: from float32
    fp8_out = base.fp8 is not None and precision in (None, base.fp8.layout) or precision in FP8_MODES
    if stochastic_rounding is None:
        # Into an fp8 base the merged weight starts on the fp8 grid: round to nearest gives most codes back
        # unchanged where the delta is under half a step (a LoRA at ratio 0.1 kept 17-43% of its effect),
        # so round stochastically as ComfyUI's patching does; a high-precision base rounds all of W + dW.
        stochastic_rounding = base.fp8 is not None and fp8_out
    if stochastic_rounding and not fp8_out:
        raise ValueError(f"--stochastic_rounding needs --save_precision fp8 (or an fp8 base kept in its layout), "
                         f"got {save_precision}")
    if base.fp8 is not None and precision in FP8_MODES and precision != base.fp8.layout:
        raise ValueError(f"--save_precision {save_precision} --fp8_layout {fp8_layout}: {base.path} is a pre-quantized "
                         f"{base.fp8.layout} base; another fp8 layout would re-round all its weights: leave them out "
                         f"(keeps {base.fp8.layout}, re-quantizes only merged weights) or give bf16 / fp16 / fp32")
    _check_fp8_output(base, precision, save_precision)
    _check_save_to(save_to, model, base, loras, qtype)
    deltas: dict[str, list[tuple[float, LoRAWeights]]] = {}
    for spec in loras:
        for key, w in lora_deltas(base, spec, allow_unmatched).items():
            deltas.setdefault(key, []).append((spec.ratio, w))
    plan = (Plan if base.fp8 is None else Fp8BasePlan)(base, precision, deltas, stochastic_rounding, seed)
    # Built beside save_to and renamed into place (an old save_to is replaced), with the umask's mode.
    with (atomic_folder if base.is_folder else atomic_path)(save_to) as tmp:
        if qtype:
            write_merged_gguf(plan, loras, tmp, qtype)
        else:
            write_merged(plan, loras, tmp)
    return plan


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
        specs = [parse_lora_spec(s) for s in args.lora]
        with printed_warnings():  # the library's (a LoRA's left-out modules, an fp8 base's widened tensors) as ours
            plan = merge_lora(args.model, specs, args.save_to, args.save_precision, args.stochastic_rounding, args.seed,
                              args.allow_unmatched, args.fp8_layout)
    except (ValueError, OSError) as e:  # CheckpointError is a ValueError
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    merged = sum(len(v) for v in plan.deltas.values())
    saved = args.save_precision if save_precision_type(args.save_precision) else plan.precision or "dtypes as input"
    saved += ", stochastic rounding" if plan.stochastic else ""
    print(f"merged {merged} LoRA modules ({len(specs)} files) into {len(plan.deltas)} {plan.base.family} weights -> "
          f"{args.save_to} ({saved})")  # fmt: skip
    return 0


if __name__ == "__main__":
    exit_without_collecting(main)
