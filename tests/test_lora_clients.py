"""The real-client check: LoRA files we write load in diffusers (the loader people use) and give
the same output as our model with the LoRA applied unmerged.

FLUX runs at the full width (3072, MLP 12288) because diffusers' kohya FLUX converter hard-codes
those widths for single-block `linear1` (`_convert_kohya_flux_lora_to_diffusers`, dims=[3072, 3072,
3072, 12288]); one double and one single block, small context/pooled widths (its converter does not
look at them): about 0.52 B float32 parameters. Qwen-Image's converter only renames, so a tiny
config is enough.
"""

import pytest
import torch
from diffusers import FluxPipeline, FluxTransformer2DModel, QwenImagePipeline, QwenImageTransformer2DModel
from peft.tuners.lora import LoraLayer

from library.models.flux1.model import make_img_ids, make_txt_ids
from library.models.flux1.checkpoint import flux_diffusers_module_map, load_flux
from library.models.qwen_image.model import QwenImageConfig, load_qwen_image
from networks import lora_files as lf
from networks.lora_module_map import bfl_to_diffusers
from networks.lora import LoRANetwork
from tools import convert_lora

TOLERANCE = 1e-4  # max abs difference, float32
FLUX_WIDE = dict(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=128, num_attention_heads=24,
                 joint_attention_dim=64, pooled_projection_dim=64, guidance_embeds=False, axes_dims_rope=(16, 56, 56))  # fmt: skip
QWEN_TINY = QwenImageConfig(num_layers=2, attention_head_dim=32, num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(8, 12, 12))
IMG_H, IMG_W, TXT = 4, 4, 8  # 16 image tokens, 8 text tokens


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random: 2-D ~ N(0, 1/fan_in), norms ~ 1 + N(0, 0.2^2), the rest N(0, 0.1^2)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif p.dim() == 2:
                p.normal_(0, p.shape[1] ** -0.5, generator=g)
            else:
                p.normal_(0, 0.1, generator=g)


def random_lora(model, family: str, up_std: float = 1.0, **network_args) -> LoRANetwork:
    """rank 4, alpha 2, up ~ N(0, up_std): by default a delta as large as the weights, so any mistake shows."""
    torch.manual_seed(3)
    net = LoRANetwork(model, family, rank=4, alpha=2, network_args=network_args)
    with torch.no_grad():
        for m in net.lora_modules():
            m.lora_up.weight.normal_(0, up_std)
    return net


def lora_layer_count(model: torch.nn.Module) -> int:
    return sum(isinstance(m, LoraLayer) for m in model.modules())


# ----------------------------------------------------------------------------------------------
# FLUX.1


@pytest.fixture(scope="module")
def flux_pair(tmp_path_factory):
    """(our Flux loaded from a diffusers folder, diffusers FluxTransformer2DModel from the same folder)."""
    folder = tmp_path_factory.mktemp("flux_wide") / "transformer"
    with torch.device("meta"):
        reference = FluxTransformer2DModel(**FLUX_WIDE)
    reference = reference.to_empty(device="cpu")
    assert not list(reference.buffers())  # to_empty leaves no uninitialised buffer behind
    randomize_(reference, seed=1)
    reference.save_pretrained(folder)
    del reference
    return load_flux(str(folder)), FluxTransformer2DModel.from_pretrained(folder).eval(), folder.parent


def flux_outputs(ours, theirs) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    img, txt, y = torch.randn(1, IMG_H * IMG_W, 64, generator=g), torch.randn(1, TXT, 64, generator=g), torch.randn(1, 64, generator=g)
    sigma, img_ids = torch.tensor([0.4]), make_img_ids(1, IMG_H, IMG_W)
    with torch.no_grad():
        mine = ours(img, img_ids, txt, make_txt_ids(1, TXT), sigma, y)
        reference = theirs(hidden_states=img, encoder_hidden_states=txt, pooled_projections=y, timestep=sigma,
                           img_ids=img_ids[0].float(), txt_ids=torch.zeros(TXT, 3), return_dict=False)[0]  # fmt: skip
    return mine, reference


