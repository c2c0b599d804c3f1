"""tools/convert_config.py on sd-scripts' hunyuan_image_train_network.py configs: its documented command line and a
TOML become configs train_lora.py reads; its LoRA module's modules at their ranks are ours' (networks.lora_hunyuan_
image's own network on the tiny model where an sd-scripts checkout is at hand, a fixed list always); its default
"sigma" draw is refused with ours' closest draw, whose distance is measured here, and its flux_shift (a quarter of
this model's tokens) with the one-size equal."""

import math
import os
import types
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from library.models import flow_matching as fm
from library.models.registry import spec_of
from library.text_files import toml_loads
from library.training.config import load_config, lora_network_args
from library.training.peers import sd_scripts
from library.training.peers.rules import DROPPED, KEPT, NOT_CARRIED, RENAMED
from networks.lora import LoRANetwork
from tests.test_convert_config_sd_scripts import CHECKOUT, convert

TINY_DOUBLE, TINY_SINGLE = 2, 2  # library/models/hunyuan_image/tiny.py
# every Linear of an MMDoubleStreamBlock (per stream: modulation, fused qkv, out, MLP in / out) and of an
# MMSingleStreamBlock (linear1, linear2, modulation): networks.lora_hunyuan_image's TARGET_REPLACE_MODULE_* default
DOUBLE_LINEARS = tuple(f"{s}_{m}" for s in ("img", "txt")
                       for m in ("mod.linear", "attn_qkv", "attn_proj", "mlp.fc1", "mlp.fc2"))
SINGLE_LINEARS = ("linear1", "linear2", "modulation.linear")
THEIR_DEFAULT = {*(f"double_blocks.{i}.{n}" for i in range(TINY_DOUBLE) for n in DOUBLE_LINEARS),
                 *(f"single_blocks.{i}.{n}" for i in range(TINY_SINGLE) for n in SINGLE_LINEARS)}


def their_dataset(tmp_path, image_dir) -> str:
    """An sd-scripts dataset TOML over the tiny images, buckets on the 32 px its script asserts for this model."""
    path = tmp_path / "my_hunyuan_dataset_config.toml"
    path.write_text("\n".join([
        "[general]", "shuffle_caption = false", 'caption_extension = ".txt"', "", "[[datasets]]", "resolution = 64",
        "batch_size = 1", "enable_bucket = true", "min_bucket_reso = 32", "max_bucket_reso = 128",
        "bucket_reso_steps = 32", "", "  [[datasets.subsets]]", f'  image_dir = "{image_dir}"', "  num_repeats = 1",
        ""]))
    return str(path)


def hunyuan_command(tiny_set, dataset: str, out: str, *extra: str) -> str:
    """sd-scripts' docs/hunyuan_image_train_network.md command line (section 4), its paths on the tiny set (the single
    files its docs download: Tencent's DiT, ComfyUI's Qwen2.5-VL, byT5 and VAE)."""
    return " ".join([
        "accelerate launch --num_cpu_threads_per_process 1 hunyuan_image_train_network.py",
        f'--pretrained_model_name_or_path="{tiny_set["hunyuan_image"]}"',
        f'--text_encoder="{tiny_set["hunyuan_image_qwen_single_file"]}"',
        f'--byt5="{tiny_set["hunyuan_image_glyph_single_file"]}"', f'--vae="{tiny_set["hunyuan_image_vae_single"]}"',
        f'--dataset_config="{dataset}"', f'--output_dir="{out}"', '--output_name="my_hunyuan_lora"',
        "--save_model_as=safetensors", "--network_module=networks.lora_hunyuan_image", "--network_dim=16",
        "--network_alpha=1", "--network_train_unet_only", "--learning_rate=1e-4", '--optimizer_type="AdamW8bit"',
        '--lr_scheduler="constant"', '--attn_mode="torch"', "--split_attn", "--max_train_epochs=10",
        "--save_every_n_epochs=1", '--mixed_precision="bf16"', "--gradient_checkpointing",
        '--model_prediction_type="raw"', "--discrete_flow_shift=5.0", "--blocks_to_swap=18",
        "--cache_text_encoder_outputs", "--cache_latents", *extra,
    ])


