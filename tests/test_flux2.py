"""FLUX.2 transformer: parity with diffusers' Flux2Transformer2DModel, BFL <-> diffusers names,
released sizes on `meta`, checkpoint formats."""

import dataclasses
import os

import pytest
import torch
from diffusers import Flux2Transformer2DModel
from safetensors.torch import load_file, save_file
from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers
from diffusers.pipelines.flux2.pipeline_flux2_klein import Flux2KleinPipeline

from library.io import CheckpointError
from library.models.family import fp8_prepare
from library.models.flux2.checkpoint import (
    diffusers_config,
    diffusers_to_flux2_state_dict,
    flux2_diffusers_module_map,
    flux2_to_diffusers_state_dict,
    load_flux2,
)
from library.models.flux2.model import FLUX2_CONFIGS, Flux2, Flux2Config, make_img_ids, make_txt_ids
from library.models.flux2.spec import SHARED_MODULATION
from library.precision.fp8 import FP8Linear
from library.models.registry import arch_spec

# head_dim 32 = 4 x 8, FLUX.2's four equal RoPE axes scaled down; context 96 = 3 stacked layers x 32.
TINY = dict(in_channels=128, context_in_dim=96, hidden_size=64, num_heads=2, depth=2, depth_single=2, axes_dim=(8, 8, 8, 8))
H, W, T, B = 6, 8, 7, 2  # latent grid in 2x2 patches (non-square), text length, batch


def tiny_config(guidance: bool) -> Flux2Config:
    return Flux2Config(**TINY, guidance_embed=guidance)


def tiny_diffusers(guidance: bool) -> Flux2Transformer2DModel:
    config = {k: v for k, v in diffusers_config(tiny_config(guidance)).items() if not k.startswith("_")}
    return randomize(Flux2Transformer2DModel(**config))