def test_flux_kohya_and_diffusers_files_load_in_diffusers_with_our_output(flux_pair):
    ours, theirs, root = flux_pair
    base, base_reference = flux_outputs(ours, theirs)
    assert (base - base_reference).abs().max() <= TOLERANCE

    net = random_lora(ours, "flux", train_modulation=True)  # attention, MLP, single-block and modulation Linears
    net.save(str(root / "kohya.safetensors"))
    expected_modules = bfl_to_diffusers(net.lora_weights(), flux_diffusers_module_map(1, 1, 3072, 12288, guidance=False))
    assert len(expected_modules) == 20  # qkv / linear1 split into to_q, to_k, to_v (+ proj_mlp)
    net.apply()
    with_lora, _ = flux_outputs(ours, theirs)
    assert (with_lora - base).abs().max() > 1.0  # the LoRA changes the output a lot

    pipe = FluxPipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None, transformer=theirs)
    pipe.load_lora_weights(str(root / "kohya.safetensors"))
    assert lora_layer_count(theirs) == len(expected_modules)
    _, reference = flux_outputs(ours, theirs)
    kohya_diff = (with_lora - reference).abs().max().item()

    pipe.unload_lora_weights()
    assert convert_lora.main([str(root / "kohya.safetensors"), str(root / "diffusers.safetensors"), "--to", "diffusers"]) == 0
    pipe.load_lora_weights(str(root / "diffusers.safetensors"))  # PEFT names, alpha folded into lora_B
    assert lora_layer_count(theirs) == len(expected_modules)
    _, reference = flux_outputs(ours, theirs)
    diffusers_diff = (with_lora - reference).abs().max().item()
    print(f"FLUX width 3072: max abs diff kohya {kohya_diff:.3g}, diffusers/PEFT {diffusers_diff:.3g}")
    assert kohya_diff <= TOLERANCE and diffusers_diff <= TOLERANCE


def test_flux_kontext_lora_loads_in_flux_kontext_pipeline_with_our_output(flux_pair):
    """A Kontext LoRA is a FLUX.1 LoRA: FluxKontextPipeline loads our kohya file, and its transformer
    called the way the pipeline calls it (target + reference tokens) gives our runtime LoRA's output."""
    from diffusers import FluxKontextPipeline

    from library.models.flux1.kontext import FluxKontextFamily

    ours, theirs, root = flux_pair
    ours = load_flux(str(root / "transformer"))  # a fresh base: the FLUX.1 test leaves its LoRA applied
    g = torch.Generator().manual_seed(4)
    x_t, reference = torch.randn(1, IMG_H * IMG_W, 64, generator=g), torch.randn(1, 16, 4, 6, generator=g)
    text = {"t5": torch.randn(1, TXT, 64, generator=g), "clip_pooled": torch.randn(1, 64, generator=g)}
    sigma, family = torch.tensor([0.6]), FluxKontextFamily("unused")
    net = random_lora(ours, "flux", train_modulation=True)
    net.save(str(root / "kontext.safetensors"))
    with torch.no_grad():
        base = family.predict(ours, x_t, sigma, text, IMG_H, IMG_W, None, control=[reference])
        net.apply()
        mine = family.predict(ours, x_t, sigma, text, IMG_H, IMG_W, None, control=[reference])
    assert (mine - base).abs().max() > 1.0  # the LoRA changes the output a lot

    pipe = FluxKontextPipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=None, text_encoder_2=None,
                               tokenizer_2=None, transformer=theirs)
    pipe.unload_lora_weights()
    pipe.load_lora_weights(str(root / "kontext.safetensors"))
    latent_ids = FluxKontextPipeline._prepare_latent_image_ids(1, IMG_H, IMG_W, "cpu", torch.float32)
    image_ids = FluxKontextPipeline._prepare_latent_image_ids(1, 2, 3, "cpu", torch.float32)
    image_ids[..., 0] = 1
    with torch.no_grad():
        out = theirs(hidden_states=torch.cat([x_t, FluxKontextPipeline._pack_latents(reference, 1, 16, 4, 6)], dim=1),
                     timestep=sigma, guidance=None, pooled_projections=text["clip_pooled"],
                     encoder_hidden_states=text["t5"], txt_ids=torch.zeros(TXT, 3),
                     img_ids=torch.cat([latent_ids, image_ids]), return_dict=False)[0][:, : x_t.shape[1]]  # fmt: skip
    pipe.unload_lora_weights()
    diff = (mine - out).abs().max().item()
    print(f"FLUX Kontext LoRA in FluxKontextPipeline's transformer: max abs diff {diff:.3g}")
    assert out.abs().mean() > 0.1 and diff <= TOLERANCE


