"""Write a tiny, random, but real-format model set: every file is laid out as users have the real
ones, with the real architectures at toy sizes, so the loaders, converters and the whole training
path can be exercised on a CPU in seconds.

    python tools/make_tiny_models.py --out DIR [--seed 0]

DIR/
  <folder>/...                         each architecture's files, as its writers lay them out (the
                                       writers its spec lists in TINY, library/models/<family>/tiny.py)
  llm/                                 Qwen2-style causal LM + tokenizer (library/models/tiny_files.py)
  manifest.json                        what was written, with sizes and dims

Dimensions are consistent across the set (library/models/tiny_files.py TINY: the text encoders'
widths are the transformers' context widths, 16 latent channels unless an architecture declares
its own). Everything is deterministic from --seed (each component seeds its own generator). Weights
are float32 so that parity tests can compare at 1e-5.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

if __package__ in (None, ""):  # run as a script: make `library` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.cli import Parser, check_command_line, check_out_folder, exit_without_collecting  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--seed", type=int, default=0)
    return parser


# The arguments are checked before torch and the library load (seconds): --help and a bad flag answer at once.
if __name__ == "__main__":
    check_command_line(build_parser)

from library.models.registry import arch_specs  # noqa: E402
from library.models.spec import load_symbol  # noqa: E402
from library.models.tiny_files import (  # noqa: E402
    TINY,
    build_qwen_tokenizer,
    round_up,
    save_vl_processor,
    seed_component,
    vision_token_ids,
    write_json,
)

# ----------------------------------------------------------------------------------------------
# The set: every architecture's writers, in registry order


def make_tiny_models(out_dir: str, seed: int = 0) -> dict[str, str]:
    """Write the tiny set under out_dir; returns {component name: path} (also in manifest.json)."""
    paths: dict[str, str] = {}
    dims = dict(TINY)
    for tiny in (spec.tiny for spec in arch_specs().values() if spec.tiny):
        dims.update(tiny.dims)
        for writer in tiny.writers:
            paths.update(load_symbol(writer)(out_dir, seed))
    manifest = {
        "seed": seed,
        "dims": {k: list(v) if isinstance(v, tuple) else v for k, v in dims.items()},
        "paths": {k: os.path.relpath(v, out_dir) for k, v in paths.items()},
        "bytes": {k: _size(v) for k, v in paths.items()},
    }
    write_json(os.path.join(out_dir, "manifest.json"), manifest)
    return paths


def tiny_config(model_type: str, paths: dict[str, str], transformer: str | None = None, **values) -> str:
    """The TOML text of a training config on the tiny set for `model_type`, from its spec's
    TINY.config_files / config_values: the files as `paths` (make_tiny_models' answer, with the
    dataset's) holds them, `transformer` (default: the set's own) and any further `values`."""
    from library.models.registry import spec_of

    tiny = spec_of(model_type).tiny
    keys = {"model_type": model_type, "pretrained_model_name_or_path": transformer or paths[tiny.transformer],
            **{key: paths[name] for key, name in tiny.config_files.items()}, **tiny.config_values,
            "dataset_config": paths["dataset_config"], **values}
    return "".join(f"{key} = {json.dumps(value)}\n" for key, value in keys.items())


def _size(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, files in os.walk(path) for f in files)


# ----------------------------------------------------------------------------------------------
# A captioner for tools/caption_images.py (not part of the set: tests write it when they need it)


# The Qwen3-VL chat template's rendering of messages whose content is a string or a list of image /
# text parts, and its generation prompt (no default system message, unlike Qwen2.5-VL's); tools,
# videos and reasoning left out.
QWEN3_VL_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}"
    "{%- else %}{%- for part in message.content %}"
    "{%- if part.type == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part.type == 'text' %}{{- part.text }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Qwen3-VL's image settings (preprocessor_config.json): patch 16, mean / std 0.5; smaller pixel bounds.
TINY_QWEN3_VL_IMAGE_PROCESSOR = {"min_pixels": 64 * 64, "max_pixels": 32 * 32 * 64, "patch_size": 16, "merge_size": 2,
                                 "temporal_patch_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}


def write_qwen3_vl(out: str, seed: int, width: int = TINY["lm_hidden"]) -> dict[str, str]:
    """A Qwen3VLForConditionalGeneration in one folder as the released Qwen3-VL repos hold it (weights,
    config, preprocessor_config.json, tokenizer with the chat template), for tools/caption_images.py.
    width: the language model's (64 gives every Linear the multiples of 32 outputs and 64 inputs that
    bitsandbytes' 4-bit CPU kernels need). Not part of make_tiny_models' set (training needs no
    captioner); tests write it when they need it."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    tokenizer = build_qwen_tokenizer(vision_templates=())
    tokenizer.chat_template = QWEN3_VL_CHAT_TEMPLATE
    seed_component(seed, 14)
    head_dim = 16
    text = {"vocab_size": round_up(len(tokenizer)), "hidden_size": width, "num_hidden_layers": 2,
            "num_attention_heads": width // head_dim, "num_key_value_heads": width // head_dim // 2, "head_dim": head_dim,
            "intermediate_size": 2 * width, "rms_norm_eps": 1e-6, "max_position_embeddings": 2048,
            "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True,
                                "rope_theta": 5000000.0},
            "bos_token_id": None, "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    vision = {"depth": 2, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "patch_size": 16,
              "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": width,
              "num_position_embeddings": 64, "deepstack_visual_indexes": [0]}
    model = Qwen3VLForConditionalGeneration(Qwen3VLConfig(text_config=text, vision_config=vision,
                                                          **vision_token_ids(tokenizer)))
    folder = os.path.join(out, "qwen3_vl" if width == TINY["lm_hidden"] else f"qwen3_vl_{width}")
    model.save_pretrained(folder, safe_serialization=True)
    save_vl_processor(folder, TINY_QWEN3_VL_IMAGE_PROCESSOR, "Qwen3VLProcessor", tokenizer)
    return {"qwen3_vl": folder}


def main(argv=None):
    try:
        args = build_parser().parse_args(argv)
        check_out_folder("--out", args.out, "the tiny models go there")  # a traceback after the first files
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    paths = make_tiny_models(args.out, args.seed)
    for name, path in paths.items():
        print(f"{name:26s} {_size(path) / 1024:8.1f} KiB  {path}")
    print(f"{'total':26s} {_size(args.out) / 1024:8.1f} KiB  {os.path.join(args.out, 'manifest.json')}")


if __name__ == "__main__":
    exit_without_collecting(main)