def randomize(model: torch.nn.Module) -> torch.nn.Module:
    """Every parameter random, norms around 1 (FLUX.2 has no biases: every 1-D tensor is a norm)."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g) if p.dim() == 1 else 0.15 * torch.randn(p.shape, generator=g))
    return model.eval()


def inputs(guidance: bool):
    g = torch.Generator().manual_seed(2)
    return dict(
        img=torch.randn(B, H * W, 128, generator=g),
        img_ids=make_img_ids(B, H, W),
        txt=torch.randn(B, T, 96, generator=g),
        txt_ids=make_txt_ids(B, T),
        timesteps=torch.tensor([0.3, 0.85]),
        guidance=torch.tensor([4.0, 1.5]) if guidance else None,
    )


def diffusers_forward(model: Flux2Transformer2DModel, x: dict) -> torch.Tensor:
    # As Flux2KleinPipeline calls it: sigma (timestep / 1000), guidance None for [klein] (Flux2Pipeline
    # passes the raw scale for [dev]), ids from the pipeline's own helpers.
    img_ids = Flux2KleinPipeline._prepare_latent_ids(torch.zeros(B, 128, H, W))
    txt_ids = Flux2KleinPipeline._prepare_text_ids(x["txt"])
    assert torch.equal(img_ids, x["img_ids"]) and torch.equal(txt_ids, x["txt_ids"])
    with torch.no_grad():
        return model(
            hidden_states=x["img"], encoder_hidden_states=x["txt"], timestep=x["timesteps"], img_ids=img_ids,
            txt_ids=txt_ids, guidance=x["guidance"], return_dict=False,
        )[0]  # fmt: skip


@pytest.mark.parametrize("variant", ["klein", "dev"])
def test_flux2_matches_diffusers_fp32(variant):
    guidance = variant == "dev"
    reference = tiny_diffusers(guidance)
    model = Flux2(tiny_config(guidance))
    model.load_state_dict(diffusers_to_flux2_state_dict(reference.state_dict()), strict=True)
    x = inputs(guidance)
    expected = diffusers_forward(reference, x)
    with torch.no_grad():
        out = model(**x)
    assert out.shape == (B, H * W, 128) and out.dtype == torch.float32
    assert expected.abs().mean() > 0.1  # a real signal, not a vanishing one
    assert (out - expected).abs().max().item() <= 1e-5


def test_bfl_names_are_what_diffusers_single_file_reads():
    """Our (BFL) state dict through diffusers' own single-file converter gives diffusers' names and
    shapes, and the same weights: an oracle for the name map independent of our converter."""
    model = randomize(Flux2(tiny_config(True)))
    bfl = {k: v.clone() for k, v in model.state_dict().items()}
    theirs = convert_flux2_transformer_checkpoint_to_diffusers(dict(bfl))
    ours = flux2_to_diffusers_state_dict(bfl)
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    tiny_diffusers(True).load_state_dict(ours, strict=True)
    back = diffusers_to_flux2_state_dict(ours)
    assert back.keys() == bfl.keys() and all(torch.equal(back[k], bfl[k]) for k in bfl)


def test_guidance_required_for_dev_and_changes_output():
    model = randomize(Flux2(tiny_config(True)))
    x = inputs(True)
    with pytest.raises(ValueError, match="guidance"):
        model(**{**x, "guidance": None})
    with torch.no_grad():
        delta = (model(**x) - model(**{**x, "guidance": x["guidance"] + 1})).abs().max()
    assert delta > 1e-3


def test_module_map_covers_every_linear_with_matching_rows():
    model, reference = Flux2(tiny_config(True)), tiny_diffusers(True)
    ours = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    theirs = {n: m for n, m in reference.named_modules() if isinstance(m, torch.nn.Linear)}
    table = flux2_diffusers_module_map(2, 2, 64, 192, out_channels=128, guidance=True)
    assert table.keys() == ours.keys()
    rows_per_target: dict[str, int] = {}
    for name, parts in table.items():
        assert sorted((s, e) for _, s, e in parts)[-1][1] == ours[name].out_features
        for target, start, end in parts:
            assert theirs[target].in_features == ours[name].in_features
            rows_per_target[target] = rows_per_target.get(target, 0) + end - start
    assert rows_per_target == {n: m.out_features for n, m in theirs.items()}


# Parameter counts of the released sizes (diffusers' Flux2Transformer2DModel on meta gives the same).
RELEASED = {"dev": 32_223_281_152, "klein_4b": 3_875_544_576, "klein_9b": 9_078_581_248}


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_released_sizes_on_meta_match_diffusers(name):
    config = FLUX2_CONFIGS[name]
    with torch.device("meta"):
        ours = Flux2(config)
        reference = Flux2Transformer2DModel(**{k: v for k, v in diffusers_config(config).items() if not k.startswith("_")})
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in reference.parameters()) == RELEASED[name]
    converted = flux2_to_diffusers_state_dict(ours.state_dict())
    expected = reference.state_dict()
    assert converted.keys() == expected.keys()
    assert all(converted[k].shape == expected[k].shape for k in converted)


# ----------------------------------------------------------------------------------------------
# Checkpoints: the tiny writer's files, other layouts, dtypes, fp8, errors


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    from library.models.flux2.tiny import write_flux2

    return write_flux2(str(tmp_path_factory.mktemp("flux2")), seed=0)


def test_tiny_files_load_in_both_formats_and_in_diffusers(tiny_files):
    """Our BFL file and diffusers folder hold the same model; diffusers reads both (from_single_file
    with its own FLUX.2 converter, from_pretrained) and computes what we compute."""
    bfl, folder = load_flux2(tiny_files["flux2_tiny"]), load_flux2(tiny_files["flux2_diffusers"])
    assert bfl.config == folder.config and bfl.guidance_in is None
    assert all(torch.equal(a, b) for a, b in zip(bfl.state_dict().values(), folder.state_dict().values()))
    single = Flux2Transformer2DModel.from_single_file(tiny_files["flux2_tiny"], config=tiny_files["flux2_diffusers"],
                                                      local_files_only=True)
    pretrained = Flux2Transformer2DModel.from_pretrained(tiny_files["flux2_diffusers"])
    assert all(torch.equal(a, b) for a, b in zip(single.state_dict().values(), pretrained.state_dict().values()))
    x = inputs(False)
    with torch.no_grad():
        assert (bfl(**x) - diffusers_forward(pretrained, x)).abs().max().item() <= 1e-5
    dev = load_flux2(tiny_files["flux2_dev_tiny"])
    assert dev.config.guidance_embed and dev.config.context_in_dim == 96 and dev.config.in_channels == 128


def test_bfl_file_without_metadata_with_comfy_prefix_infers_the_config(tmp_path, tiny_files):
    """Released BFL files carry no config: it comes from the key shapes (theta and the RoPE split are
    FLUX.2's); ComfyUI's `model.diffusion_model.` prefix is stripped."""
    sd = load_file(tiny_files["flux2_dev_tiny"])
    save_file({"model.diffusion_model." + k: v for k, v in sd.items()}, tmp_path / "comfy.safetensors")
    model = load_flux2(str(tmp_path / "comfy.safetensors"))
    assert model.config == load_flux2(tiny_files["flux2_dev_tiny"]).config == tiny_config(True)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in sd.items())


def test_sharded_pipeline_folder_in_bf16(tmp_path):
    reference = tiny_diffusers(True)
    reference.save_pretrained(tmp_path / "transformer", max_shard_size="100KB")
    assert len(list((tmp_path / "transformer").glob("*.safetensors"))) > 1
    model = load_flux2(str(tmp_path), dtype=torch.bfloat16)
    assert model.config == tiny_config(True) and model.compute_dtype == torch.bfloat16
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    x = inputs(True)
    with torch.no_grad():
        out, expected = model(**x), diffusers_forward(reference, x)
    assert out.dtype == torch.bfloat16
    assert ((out.float() - expected).norm() / expected.norm()).item() < 0.02  # bf16 weights and activations


def test_fp8_scaled_keeps_embedders_final_layer_and_shared_modulation(tiny_files):
    model = load_flux2(tiny_files["flux2_dev_tiny"], dtype=torch.bfloat16, prepare=fp8_prepare("fp8_scaled", "flux2"))
    kept = {n for n, m in model.named_modules() if type(m) is torch.nn.Linear}
    assert kept == {"img_in", "txt_in", "final_layer.linear", "final_layer.adaLN_modulation.1",
                    "double_stream_modulation_img.lin", "double_stream_modulation_txt.lin", "single_stream_modulation.lin"} | {
        f"{e}.{layer}" for e in ("time_in", "guidance_in") for layer in ("in_layer", "out_layer")}  # fmt: skip
    quantized = {n for n, m in model.named_modules() if isinstance(m, FP8Linear)}
    assert quantized == {n for b in ("img", "txt") for i in range(2) for n in (
        f"double_blocks.{i}.{b}_attn.qkv", f"double_blocks.{i}.{b}_attn.proj", f"double_blocks.{i}.{b}_mlp.0",
        f"double_blocks.{i}.{b}_mlp.2")} | {f"single_blocks.{i}.linear{j}" for i in range(2) for j in (1, 2)}  # fmt: skip
    reference = load_flux2(tiny_files["flux2_dev_tiny"])
    x = inputs(True)
    with torch.no_grad():
        out, expected = model(**x).float(), reference(**x)
    assert 1e-4 < ((out - expected).norm() / expected.norm()).item() < 0.1


def test_wrong_family_and_bad_files_fail_with_the_key(tmp_path, tiny_files):
    from library.models.flux1.checkpoint import load_flux
    from library.models.flux1.tiny import write_flux

    with pytest.raises(CheckpointError, match="FLUX.2 transformer, not FLUX.1"):
        load_flux(tiny_files["flux2_tiny"])
    with pytest.raises(CheckpointError, match="_class_name is 'Flux2Transformer2DModel'"):
        load_flux(tiny_files["flux2_diffusers"])
    flux1 = write_flux(str(tmp_path), 0)
    with pytest.raises(CheckpointError, match="not a FLUX.2 transformer"):
        load_flux2(flux1["flux_bfl"])
    with pytest.raises(CheckpointError, match="_class_name is 'FluxTransformer2DModel'"):
        load_flux2(flux1["flux_diffusers"])
    sd = load_file(os.path.join(tiny_files["flux2_diffusers"], "diffusion_pytorch_model.safetensors"))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(open(os.path.join(tiny_files["flux2_diffusers"], "config.json")).read())
    save_file({**sd, "transformer_blocks.1.attn.to_k.weight": torch.zeros(64, 32)}, bad / "diffusion_pytorch_model.safetensors")
    with pytest.raises(CheckpointError, match=r"'transformer_blocks.1.attn.to_k.weight' has shape \(64, 32\)"):
        load_flux2(str(bad))


def test_fp8_keeping_shared_modulation_pays():
    """The measurement behind the flux2 spec's SHARED_MODULATION fp8 rule, one seed: keeping the three shared
    modulation Linears in high precision cuts fp8_scaled's error by more than the memory it adds."""
    errors = {keep: shared_modulation_error(keep) for keep in (False, True)}
    error_saved = 1 - errors[True] / errors[False]
    share = 15 * 3072**2 / RELEASED["klein_4b"]  # the largest share of the released sizes
    scaled_bytes = 1 + 2 / 64
    memory_added = share * (2 - scaled_bytes) / scaled_bytes
    print(f"fp8_scaled update error {errors[False]:.4f} quantized, {errors[True]:.4f} kept: -{error_saved:.1%} "
          f"for +{memory_added:.1%} memory")
    assert error_saved > memory_added


def shared_modulation_error(keep: bool, seed: int = 0) -> float:
    """Relative error of the blocks' residual update (last single block out - first double block in)
    of a width-256 FLUX.2 with weights N(0, 0.02), fp8_scaled vs fp32."""
    from library.precision import fp8

    torch.manual_seed(seed)
    config = Flux2Config(in_channels=128, context_in_dim=96, hidden_size=256, num_heads=2, depth=1, depth_single=2,
                         axes_dim=(32, 32, 32, 32), guidance_embed=False)  # fmt: skip
    model = Flux2(config)
    with torch.no_grad():
        for name, p in model.named_parameters():  # the time embedder scaled so that the modulation is O(1)
            std = p.shape[-1] ** -0.5 if name.startswith("time_in") else 0.02
            p.copy_(1 + 0.1 * torch.randn(p.shape) if p.dim() == 1 else std * torch.randn(p.shape))
    x = {**inputs(False), "img": torch.randn(B, H * W, 128), "timesteps": torch.tensor([0.6, 0.6])}
    reference = residual_update(model, x)
    rules = arch_spec("flux2").fp8
    if not keep:
        rules = dataclasses.replace(rules, keep=tuple(p for p in rules.keep if p not in SHARED_MODULATION))
    fp8.quantize_module(model, "fp8_scaled", rules)
    return ((residual_update(model, x) - reference).norm() / reference.norm()).item()


def residual_update(model: Flux2, x: dict) -> torch.Tensor:
    seen = {}  # (the hooks return None: a returned value would replace the block's input / output)
    hooks = [
        model.double_blocks[0].register_forward_pre_hook(lambda m, a: seen.update(input=torch.cat((a[1], a[0]), 1))),
        model.single_blocks[-1].register_forward_hook(lambda m, a, out: seen.update(output=out)),
    ]
    with torch.no_grad():
        model(**x)
    for hook in hooks:
        hook.remove()
    return seen["output"] - seen["input"]


def test_comfy_scaled_fp8_file_loads_as_stored(tmp_path, tiny_files):
    """A ComfyUI scaled-fp8 FLUX.2 file (marker layout, `model.diffusion_model.` prefix): every block
    Linear keeps its e4m3 codes and per-tensor scale; the model computes with codes * scale."""
    from library.precision import fp8

    sd = load_file(tiny_files["flux2_tiny"])
    dequantized, stored = dict(sd), {"scaled_fp8": torch.empty(0, dtype=torch.float8_e4m3fn)}
    for key, w in sd.items():
        layer = key[: -len(".weight")]
        if w.dim() == 2 and not fp8.is_high_precision(layer, arch_spec("flux2").fp8):
            scale = (w.abs().amax() / 448.0).float()
            stored[key], stored[layer + ".scale_weight"] = (w / scale).to(torch.float8_e4m3fn), scale
            dequantized[key] = stored[key].float() * scale
        else:
            stored[key] = w
    save_file({"model.diffusion_model." + k: v for k, v in stored.items()}, tmp_path / "comfy_fp8.safetensors")
    model = load_flux2(str(tmp_path / "comfy_fp8.safetensors"))
    layers = [m for m in model.modules() if isinstance(m, FP8Linear)]
    assert len(layers) == 2 * 2 * 4 + 2 * 2 and {m.mode for m in layers} == {"fp8_tensor_scaled"}
    reference = Flux2(model.config)
    reference.load_state_dict(dequantized, strict=True)
    x = inputs(False)
    with torch.no_grad():
        assert (model(**x) - reference(**x)).abs().max().item() <= 1e-5


def test_gradient_checkpointing_gives_the_same_gradients_and_planner_load_reads_no_weights(tiny_files):
    model = load_flux2(tiny_files["flux2_tiny"])
    x = inputs(False)
    grads = []
    for ckpt in (False, True):
        model.zero_grad()
        model.gradient_checkpointing = ckpt
        model(**x).square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])
    assert grads[0]["single_stream_modulation.lin.weight"].abs().max() > 0  # the shared modulation trains too
    planned = load_flux2(tiny_files["flux2_tiny"], dtype=torch.bfloat16, read_weights=False)
    assert {p.device.type for p in planned.parameters()} == {"meta"} and {p.dtype for p in planned.parameters()} == {torch.bfloat16}