def test_flux_in_dims_embedders_load_in_diffusers_after_convert_lora_only(flux_pair):
    """diffusers 0.42.1's kohya FLUX reader names the embedders (x_embedder, context_embedder, time_text_embed)
    without its transformer prefix, so a LoRA trained with in_dims lost its 6 embedder modules in
    load_lora_weights with no warning (4.8 off against a LoRA effect of 7.4); README said it loads as saved.
    The documented way: convert_lora.py --to diffusers, which loads them (its output: the test above). This
    pins diffusers' drop: when it loads the kohya file whole, the README's line can go."""
    ours, theirs, root = flux_pair
    net = random_lora(ours, "flux", in_dims="[4, 4, 4, 0, 4]")  # (not applied: only its file is read)
    assert sum(m.split(".")[0] in ("img_in", "txt_in", "time_in", "vector_in") for m in net.lora_weights()) == 6
    net.save(str(root / "in_dims.safetensors"))
    assert convert_lora.main([str(root / "in_dims.safetensors"), str(root / "in_dims_diffusers.safetensors"),
                              "--to", "diffusers"]) == 0
    pipe = FluxPipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=None, text_encoder_2=None,
                        tokenizer_2=None, transformer=theirs)
    loaded = {}
    for name in ("in_dims", "in_dims_diffusers"):
        pipe.unload_lora_weights()
        pipe.load_lora_weights(str(root / f"{name}.safetensors"))
        layers = [n for n, m in theirs.named_modules() if hasattr(m, "lora_A") and len(m.lora_A)]
        loaded[name] = sum(n.startswith(("x_embedder", "context_embedder", "time_text_embed")) for n in layers)
    pipe.unload_lora_weights()
    assert loaded == {"in_dims": 0, "in_dims_diffusers": 6}


# ----------------------------------------------------------------------------------------------
# Qwen-Image


def qwen_outputs(ours, theirs) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    img, txt = torch.randn(1, IMG_H * IMG_W, 64, generator=g), torch.randn(1, TXT, 32, generator=g)
    mask, sigma = torch.ones(1, TXT, dtype=torch.long), torch.tensor([0.4])
    with torch.no_grad():
        mine = ours(img, txt, mask.bool(), sigma, [(1, IMG_H, IMG_W)])
        reference = theirs(hidden_states=img, encoder_hidden_states=txt, encoder_hidden_states_mask=mask, timestep=sigma,
                           img_shapes=[[(1, IMG_H, IMG_W)]], return_dict=False)[0]  # fmt: skip
    return mine, reference


