"""FLUX.3 transformer: parity with diffusers' Flux3Transformer2DModel, BFL <-> diffusers names,
released sizes on `meta`, checkpoint formats, checkpointing and block swap."""

import os

import pytest
import torch
from diffusers import Flux3Transformer2DModel
from diffusers.loaders.single_file_utils import convert_flux3_transformer_checkpoint_to_diffusers
from diffusers.modular_pipelines.flux3.before_denoise import Flux3TextRoPEInputsStep, _prepare_image_ids
from safetensors.torch import load_file, save_file

from library.io import CheckpointError
from library.models.block_swap import enable_block_swap
from library.models.flux3.checkpoint import (
    diffusers_config, diffusers_to_flux3_state_dict, flux3_to_diffusers_state_dict, load_flux3, save_flux3_diffusers,
)
from library.models.flux3.model import FLUX3_CONFIGS, Flux3Config, Flux3Transformer, make_img_ids, make_txt_ids

# head_dim 32 = 4 x 8, FLUX.3's four equal RoPE axes scaled down; the image and reference widths differ so that
# a swapped embedder cannot pass.
TINY = dict(in_channels=16, cond_in_channels=12, context_in_dim=40, hidden_size=64, num_heads=2, depth=2,
            depth_single=2, axes_dim=(8, 8, 8, 8))
H, W, T, B = 5, 7, 6, 2  # an odd latent grid in 2x2 patches, text length, batch
REFERENCES = ((3, 4), (2, 2))  # reference k's grid, at l = -(1 + k)


def tiny_config(flow_map: bool = False) -> Flux3Config:
    return Flux3Config(**TINY, flow_map=flow_map)


