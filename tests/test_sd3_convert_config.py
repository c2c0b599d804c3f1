"""tools/convert_config.py on sd-scripts' sd3_train_network.py and ai-toolkit's sd3 configs: its documented command
line and an all-in-one checkpoint's become configs train_lora.py reads; its draw and loss (weighting_scheme's density
and x0 loss, training_shift, the whole-timestep floor) are ours where the law is the same, measured here, and refused
with the closest where not; its encoder masks mean what their refusals say (measured on the tiny CLIP and T5); its
LoRA module's modules at their ranks are ours' (networks.lora_sd3's own network on the tiny model where an sd-scripts
checkout is at hand, a fixed list always)."""

import math
import os
import types
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file as load_safetensors

from library.io import save_safetensors
from library.models import flow_matching as fm
from library.models.registry import spec_of
from library.text_files import toml_loads
from library.training.config import load_config, lora_network_args
from library.training.peers import ai_toolkit, sd_scripts
from library.training.peers.rules import DROPPED, KEPT, NOT_CARRIED, RENAMED
from networks.lora import LoRANetwork
from tests.test_convert_config_ai_toolkit import job, verdict
from tests.test_convert_config_sd_scripts import CHECKOUT, convert

# every Linear of each stream of the tiny model's 3 joint blocks (networks.lora_sd3's SD3_TARGET_REPLACE_MODULE
# SingleDiTBlock, ours DismantledBlock): block 0's x_block has MMDiT-X's attn2, block 2's context_block is pre-only
STREAM = ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2", "adaLN_modulation.1")
THEIR_DEFAULT = {*(f"joint_blocks.{i}.{s}_block.{m}" for i in range(3) for s in ("x", "context") for m in STREAM
                   if not (i == 2 and s == "context" and m != "attn.qkv" and m != "adaLN_modulation.1")),
                 "joint_blocks.0.x_block.attn2.qkv", "joint_blocks.0.x_block.attn2.proj"}


def their_dataset(tmp_path, image_dir) -> str:
    path = tmp_path / "my_sd3_dataset_config.toml"
    path.write_text("\n".join([
        "[general]", 'caption_extension = ".txt"', "", "[[datasets]]", "resolution = 64", "batch_size = 1",
        "enable_bucket = true", "min_bucket_reso = 32", "max_bucket_reso = 128",
        "bucket_reso_steps = 32", "", "  [[datasets.subsets]]", f'  image_dir = "{image_dir}"',
        ""]))
    return str(path)


def sd3_command(model: str, dataset: str, out: str, *extra: str) -> str:
    """sd-scripts' docs/sd3_train_network.md command line (section 4) with its LoRA module, on the tiny files."""
    return " ".join([
        "accelerate launch --num_cpu_threads_per_process 1 sd3_train_network.py",
        f'--pretrained_model_name_or_path="{model}"', f'--dataset_config="{dataset}"', f'--output_dir="{out}"',
        '--output_name="my_sd3_lora"', "--save_model_as=safetensors", "--network_module=networks.lora_sd3",
        "--network_dim=16", "--network_alpha=1", "--learning_rate=1e-4", '--optimizer_type="AdamW8bit"',
        '--lr_scheduler="constant"', "--sdpa", "--max_train_epochs=10", "--save_every_n_epochs=1",
        '--mixed_precision="fp16"', "--gradient_checkpointing", '--weighting_scheme="uniform"', "--blocks_to_swap=32",
        *extra])


