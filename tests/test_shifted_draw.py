"""shifted_draw = "uniform": a shift (timestep_sampling "shift" or a model's own) moves a uniform draw instead of
sigmoid(sigmoid_scale randn), as sd-scripts' default "sigma" draw (a uniform pick of a shifted scheduler's 1000 sigmas)
and its Lumina nextdit_shift draw; the converters' tests check those carry (test_hunyuan_image_convert_config.py,
test_lumina2_convert_config.py, test_sd3_convert_config.py)."""

import json
import math
import pathlib
import re

import pytest
import torch
from safetensors import safe_open

import train_lora
from library.models import flow_matching as fm
from library.training.config import ConfigError, load_config
from tests.test_reliability import ROOT, files_under, flux_args
from tests.test_timestep_range import FLUX

QUICKSTART = pathlib.Path(ROOT, "configs", "quickstart.toml")


def test_the_shift_moves_the_uniform_draw_from_the_same_generator():
    """shift k: k s / (1 + (k - 1) s) of s = 1 - U, U the generator's own draw; an architecture's: its time shift at
    the token count; unset: the sigmoid draw as before."""
    u = torch.rand(64, generator=torch.Generator().manual_seed(9))
    s = 1.0 - u
    ours = fm.sample_sigmas(64, "shift", generator=torch.Generator().manual_seed(9), shift=3.0, shifted="uniform")
    torch.testing.assert_close(ours, 3.0 * s / (1.0 + 2.0 * s), rtol=0, atol=1e-6)
    flux = fm.sample_sigmas(64, "flux_shift", generator=torch.Generator().manual_seed(9), image_seq_len=4096,
                            shifted="uniform")
    mu = fm.resolution_mu(fm.sampling_of("flux"), 4096)
    torch.testing.assert_close(flux, math.exp(mu) / (math.exp(mu) + 1.0 / s - 1.0), rtol=0, atol=1e-6)
    assert torch.equal(fm.sample_sigmas(64, "shift", generator=torch.Generator().manual_seed(9), shift=3.0),
                       fm.sample_sigmas(64, "shift", generator=torch.Generator().manual_seed(9), shift=3.0,
                                        shifted="sigmoid"))
    with pytest.raises(ValueError, match="shifted_draw 'normal' is not one of sigmoid, uniform"):
        fm.sample_sigmas(4, "shift", generator=None, shifted="normal")


