"""FLUX.1 transformer: parity with diffusers, checkpoint formats, precision, checkpointing."""

import json
import os

import pytest
import torch
from diffusers import FluxTransformer2DModel
from safetensors.torch import load_file, save_file

from library.models.flux1.model import FLUX_DEV, FLUX_SCHNELL, Flux, FluxConfig, make_img_ids, make_txt_ids
from library.models.flux1.checkpoint import (
    FLUX_DIFFUSERS_NAMES,
    diffusers_to_flux_state_dict,
    flux_diffusers_module_map,
    flux_to_diffusers_state_dict,
    load_flux,
    save_flux_bfl,
    save_flux_diffusers,
)
from library.io import CheckpointError
from library.models.registry import arch_spec

# head_dim 32 = 4 + 14 + 14, the FLUX.1 axes split scaled down (default_axes_dim(32)).
TINY = dict(
    in_channels=64, vec_in_dim=16, context_in_dim=32, hidden_size=64, num_heads=2, depth=2, depth_single=2, axes_dim=(4, 14, 14)
)
H, W, T, B = 16, 24, 7, 2  # latent grid in 2x2 patches (non-square), text length, batch


def tiny_config(guidance: bool) -> FluxConfig:
    return FluxConfig(**TINY, guidance_embed=guidance)


def tiny_diffusers(guidance: bool) -> FluxTransformer2DModel:
    model = FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=2, num_single_layers=2, attention_head_dim=32, num_attention_heads=2,
        joint_attention_dim=32, pooled_projection_dim=16, guidance_embeds=guidance, axes_dims_rope=(4, 14, 14),
    )  # fmt: skip
    return randomize(model)