def test_documented_command_converts_and_train_lora_reads_it(tiny_set, tmp_path, capsys):
    """text_encoder / byt5 kept, vae -> ae, its fp8 switches as our precisions, blocks_to_swap 18 -> 27, the memory
    switches dropped; its default draw "sigma" ours' shift of a uniform draw at its 5.0; the FLUX.1 script's
    guidance_scale and Lumina's sample_batch_size unknown (its parser has neither)."""
    dataset = their_dataset(tmp_path, tiny_set["image_dir"])
    command = hunyuan_command(tiny_set, dataset, str(tmp_path / "run"), "--fp8_scaled", "--fp8_base", "--fp8_vl",
                              "--text_encoder_cpu", "--vae_chunk_size=16", "--guidance_scale=1.0",
                              "--sample_batch_size=2")
    out = tmp_path / "ours.toml"
    code, rows, text = convert(["--command", command, "--out", str(out)], capsys)
    assert code == 0, text
    assert (rows["text_encoder"], rows["byt5"], rows["vae"]) == (("kept", ""), ("kept", ""), ("renamed", "ae"))
    for dropped in ("attn_mode", "split_attn", "vae_chunk_size", "text_encoder_cpu", "model_prediction_type",
                    "fp8_base", "network_train_unet_only", "cache_latents"):
        assert rows[dropped][0] == "dropped", (dropped, rows[dropped])
    assert rows["fp8_scaled"] == ("renamed", 'base_precision = "fp8_scaled"')
    assert rows["fp8_vl"] == ("renamed", 'text_encoder_precision = "fp8"')
    assert rows["blocks_to_swap"][1].startswith("blocks_to_swap = 27: sd-scripts' 18 swaps 9 double and 18 single")
    assert rows["timestep_sampling (default)"][0] == "renamed" and rows["discrete_flow_shift"] == ("kept", "")
    assert "int64(1000 sigma)" in text  # the feed's note
    assert rows["guidance_scale"][0] == rows["sample_batch_size"][0] == "unknown"
    assert "network_args (default)" not in rows  # its default trains ours' default modules
    assert "check: train_lora.py reads it as written" in text
    ours = toml_loads(out.read_text())
    assert (ours["model_type"], ours["text_encoder"], ours["byt5"], ours["ae"]) == (
        "hunyuan_image", tiny_set["hunyuan_image_qwen_single_file"], tiny_set["hunyuan_image_glyph_single_file"],
        tiny_set["hunyuan_image_vae_single"])
    assert (ours["base_precision"], ours["text_encoder_precision"], ours["blocks_to_swap"]) == ("fp8_scaled", "fp8", 27)
    assert (ours["timestep_sampling"], ours["shifted_draw"], ours["discrete_flow_shift"]) == ("shift", "uniform", 5.0)
    assert "network_args" not in ours
    args = load_config(["--config_file", str(out)])
    assert (args.model_type, args.network_dim, args.network_alpha) == ("hunyuan_image", 16, 1.0)


def test_the_check_names_a_missing_byt5_file(tiny_set, tmp_path, capsys):
    """The family's own file keys (byt5) are checked with the rest: a path this machine lacks is named."""
    dataset = their_dataset(tmp_path, tiny_set["image_dir"])
    command = hunyuan_command(tiny_set, dataset, str(tmp_path / "run")).replace(
        tiny_set["hunyuan_image_glyph_single_file"], str(tmp_path / "absent_byt5.safetensors"))
    code, _, text = convert(["--command", command, "--out", str(tmp_path / "ours.toml")], capsys)
    assert code == 0 and f"not on this machine: byt5 = {tmp_path / 'absent_byt5.safetensors'}" in text, text