def test_documented_command_converts_and_train_lora_reads_it(tiny_set, tmp_path, capsys):
    """The files kept (vae -> ae), blocks_to_swap 32 of one block kind; its default draw uniform (ours "uniform"),
    its x0 loss as weighting_scheme sigma_sq; the encoder masks, per-encoder dropout and random crop of the positions
    not carried, its [DOES NOT WORK] switches dropped, the FLUX.1 script's draw keys unknown (its parser has none)."""
    dataset = their_dataset(tmp_path, tiny_set["image_dir"])
    command = sd3_command(
        tiny_set["sd3"], dataset, str(tmp_path / "run"), f'--clip_l="{tiny_set["sd3_clip_l_single"]}"',
        f'--clip_g="{tiny_set["sd3_clip_g_single"]}"', f'--t5xxl="{tiny_set["sd3_t5xxl_single"]}"',
        f'--vae="{tiny_set["sd3_vae"]}"', "--apply_lg_attn_mask", "--t5_dropout_rate=0.1",
        "--pos_emb_random_crop_rate=0.0", "--cache_text_encoder_outputs", "--network_train_unet_only", "--save_clip",
        "--guidance_scale=1.0", "--timestep_sampling=shift", "--fp8_base")
    out = tmp_path / "ours.toml"
    code, rows, text = convert(["--command", command, "--out", str(out)], capsys)
    assert code == 0, text
    assert (rows["clip_l"], rows["clip_g"], rows["t5xxl"], rows["vae"]) == (
        ("kept", ""), ("kept", ""), ("kept", ""), ("renamed", "ae"))
    assert rows["weighting_scheme (draw)"][0] == "renamed" and 'timestep_sampling = "uniform"' in rows[
        "weighting_scheme (draw)"][1]
    assert rows["weighting_scheme (loss)"] == ("renamed", 'weighting_scheme = "sigma_sq": its x0 loss (weight 1) is '
                                                          'sigma^2 x the velocity loss')
    assert rows["blocks_to_swap"][0] == "kept" and rows["fp8_base"] == ("renamed", 'base_precision = "fp8" (the plain '
                                                                       'cast, as sd-scripts; "fp8_scaled" is ours '
                                                                       'with per-block scales)')
    for refused in ("apply_lg_attn_mask", "t5_dropout_rate"):
        assert rows[refused][0] == "not carried", refused
    for dropped in ("pos_emb_random_crop_rate", "save_clip", "sdpa", "network_train_unet_only",
                    "cache_text_encoder_outputs"):
        assert rows[dropped][0] == "dropped", (dropped, rows[dropped])
    assert rows["guidance_scale"][0] == rows["timestep_sampling"][0] == "unknown"
    assert "network_args (default)" not in rows  # its default trains ours' default modules
    assert "check: train_lora.py reads it as written" in text
    ours = toml_loads(out.read_text())
    assert (ours["model_type"], ours["clip_g"], ours["ae"], ours["timestep_sampling"], ours["blocks_to_swap"]) == (
        "sd3", tiny_set["sd3_clip_g_single"], tiny_set["sd3_vae"], "uniform", 32)
    args = load_config(["--config_file", str(out)])
    assert (args.model_type, args.network_dim, args.network_alpha, args.base_precision) == ("sd3", 16, 1.0, "fp8")


def test_an_all_in_one_checkpoint_is_every_file_and_the_docs_lora_module_is_refused(tiny_set, tmp_path, capsys):
    """Without --clip_l / --clip_g / --t5xxl / --vae sd-scripts reads them from the checkpoint (sd3_utils.load_*):
    ours takes the checkpoint as each key's path (its loaders read text_encoders.* and first_stage_model.*). The docs'
    networks.lora (the SD 1.x module: no MMDiT module is its target) is not carried."""
    aio = tmp_path / "sd3_tiny_incl_clips_t5xxl.safetensors"
    save_safetensors({**load_safetensors(tiny_set["sd3"]), **load_safetensors(tiny_set["sd3_text_bundled"]),
                      **load_safetensors(tiny_set["sd3_vae"])}, str(aio))
    command = sd3_command(str(aio), their_dataset(tmp_path, tiny_set["image_dir"]), str(tmp_path / "run")).replace(
        "networks.lora_sd3", "networks.lora")
    out = tmp_path / "ours.toml"
    code, rows, text = convert(["--command", command, "--out", str(out)], capsys)
    assert code == 0, text
    for key in ("clip_l", "clip_g", "t5xxl"):
        assert rows[f"{key} (default)"][0] == "kept", key
    assert rows["vae (default)"][0] == "renamed" and rows["network_module"][0] == "not carried"
    ours = toml_loads(out.read_text())
    assert {ours[k] for k in ("pretrained_model_name_or_path", "clip_l", "clip_g", "t5xxl", "ae")} == {str(aio)}
    assert load_config(["--config_file", str(out)]).clip_g == str(aio)


