"""The LoRA tools accept FLUX.1 Kontext: merge_lora bakes a Kontext LoRA into the base with the
runtime LoRA's edit predictions, convert_lora round-trips it through diffusers names, the
precision doctor runs on it and the memory planner counts the reference's tokens."""

import torch

from library.models.flux1.kontext import FluxKontextFamily
from networks.lora import LoRANetwork
from tools import convert_lora, merge_lora, plan_memory, precision_doctor


def edit_inputs():
    g = torch.Generator().manual_seed(5)
    return (torch.randn(1, 16, 64, generator=g), torch.randn(1, 16, 8, 8, generator=g),
            {"t5": torch.randn(1, 8, 32, generator=g), "clip_pooled": torch.randn(1, 32, generator=g)})


def test_merged_kontext_lora_predicts_like_the_runtime_lora(tiny_set, tmp_path):
    family = FluxKontextFamily(tiny_set["flux_bfl"])
    model = family.load_transformer(torch.float32)
    torch.manual_seed(1)
    net = LoRANetwork(model, "flux", 4, 4.0)
    with torch.no_grad():
        for m in net.lora_modules():
            m.lora_up.weight.normal_(0, 0.2)
    net.save(str(tmp_path / "kontext_lora.safetensors"))
    net.apply()
    x_t, reference, text = edit_inputs()
    with torch.no_grad():
        runtime = family.predict(model, x_t, torch.tensor([0.5]), text, 4, 4, 2.5, control=[reference])
    out = tmp_path / "merged.safetensors"
    assert merge_lora.main(["--model", tiny_set["flux_bfl"], "--lora", str(tmp_path / "kontext_lora.safetensors"),
                            "--save_to", str(out), "--save_precision", "fp32"]) == 0
    merged = FluxKontextFamily(str(out)).load_transformer(torch.float32)
    with torch.no_grad():
        baked = family.predict(merged, x_t, torch.tensor([0.5]), text, 4, 4, 2.5, control=[reference])
        base = family.predict(family.load_transformer(torch.float32), x_t, torch.tensor([0.5]), text, 4, 4, 2.5,
                              control=[reference])
    assert (runtime - base).abs().max() > 1e-2  # the LoRA matters
    assert (baked - runtime).abs().max().item() <= 1e-5

    kohya, diffusers, back = (str(tmp_path / f"{n}.safetensors") for n in ("kontext_lora", "d", "k"))
    assert convert_lora.main([kohya, diffusers, "--to", "diffusers", "--model_type", "flux_kontext"]) == 0
    assert convert_lora.main([diffusers, back, "--to", "kohya", "--model_type", "flux_kontext"]) == 0
    again = LoRANetwork(family.load_transformer(torch.float32), "flux", 4, 4.0)
    again.load_weights(back)
    for (name, a), b in zip(net.state_dict().items(), again.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), name


def test_precision_doctor_and_memory_planner_accept_flux_kontext(tiny_set, tmp_path, capsys):
    assert precision_doctor.main(["--model_type", "flux_kontext", "--model", tiny_set["flux_bfl"], "--resolution", "64",
                                  "--text_len", "8", "--timesteps", "0.5", "--out", str(tmp_path / "doctor"),
                                  "--device", "cpu"]) == 0
    from library.models.flux1.family import FluxFamily
    from library.training.memory_plan import training_plan

    capsys.readouterr()
    assert plan_memory.main(["--preset", "flux1-kontext-dev", "--vram", "24", "--resolution", "256",
                             "--base_precision", "fp8_scaled"]) == 0
    assert "training" in capsys.readouterr().out
    plans = {cls.name: training_plan(cls(tiny_set["flux_bfl"]), plan_memory.default_args(cls.name), 64, 64, 1, 8)
             for cls in (FluxFamily, FluxKontextFamily)}
    # the reference's tokens ride along in every block, and its latents are an input
    above_grads = {k: p.activations - p.lora_grads for k, p in plans.items()}  # activations holds the LoRA grads too
    assert above_grads["flux_kontext"] > 1.5 * above_grads["flux"], above_grads
    assert plans["flux_kontext"].inputs > plans["flux"].inputs