def test_toml_reads_its_scripts_defaults_and_draws(tiny_set, tmp_path, capsys):
    """A TOML (its text_encoder key names the script): `shift` at its discrete_flow_shift 5.0 default; lora_flux's
    type ranks, train_blocks and in_dims dropped (its create_network reads none), network_reg_dims kept; another
    prediction type, a text encoder rate and split_qkv said; the other draws as FLUX.1's rules read them."""
    dataset = their_dataset(tmp_path, tiny_set["image_dir"])
    config = tmp_path / "hunyuan_lora.toml"
    config.write_text("\n".join([f'dataset_config = "{dataset}"',
        f'pretrained_model_name_or_path = "{tiny_set["hunyuan_image"]}"',
        f'text_encoder = "{tiny_set["hunyuan_image_text_encoder"]}"',
        f'byt5 = "{tiny_set["hunyuan_image_glyph_encoder"]}"', f'vae = "{tiny_set["hunyuan_image_vae"]}"',
        f'output_dir = "{tmp_path / "run"}"', 'timestep_sampling = "shift"', "sigmoid_scale = 1.2",
        'network_args = ["train_blocks=single", "img_attn_dim=8", "in_dims=[4,4,4,4,4]", "split_qkv=True", '
        '"network_reg_dims=single_blocks=8,img_mod=0", "verbose=True"]', ""]))
    code, rows, text = convert([str(config)], capsys)
    assert code == 0, text
    assert rows["timestep_sampling"][0] == "kept" and rows["discrete_flow_shift (default)"] == ("kept", "")
    for name in ("train_blocks", "img_attn_dim", "in_dims"):
        assert rows[f"network_args {name}"] == ("dropped", "networks.lora_hunyuan_image does not read it"), name
    assert rows["network_args split_qkv"][0] == "not carried" and rows["network_args verbose"][0] == "dropped"
    ours = toml_loads((tmp_path / "hunyuan_lora_converted.toml").read_text())
    assert (ours["model_type"], ours["timestep_sampling"], ours["sigmoid_scale"], ours["discrete_flow_shift"]) == (
        "hunyuan_image", "shift", 1.2, 5.0)
    assert ours["network_args"] == ["network_reg_dims=single_blocks=8,img_mod=0"]
    assert "check: train_lora.py reads it as written" in text

    def verdicts(**config) -> tuple[dict, dict]:
        t = sd_scripts.translate({"text_encoder": "q", **config}, "x.toml")
        return {line.key: line.verdict for line in t.lines}, t.config

    v, c = verdicts(timestep_sampling="sigma", discrete_flow_shift=1.0)  # unshifted: U(0, 1)
    assert v["timestep_sampling"] == RENAMED and c["timestep_sampling"] == "uniform"
    v, c = verdicts(timestep_sampling="sigma", weighting_scheme="logit_normal", logit_std=1.3)
    assert (c["timestep_sampling"], c["sigmoid_scale"], c["discrete_flow_shift"]) == ("shift", 1.3, 5.0)
    v, c = verdicts(timestep_sampling="uniform", model_prediction_type="sigma_scaled", network_train_unet_only=False,
                    text_encoder_lr=1e-5)
    assert (v["timestep_sampling"], c["timestep_sampling"]) == (KEPT, "uniform")
    assert v["model_prediction_type"] == NOT_CARRIED
    assert v["network_train_unet_only"] == v["text_encoder_lr"] == DROPPED  # its network makes no text encoder LoRA
    v, c = verdicts(fp8_base=True)  # without fp8_scaled its script casts the DiT plainly (a warning)
    assert v["fp8_base"] == RENAMED and c["base_precision"] == "fp8"