def draw(**config) -> tuple[dict, dict]:
    """{line key: (verdict, text)} and our keys of a TOML holding `config` (clip_g names the script)."""
    t = sd_scripts.translate({"clip_g": "g.safetensors", **config}, "x.toml")
    return {line.key.removesuffix(" (default)"): (line.verdict, line.text) for line in t.lines}, t.config


@pytest.mark.parametrize("config, ours, draw_verdict, loss_verdict", [
    ({}, {"timestep_sampling": "uniform", "weighting_scheme": "sigma_sq"}, RENAMED, RENAMED),
    ({"weighting_scheme": "sigma_sqrt"}, {"timestep_sampling": "uniform", "weighting_scheme": "none"}, RENAMED,
     RENAMED),
    ({"weighting_scheme": "logit_normal", "logit_std": 1.3, "training_shift": 3.0},
     {"timestep_sampling": "shift", "sigmoid_scale": 1.3, "discrete_flow_shift": 3.0, "weighting_scheme": "sigma_sq"},
     RENAMED, RENAMED),
    ({"weighting_scheme": "logit_normal"}, {"timestep_sampling": "sigmoid", "sigmoid_scale": 1.0,
                                            "weighting_scheme": "sigma_sq"}, RENAMED, RENAMED),
    ({"weighting_scheme": "logit_normal", "logit_mean": 0.5},  # its sigma is u: the mean as it is
     {"timestep_sampling": "sigmoid", "sigmoid_scale": 1.0, "sigmoid_mean": 0.5, "weighting_scheme": "sigma_sq"},
     RENAMED, RENAMED),
    ({"weighting_scheme": "mode"}, {"timestep_sampling": "mode", "mode_scale": 1.29, "weighting_scheme": "sigma_sq"},
     RENAMED, RENAMED),
    ({"weighting_scheme": "mode", "mode_scale": 0.8, "training_shift": 3.0},
     {"timestep_sampling": "shift", "shifted_draw": "mode", "mode_scale": 0.8, "discrete_flow_shift": 3.0,
      "weighting_scheme": "sigma_sq"}, RENAMED, RENAMED),
    ({"weighting_scheme": "mode", "mode_scale": 2.0}, {"weighting_scheme": "sigma_sq"}, NOT_CARRIED, RENAMED),
    ({"weighting_scheme": "cosmap", "training_shift": 3.0},  # its uniform density shifted: ours' shifted_draw
     {"timestep_sampling": "shift", "shifted_draw": "uniform", "discrete_flow_shift": 3.0}, RENAMED, NOT_CARRIED),
    ({"training_shift": 3.0},
     {"timestep_sampling": "shift", "shifted_draw": "uniform", "discrete_flow_shift": 3.0,
      "weighting_scheme": "sigma_sq"}, RENAMED, RENAMED),
])
def test_its_draw_and_loss_become_ours_where_the_law_is_the_same(config, ours, draw_verdict, loss_verdict):
    lines, translated = draw(**config)
    assert lines["weighting_scheme (draw)"][0] == draw_verdict and lines["weighting_scheme (loss)"][0] == loss_verdict
    assert {k: translated[k] for k in ("timestep_sampling", "sigmoid_scale", "sigmoid_mean", "mode_scale",
                                       "discrete_flow_shift", "shifted_draw", "weighting_scheme")
            if k in translated} == ours


