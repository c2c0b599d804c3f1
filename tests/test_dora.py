"""DoRA in our LoRA (network_args dora=True / use_dora): equal to PEFT's DoRA on the same weights
(nn.Linear and our fp8 base), the magnitude trains and the base does not, files carry the
magnitude as `dora_scale` [out, 1] (kohya / ComfyUI) or `lora_magnitude_vector` [out] (PEFT), and
load back to the same output."""

import importlib

import pytest
import torch
import torch.nn as nn
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load_file

from library.io import CheckpointError
from library.precision.fp8 import FP8Linear
from networks import lora_files as lf
from networks.lora import LoRANetwork
from networks.lora_module import LoRAModule

flux = importlib.import_module("library.models.flux1.model")


class One(nn.Module):
    def __init__(self, linear):
        super().__init__()
        self.lin = linear

    def forward(self, x):
        return self.lin(x)


def peft_dora(linear: nn.Linear, rank=4, alpha=8.0, seed=3):
    """PEFT's DoRA on a copy of `linear`, with random A, B and magnitude."""
    ref = nn.Linear(linear.in_features, linear.out_features)
    ref.load_state_dict(linear.state_dict())
    model = get_peft_model(One(ref), LoraConfig(r=rank, lora_alpha=alpha, target_modules=["lin"], use_dora=True))
    g = torch.Generator().manual_seed(seed)
    sd = get_peft_model_state_dict(model)
    sd = {k: v + torch.randn(v.shape, generator=g) * 0.3 for k, v in sd.items()}
    set_peft_model_state_dict(model, sd)
    return model, sd


def ours_from(sd, base, alpha=8.0) -> LoRAModule:
    a, b = sd["base_model.model.lin.lora_A.weight"], sd["base_model.model.lin.lora_B.weight"]
    m = LoRAModule("lin", base, a.shape[0], alpha, dora=True)
    with torch.no_grad():
        m.lora_down.weight.copy_(a), m.lora_up.weight.copy_(b)
        m.dora_scale.copy_(sd["base_model.model.lin.lora_magnitude_vector"].reshape(-1, 1))
    m.apply_to_base()
    return m


def test_dora_forward_equals_peft_dora_on_the_same_weights():
    torch.manual_seed(0)
    base = nn.Linear(16, 12)
    peft_model, sd = peft_dora(base)
    module = ours_from(sd, base)
    assert torch.allclose(module.dora_scale.reshape(-1), sd["base_model.model.lin.lora_magnitude_vector"])
    x = torch.randn(3, 5, 16)
    theirs = peft_model(x)
    ours = base(x)
    assert (ours - base.__class__.forward(base, x)).abs().max() > 1e-2  # DoRA changes the output
    assert (ours - theirs).abs().max() < 1e-5
    # the merged weight (our merge / ComfyUI's formula at strength 1) gives the same output
    merged = module.weights().merged(base.weight)
    assert (nn.functional.linear(x, merged, base.bias) - theirs).abs().max() < 1e-5


def test_dora_on_fp8_base_equals_peft_on_the_dequantized_weight_and_only_lora_trains():
    torch.manual_seed(0)
    fp8 = FP8Linear.from_linear(nn.Linear(64, 32), "fp8_scaled")
    dequantized = nn.Linear(64, 32)
    with torch.no_grad():
        dequantized.weight.copy_(fp8.dequantized_weight(torch.float32)), dequantized.bias.copy_(fp8.bias)
    peft_model, sd = peft_dora(dequantized)
    module = ours_from(sd, fp8)
    module.train()
    x = torch.randn(4, 64)
    out = fp8(x)
    assert (out - peft_model(x)).abs().max() < 1e-5
    out.square().sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in module.parameters_to_train())
    assert fp8.weight.grad is None and not fp8.bias.requires_grad