@pytest.mark.parametrize("flags, message", [
    (["--timestep_sampling", "sigmoid", "--shifted_draw", "uniform"],
     "key 'shifted_draw' does nothing with timestep_sampling = \"sigmoid\"; it needs a shift"),
    (["--timestep_sampling", "shift", "--shifted_draw", "uniform", "--sigmoid_scale", "1.5"],
     "key 'sigmoid_scale' does nothing with shifted_draw = \"uniform\" (the shift moves a uniform draw)"),
    (["--timestep_sampling", "shift", "--shifted_draw", "mode", "--sigmoid_mean", "0.5"],
     "key 'sigmoid_mean' does nothing with shifted_draw = \"mode\" (the shift moves a mode draw)"),
    (["--timestep_sampling", "uniform", "--sigmoid_mean", "0.5"],
     "key 'sigmoid_mean' does nothing with timestep_sampling = \"uniform\"; it needs a sigmoid draw"),
    (["--timestep_sampling", "mode", "--sigmoid_scale", "1.5"],
     "key 'sigmoid_scale' does nothing with timestep_sampling = \"mode\"; it needs a sigmoid draw"),
    (["--timestep_sampling", "mode", "--shifted_draw", "mode"],
     "key 'shifted_draw' does nothing with timestep_sampling = \"mode\"; it needs a shift"),
    (["--timestep_sampling", "sigmoid", "--mode_scale", "1.0"],
     "key 'mode_scale' does nothing with timestep_sampling = \"sigmoid\" and shifted_draw = \"sigmoid\"; it needs a "
     "mode draw"),
    (["--timestep_sampling", "mode", "--mode_scale", "2.0"], "key 'mode_scale' must be > -1 and <= 1.75"),
    (["--timestep_sampling", "qinglong", "--qinglong_mid", "sigmoid", "--shifted_draw", "mode"],
     "key 'shifted_draw' does nothing with timestep_sampling = \"qinglong\" and qinglong_mid = sigmoid"),
    (["--timestep_sampling", "qinglong", "--qinglong_mid", "mode", "--sigmoid_mean", "1"],
     "key 'sigmoid_mean' does nothing with timestep_sampling = \"qinglong\" and qinglong_mid = mode"),
])
def test_keys_it_makes_idle_are_one_line(flags, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(FLUX + flags)


@pytest.mark.parametrize("flags, law", [
    (["--timestep_sampling", "mode", "--mode_scale", "0.7"], {"method": "mode", "mode_scale": 0.7}),
    (["--timestep_sampling", "shift", "--shifted_draw", "mode", "--discrete_flow_shift", "2.5"],
     {"method": "shift", "shifted": "mode", "shift": 2.5}),
    (["--timestep_sampling", "sigmoid", "--sigmoid_mean", "-0.8"], {"method": "sigmoid", "sigmoid_mean": -0.8}),
    (["--sigmoid_mean", "0.5"], {"method": "flux_shift", "sigmoid_mean": 0.5}),  # the model's own shift
    (["--timestep_sampling", "qinglong", "--qinglong_mid", "mode"], None),
])
def test_the_training_draw_reads_the_keys(tiny_set, flags, law):
    """The family's draw (one sample's generator) at the config's keys is flow_matching's law at them; qinglong's mid
    draw mode reads mode_scale too (its mixture's mid share)."""
    from library.models.flux1.family import FluxFamily

    args = load_config(FLUX + flags)
    family = FluxFamily(tiny_set["flux_bfl"])
    model = family.load_transformer(torch.float32, read_weights=False)
    drawn = family.draw_sigmas(model, args, torch.Generator().manual_seed(3), 64, 64, 4096)
    if law is None:  # the pick first, then each law's 4096 from the same generator
        g = torch.Generator().manual_seed(3)
        expected = fm.qinglong_sigmas(4096, g, lambda: fm.sample_sigmas(4096, "mode", generator=g, mode_scale=1.29),
                                      (0.11, 0.10), (-6.0, 2.0))
        assert torch.equal(drawn, expected)
        return
    method = law.pop("method")
    expected = fm.sample_sigmas(4096, method, generator=torch.Generator().manual_seed(3), image_seq_len=32 * 32, **law)
    assert torch.equal(drawn, expected)
    assert not torch.equal(drawn, fm.sample_sigmas(4096, method, generator=torch.Generator().manual_seed(3),
                                                   image_seq_len=32 * 32))


def test_a_run_records_it(tiny_set, tmp_path):
    assert load_config(FLUX + ["--shifted_draw", "uniform"]).shifted_draw == "uniform"  # (the model's own shift)
    out = tmp_path / "out"
    assert train_lora.main(flux_args(tiny_set, out, "--timestep_sampling", "shift", "--shifted_draw", "uniform",
                                     "--discrete_flow_shift", "3")) == 0
    with safe_open(str(out / "tiny_flux_lora.safetensors"), framework="pt") as f:
        header = f.metadata()
    assert (header["ss_shifted_draw"], header["ss_discrete_flow_shift"]) == ("uniform", "3.0")
    assert "ss_qinglong" not in header and json.loads(header.get("ss_logsnr_mean_std", "null")) is None
    assert "ss_mode_scale" not in header and "ss_sigmoid_mean" not in header
    assert train_lora.main(flux_args(tiny_set, out, "--timestep_sampling", "shift", "--shifted_draw", "mode",
                                     "--mode_scale", "0.9", "--output_name", "mode")) == 0
    with safe_open(str(out / "mode.safetensors"), framework="pt") as f:
        header = f.metadata()
    assert (header["ss_shifted_draw"], header["ss_mode_scale"]) == ("mode", "0.9")
    assert train_lora.main(flux_args(tiny_set, out, "--timestep_sampling", "sigmoid", "--sigmoid_mean", "0.4",
                                     "--output_name", "mean")) == 0
    with safe_open(str(out / "mean.safetensors"), framework="pt") as f:
        header = f.metadata()
    assert header["ss_sigmoid_mean"] == "0.4" and "ss_mode_scale" not in header and "ss_shifted_draw" not in header


@pytest.mark.parametrize("flags", [["--shifted_draw", "uniform"],
                                   ["--timestep_sampling", "qinglong", "--shifted_draw", "uniform"]])
def test_the_own_law_of_a_checkpoint_without_a_shift_refuses_it(tiny_set, tmp_path, capsys, flags):
    """timestep_sampling unset (or qinglong's mid draw unset) is the checkpoint's own law: a schnell file's is the
    unshifted sigmoid draw, which moves nothing; shifted_draw was taken there, recorded in the header and read by
    nothing. Refused before caching, from the model on the meta device; a dev file's own shift still reads it."""
    from tests.test_generate import schnell_like

    schnell = schnell_like(tmp_path, tiny_set)[0][1]
    config = tmp_path / "own_law.toml"  # the quickstart without its shift: the model's own law
    config.write_text(re.sub(r"(?m)^(timestep_sampling|discrete_flow_shift) = .*$", "", QUICKSTART.read_text()))
    out = tmp_path / "out"
    for name, model in (("dev", tiny_set["flux_bfl"]), ("schnell", schnell)):
        code = train_lora.main(flux_args(tiny_set, out / name, "--config_file", str(config),
                                         "--pretrained_model_name_or_path", model, *flags))
        assert (code == 0) == (name == "dev")
    unset = "timestep_sampling = \"qinglong\" with qinglong_mid unset" if "qinglong" in flags else \
        "timestep_sampling unset"
    assert (f"key 'shifted_draw' = uniform does nothing: {unset} draws {schnell}'s own law, \"sigmoid\"; it needs a "
            f"shift (timestep_sampling = \"shift\")") in capsys.readouterr().err
    assert files_under(out / "schnell") == []


def test_a_sigmoid_scale_beside_an_own_uniform_law_is_refused():
    """A family whose own law is the uniform draw (its default_timestep_sampling) reads no sigmoid_scale there."""
    from library.training.diffusion_checks import check_own_draw_keys

    class UniformOwnLaw:
        def default_timestep_sampling(self, model):
            return "uniform"

    args = load_config(FLUX + ["--sigmoid_scale", "1.5"])
    with pytest.raises(ConfigError, match=re.escape("key 'sigmoid_scale' = 1.5 does nothing: timestep_sampling unset "
                                                    "draws m's own law, \"uniform\"; it needs a sigmoid draw")):
        check_own_draw_keys(args, UniformOwnLaw(), lambda: None)
    check_own_draw_keys(load_config(FLUX + ["--sigmoid_scale", "1.5", "--timestep_sampling", "sigmoid"]),
                        UniformOwnLaw(), lambda: None)  # a named law: config_keys' to check


@pytest.mark.parametrize("density", [{"weighting_scheme": "logit_normal", "logit_mean": 0.6, "logit_std": 1.1},
                                     {"weighting_scheme": "mode", "mode_scale": 1.29},
                                     {"weighting_scheme": "mode", "mode_scale": 0.5}])
def test_sd_scripts_sigma_draw_by_its_density_is_the_translated_law(density):
    """sd-scripts' "sigma" draw (flux_train_utils, restated): u of weighting_scheme's density indexes the 1000 sigmas
    of a scheduler shifted by discrete_flow_shift 3, from sigma 1 down (diffusers' FlowMatchEulerDiscreteScheduler).
    The converter's keys (logit_mean negated into sigmoid_mean, the mode law as shifted_draw "mode") draw it: KS of
    200 000 draws < 0.006 (its grid's steps 0.001); the mean unnegated is far off (> 0.05)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from library.training.peers import sd_scripts

    g = torch.Generator().manual_seed(11)
    if density["weighting_scheme"] == "logit_normal":
        u = torch.sigmoid(density["logit_mean"] + density["logit_std"] * torch.randn(200_000, generator=g))
    else:
        v = torch.rand(200_000, generator=g)
        u = 1 - v - density["mode_scale"] * (torch.cos(math.pi * v / 2) ** 2 - 1 + v)
    theirs = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0).sigmas[(u * 1000).long()]
    config = sd_scripts.translate({"timestep_sampling": "sigma", "discrete_flow_shift": 3.0, **density},
                                  "x.toml").config
    keys = {"shift": config.get("discrete_flow_shift", 3.0), "sigmoid_scale": config.get("sigmoid_scale", 1.0),
            "sigmoid_mean": config.get("sigmoid_mean", 0.0), "shifted": config.get("shifted_draw", "sigmoid"),
            "mode_scale": config.get("mode_scale", fm.MODE_SCALE)}
    ours = fm.sample_sigmas(200_000, config["timestep_sampling"], generator=torch.Generator().manual_seed(12), **keys)
    grid = torch.linspace(0, 1, 2001, dtype=torch.float64)

    def distance(draws):
        cdfs = [torch.searchsorted(d.double().sort().values, grid, right=True).double() / len(d)
                for d in (draws, theirs)]
        return (cdfs[0] - cdfs[1]).abs().max().item()

    assert distance(ours) < 0.006
    if "logit_mean" in density:
        wrong = fm.sample_sigmas(200_000, "shift", generator=torch.Generator().manual_seed(12),
                                 **{**keys, "sigmoid_mean": -keys["sigmoid_mean"]})
        assert distance(wrong) > 0.05