def test_its_draw_arguments_each_say_what_they_became():
    lines, _ = draw(weighting_scheme="uniform", training_shift=3.0, logit_std=2.0, min_timestep=100, max_timestep=1000)
    assert lines["weighting_scheme (draw)"][1].startswith(
        'timestep_sampling = "shift" with shifted_draw = "uniform", discrete_flow_shift = 3 (the same law')
    assert lines["training_shift"] == (RENAMED, "discrete_flow_shift") and lines["logit_std"][0] == DROPPED
    # its t = floor(u' (max - min) + min): the law scaled into the range, as ours' (not carried before 2026-12-05)
    assert lines["min_timestep"] == (KEPT, "min_timestep") and lines["max_timestep"][0] == DROPPED
    ranged = draw(min_timestep=100, max_timestep=900)[1]
    assert (ranged["min_timestep"], ranged["max_timestep"]) == (100, 900)
    lines, config = draw(weighting_scheme="logit_normal", logit_std=1.3, logit_mean=0.0, training_shift=3.0)
    assert lines["logit_std"] == (RENAMED, "sigmoid_scale")
    assert lines["training_shift"] == (RENAMED, "discrete_flow_shift")
    assert lines["logit_mean"][0] == DROPPED
    assert draw(weighting_scheme="logit_normal", logit_mean=-0.4)[0]["logit_mean"] == (RENAMED, "sigmoid_mean")
    lines, config = draw(weighting_scheme="mode", mode_scale=1.0, logit_mean=0.5)
    assert lines["mode_scale"] == (KEPT, "mode_scale") and lines["logit_mean"][0] == DROPPED
    assert "ours' mode draw takes (-1, 1.75]" in draw(weighting_scheme="mode", mode_scale=2.0)[0][
        "weighting_scheme (draw)"][1]
    with pytest.raises(ValueError, match="weighting_scheme 'lognorm'"):
        draw(weighting_scheme="lognorm")


def their_cdf(x: torch.Tensor, law_cdf, k: float) -> torch.Tensor:
    """P(sigma <= x) of its draw: u' = k u / (1 + (k - 1) u) of a u of CDF law_cdf, sigma = floor(1000 u') / 1000."""
    upper = (torch.floor(x * 1000 + 1e-9) + 1) / 1000  # sigma <= x  <=>  u' < (floor(1000 x) + 1) / 1000
    unshifted = upper / (k - (k - 1) * upper)
    return law_cdf(unshifted.clamp(0, 1))


def sigmoid_cdf(scale: float):
    return lambda s: 0.5 * (1 + torch.erf(torch.log(s / (1 - s)) / scale / math.sqrt(2))).nan_to_num(0.0, 1.0)


def ours_cdf(x: torch.Tensor, scale: float, k: float) -> torch.Tensor:
    return sigmoid_cdf(scale)(x / (k - (k - 1) * x))


def test_the_draws_are_its_laws_within_the_distances_said():
    """logit_normal at shift 3 is ours' shift draw but for its whole-timestep floor (0.0026 in CDF; ours' sampler
    draws that law: KS of 100 000 draws < 0.006); its uniform draw shifted by 3 is ours' shift of a uniform draw
    (shifted_draw) but for the floor (0.003 in CDF; ours' sampler: KS < 0.006), where the closest shift of a sigmoid
    draw (scale 1.7) was 0.0113 off."""
    x = torch.linspace(1e-5, 1 - 1e-5, 100_001, dtype=torch.float64)
    same = (their_cdf(x, sigmoid_cdf(1.0), 3.0) - ours_cdf(x, 1.0, 3.0)).abs().max().item()
    assert 0.002 < same < 0.003, same  # the floor: 0.001 x the law's density, 2.6 at its peak
    draws = fm.sample_sigmas(100_000, "shift", generator=torch.Generator().manual_seed(0), shift=3.0).double()
    grid = torch.linspace(0.01, 0.99, 99, dtype=torch.float64)
    empirical = torch.searchsorted(draws.sort().values, grid, right=True).double() / len(draws)
    assert (empirical - ours_cdf(grid, 1.0, 3.0)).abs().max().item() < 0.006
    assert spec_of("sd3").sampling.shift == 3.0  # ours' default draw, sd3_shift: this shift draw at k = 3

    def uniform(scale: float) -> float:
        return (their_cdf(x, lambda u: u, 3.0) - ours_cdf(x, scale, 3.0)).abs().max().item()

    assert 0.011 < uniform(1.7) <= 0.012 and uniform(1.0) > 0.11 and min(uniform(1.6), uniform(1.8)) > uniform(1.7)
    shifted = x / (3.0 - 2.0 * x)  # ours' shifted uniform draw's CDF: the unshifted sigma of x
    assert (their_cdf(x, lambda u: u, 3.0) - shifted).abs().max().item() < 0.0031  # 0.001 x its density, 3 at 1
    draws = fm.sample_sigmas(100_000, "shift", generator=torch.Generator().manual_seed(1), shift=3.0,
                             shifted="uniform").double()
    empirical = torch.searchsorted(draws.sort().values, grid, right=True).double() / len(draws)
    assert (empirical - grid / (3.0 - 2.0 * grid)).abs().max().item() < 0.006