def randomize(model: torch.nn.Module) -> torch.nn.Module:
    """Every parameter random, norms around 1 (FLUX.3 has no biases: every 1-D tensor is a norm)."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.2 * noise if p.dim() == 1 else 0.15 * noise)
    return model.eval()


def tiny_diffusers(flow_map: bool = False) -> Flux3Transformer2DModel:
    config = {k: v for k, v in diffusers_config(tiny_config(flow_map)).items() if not k.startswith("_")}
    return randomize(Flux3Transformer2DModel(**config))


def ours_from(reference: Flux3Transformer2DModel) -> Flux3Transformer:
    model = Flux3Transformer(tiny_config(reference.config.flow_map))
    model.load_state_dict(diffusers_to_flux3_state_dict(reference.state_dict()), strict=True)
    return model.eval()


def inputs(flow_map: bool = False, references: bool = False) -> dict:
    g = torch.Generator().manual_seed(2)
    x = dict(img=torch.randn(B, H * W, 16, generator=g), img_ids=make_img_ids(B, H, W),
             txt=torch.randn(B, T, 40, generator=g), txt_ids=make_txt_ids(B, T), timesteps=torch.tensor([0.3, 0.85]))
    if references:
        x["img_cond"] = torch.randn(B, sum(h * w for h, w in REFERENCES), 12, generator=g)
        x["img_cond_ids"] = torch.cat([make_img_ids(B, h, w, l=-(1 + k)) for k, (h, w) in enumerate(REFERENCES)], dim=1)
    if flow_map:
        x["target_timesteps"] = torch.tensor([0.1, 0.6])
    return x


def diffusers_forward(model: Flux3Transformer2DModel, x: dict) -> torch.Tensor:
    # As the Flux3 modular pipeline calls it: ids [S, 4] float32 from its own helpers, shared by the batch.
    img_ids = _prepare_image_ids(H, W, 0.5)
    txt_ids = Flux3TextRoPEInputsStep._prepare_text_ids(x["txt"])
    assert torch.equal(img_ids, x["img_ids"][0]) and torch.equal(txt_ids, x["txt_ids"][0])
    cond_ids = None
    if "img_cond" in x:
        cond_ids = torch.cat([_prepare_image_ids(h, w, 0.5, l_coord=-(1 + k)) for k, (h, w) in enumerate(REFERENCES)])
        assert torch.equal(cond_ids, x["img_cond_ids"][0])
    with torch.no_grad():
        return model(hidden_states=x["img"], encoder_hidden_states=x["txt"], timestep=x["timesteps"], img_ids=img_ids,
                     txt_ids=txt_ids, image_cond_hidden_states=x.get("img_cond"), image_cond_ids=cond_ids,
                     target_timestep=x.get("target_timesteps"), return_dict=False)[0]


# Measured: at most 7.0e-6 (outputs ~2 on average). The blocks are bit-identical (next test); what differs
# is the modulation Linears' GEMM, run per token by diffusers ([B * L, h]) and per sample here ([B, h]):
# another blocking of the same dot products, ~1 ulp apart.
@pytest.mark.parametrize("flow_map, references", [(False, False), (False, True), (True, False), (True, True)])
def test_flux3_matches_diffusers_fp32(flow_map, references):
    reference = tiny_diffusers(flow_map)
    model = ours_from(reference)
    x = inputs(flow_map, references)
    expected = diffusers_forward(reference, x)
    with torch.no_grad():
        out = model(**x)
    diff = (out - expected).abs().max().item()
    print(f"flow_map={flow_map} references={references}: max |ours - diffusers| {diff:.2e}")
    assert out.shape == (B, H * W, 16) and out.dtype == torch.float32
    assert expected.abs().mean() > 0.1  # a real signal, not a vanishing one
    assert diff <= 2e-5


def test_blocks_match_diffusers_bit_for_bit():
    """A per-mode block and a single block (over [txt, image, references], each modulated by its own triple)
    compute exactly what diffusers' do with the same weights and modulation."""
    reference = tiny_diffusers()
    model = ours_from(reference)
    g = torch.Generator().manual_seed(3)
    txt, img, cond = (torch.randn(B, n, 64, generator=g) for n in (T, H * W, 12))
    txt_mod, img_mod, cond_mod = (0.3 * torch.randn(B, 192, generator=g) for _ in range(3))
    ids = torch.cat([make_txt_ids(1, T)[0], make_img_ids(1, H, W)[0], make_img_ids(1, 3, 4, l=-1)[0]])
    rotary = reference.pos_embed(ids)
    cos, sin = rotary[0][None, :, ::2], rotary[1][None, :, ::2]  # diffusers repeats each angle for its pair
    span = slice(T, T + H * W)
    with torch.no_grad():
        theirs = reference.mode_blocks["image"][0](img, img_mod[:, None].expand(-1, H * W, -1),
                                                   (rotary[0][span], rotary[1][span]))
        ours = model.content_mode_blocks["image"][0](img, img_mod, cos[:, span], sin[:, span])
        assert torch.equal(ours, theirs)
        per_token = torch.cat((img_mod[:, None].expand(-1, H * W, -1), cond_mod[:, None].expand(-1, 12, -1)), dim=1)
        their_txt, their_content = reference.single_transformer_blocks[0](
            torch.cat((img, cond), dim=1), txt, per_token, txt_mod[:, None].expand(-1, T, -1), rotary)
        our_txt, our_img, our_cond = model.single_blocks[0]((txt, img, cond), (txt_mod, img_mod, cond_mod), cos, sin)
    assert torch.equal(our_txt, their_txt) and torch.equal(torch.cat((our_img, our_cond), dim=1), their_content)


def test_bfl_names_are_what_diffusers_single_file_reads():
    """Our (BFL) state dict through diffusers' own single-file converter gives diffusers' names and the same
    weights (the final adaLN's halves swapped); ours converts the same way and back; REPA heads are dropped."""
    model = randomize(Flux3Transformer(tiny_config(flow_map=True)))
    bfl = {k: v.clone() for k, v in model.state_dict().items()}
    theirs = convert_flux3_transformer_checkpoint_to_diffusers({**bfl, "repa_projectors.0.weight": torch.ones(2, 2)})
    ours = flux3_to_diffusers_state_dict({**bfl, "repa_projectors.0.weight": torch.ones(2, 2)})
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert not torch.equal(ours["norm_out.linear.weight"], bfl["final_layer.image.adaLN_modulation.1.weight"])
    tiny_diffusers(flow_map=True).load_state_dict(ours, strict=True)
    back = diffusers_to_flux3_state_dict(ours)
    assert back.keys() == bfl.keys() and all(torch.equal(back[k], bfl[k]) for k in bfl)