def test_dora_magnitude_starts_at_the_weight_norm_so_step_0_equals_the_base():
    model = flux.Flux(flux.FluxConfig(hidden_size=16, num_heads=1, depth=1, depth_single=1, axes_dim=(4, 6, 6),
                                      context_in_dim=8, vec_in_dim=8, guidance_embed=False))
    inputs = (torch.randn(1, 4, 64), flux.make_img_ids(1, 2, 2), torch.randn(1, 3, 8), flux.make_txt_ids(1, 3),
              torch.tensor([0.5]), torch.randn(1, 8))
    before = model(*inputs)
    net = LoRANetwork(model, "flux", 4, network_args={"use_dora": "true"})
    net.apply()
    assert (model(*inputs) - before).abs().max() < 1e-5
    assert len(net.trainable_parameters()) == 3 * len(net.lora_modules())
    assert sum(len(g["params"]) for g in net.param_groups(1e-3)) == len(net.trainable_parameters())


def test_dora_kohya_and_peft_files_load_back_with_the_same_output(tmp_path):
    torch.manual_seed(0)
    model = flux.Flux(flux.FluxConfig(hidden_size=16, num_heads=1, depth=1, depth_single=1, axes_dim=(4, 6, 6),
                                      context_in_dim=8, vec_in_dim=8, guidance_embed=False))
    inputs = (torch.randn(1, 4, 64), flux.make_img_ids(1, 2, 2), torch.randn(1, 3, 8), flux.make_txt_ids(1, 3),
              torch.tensor([0.5]), torch.randn(1, 8))
    net = LoRANetwork(model, "flux", 4, alpha=2.0, network_args={"dora": True})
    with torch.no_grad():
        for p in net.trainable_parameters():
            p.add_(torch.randn_like(p) * 0.1)
    net.apply()
    trained = model(*inputs).detach()
    path = str(tmp_path / "dora.safetensors")
    net.save(path)
    tensors = load_file(path)
    scale = tensors["lora_unet_double_blocks_0_img_attn_qkv.dora_scale"]
    assert scale.shape == (48, 1) and scale.dtype == torch.float32  # [out, 1]: ComfyUI's output-axis layout
    net.remove()
    loaded = LoRANetwork.from_weights(model, "flux", path)
    assert all(m.dora_scale is not None for m in loaded.lora_modules())
    loaded.apply()
    assert (model(*inputs) - trained).abs().max() < 1e-6
    loaded.remove()
    peft_path = str(tmp_path / "dora_peft.safetensors")
    lf.write_peft(net.lora_weights(), peft_path)
    assert load_file(peft_path)["transformer.double_blocks.0.img_attn.qkv.lora_magnitude_vector"].shape == (48,)
    again = LoRANetwork.from_weights(model, "flux", peft_path)
    again.apply()
    assert (model(*inputs) - trained).abs().max() < 1e-5
    again.remove()
    plain = LoRANetwork(model, "flux", 4, alpha=2.0)
    with pytest.raises(CheckpointError, match="is DoRA in the file, plain LoRA in the network"):
        plain.load_weights(path)


def test_a_bf16_file_keeps_the_learned_magnitude_in_float32(tmp_path):
    """The magnitude scales each output row: in bf16 (the file's save dtype, as it was) a learned change of 0.1%
    rounds away (bf16's step is 0.4% of the value); kept float32 in the kohya and the PEFT layouts, exact."""
    model = flux.Flux(flux.FluxConfig(hidden_size=16, num_heads=1, depth=1, depth_single=1, axes_dim=(4, 6, 6),
                                      context_in_dim=8, vec_in_dim=8, guidance_embed=False))
    net = LoRANetwork(model, "flux", 4, alpha=2.0, network_args={"dora": True})
    with torch.no_grad():
        for m in net.lora_modules():
            m.dora_scale.mul_(1.001)
    weights = net.lora_weights()
    kohya = lf.kohya_state_dict(weights, torch.bfloat16)
    peft = lf.peft_state_dict(weights, dtype=torch.bfloat16)
    for path, w in weights.items():
        name = lf.kohya_name(path, "lora_unet")
        assert kohya[f"{name}.lora_up.weight"].dtype == torch.bfloat16
        assert torch.equal(kohya[f"{name}.dora_scale"].reshape(-1), w.magnitude.float())
        assert torch.equal(peft[f"transformer.{path}.lora_magnitude_vector"], w.magnitude.float())
    assert not torch.equal(w.magnitude.to(torch.bfloat16).float(), w.magnitude.float())  # what bf16 kept