def randomize(model: torch.nn.Module) -> torch.nn.Module:
    """Every parameter random, norms around 1: zero-initialised gates and norms must matter too."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            is_norm = p.dim() == 1 and ("norm" in name and not name.endswith("bias"))
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g) if is_norm else 0.15 * torch.randn(p.shape, generator=g))
    return model.eval()


def inputs(guidance: bool):
    g = torch.Generator().manual_seed(2)
    return dict(
        img=torch.randn(B, H * W, 64, generator=g),
        img_ids=make_img_ids(B, H, W),
        txt=torch.randn(B, T, 32, generator=g),
        txt_ids=make_txt_ids(B, T),
        timesteps=torch.tensor([0.3, 0.85]),
        y=torch.randn(B, 16, generator=g),
        guidance=torch.tensor([3.5, 1.0]) if guidance else None,
    )


def diffusers_forward(model: FluxTransformer2DModel, x: dict) -> torch.Tensor:
    # FluxPipeline passes sigma (timestep / 1000) and the raw guidance scale; the model multiplies
    # both by 1000 itself. Its ids are 2-D, built by FluxPipeline._prepare_latent_image_ids.
    from diffusers import FluxPipeline

    img_ids = FluxPipeline._prepare_latent_image_ids(B, H, W, "cpu", torch.float32)
    assert torch.equal(img_ids, x["img_ids"][0].float())
    with torch.no_grad():
        return model(
            hidden_states=x["img"], encoder_hidden_states=x["txt"], pooled_projections=x["y"], timestep=x["timesteps"],
            img_ids=img_ids, txt_ids=torch.zeros(T, 3), guidance=x["guidance"], return_dict=False,
        )[0]  # fmt: skip


def relative_rms_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("variant", ["dev_sharded", "schnell_pipeline_folder"])
def test_flux_matches_diffusers_fp32(tmp_path, variant):
    guidance = variant.startswith("dev")
    reference = tiny_diffusers(guidance)
    if guidance:  # transformer folder itself, several shards + index
        reference.save_pretrained(tmp_path, max_shard_size="100KB")
        assert len([f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]) > 1
    else:  # a pipeline folder with transformer/
        reference.save_pretrained(tmp_path / "transformer")
    model = load_flux(str(tmp_path))
    assert model.config == tiny_config(guidance)

    x = inputs(guidance)
    expected = diffusers_forward(reference, x)
    with torch.no_grad():
        out = model(**x)
    assert out.shape == (B, H * W, 64) and out.dtype == torch.float32
    assert expected.abs().mean() > 0.1  # a real signal, not a vanishing one
    assert (out - expected).abs().max().item() <= 1e-5


def test_guidance_required_for_dev_and_changes_output():
    model = randomize(Flux(tiny_config(True)))
    x = inputs(True)
    with pytest.raises(ValueError, match="guidance"):
        model(**{**x, "guidance": None})
    with torch.no_grad():
        delta = (model(**x) - model(**{**x, "guidance": x["guidance"] + 1})).abs().max()
    assert delta > 1e-3


def test_state_dict_conversion_round_trip_and_fits_diffusers():
    model = randomize(Flux(tiny_config(True)))
    bfl = model.state_dict()
    diffusers_sd = flux_to_diffusers_state_dict(bfl)
    tiny_diffusers(True).load_state_dict(diffusers_sd, strict=True)  # every name and shape diffusers expects
    back = diffusers_to_flux_state_dict(diffusers_sd)
    assert back.keys() == bfl.keys()
    assert all(torch.equal(back[k], bfl[k]) for k in bfl)
    # (shift, scale) -> (scale, shift): the final adaLN rows are swapped, not copied.
    h = 64
    assert torch.equal(diffusers_sd["norm_out.linear.weight"][:h], bfl["final_layer.adaLN_modulation.1.weight"][h:])


def test_module_map_covers_every_linear_with_matching_rows():
    model, reference = Flux(tiny_config(True)), tiny_diffusers(True)
    ours = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    theirs = {n: m for n, m in reference.named_modules() if isinstance(m, torch.nn.Linear)}
    table = flux_diffusers_module_map(2, 2, 64, 256, out_channels=64, guidance=True)
    assert table.keys() == ours.keys()
    rows_per_target: dict[str, int] = {}
    for name, parts in table.items():
        assert sorted((s, e) for _, s, e in parts)[-1][1] == ours[name].out_features
        for target, start, end in parts:
            assert theirs[target].in_features == ours[name].in_features
            rows_per_target[target] = rows_per_target.get(target, 0) + end - start
    assert rows_per_target == {n: m.out_features for n, m in theirs.items()}
    assert len(FLUX_DIFFUSERS_NAMES) == 8 + 19 * 10 + 38 * 3 + 2


@pytest.mark.parametrize("prefix", ["model.diffusion_model.", "diffusion_model."])
def test_comfyui_prefixed_bfl_file_loads(tmp_path, prefix):
    model = randomize(Flux(tiny_config(False)))
    sd = {prefix + k: v for k, v in model.state_dict().items()}
    sd["first_stage_model.decoder.conv_in.weight"] = torch.zeros(3)  # other components of an all-in-one file
    save_file(sd, tmp_path / "comfy.safetensors")  # no config metadata: inferred from shapes
    loaded = load_flux(str(tmp_path / "comfy.safetensors"))
    assert loaded.config == model.config
    x = inputs(False)
    with torch.no_grad():
        assert torch.equal(loaded(**x), model(**x))


def test_bfl_and_diffusers_writers_reload_identically(tmp_path):
    model = randomize(Flux(tiny_config(True)))
    save_flux_bfl(model, str(tmp_path / "flux.safetensors"))
    save_flux_diffusers(model, None, str(tmp_path / "diffusers"))
    with open(tmp_path / "diffusers" / "config.json") as f:
        assert FluxTransformer2DModel.from_config(json.load(f)).config.guidance_embeds is True
    for path in (tmp_path / "flux.safetensors", tmp_path / "diffusers"):
        loaded = load_flux(str(path))
        assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())


def test_shape_mismatch_names_key_and_shapes(tmp_path):
    model = Flux(tiny_config(False))
    sd = model.state_dict()
    sd["txt_in.weight"] = torch.zeros(64, 48)
    save_file(sd, tmp_path / "bad.safetensors")
    with pytest.raises(CheckpointError) as refused:
        load_flux(str(tmp_path / "bad.safetensors"), config=tiny_config(False))
    # the file named once (it was "bad.safetensors: bad.safetensors: key ...")
    said = "key 'txt_in.weight' has shape (64, 48), expected (64, 32)"
    assert str(refused.value) == f"{tmp_path / 'bad.safetensors'}: {said}"

    save_flux_diffusers(model, None, str(tmp_path / "d"))
    d_sd = load_file(tmp_path / "d" / "diffusion_pytorch_model.safetensors")
    d_sd["single_transformer_blocks.1.attn.to_k.weight"] = torch.zeros(60, 64)
    save_file(d_sd, tmp_path / "d" / "diffusion_pytorch_model.safetensors")
    message = r"'single_transformer_blocks\.1\.attn\.to_k\.weight' has shape \(60, 64\), expected \(64, 64\)"
    with pytest.raises(CheckpointError, match=message):
        load_flux(str(tmp_path / "d"))


def test_bf16_within_tolerance_of_fp32(tmp_path):
    model = randomize(Flux(tiny_config(True)))
    save_flux_bfl(model, str(tmp_path / "flux.safetensors"))
    bf16 = load_flux(str(tmp_path / "flux.safetensors"), dtype=torch.bfloat16)
    assert bf16.compute_dtype == torch.bfloat16 and bf16.img_in.weight.dtype == torch.bfloat16
    x = inputs(True)
    with torch.no_grad():
        ref, out = model(**x), bf16(**x)
    assert out.dtype == torch.bfloat16
    # Stated tolerance: bf16 keeps 8 significant bits; through 4 blocks the relative RMS error stays
    # under 3% (measured 1.1%) and the largest error under 3% of max |output| (measured 1.6%).
    assert relative_rms_error(out, ref) <= 0.03
    assert (out.float() - ref).abs().max() <= 0.03 * ref.abs().max()
    with pytest.raises(TypeError, match="position ids"):
        bf16(**{**x, "img_ids": x["img_ids"].bfloat16()})


def test_gradient_checkpointing_gives_same_grads():
    model = randomize(Flux(tiny_config(True))).train()
    x = inputs(True)
    grads = []
    for use_checkpoint in (False, True):
        model.zero_grad()
        model.gradient_checkpointing = use_checkpoint
        model(**x).square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert all(torch.allclose(grads[0][n], grads[1][n], rtol=1e-5, atol=1e-7) for n in grads[0])
    assert grads[0]["double_blocks.0.img_attn.qkv.weight"].abs().max() > 0


def test_meta_param_counts_match_released_models():
    counts = {}
    for name, config in (("dev", FLUX_DEV), ("schnell", FLUX_SCHNELL)):
        with torch.device("meta"):
            counts[name] = sum(p.numel() for p in Flux(config).parameters())
            reference = FluxTransformer2DModel(guidance_embeds=config.guidance_embed)
        assert counts[name] == sum(p.numel() for p in reference.parameters())
    assert counts == {"dev": 11_901_408_320, "schnell": 11_891_178_560}


def test_fp8_scaled_load_quantizes_linears_from_both_layouts(tmp_path):
    from library.precision.fp8 import fp8_load_converter, prepare_fp8

    model = randomize(Flux(tiny_config(True)))
    save_flux_bfl(model, str(tmp_path / "flux.safetensors"))
    save_flux_diffusers(model, None, str(tmp_path / "diffusers"))
    x, outputs = inputs(True), []
    for path in (tmp_path / "flux.safetensors", tmp_path / "diffusers"):
        prepare = lambda m: fp8_load_converter(prepare_fp8(m, "fp8_scaled", arch_spec("flux").fp8))  # noqa: E731
        fp8 = load_flux(str(path), dtype=torch.bfloat16, prepare=prepare)
        assert fp8.double_blocks[0].img_attn.qkv.weight.dtype == torch.float8_e4m3fn
        assert fp8.img_in.weight.dtype == torch.bfloat16  # embedders stay high precision (its spec's fp8 keep rules)
        with torch.no_grad():
            outputs.append(fp8(**x))
    assert torch.equal(outputs[0], outputs[1])  # the diffusers join feeds the quantizer the same fused rows
    with torch.no_grad():
        ref = model(**x)
    # Scaled e4m3 (3 mantissa bits, per-channel scales) with these N(0, 0.15) weights: stated bound
    # 12% relative RMS error (measured 7.6%; bf16 alone gives 1.1%).
    assert relative_rms_error(outputs[0], ref) <= 0.12


def test_the_guidance_embedding_is_read_once_per_file(tiny_set, tmp_path, monkeypatch):
    """has_guidance_embedding (asked for each sample's steps and options) read the checkpoint's header
    on every call: 4 reads for the 4 calls below; now 1, and 1 more once the file is rewritten."""
    import shutil

    from library.io import CheckpointReader
    from library.models.flux1.family import FluxFamily

    reads = []
    real_keys = CheckpointReader.keys
    monkeypatch.setattr(CheckpointReader, "keys", lambda self: (reads.append(1), real_keys(self))[1])
    path = tmp_path / "flux.safetensors"
    shutil.copy(tiny_set["flux_bfl"], path)
    family = FluxFamily(str(path))
    assert [family.has_guidance_embedding(), family.sample_steps, "guidance" in family.unread_sample_options(),
            FluxFamily(str(path)).has_guidance_embedding()] == [True, 28, False, True]
    assert len(reads) == 1
    weights = {k: v for k, v in load_file(path).items() if not k.startswith("guidance_in.")}  # schnell's keys
    save_file(weights, str(path))
    assert family.has_guidance_embedding() is False and len(reads) == 2
