"""merge_lora refuses a merged weight its output type cannot hold, in one line naming the weight, before the
file is done: fp16 wrote such a weight as inf, unscaled e4m3 clipped it to 448, a GGUF block's fp16 scale
overflowed to inf (gguf reads NaN back), each with exit status 0. A scaled or wider output takes it."""

import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.test_merge_convert import merge, only_line

KEY = "double_blocks.0.img_attn.proj.weight"


def big_lora(path, rows: int, cols: int) -> str:
    """A rank-2 kohya LoRA on KEY whose delta is 300 * 300 * 2 = 180000 everywhere (alpha = rank)."""
    name = "lora_unet_" + KEY.removesuffix(".weight").replace(".", "_")
    save_file({f"{name}.lora_down.weight": torch.full((2, cols), 300.0),
               f"{name}.lora_up.weight": torch.full((rows, 2), 300.0), f"{name}.alpha": torch.tensor(2.0)}, str(path))
    return str(path)


@pytest.mark.parametrize(
    "case, extra, message",
    [
        ("fp16", ["--save_precision", "fp16"], "reaches 1.8e+05, past the largest value 65504 of fp16"),
        ("plain_fp8", ["--save_precision", "fp8", "--fp8_layout", "plain"],
         "past the largest value 448 of float8_e4m3fn without a scale: it cannot be written as it is; use a scaled"),
        ("plain_fp8_base", [], "of float8_e4m3fn without a scale: it cannot be written as it is; save bf16"),
        ("gguf", ["--save_precision", "gguf_q8_0"], "reaches 9e+06, past the largest value 8.31901e+06 of GGUF Q8_0"),
    ],
)
def test_a_merged_weight_its_output_cannot_hold_is_one_line_and_no_file(tiny_set, tmp_path, capsys, case, extra,
                                                                        message):
    base = tiny_set["flux_bfl"]
    tensors = load_file(base)
    lora = big_lora(tmp_path / "big.safetensors", *tensors[KEY].shape)
    if case == "plain_fp8_base":  # merged into as it is: its plain e4m3 codes kept
        tensors[KEY] = tensors[KEY].to(torch.float8_e4m3fn)
        save_file(tensors, str(tmp_path / "fp8_base.safetensors"))
        base = str(tmp_path / "fp8_base.safetensors")
    ratio = ":50" if case == "gguf" else ""  # a Q8_0 block holds up to 127 x 65504
    save_to = tmp_path / ("out.gguf" if case == "gguf" else "out.safetensors")
    before = set(os.listdir(tmp_path))
    capsys.readouterr()
    assert merge("--model", base, "--lora", lora + ratio, "--save_to", save_to, *extra) == 2
    line = only_line(capsys.readouterr().err)
    assert line.startswith(f"error: '{KEY}' reaches ") and message in line, line
    assert set(os.listdir(tmp_path)) == before  # no output, no temporary file


def test_wider_and_scaled_outputs_take_the_same_merge(tiny_set, tmp_path):
    base = tiny_set["flux_bfl"]
    lora = big_lora(tmp_path / "big.safetensors", *load_file(base)[KEY].shape)
    for precision in ("bf16", "fp8_scaled"):
        assert merge("--model", base, "--lora", lora, "--save_to", tmp_path / f"{precision}.safetensors",
                     "--save_precision", precision) == 0
    merged = load_file(str(tmp_path / "bf16.safetensors"))[KEY].float()
    assert (merged - 180000).abs().max() <= 0.004 * 180000  # bf16's rounding of the base + 180000


def test_a_merged_weight_fp16_rounds_to_its_largest_value_is_written(tiny_set, tmp_path):
    """A merged weight just past 65504 but below 65520 (fp16's rounding boundary to inf) rounds to 65504 as any
    value rounds: check_in_range refused it ("cannot be written as it is") though the fp16 file holds it finite."""
    base = tiny_set["flux_bfl"]
    rows, cols = load_file(base)[KEY].shape
    name = "lora_unet_" + KEY.removesuffix(".weight").replace(".", "_")
    side = (65512.0 / 2) ** 0.5  # rank 2, alpha = rank: delta 2 * side^2 = 65512 (+ the base's small values)
    save_file({f"{name}.lora_down.weight": torch.full((2, cols), side),
               f"{name}.lora_up.weight": torch.full((rows, 2), side), f"{name}.alpha": torch.tensor(2.0)},
              str(tmp_path / "near.safetensors"))
    assert merge("--model", base, "--lora", tmp_path / "near.safetensors", "--save_to", tmp_path / "out.safetensors",
                 "--save_precision", "fp16") == 0
    merged = load_file(str(tmp_path / "out.safetensors"))[KEY]
    assert merged.dtype == torch.float16 and torch.isfinite(merged).all() and merged.float().max() == 65504