def test_default_sigma_draw_is_ours_shift_of_a_uniform_draw():
    """Its default: u ~ U(0, 1) picks one of the 1000 sigmas of the scheduler shifted by 5 (diffusers'
    FlowMatchEulerDiscreteScheduler's, as its own); ours' shift at k = 5 of a uniform draw (shifted_draw) is that law
    continuous: at the quantiles of its grid ours' sigmas are its, and ours' sampler's CDF is within 1 / 1000 of the
    grid's at every sigma (the grid's steps). Ours' old closest, the shift of sigmoid(1.7 randn), was 0.0106 off."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    theirs = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=5.0).sigmas[:1000].double().sort().values
    q = 1 - (torch.arange(1000, dtype=torch.float64) + 1) / 1000  # its grid: sigma_i = shift(i / 1000), i = 1 .. 1000
    ours = fm.sample_sigmas(1000, "shift", generator=None, shift=5.0, quantiles=q.clamp(1e-6, 1 - 1e-6),
                            shifted="uniform").double().sort().values
    assert (ours - theirs).abs().max().item() < 1e-5
    draws = fm.sample_sigmas(200_000, "shift", generator=torch.Generator().manual_seed(0), shift=5.0,
                             shifted="uniform").double().sort().values
    grid = torch.linspace(0.01, 0.99, 99, dtype=torch.float64)
    empirical = torch.searchsorted(draws, grid, right=True).double() / len(draws)
    grid_cdf = torch.searchsorted(theirs, grid, right=True).double() / 1000
    assert (empirical - grid_cdf).abs().max().item() < 0.005  # 200 000 draws: KS ~ 0.003, the grid's 0.001
    t = sd_scripts.translate({"text_encoder": "q"}, "x.toml")
    line = next(line for line in t.lines if line.key == "timestep_sampling (default)")
    assert line.verdict == RENAMED and spec_of("hunyuan_image").sampling.method == "hunyuan_image_shift"
    assert (t.config["timestep_sampling"], t.config["shifted_draw"], t.config["discrete_flow_shift"]) == (
        "shift", "uniform", 5.0)


def test_flux_shift_is_refused_with_its_one_size_equal():
    """Its flux_shift reads FLUX.1's line at (h/2)(w/2) of the 32x latent: at 1024 px mu = 0.5 (ours' flux_shift
    reads 1024 tokens: 0.63); time_shift(mu) is the shift draw at k = e^mu, the numbers its refusal names."""
    t = sd_scripts.translate({"text_encoder": "q", "timestep_sampling": "flux_shift"}, "x.toml")
    line = next(line for line in t.lines if line.key == "timestep_sampling")
    assert line.verdict == NOT_CARRIED and "1.65 at 1024 px, 1.88 at 2048 px" in line.text
    s = torch.linspace(0.001, 0.999, 999, dtype=torch.float64)
    for px, k in ((1024, 1.65), (2048, 1.88)):
        h = px // 32
        mu = fm.calculate_shift((h // 2) * (h // 2), 256, 4096, 0.5, 1.15)
        assert round(math.exp(mu), 2) == k
        shifted = (math.exp(mu) * s / (1 + (math.exp(mu) - 1) * s)).float()
        assert (fm.time_shift(mu, s) - shifted).abs().max().item() < 1e-6  # (time_shift runs in float32)
    assert fm.calculate_shift(32 * 32, 256, 4096, 0.5, 1.15) == pytest.approx(0.63)  # ours' read at 1024 px


def our_lora(network_args: list[str], rank: int) -> dict[str, int]:
    from library.models.hunyuan_image.tiny import random_hunyuan_image, tiny_config

    args = lora_network_args(SimpleNamespace(network_args=network_args, network_dropout=0.0, config_file="x.toml"))
    model = random_hunyuan_image(tiny_config())
    return {m.name: m.rank for m in LoRANetwork(model, "hunyuan_image", rank=rank, network_args=args).lora_modules()}


def test_the_default_trains_every_linear_of_the_double_and_single_blocks():
    """TARGET_REPLACE_MODULE_DOUBLE / _SINGLE: every Linear of the MMDoubleStreamBlocks and MMSingleStreamBlocks at
    network_dim, modulation included, nothing else (refiner, embedders, final layer): ours' default, 26 tiny modules."""
    from library.models.hunyuan_image.tiny import random_hunyuan_image, tiny_config

    model = random_hunyuan_image(tiny_config())
    walked = {f"{name}.{child}" for name, block in model.named_modules()
              if type(block).__name__ in ("MMDoubleStreamBlock", "MMSingleStreamBlock")
              for child, m in block.named_modules() if isinstance(m, nn.Linear)}
    assert walked == THEIR_DEFAULT and len(THEIR_DEFAULT) == 26
    t = sd_scripts.translate({"text_encoder": "q", "network_dim": 8, "network_args": ["train_blocks=double"]}, "x.toml")
    assert "network_args" not in t.config  # (train_blocks: unread there)
    ours = our_lora([], 8)
    assert set(ours) == THEIR_DEFAULT and set(ours.values()) == {8}