# Parameter counts of the released sizes (diffusers' Flux3Transformer2DModel defaults on meta give the same).
RELEASED = {"image": 5_538_458_368, "image_distilled": 5_548_681_984}


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_released_sizes_on_meta_match_diffusers(name):
    config = FLUX3_CONFIGS[name]
    with torch.device("meta"):
        ours = Flux3Transformer(config)
        reference = Flux3Transformer2DModel(flow_map=config.flow_map)  # diffusers' defaults: the released model
    count = sum(p.numel() for p in ours.parameters())
    print(f"FLUX.3 {name}: {count:,} parameters")
    assert count == sum(p.numel() for p in reference.parameters()) == RELEASED[name]
    expected = reference.state_dict()
    for converted in (convert_flux3_transformer_checkpoint_to_diffusers(dict(ours.state_dict())),
                      flux3_to_diffusers_state_dict(ours.state_dict())):
        assert converted.keys() == expected.keys()
        assert all(converted[k].shape == expected[k].shape for k in converted)
    assert diffusers_to_flux3_state_dict(expected).keys() == ours.state_dict().keys()


# ----------------------------------------------------------------------------------------------
# Checkpoints


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """One flow-map model as a BFL file without metadata (the config from its shapes), the same with ComfyUI's
    prefix and a REPA head, and diffusers' own save_pretrained folder (sharded)."""
    folder = tmp_path_factory.mktemp("flux3")
    reference = tiny_diffusers(flow_map=True)
    bfl = {k: v.contiguous() for k, v in diffusers_to_flux3_state_dict(reference.state_dict()).items()}
    save_file(bfl, folder / "flux3.safetensors")
    comfy = {"model.diffusion_model." + k: v for k, v in bfl.items()}
    save_file({**comfy, "model.diffusion_model.repa_projectors.0.weight": torch.ones(3, 3),
               "vae.decoder.conv_in.weight": torch.ones(2)}, folder / "comfy.safetensors")
    reference.save_pretrained(folder / "pipeline" / "transformer", max_shard_size="200KB")
    return {"reference": reference, "bfl": str(folder / "flux3.safetensors"),
            "comfy": str(folder / "comfy.safetensors"), "diffusers": str(folder / "pipeline")}


def test_bfl_comfy_and_diffusers_files_load_the_same_model(files):
    models = [load_flux3(files[kind]) for kind in ("bfl", "comfy", "diffusers")]
    shards = [f for f in os.listdir(os.path.join(files["diffusers"], "transformer")) if f.endswith(".safetensors")]
    assert len(shards) > 1
    assert all(m.config == tiny_config(flow_map=True) for m in models)
    weights = [m.state_dict() for m in models]
    assert all(w.keys() == weights[0].keys() and all(torch.equal(w[k], weights[0][k]) for k in w) for w in weights)
    x = inputs(flow_map=True, references=True)
    expected = diffusers_forward(files["reference"], x)
    with torch.no_grad():
        outs = [m(**x) for m in models]
    assert all(torch.equal(o, outs[0]) for o in outs) and (outs[0] - expected).abs().max().item() <= 2e-5


def test_our_diffusers_folder_loads_in_diffusers_and_back(files, tmp_path):
    model = load_flux3(files["bfl"])
    save_flux3_diffusers(model, None, str(tmp_path / "transformer"))
    pretrained = Flux3Transformer2DModel.from_pretrained(str(tmp_path / "transformer"))
    x = inputs(flow_map=True)
    with torch.no_grad():
        assert (model(**x) - diffusers_forward(pretrained, x)).abs().max().item() <= 2e-5
    again = load_flux3(str(tmp_path))
    assert again.config == model.config and all(torch.equal(a, b) for a, b in
                                                zip(again.state_dict().values(), model.state_dict().values()))
    planned = load_flux3(files["bfl"], dtype=torch.bfloat16, read_weights=False)
    assert {p.device.type for p in planned.parameters()} == {"meta"} and planned.compute_dtype == torch.bfloat16