def random_dora(model, family, **args) -> LoRANetwork:
    """A DoRA with large random updates and magnitudes, so any mistake shows in the output."""
    torch.manual_seed(3)
    net = LoRANetwork(model, family, rank=4, alpha=2, network_args={"dora": True, **args})
    with torch.no_grad():
        for m in net.lora_modules():
            m.lora_up.weight.normal_(0, 1.0)
            m.dora_scale.mul_(1 + 0.3 * torch.randn_like(m.dora_scale))
    return net


def test_dora_files_load_in_diffusers_with_our_output(tmp_path):
    """diffusers reads a DoRA from PEFT keys (lora_magnitude_vector -> use_dora); its kohya FLUX
    converter drops `dora_scale`, so diffusers users get our convert_lora --to diffusers output."""
    from diffusers import FluxPipeline, FluxTransformer2DModel, QwenImagePipeline, QwenImageTransformer2DModel
    from library.models.flux1.checkpoint import load_flux
    from library.models.qwen_image.model import load_qwen_image
    from tests.test_lora_clients import QWEN_TINY, flux_outputs, lora_layer_count, qwen_outputs, randomize_
    from tools import convert_lora

    flux_cfg = dict(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=16,
                    num_attention_heads=2, joint_attention_dim=64, pooled_projection_dim=64, guidance_embeds=False,
                    axes_dims_rope=(4, 6, 6))
    theirs = FluxTransformer2DModel(**flux_cfg)
    randomize_(theirs, seed=1)
    theirs.save_pretrained(tmp_path / "flux" / "transformer")
    ours, theirs = load_flux(str(tmp_path / "flux" / "transformer")), theirs.eval()
    net = random_dora(ours, "flux")
    net.save(str(tmp_path / "flux_kohya.safetensors"))
    base, _ = flux_outputs(ours, theirs)
    net.apply()
    with_dora, _ = flux_outputs(ours, theirs)
    assert (with_dora - base).abs().max() > 0.5
    assert convert_lora.main([str(tmp_path / "flux_kohya.safetensors"), str(tmp_path / "flux_peft.safetensors"),
                              "--to", "diffusers"]) == 0
    pipe = FluxPipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=None, text_encoder_2=None,
                        tokenizer_2=None, transformer=theirs)
    pipe.load_lora_weights(str(tmp_path / "flux_peft.safetensors"))
    assert lora_layer_count(theirs) == 20 and theirs.transformer_blocks[0].attn.to_q.use_dora["default_0"]
    flux_diff = (with_dora - flux_outputs(ours, theirs)[1]).abs().max().item()

    reference = QwenImageTransformer2DModel(**{k: v for k, v in QWEN_TINY.to_diffusers().items() if not k.startswith("_")})
    randomize_(reference, seed=5)
    reference.save_pretrained(tmp_path / "qwen" / "transformer")
    ours, theirs = load_qwen_image(str(tmp_path / "qwen")), reference.eval()
    net = random_dora(ours, "qwen_image")
    lf.write_peft(net.lora_weights(), str(tmp_path / "qwen_peft.safetensors"))
    net.apply()
    with_dora, _ = qwen_outputs(ours, theirs)
    pipe = QwenImagePipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=None, transformer=theirs)
    pipe.load_lora_weights(str(tmp_path / "qwen_peft.safetensors"))
    qwen_diff = (with_dora - qwen_outputs(ours, theirs)[1]).abs().max().item()
    print(f"DoRA in diffusers: max abs diff FLUX {flux_diff:.3g}, Qwen-Image {qwen_diff:.3g}")
    assert flux_diff <= 1e-4 and qwen_diff <= 1e-4


def random_module(base, dora: bool, multiplier: float, seed: int) -> LoRAModule:
    module = LoRAModule("lin", base, 4, 8.0, multiplier=multiplier, dora=dora)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters_to_train():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return module