def their_network(network_args: dict[str, str], rank: int) -> dict[str, int]:
    """networks.lora_hunyuan_image's own create_network (on lora_flux's LoRANetwork) over the tiny model, read from
    the checkout: its `library` is not ours, so its imports of it (a log setup, type hints) are left out. Our blocks
    carry its class names (MMDoubleStreamBlock, MMSingleStreamBlock), which its module walk looks for."""
    from library.models.hunyuan_image.tiny import random_hunyuan_image, tiny_config

    def source(name: str) -> str:
        with open(os.path.join(CHECKOUT, "networks", name), encoding="utf-8") as f:
            return (f.read().replace("from library.utils import setup_logging", "setup_logging = lambda: None")
                    .replace("from library.sdxl_original_unet import SdxlUNet2DConditionModel",
                             "SdxlUNet2DConditionModel = None")
                    .replace("from library.hunyuan_image_vae import HunyuanVAE2D", "HunyuanVAE2D = None")
                    .replace("from networks import lora_flux", ""))

    lora_flux = types.ModuleType("lora_flux")
    exec(compile(source("lora_flux.py"), "lora_flux.py", "exec"), lora_flux.__dict__)
    namespace = {"__name__": "lora_hunyuan_image", "lora_flux": lora_flux}
    exec(compile(source("lora_hunyuan_image.py"), "lora_hunyuan_image.py", "exec"), namespace)
    model = random_hunyuan_image(tiny_config())
    network = namespace["create_network"](1.0, rank, rank, None, [nn.Module()], model, **network_args)
    return {lora.lora_name.removeprefix("lora_unet_"): lora.lora_dim for lora in network.unet_loras}


@pytest.mark.skipif(not os.path.isfile(os.path.join(CHECKOUT, "networks", "lora_hunyuan_image.py")),
                    reason="no sd-scripts checkout (.peers/sd-scripts or SD_SCRIPTS_CHECKOUT)")
@pytest.mark.parametrize("network_args", [
    {}, {"train_blocks": "single", "img_attn_dim": "8", "in_dims": "[4,4,4,4,4]"},
    {"network_reg_dims": "single_blocks=8,img_mod=0"},
    {"network_reg_dims": "txt_=2", "train_double_block_indices": "0"},
])
def test_our_network_trains_its_modules_at_its_ranks(network_args):
    """Each argument set's translation trains the modules networks.lora_hunyuan_image trains, each at its rank."""
    given = [f"{k}={v}" for k, v in network_args.items()]
    t = sd_scripts.translate({"text_encoder": "q", "network_dim": 4, "network_args": given}, "x.toml")
    ours = {name.replace(".", "_"): rank for name, rank in our_lora(t.config.get("network_args", []), 4).items()}
    assert ours == their_network(network_args, 4)