def test_qwen_image_kohya_and_peft_files_load_in_diffusers_with_our_output(tmp_path):
    reference = QwenImageTransformer2DModel(**{k: v for k, v in QWEN_TINY.to_diffusers().items() if not k.startswith("_")})
    randomize_(reference, seed=5)
    reference.save_pretrained(tmp_path / "transformer")
    ours, theirs = load_qwen_image(str(tmp_path)), reference.eval()
    base, base_reference = qwen_outputs(ours, theirs)
    assert (base - base_reference).abs().max() <= TOLERANCE

    net = random_lora(ours, "qwen_image", mod_dim=4)  # `lora_unet_transformer_blocks_0_attn_to_q`, ... and img_mod.1
    net.save(str(tmp_path / "kohya.safetensors"))
    lf.write_peft(net.lora_weights(), str(tmp_path / "peft.safetensors"))
    net.apply()
    with_lora, _ = qwen_outputs(ours, theirs)
    assert (with_lora - base).abs().max() > 0.5

    pipe = QwenImagePipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=None, transformer=theirs)
    diffs = {}
    for name in ("kohya", "peft"):
        pipe.load_lora_weights(str(tmp_path / f"{name}.safetensors"))
        assert lora_layer_count(theirs) == len(net.lora_modules()) == 2 * 14
        diffs[name] = (with_lora - qwen_outputs(ours, theirs)[1]).abs().max().item()
        pipe.unload_lora_weights()
    print(f"Qwen-Image: max abs diff kohya {diffs['kohya']:.3g}, PEFT {diffs['peft']:.3g}")
    assert max(diffs.values()) <= TOLERANCE


def test_qwen_image_edit_lora_loads_in_edit_plus_pipeline_with_our_output(tmp_path):
    """A Qwen-Image-Edit-2511 LoRA (zero_cond_t) is a Qwen-Image LoRA: QwenImageEditPlusPipeline loads
    our kohya file, and its transformer called as the pipeline calls it (target + two condition
    images' tokens, img_shapes listing all, output cut to the target) gives our runtime LoRA's output."""
    import dataclasses

    from diffusers import QwenImageEditPlusPipeline

    from library.models.qwen_image.edit import TRANSFORMER_FLAGS
    from library.models.qwen_image.edit_family import QwenImageEditFamily
    from library.models.latents import pack_latents

    config = dataclasses.replace(QWEN_TINY, **TRANSFORMER_FLAGS["qwen-image-edit-2511"])
    theirs = QwenImageTransformer2DModel(**{k: v for k, v in config.to_diffusers().items() if not k.startswith("_")})
    randomize_(theirs, seed=6)
    theirs.save_pretrained(tmp_path / "transformer")
    family = QwenImageEditFamily(str(tmp_path))
    ours = family.load_transformer(torch.float32)
    assert family.version == "qwen-image-edit-2511" and ours.config.zero_cond_t
    g = torch.Generator().manual_seed(4)
    x_t = torch.randn(1, IMG_H * IMG_W, 64, generator=g)
    control = [torch.randn(1, 16, 8, 12, generator=g), torch.randn(1, 16, 6, 4, generator=g)]
    text = {"embeds": torch.randn(1, TXT, 32, generator=g), "mask": torch.ones(1, TXT, dtype=torch.bool)}
    sigma = torch.tensor([0.4])
    net = random_lora(ours, family.arch, mod_dim=4)
    net.save(str(tmp_path / "edit.safetensors"))
    with torch.no_grad():
        base = family.predict(ours, x_t, sigma, text, IMG_H, IMG_W, None, control=control)
        net.apply()
        mine = family.predict(ours, x_t, sigma, text, IMG_H, IMG_W, None, control=control)
    assert (mine - base).abs().max() > 0.5  # the LoRA changes the output a lot

    pipe = QwenImageEditPlusPipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=None, processor=None,
                                     transformer=theirs.eval())
    pipe.load_lora_weights(str(tmp_path / "edit.safetensors"))
    assert lora_layer_count(theirs) == len(net.lora_modules())
    with torch.no_grad():
        out = theirs(hidden_states=torch.cat([x_t, *map(pack_latents, control)], dim=1), timestep=sigma, guidance=None,
                     encoder_hidden_states=text["embeds"], encoder_hidden_states_mask=text["mask"].long(),
                     img_shapes=[[(1, IMG_H, IMG_W), (1, 4, 6), (1, 3, 2)]], return_dict=False)[0][:, : x_t.shape[1]]
    diff = (mine - out).abs().max().item()
    print(f"Qwen-Image-Edit-2511 LoRA in QwenImageEditPlusPipeline's transformer: max abs diff {diff:.3g}")
    assert out.abs().mean() > 0.1 and diff <= TOLERANCE