def test_bf16_weights_compute_in_bf16_with_float32_positions(files):
    """bf16 weights and activations; the fractional ids and the QK norm / RoPE stay float32 inside."""
    model, reference = load_flux3(files["bfl"], dtype=torch.bfloat16), load_flux3(files["bfl"])
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16} and model.compute_dtype == torch.bfloat16
    x = inputs(flow_map=True, references=True)
    with torch.no_grad():
        out, expected = model(**x), reference(**x)
    assert out.dtype == torch.bfloat16
    assert ((out.float() - expected).norm() / expected.norm()).item() < 0.02


def test_a_wrong_shape_or_foreign_file_is_one_line_naming_file_key_and_shapes(files, tmp_path):
    sd = load_file(files["bfl"])
    save_file({**sd, "txt_mode_blocks.1.k_proj.weight": torch.zeros(64, 32)}, tmp_path / "bad.safetensors")
    with pytest.raises(CheckpointError) as bfl_error:
        load_flux3(str(tmp_path / "bad.safetensors"), config=tiny_config(flow_map=True))
    assert str(bfl_error.value) == (f"{tmp_path / 'bad.safetensors'}: key 'txt_mode_blocks.1.k_proj.weight' has "
                                    f"shape (64, 32), expected (64, 64)")
    folder = os.path.join(files["diffusers"], "transformer")
    bad = tmp_path / "bad_folder"
    bad.mkdir()
    (bad / "config.json").write_text(open(os.path.join(folder, "config.json")).read())
    theirs = {k: v for f in sorted(os.listdir(folder)) if f.endswith(".safetensors")
              for k, v in load_file(os.path.join(folder, f)).items()}
    save_file({**theirs, "mode_blocks.image_cond.0.attn.to_v.weight": torch.zeros(64, 7)},
              bad / "diffusion_pytorch_model.safetensors")
    with pytest.raises(CheckpointError, match=r"'mode_blocks.image_cond.0.attn.to_v.weight' has shape \(64, 7\), "
                                              r"expected \(64, 64\)") as folder_error:
        load_flux3(str(bad))
    assert "\n" not in str(folder_error.value)
    save_file({"double_blocks.0.img_attn.qkv.weight": torch.zeros(6, 2)}, tmp_path / "other.safetensors")
    with pytest.raises(CheckpointError, match="not a FLUX.3 transformer"):
        load_flux3(str(tmp_path / "other.safetensors"))


# ----------------------------------------------------------------------------------------------
# Training paths


def test_gradient_checkpointing_gives_the_same_gradients(files):
    model = load_flux3(files["bfl"])
    x = inputs(flow_map=True, references=True)
    grads = []
    for ckpt in (False, True):
        model.zero_grad()
        model.gradient_checkpointing = ckpt
        model(**x).square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])
    for name in ("single_stream_modulations.image_cond.lin.weight", "content_mode_blocks.image_cond.1.q_proj.weight",
                 "ref_time_in.in_layer.weight", "early_stream_modulations.txt.lin.weight"):
        assert grads[0][name].abs().max() > 0, name  # every mode trains, the flow map's embedder too


def test_block_swap_with_and_without_references_changes_nothing(files):
    model = load_flux3(files["bfl"]).requires_grad_(False)
    cases = [inputs(flow_map=True), inputs(flow_map=True, references=True)]
    with torch.no_grad():
        expected = [model(**x) for x in cases]
        swap = enable_block_swap(model, 7, "cpu")  # the image_cond blocks and the single blocks are swapped
        outs = [model(**x) for x in cases]
    assert all(torch.equal(o, e) for o, e in zip(outs, expected))
    assert not swap.resident and not swap.pending  # text to image: the reference blocks were skipped, released


def test_inputs_a_variant_needs_are_checked():
    model = Flux3Transformer(tiny_config(flow_map=False))
    x = inputs(flow_map=False, references=True)
    with pytest.raises(ValueError, match="target_timesteps"):
        model(**x, target_timesteps=torch.zeros(B))
    with pytest.raises(ValueError, match="img_cond_ids"):
        model(**{**x, "img_cond_ids": None})
    with pytest.raises(ValueError, match="target_timesteps"):
        Flux3Transformer(tiny_config(flow_map=True))(**x)