@pytest.mark.parametrize("kind", ["linear", "fp8_scaled"])
def test_a_dora_applied_after_a_lora_equals_the_dora_on_the_base_with_the_lora_merged(kind):
    """generate.py --lora lora.safetensors dora.safetensors: the DoRA's norm was ||W + dW|| of the raw base weight,
    not of W + the LoRA's delta (0.11 of a module's output off), where a base_loras run trains the DoRA on the base
    with the LoRA merged (and ComfyUI patches in sequence); a DoRA alone is unchanged."""
    torch.manual_seed(0)
    base = nn.Linear(16, 12)
    if kind == "fp8_scaled":
        base = FP8Linear.from_linear(base, kind)
    weight = base.dequantized_weight(torch.float32) if kind != "linear" else base.weight.detach().float()
    x = torch.randn(3, 5, 16)
    alone = random_module(base, True, 0.8, seed=2)
    alone.apply_to_base()
    dora_alone = base(x).detach()
    expected_alone = nn.functional.linear(x, alone.weights().merged(weight, 0.8), base.bias.float())
    assert (dora_alone - expected_alone).abs().max() < 1e-5
    alone.remove_from_base()
    lora = random_module(base, False, 0.7, seed=1)
    dora = random_module(base, True, 0.8, seed=2)
    lora.apply_to_base(), dora.apply_to_base()
    stacked = base(x)
    merged = nn.Linear(16, 12)  # the base_loras base: the LoRA merged into the float32 weights
    with torch.no_grad():
        merged.weight.copy_(lf.merge_into_weight(weight, [(0.7, lora.weights())])), merged.bias.copy_(base.bias.float())
    same = LoRAModule("lin", merged, 4, 8.0, multiplier=0.8, dora=True)
    same.load_state_dict(dora.state_dict())  # the same magnitudes (a DoRA starts them at the norms of its base)
    same.apply_to_base()
    assert (stacked - merged(x)).abs().max() < 1e-5
    dora.remove_from_base(), lora.remove_from_base()
    alone.apply_to_base()
    assert torch.equal(base(x), dora_alone)  # the DoRA alone: the same output, bit for bit


def test_a_dora_applied_after_a_lokr_normalises_the_weight_its_forward_computes():
    """--lora lokr.safetensors dora.safetensors: the DoRA's norm is of the weight with the LoKr's delta (read off the
    LoKr'd layer itself here); after a LyCORIS module whose weight it cannot read (algo=full), it is refused."""
    from networks.lycoris_network import LycorisNetwork
    from tests.test_lycoris import flux_inputs, randomize, tiny_flux

    torch.manual_seed(0)
    model = tiny_flux()
    lokr = LycorisNetwork(model, "flux", 4, network_args={"algo": "lokr", "factor": 4})
    randomize(lokr)
    lokr.apply()
    reference = tiny_flux()
    reference.load_state_dict(model.state_dict())
    with torch.no_grad():  # each LoKr'd Linear's weight, probed: lin(I) - bias
        for name, layer in reference.named_modules():
            if isinstance(layer, nn.Linear) and "forward" in model.get_submodule(name).__dict__:
                lin = model.get_submodule(name)
                layer.weight.copy_((lin(torch.eye(lin.in_features)) - lin.bias).t())
    dora = random_dora(model, "flux")
    same = LoRANetwork(reference, "flux", rank=4, alpha=2, network_args={"dora": True})
    same.load_state_dict(dora.state_dict())  # the same magnitudes (a DoRA starts them at the norms of its base)
    dora.apply(), same.apply()
    x = flux_inputs()
    assert (model(*x) - reference(*x)).abs().max() < 1e-5
    dora.remove(), lokr.remove()
    full = LycorisNetwork(model, "flux", 4, network_args={"algo": "full"})
    full.apply()
    with pytest.raises(ValueError, match="DoRA module .* after the LyCORIS FullModule .* give the DoRA file first"):
        random_dora(model, "flux").apply()