def ks(draws: torch.Tensor, reference: torch.Tensor) -> float:
    """The largest CDF distance between two samples (Kolmogorov-Smirnov), both float64."""
    grid = torch.linspace(0, 1, 2001, dtype=torch.float64)
    cdf = [torch.searchsorted(d.double().sort().values, grid, right=True).double() / len(d) for d in (draws, reference)]
    return (cdf[0] - cdf[1]).abs().max().item()


@pytest.mark.parametrize("scale, k", [(1.29, 1.0), (0.5, 3.0), (-0.5, 1.0), (1.75, 1.0)])
def test_ours_mode_draw_is_its_mode_law(scale, k):
    """Its mode density (diffusers' compute_density_for_timestep_sampling, restated: 1 - v - s (cos^2(pi v / 2) - 1 +
    v) of v ~ U[0, 1)), shifted by training_shift k, against ours' timestep_sampling "mode" (k = 1) or a shift of
    shifted_draw "mode": KS of 200 000 draws each < 0.006; the sigmoid draw is not it (> 0.03 at the default)."""
    v = torch.rand(200_000, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    u = 1 - v - scale * (torch.cos(math.pi * v / 2) ** 2 - 1 + v)
    theirs = k * u / (1 + (k - 1) * u)
    method = "mode" if k == 1 else "shift"
    ours = fm.sample_sigmas(200_000, method, generator=torch.Generator().manual_seed(6), shift=k, shifted="mode",
                            mode_scale=scale)
    assert ks(ours, theirs) < 0.006
    if scale == 1.29:
        assert ks(fm.sample_sigmas(200_000, "sigmoid", generator=torch.Generator().manual_seed(6)), theirs) > 0.03
    quantiles = (torch.arange(1000, dtype=torch.float64) + 0.5) / 1000  # (num_timestep_buckets: monotone in them)
    mapped = fm.sample_sigmas(1000, method, generator=None, shift=k, shifted="mode", mode_scale=scale,
                              quantiles=quantiles)
    assert (mapped.diff() < 0).all() or (mapped.diff() > 0).all()


def test_ours_sigmoid_mean_is_its_logit_mean():
    """logit_normal at logit_mean m: its sigma sigmoid(N(m, std)) (this script's: sigma is u) is ours' sigmoid draw at
    sigmoid_mean m; KS < 0.006, and > 0.05 at mean 0."""
    n = torch.randn(200_000, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    theirs = torch.sigmoid(0.7 + 1.2 * n)
    ours = fm.sample_sigmas(200_000, "sigmoid", generator=torch.Generator().manual_seed(8), sigmoid_scale=1.2,
                            sigmoid_mean=0.7)
    assert ks(ours, theirs) < 0.006
    assert ks(fm.sample_sigmas(200_000, "sigmoid", generator=torch.Generator().manual_seed(8), sigmoid_scale=1.2),
              theirs) > 0.05


def test_its_x0_loss_is_sigma_squared_times_ours_and_sigma_sqrt_cancels_it():
    """Its loss, as sd3_train_network computes it (model_pred x (-sigma) + noisy input against the latents, times
    compute_loss_weighting_for_sd3), against ours' flow_loss on the same prediction: sigma^2 x ours with uniform,
    ours with sigma_sqrt, ours weighted by sigma_sq with uniform (max rel. diff < 1e-6); at sigma 0 (its floor draws it) sigma_sqrt's loss is NaN."""
    g = torch.Generator().manual_seed(0)
    x0, noise, pred = (torch.randn(4, 16, 8, 8, generator=g, dtype=torch.float64) for _ in range(3))
    sigmas = torch.tensor([0.001, 0.25, 0.5, 0.999], dtype=torch.float64)
    s = sigmas.view(-1, 1, 1, 1)
    noisy = s * noise + (1 - s) * x0

    def theirs(scheme: str) -> torch.Tensor:
        weight = s ** -2.0 if scheme == "sigma_sqrt" else torch.ones_like(s)
        return (((pred * (-s) + noisy) - x0) ** 2 * weight).mean(dim=(1, 2, 3))

    ours = ((pred - fm.flow_target(x0, noise).double()) ** 2).mean(dim=(1, 2, 3))
    assert torch.allclose(theirs("uniform"), sigmas ** 2 * ours, rtol=1e-6, atol=0)
    assert torch.allclose(theirs("uniform"), fm.loss_weighting(sigmas, "sigma_sq").double() * ours, rtol=1e-6, atol=0)
    assert torch.allclose(theirs("sigma_sqrt"), ours, rtol=1e-6, atol=0)
    zero = torch.zeros(1, 1, 1, 1, dtype=torch.float64)
    assert torch.isnan((((pred[:1] * (-zero) + x0[:1]) - x0[:1]) ** 2 * zero ** -2.0).mean())


def test_its_huber_is_not_ours_and_it_perturbs_no_input():
    """Its huber is huber_c's of its x0 error, sigma x the velocity error (the loss above); ours' is sigma^2 x
    huber of the velocity error under sigma_sq: 0.22 of its at sigma 0.1 for an error of 1, c 0.1, so loss_type
    huber is not carried (it was kept). Its get_noisy_model_input_and_timesteps perturbs no input: ip_noise_gamma
    is dropped (it was kept: ours would have perturbed it)."""
    def huber(r, c):
        return 2 * c * (math.sqrt(r * r + c * c) - c)

    assert abs(0.1 ** 2 * huber(1.0, 0.1) / huber(0.1 * 1.0, 0.1) - 0.22) < 0.01
    base = {"network_module": "networks.lora_sd3", "network_train_unet_only": True}
    t = sd_scripts.translate({**base, "loss_type": "huber", "huber_schedule": "constant", "huber_c": 0.1,
                              "ip_noise_gamma": 0.1}, "x.toml")
    assert [verdict(t, k)[0] for k in ("loss_type", "huber_c", "ip_noise_gamma")] == [NOT_CARRIED, DROPPED, DROPPED]
    assert not {"loss_type", "huber_c", "ip_noise_gamma"} & set(t.config)
    assert sd_scripts.translate({**base, "loss_type": "l2"}, "x.toml").config["loss_type"] == "l2"


def test_the_encoder_masks_change_what_their_refusals_say(tiny_set):
    """Its apply_lg_attn_mask passes the padding mask to CLIP (causal): the caption's rows (up to its end token) and
    the pooled vector are the same (max diff 0.0), the padding rows differ; apply_t5_attn_mask to T5 (both ways): the
    caption's rows differ too. The transformer is fed every row either way."""
    from transformers import AutoTokenizer, CLIPTextModelWithProjection, T5EncoderModel

    caption = "a photo of a cat"
    for folder, tokenizer_folder in (("sd3_clip_l", "sd3_tokenizer"), ("sd3_clip_g", "sd3_tokenizer_2")):
        tokenizer = AutoTokenizer.from_pretrained(tiny_set[tokenizer_folder])
        model = CLIPTextModelWithProjection.from_pretrained(tiny_set[folder]).eval()
        tokens = tokenizer(caption, padding="max_length", max_length=77, truncation=True, return_tensors="pt")
        with torch.no_grad():
            plain = model(tokens.input_ids, output_hidden_states=True)
            masked = model(tokens.input_ids, tokens.attention_mask, output_hidden_states=True)
        length = int(tokens.attention_mask.sum())
        rows = (plain.hidden_states[-2] - masked.hidden_states[-2]).abs().amax(dim=-1)[0]
        assert rows[:length].max().item() == 0.0 and rows[length:].min().item() > 1e-4, folder
        assert (plain.text_embeds - masked.text_embeds).abs().max().item() == 0.0
    tokenizer = AutoTokenizer.from_pretrained(tiny_set["sd3_tokenizer_3"])
    t5 = T5EncoderModel.from_pretrained(tiny_set["sd3_t5xxl"]).eval()
    tokens = tokenizer(caption, padding="max_length", max_length=32, truncation=True, return_tensors="pt")
    with torch.no_grad():
        rows = (t5(tokens.input_ids).last_hidden_state - t5(tokens.input_ids, tokens.attention_mask).last_hidden_state)
    assert rows.abs().amax(dim=-1)[0, :int(tokens.attention_mask.sum())].min().item() > 1e-4


def our_lora(network_args: list[str], rank: int) -> dict[str, int]:
    from library.models.sd3.tiny import random_sd3, tiny_config

    args = lora_network_args(SimpleNamespace(network_args=network_args, network_dropout=0.0, config_file="x.toml"))
    return {m.name: m.rank for m in LoRANetwork(random_sd3(tiny_config()), "sd3", rank=rank,
                                                network_args=args).lora_modules()}


def translated_args(network_args: list[str], rank: int = 4) -> list[str]:
    t = sd_scripts.translate({"clip_g": "g", "network_dim": rank, "network_args": network_args}, "x.toml")
    return t.config.get("network_args", [])


def test_the_default_trains_every_linear_of_the_joint_blocks_and_emb_dims_the_embedders():
    """SD3_TARGET_REPLACE_MODULE: every Linear of each stream at network_dim (attn2 and modulation included, 29 tiny
    modules), ours' default; emb_dims [2, 3, 0, 5, 6, 0] with context_mlp_dim 0 and blocks 0-1: the embedders at
    their ranks, the final layer's adaLN alone (network_reg_dims drops its linear); an x_embedder rank not carried."""
    from library.models.sd3.tiny import random_sd3, tiny_config

    model = random_sd3(tiny_config())
    walked = {f"{name}.{child}" for name, block in model.named_modules() if type(block).__name__ == "DismantledBlock"
              for child, m in block.named_modules() if isinstance(m, nn.Linear)}
    assert walked == THEIR_DEFAULT and len(THEIR_DEFAULT) == 29
    assert translated_args([]) == [] and set(our_lora([], 8).items()) == {(n, 8) for n in THEIR_DEFAULT}
    given = ["emb_dims=[2,3,0,5,6,0]", "context_mlp_dim=0", "train_block_indices=0-1", "verbose=True"]
    items = translated_args(given)
    assert items == ["context_embedder_dim=2", "t_embedder_dim=3", "y_embedder_dim=5", "final_layer_dim=6",
                     "network_reg_dims=final_layer_linear=0", "context_mlp_dim=0", "train_block_indices=0-1"]
    expected = {**{n: 4 for n in THEIR_DEFAULT if not n.startswith("joint_blocks.2.") and "context_block.mlp" not in n},
                "context_embedder": 2, "t_embedder.mlp.0": 3, "t_embedder.mlp.2": 3, "y_embedder.mlp.0": 5,
                "y_embedder.mlp.2": 5, "final_layer.adaLN_modulation.1": 6}
    assert our_lora(items, 4) == expected
    t = sd_scripts.translate({"clip_g": "g", "network_args": ["emb_dims=[2,3,4,5,6,6]", "split_qkv=True"]}, "x.toml")
    assert verdict(t, "network_args emb_dims")[0] == verdict(t, "network_args split_qkv")[0] == NOT_CARRIED
    assert t.config["network_args"] == ["context_embedder_dim=2", "t_embedder_dim=3", "y_embedder_dim=5",
                                        "final_layer_dim=6"]


def their_network(network_args: dict[str, str], rank: int) -> dict[str, int]:
    """networks.lora_sd3's own create_network (with lora_flux's LoRAModule) over the tiny model, read from the
    checkout: its imports of its `library` (a log setup, sd3_models for type hints) are left out, and its block class
    SingleDiTBlock is ours' DismantledBlock (the same two streams of a joint block)."""
    from library.models.sd3.tiny import random_sd3, tiny_config

    def source(name: str) -> str:
        with open(os.path.join(CHECKOUT, "networks", name), encoding="utf-8") as f:
            return (f.read().replace("from library.utils import setup_logging", "setup_logging = lambda: None")
                    .replace("from library import sd3_models", "")
                    .replace("sd3_models.SDVAE", "object").replace("sd3_models.MMDiT", "object")
                    .replace("from library.sdxl_original_unet import SdxlUNet2DConditionModel",
                             "SdxlUNet2DConditionModel = None")
                    .replace("from networks.lora_flux import LoRAModule, LoRAInfModule", ""))

    lora_flux = types.ModuleType("lora_flux")
    exec(compile(source("lora_flux.py"), "lora_flux.py", "exec"), lora_flux.__dict__)
    namespace = {"__name__": "lora_sd3", "LoRAModule": lora_flux.LoRAModule, "LoRAInfModule": lora_flux.LoRAInfModule}
    exec(compile(source("lora_sd3.py"), "lora_sd3.py", "exec"), namespace)
    namespace["LoRANetwork"].SD3_TARGET_REPLACE_MODULE = ["DismantledBlock"]
    network = namespace["create_network"](1.0, rank, rank, None, [], random_sd3(tiny_config()), **network_args)
    return {lora.lora_name.removeprefix("lora_unet_"): lora.lora_dim for lora in network.unet_loras}


@pytest.mark.skipif(not os.path.isfile(os.path.join(CHECKOUT, "networks", "lora_sd3.py")),
                    reason="no sd-scripts checkout (.peers/sd-scripts or SD_SCRIPTS_CHECKOUT)")
@pytest.mark.parametrize("network_args", [
    {}, {"emb_dims": "[2,3,0,5,6,0]", "context_mlp_dim": "0", "train_block_indices": "0-1"},
    {"x_attn_dim": "8", "context_mod_dim": "0", "emb_dims": "[0,0,0,0,4,4]"},
    {"x_mod_dim": "2", "emb_dims": "[1,0,0,0,0,3]", "train_block_indices": "1"},
])
def test_our_network_trains_its_modules_at_its_ranks(network_args):
    ours = {name.replace(".", "_"): r for name, r in our_lora(translated_args(
        [f"{k}={v}" for k, v in network_args.items()]), 4).items()}
    assert ours == their_network(network_args, 4)


def test_ai_toolkits_sd3_and_its_older_is_v3_are_ours_bucketed_at_its_32_px():
    """model.arch sd3 (is_v3: true before it): our sd3, its datasets at get_bucket_divisibility 32 (2^3 x 2 x 2); its
    sigmoid draw (unshifted: its sd flow scheduler's shift 3 applies to timestep_type shift only) is ours'."""
    for model in ({"arch": "sd3"}, {"is_v3": True}):
        config = job(train={"timestep_type": "sigmoid"})
        config["config"]["process"][0]["model"] = {"name_or_path": "stabilityai/stable-diffusion-3.5-large", **model}
        t = ai_toolkit.translate(config, "run.yaml")
        assert t.config["model_type"] == "sd3" and t.config["timestep_sampling"] == "sigmoid"
        assert [d["bucket_reso_steps"] for d in t.dataset["datasets"]] == [32]
    t = ai_toolkit.translate(job(model={"arch": "sd3"}, train={"timestep_type": "shift"}), "run.yaml")
    assert verdict(t, "train.timestep_type")[0] == RENAMED  # its shift 3, fixed: ours' shift of a uniform draw
    assert (t.config["timestep_sampling"], t.config["shifted_draw"], t.config["discrete_flow_shift"]) == (
        "shift", "uniform", 3.0)
