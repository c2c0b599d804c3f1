"""scale_weight_norms (sd-scripts' max-norm regularization, networks/lora.py LoRANetwork.scale_weight_norms):
modules whose delta norm is over the bound are scaled to it by sqrt(ratio) on up and down as sd-scripts'
apply_max_norm_regularization does, the others left bit for bit; a run logs the counts and records the bound;
a LyCORIS network is refused in one line."""

import csv
import math

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import train_lora
from tests.test_reliability import flux_args, one_error_line


def sd_scripts_max_norm(pairs, max_norm):
    """sd-scripts' networks/lora_flux.py apply_max_norm_regularization, restated on (up, down, scale) triples."""
    out, norms, scaled = [], [], 0
    for up, down, scale in pairs:
        norm = (up @ down * scale).norm().clamp(min=max_norm / 2)
        ratio = norm.clamp(max=max_norm) / norm
        if ratio != 1:
            scaled += 1
        out.append((up * ratio**0.5, down * ratio**0.5))
        norms.append(((up @ down * scale).norm() * ratio).item())
    return out, scaled, sum(norms) / len(norms), max(norms)


def test_modules_over_the_bound_are_scaled_as_sd_scripts_scales_them(tiny_set):
    from library.models.flux1.family import FluxFamily
    from tests.test_merge_convert import lora

    model = FluxFamily(tiny_set["flux_bfl"]).load_transformer(torch.float32)
    network = lora(model, "flux", rank=4, alpha=2.0, seed=1)
    modules = network.lora_modules()
    with torch.no_grad():  # half the modules far under the bound
        for m in modules[::2]:
            m.lora_up.weight.mul_(1e-4)
    before = [(m.lora_up.weight.clone(), m.lora_down.weight.clone(), m.scale) for m in modules]
    expected, scaled, mean, most = sd_scripts_max_norm(before, 0.5)
    stats = network.scale_weight_norms(0.5)
    assert 0 < stats["keys_scaled"] == scaled < len(modules)
    assert stats["average_key_norm"] == pytest.approx(mean, rel=1e-5) and stats["max_key_norm"] == pytest.approx(most, rel=1e-5)
    for m, (up, down, _), (want_up, want_down) in zip(modules, before, expected):
        if (m.scale * up @ down).norm() <= 0.5:  # left bit for bit
            assert torch.equal(m.lora_up.weight, up) and torch.equal(m.lora_down.weight, down)
        else:
            torch.testing.assert_close(m.lora_up.weight, want_up, rtol=1e-6, atol=0)
            torch.testing.assert_close(m.lora_down.weight, want_down, rtol=1e-6, atol=0)
            assert (m.scale * m.lora_up.weight @ m.lora_down.weight).norm().item() == pytest.approx(0.5, rel=1e-5)


def test_a_run_bounds_every_saved_module_logs_the_counts_and_records_the_bound(tiny_set, tmp_path):
    out = tmp_path / "out"
    bound = 1e-3  # under what the first step's update gives every module
    assert train_lora.main(flux_args(tiny_set, out, "--scale_weight_norms", str(bound), "--max_train_steps", "2",
                                     "--network_alpha", "4", "--ip_noise_gamma", "0.05", "--min_timestep", "100",
                                     "--max_timestep", "900", "--preserve_distribution_shape", "true",
                                     "--timestep_sampling", "logsnr")) == 0
    weights = load_file(str(out / "tiny_flux_lora.safetensors"))
    downs = [k for k in weights if k.endswith("lora_down.weight")]
    for key in downs:
        up, down = weights[key.replace("lora_down", "lora_up")].float(), weights[key].float()
        norm = (4 / down.shape[0] * up @ down).norm().item()
        assert norm <= bound * (1 + 1e-2), (key, norm)  # (saved in the LoRA's dtype)
    with open(out / "tiny_flux_lora_log.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["keys_scaled"]) for r in rows] == [len(downs)] * 2
    assert all(math.isclose(float(r["max_key_norm"]), bound, rel_tol=1e-5) for r in rows)
    with safe_open(str(out / "tiny_flux_lora.safetensors"), framework="pt") as f:
        assert f.metadata()["ss_scale_weight_norms"] == str(bound)
        assert f.metadata()["ss_ip_noise_gamma"] == "0.05"  # (other header keys of training settings, one run)
        assert [f.metadata()[f"ss_{k}"] for k in ("min_timestep", "max_timestep", "preserve_distribution_shape",
                                                  "logsnr_mean_std")] == ["100", "900", "True", "[-6.0, 2.0]"]


def test_a_lycoris_network_is_refused_in_one_line(tiny_set, tmp_path, capsys):
    capsys.readouterr()
    line = one_error_line(capsys, train_lora.main(flux_args(tiny_set, tmp_path, "--scale_weight_norms", "1",
                                                            "--network_module", "lycoris.kohya")))
    assert "scale_weight_norms needs network_module networks.lora (LoRA, DoRA); lycoris.kohya is not scaled by it" in line


def test_an_llm_lora_is_bounded_too(tiny_set, tmp_path):
    from tests.test_train_llm import llm_args

    out = tmp_path / "llm"
    assert train_lora.main(llm_args(tiny_set, out, "--pretrained_model_name_or_path", tiny_set["llm"], "--scale_weight_norms",
                                    "1e-4", "--max_train_steps", "1", "--learning_rate", "1e-2")) == 0
    (log,) = out.glob("*_log.csv")
    with open(log) as f:
        (row,) = list(csv.DictReader(f))
    assert int(row["keys_scaled"]) > 0 and math.isclose(float(row["max_key_norm"]), 1e-4, rel_tol=1e-5)
