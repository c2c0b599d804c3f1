"""The LoRA tools accept Qwen-Image-Edit: merge_lora bakes an edit LoRA into the base with the
runtime LoRA's edit predictions, convert_lora round-trips it through diffusers names, the
precision doctor runs on it and the memory planner counts the reference's tokens."""

import torch

from library.models.qwen_image.edit_family import QwenImageEditFamily
from networks.lora import LoRANetwork
from tools import convert_lora, merge_lora, plan_memory, precision_doctor

EDIT_2511 = "qwen-image-edit-2511"


def edit_inputs():
    g = torch.Generator().manual_seed(5)
    text = {"embeds": torch.randn(1, 8, 32, generator=g), "mask": torch.ones(1, 8, dtype=torch.bool)}
    return torch.randn(1, 16, 64, generator=g), torch.randn(1, 16, 8, 8, generator=g), text


def test_merged_edit_lora_predicts_like_the_runtime_lora(tiny_set, tmp_path):
    family = QwenImageEditFamily(tiny_set["qwen_image_edit_2511"])
    model = family.load_transformer(torch.float32)
    assert family.version == EDIT_2511 and model.config.zero_cond_t
    torch.manual_seed(1)
    net = LoRANetwork(model, family.arch, 4, 4.0)
    with torch.no_grad():
        for m in net.lora_modules():
            m.lora_up.weight.normal_(0, 0.2)
    net.save(str(tmp_path / "edit_lora.safetensors"))
    net.apply()
    x_t, reference, text = edit_inputs()
    sigma = torch.tensor([0.5])
    with torch.no_grad():
        runtime = family.predict(model, x_t, sigma, text, 4, 4, None, control=[reference])
    out = tmp_path / "merged"  # a folder, as its base is (it was named .safetensors)
    assert merge_lora.main(["--model", tiny_set["qwen_image_edit_2511"], "--lora", str(tmp_path / "edit_lora.safetensors"),
                            "--save_to", str(out), "--save_precision", "fp32"]) == 0
    merged = QwenImageEditFamily(str(out), model_version=EDIT_2511).load_transformer(torch.float32)
    with torch.no_grad():
        baked = family.predict(merged, x_t, sigma, text, 4, 4, None, control=[reference])
        base = family.predict(family.load_transformer(torch.float32), x_t, sigma, text, 4, 4, None, control=[reference])
    assert (runtime - base).abs().max() > 1e-2  # the LoRA matters
    assert (baked - runtime).abs().max().item() <= 1e-5

    kohya, diffusers, back = (str(tmp_path / f"{n}.safetensors") for n in ("edit_lora", "d", "k"))
    assert convert_lora.main([kohya, diffusers, "--to", "diffusers", "--model_type", "qwen_image_edit"]) == 0
    assert convert_lora.main([diffusers, back, "--to", "kohya", "--model_type", "qwen_image_edit"]) == 0
    again = LoRANetwork(family.load_transformer(torch.float32), family.arch, 4, 4.0)
    again.load_weights(back)
    for (name, a), b in zip(net.state_dict().items(), again.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), name


def test_precision_doctor_and_memory_planner_accept_qwen_image_edit(tiny_set, tmp_path):
    assert precision_doctor.main(["--model_type", "qwen_image_edit", "--model", tiny_set["qwen_image_edit_2511"],
                                  "--resolution", "64", "--text_len", "8", "--timesteps", "0.5",
                                  "--out", str(tmp_path / "doctor"), "--device", "cpu"]) == 0
    from library.models.qwen_image.family import QwenImageFamily
    from library.training.memory_plan import training_plan

    from library.training.memory_plan import caching_phase

    preset = plan_memory.PresetFamily("qwen-image-edit")  # full size on meta: caching counts the vision tower
    assert (preset.arch, preset.plan_controls) == ("qwen_image", 1)
    text_bytes = caching_phase(preset, plan_memory.default_args("qwen_image_edit"), 256, 256).parts["text encoders (bf16)"]
    assert text_bytes == 2 * 8_292_166_656
    plans = {cls.name: training_plan(cls(tiny_set["qwen_image_edit"]), plan_memory.default_args(cls.name), 64, 64, 1, 8)
             for cls in (QwenImageFamily, QwenImageEditFamily)}
    # the reference's tokens ride along in every block, and its latents are an input
    above_grads = {k: p.activations - p.lora_grads for k, p in plans.items()}  # activations holds the LoRA grads too
    assert above_grads["qwen_image_edit"] > 1.5 * above_grads["qwen_image"], above_grads
    assert plans["qwen_image_edit"].inputs > plans["qwen_image"].inputs
