"""Nucleus-Image transformer: parity with diffusers' NucleusMoEImageTransformer2DModel (dense and expert-choice MoE
blocks, per-layer capacities, masked text of different lengths, an odd grid), the experts' batched path against
the loop and diffusers' layer, the released size on `meta`, checkpoint layouts (single file, ComfyUI prefix, diffusers
folder, pre-quantized; the config from config.json / metadata / shapes), one-line errors, checkpointing and block
swap; the experts in fp8 (quantized while loading, saved and loaded back, ComfyUI's fp8 experts as stored)."""

import dataclasses
import math
import os
import re
import sys

import pytest
import torch
from diffusers import NucleusMoEImageTransformer2DModel
from diffusers.models.transformers.transformer_nucleusmoe_image import NucleusMoELayer
from safetensors.torch import load_file, save_file

from library.io import CheckpointError
from library.models.block_swap import enable_block_swap
from library.models.nucleus_image import model as nucleus_model
from library.models.nucleus_image.checkpoint import (
    COMFY_PREFIX, config_from_diffusers, config_from_shapes, diffusers_config, load_nucleus_image,
    save_nucleus_image_diffusers, save_nucleus_image_single_file,
)
from library.models.nucleus_image.model import (
    NUCLEUS_IMAGE, NucleusImage, NucleusImageConfig, SwiGLUExperts, expert_capacity, joint_positions, random_inputs,
)
from library.models.spec import FP8Rules
from library.precision import fp8_packed
from library.precision.fp8 import FP8Linear, fp8_load_converter, prepare_fp8
from library.training.memory_plan import module_bytes
from library.precision.gguf_weights import GGUFLinear

# head_dim 32 with the released RoPE split scaled down (4, 14, 14); in, out and text widths differ so that a swapped
# projection cannot pass; 4 query heads over 2 kv heads. Six blocks as the released strategy builds them (three dense,
# then MoE) with the released capacity pattern (4, 4, then 2): 35 tokens over 8 experts pick C = 18, 18, 9.
TINY = dict(in_channels=24, out_channels=12, num_layers=6, attention_head_dim=32, num_attention_heads=4,
            num_key_value_heads=2, joint_attention_dim=40, axes_dims_rope=(4, 14, 14), num_experts=8,
            moe_intermediate_dim=48, capacity_factors=(0, 0, 0, 4, 4, 2))
H, W, T, B = 5, 7, 6, 2  # an odd token grid, the padded text length, the batch
LENGTHS = (4, 6)  # real text tokens per row: row 0 is padded (masked keys)
OUT = 4 * 12  # proj_out: patch 2 x 2 x out_channels


def tiny_config(**overrides) -> NucleusImageConfig:
    return NucleusImageConfig(**{**TINY, **overrides})


def diffusers_kwargs(config: NucleusImageConfig, use_grouped_mm: bool = False) -> dict:
    fields = {k: getattr(config, k) for k in TINY}
    fields.update(axes_dims_rope=list(config.axes_dims_rope), capacity_factors=list(config.capacity_factors))
    return dict(fields, patch_size=config.patch_size, mlp_ratio=config.mlp_ratio, moe_enabled=config.moe_enabled,
                dense_moe_strategy=config.dense_moe_strategy, use_sigmoid=config.use_sigmoid,
                route_scale=config.route_scale, use_grouped_mm=use_grouped_mm)


def randomize(model: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    """Every parameter random (diffusers zero-inits none here but leaves the experts empty): norm weights around 1,
    matrices N(0, 1 / fan_in) (the experts' fan-in is their middle axis: x @ W), biases N(0, 0.01)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if p.dim() == 1:
                p.copy_(1 + 0.2 * noise if name.endswith("weight") else 0.1 * noise)
            else:
                p.copy_(noise / math.sqrt(p.shape[-2] if p.dim() == 3 else p.shape[-1]))
    return model.eval()


def tiny_diffusers(config: NucleusImageConfig | None = None) -> NucleusMoEImageTransformer2DModel:
    return randomize(NucleusMoEImageTransformer2DModel(**diffusers_kwargs(config or tiny_config())))


def ours_from(reference: NucleusMoEImageTransformer2DModel, config: NucleusImageConfig | None = None) -> NucleusImage:
    model = NucleusImage(config or tiny_config())
    model.load_state_dict(reference.state_dict(), strict=True)  # the same names: no map
    return model.eval()


def inputs(masked: bool = True, seed: int = 2) -> dict:
    """Our forward's arguments: an H x W token grid, text padded to T with a mask (or all real)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(LENGTHS if masked else (T, T))
    return dict(img=torch.randn(B, H * W, 24, generator=g), txt=torch.randn(B, T, 40, generator=g),
                timesteps=torch.tensor([0.3, 0.85]), h=H, w=W,
                txt_mask=torch.arange(T)[None] < lengths[:, None] if masked else None)


def diffusers_forward(model: NucleusMoEImageTransformer2DModel, x: dict) -> torch.Tensor:
    """As NucleusMoEImagePipeline calls it: packed tokens, img_shapes (1, h, w), timestep = sigma, the text mask."""
    with torch.no_grad():
        return model(hidden_states=x["img"], img_shapes=[(1, x["h"], x["w"])] * x["img"].shape[0],
                     encoder_hidden_states=x["txt"], encoder_hidden_states_mask=x["txt_mask"],
                     timestep=x["timesteps"], return_dict=False)[0]


# Measured: 3.7e-6 with outputs ~1.0 on average (2.7e-6 with float32 RoPE angles: the rest is float32 rounding of
# another kernel order, SDPA's GQA against diffusers' repeated kv heads, one rounding of QK norm + RoPE against two).
def test_nucleus_image_matches_diffusers_fp32():
    reference = tiny_diffusers()
    model = ours_from(reference)
    assert model.config.moe_blocks == (3, 4, 5) and model.config.dense_inner_dim == 256
    assert [expert_capacity(f, H * W, 8) for f in model.config.capacity_factors[3:]] == [18, 18, 9]
    x = inputs()
    expected = diffusers_forward(reference, x)
    with torch.no_grad():
        out = model(**x)
    diff = (out - expected).abs().max().item()
    print(f"max |ours - diffusers| {diff:.2e}, mean |out| {expected.abs().mean():.2f}")
    assert out.shape == (B, H * W, OUT) and out.dtype == torch.float32
    assert expected.abs().mean() > 0.5 and diff <= 2e-5


def test_a_padded_caption_predicts_as_it_does_alone():
    """Row 0's 4 real tokens padded to 6 (masked keys) give what the 4 tokens give alone; its padding's values change
    nothing; a mask that masks nothing is no mask; and 4 real tokens against 6 is another prompt."""
    model = ours_from(tiny_diffusers())
    x = inputs()
    with torch.no_grad():
        out = model(**x)
        alone = model(img=x["img"][:1], txt=x["txt"][:1, : LENGTHS[0]], timesteps=x["timesteps"][:1], h=H, w=W)
        assert (out[0] - alone[0]).abs().max().item() <= 1e-5
        x["txt"][0, LENGTHS[0]:] = 100.0
        assert (model(**x) - out).abs().max().item() <= 1e-5
        full = inputs(masked=False)
        none = model(**full)
        assert torch.equal(model(**{**full, "txt_mask": torch.ones(B, T, dtype=torch.bool)}), none)
    assert (none[0] - out[0]).abs().max().item() > 0.1


@pytest.mark.parametrize("factor, capacity", [(2.0, 9), (0.5, 3)])  # the config's, and fewer slots than tokens
def test_expert_choice_layer_matches_diffusers_and_routes_by_capacity(factor, capacity):
    """One MoE layer against diffusers' NucleusMoELayer (for-loop and grouped-mm experts) on the same weights: the
    same output; each expert takes its C best tokens of each sample; a picked token's gates sum to route_scale; our
    batched experts equal the one-expert-at-a-time loop."""
    reference = tiny_diffusers()
    model = ours_from(reference)
    theirs: NucleusMoELayer = reference.transformer_blocks[5].img_mlp
    ours = model.transformer_blocks[5].img_mlp
    ours.capacity_factor = theirs.capacity_factor = factor
    g = torch.Generator().manual_seed(4)
    y, normed = torch.randn(B, H * W, 128, generator=g), torch.randn(B, H * W, 128, generator=g)
    temb = torch.randn(B, 128, generator=g)
    with torch.no_grad():
        out = ours(y, normed, temb)
        for grouped in (False, True):  # measured at most 2.3e-6 (outputs up to ~4): GEMM blockings apart
            theirs.experts.use_grouped_mm = grouped
            diff = (out - theirs(y, normed, timestep=temb)).abs().max().item()
            print(f"capacity {capacity}, grouped_mm={grouped}: max |ours - diffusers| {diff:.1e}")
            assert diff <= 1e-5
        rows, gates = ours.route(normed, temb)
        x = y.reshape(-1, 128)[rows].unflatten(0, (8, -1))  # [experts, B * C, dim]
        assert (ours.experts(x) - ours.experts.forward_loop(x)).abs().max().item() <= 1e-6
    assert expert_capacity(factor, H * W, 8) == capacity and rows.shape == gates.shape == (8 * B * capacity,)
    samples = rows.view(8, B, capacity) // (H * W)  # expert-major, then sample by sample
    assert torch.equal(samples, torch.arange(B)[None, :, None].expand(8, B, capacity))
    per_token = torch.zeros(B * H * W).index_add(0, rows, gates)
    picked = per_token != 0
    assert torch.allclose(per_token[picked], torch.full_like(per_token[picked], 2.5), atol=1e-5)
    if 8 * capacity < H * W:  # fewer slots than tokens: some take the shared expert's output alone
        assert picked.sum() < B * H * W
        lonely = (~picked).nonzero()[0].item()
        assert torch.equal(out.reshape(-1, 128)[lonely], ours.shared_expert(y).reshape(-1, 128)[lonely])


RELEASED_PARAMETERS = 16_922_679_296  # NucleusAI/Nucleus-Image transformer/config.json, on meta


def test_released_size_on_meta_matches_diffusers():
    released = diffusers_kwargs(NUCLEUS_IMAGE, use_grouped_mm=True)
    assert released["capacity_factors"] == [0, 0, 0, 4, 4] + [2] * 27 and released["num_key_value_heads"] == 4
    with torch.device("meta"):
        ours, reference = NucleusImage(NUCLEUS_IMAGE), NucleusMoEImageTransformer2DModel(**released)
    count = sum(p.numel() for p in ours.parameters())
    experts = sum(p.numel() for n, p in ours.named_parameters() if ".experts." in n)
    print(f"Nucleus-Image: {count:,} parameters, {experts:,} in the routed experts")
    assert count == sum(p.numel() for p in reference.parameters()) == RELEASED_PARAMETERS
    assert experts == 29 * 64 * 3 * 2048 * 1344
    theirs = reference.state_dict()
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in theirs.items()}
    assert [i for i, b in enumerate(ours.transformer_blocks) if b.moe_enabled] == list(range(3, 32))


def test_random_inputs_positions_are_what_the_model_feeds_rope(monkeypatch):
    """The precision doctor's expected positions are the one rope_tables call of a forward: [image, text], the
    image centred, the text after max(h//2, w//2)."""
    seen = []
    original = nucleus_model.rope_tables
    monkeypatch.setattr(nucleus_model, "rope_tables", lambda pos, *a: seen.append(pos) or original(pos, *a))
    config = tiny_config()
    conditioning = random_inputs(config, 3, 4, 8, torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = NucleusImage(config)(img=torch.randn(1, 12, 24), timesteps=torch.tensor([0.5]), **conditioning.fixed)
    assert out.shape == (1, 12, OUT) and len(seen) == 1 and seen[0].dtype == torch.int64
    assert torch.equal(seen[0], conditioning.positions[0]) and conditioning.positions.shape == (1, 20, 3)
    expected = [[0, r, c] for r in (-2, -1, 0) for c in (-2, -1, 0, 1)] + [[2, 2, 2], [3, 3, 3]]
    assert joint_positions(3, 4, 2).tolist() == expected


@pytest.mark.parametrize("change, message", [
    (dict(capacity_factors=(0, 0, 0, 4, 9, 2)), r"capacity_factors\[4\] = 9.0 is outside \[0, num_experts = 8\]"),
    (dict(capacity_factors=(0, 0, 4)), "capacity_factors has 3 entries for 6 layers"),
    (dict(dense_moe_strategy="first_three"), "dense_moe_strategy 'first_three' is none of"),
    (dict(num_key_value_heads=3), "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    (dict(axes_dims_rope=(8, 12, 14)), r"axes_dims_rope \(8, 12, 14\) must be 3 axes summing to attention_head_dim 32"),
])
def test_a_config_diffusers_would_misbuild_is_one_line(change, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(**change)
    assert tiny_config(dense_moe_strategy="leave_first_three_and_last_block_dense").moe_blocks == (3, 4)
    assert tiny_config(moe_enabled=False).moe_blocks == ()


# ----------------------------------------------------------------------------------------------
# Training paths


def test_gradient_checkpointing_gives_the_same_gradients():
    """Every block's gradients bit for bit. The timestep embedder's differ by float32 rounding only (measured 9e-8 of
    0.4): each block reads temb twice (img_mod, the router), and checkpointing hands back their sum per block where
    plain autograd adds each read into one buffer: the same terms, associated otherwise."""
    model = ours_from(tiny_diffusers())
    x = inputs()
    grads = []
    for ckpt in (False, True):
        model.zero_grad()
        model.gradient_checkpointing = ckpt
        model(**x).square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    embedder = [n for n in grads[0] if n.startswith("time_text_embed.")]
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0] if n not in embedder)
    assert all(torch.allclose(grads[0][n], grads[1][n], rtol=0, atol=1e-6) for n in embedder)
    blocks = ("0.encoder_proj.weight", "0.attn.norm_added_k.weight", "0.img_mlp.net.0.proj.weight",
              "3.img_mlp.gate.weight", "3.img_mlp.experts.gate_up_proj", "5.img_mlp.experts.down_proj",
              "4.img_mlp.shared_expert.net.2.weight", "2.img_mod.1.weight")
    for name in ("img_in.weight", "time_text_embed.timestep_embedder.linear_1.weight", "txt_norm.weight",
                 "norm_out.linear.weight", *("transformer_blocks." + b for b in blocks)):
        assert grads[0][name].abs().max() > 0, name
    assert "transformer_blocks.0.attn.norm_added_q.weight" not in grads[0]  # no text query reads it


def test_checkpointing_with_frozen_gates_gives_the_same_gradients():
    """A LoRA-like run: the base frozen (the gates need no gradient), so checkpointing's recompute runs the MLPs'
    last projections (dense net.2, the shared expert's net.2) on one token (core.residual_projection); a trained one
    among them and everything upstream get the same gradients bit for bit."""
    model = ours_from(tiny_diffusers()).requires_grad_(False)
    trained = (model.img_in.weight, model.transformer_blocks[4].img_mlp.shared_expert.net[2].weight,
               model.transformer_blocks[1].img_mlp.net[2].weight)
    x = inputs()
    grads = []
    for ckpt in (False, True):
        for p in trained:
            p.requires_grad_(True)
            p.grad = None
        model.gradient_checkpointing = ckpt
        model(**x).square().mean().backward()
        grads.append([p.grad.clone() for p in trained])
    assert all(torch.equal(a, b) and a.abs().max() > 0 for a, b in zip(*grads))


def test_block_swap_changes_nothing():
    model = ours_from(tiny_diffusers()).requires_grad_(False)
    x = inputs()
    with torch.no_grad():
        expected = model(**x)
        swap = enable_block_swap(model, 3, "cpu")
        out = model(**x)
    assert torch.equal(out, expected) and not swap.resident and not swap.pending


# ----------------------------------------------------------------------------------------------
# Checkpoints

# NucleusAI/Nucleus-Image transformer/config.json (the released facts)
RELEASED_CONFIG_JSON = {
    "_class_name": "NucleusMoEImageTransformer2DModel", "_diffusers_version": "0.38.0", "patch_size": 2,
    "in_channels": 64, "out_channels": 16, "num_layers": 32, "attention_head_dim": 128, "num_attention_heads": 16,
    "num_key_value_heads": 4, "joint_attention_dim": 4096, "axes_dims_rope": [16, 56, 56], "mlp_ratio": 4.0,
    "moe_enabled": True, "dense_moe_strategy": "leave_first_three_blocks_dense", "num_experts": 64,
    "moe_intermediate_dim": 1344, "capacity_factors": [0.0, 0.0, 0.0, 4.0, 4.0] + [2.0] * 27, "use_sigmoid": False,
    "route_scale": 2.5, "use_grouped_mm": True}
# What ComfyUI's scaled fp8 file keeps in high precision, for the loader before the family spec exists: the
# embedders, the final layer and the routers (a router's error moves tokens between experts)
FP8_RULES = FP8Rules(keep=(r"img_in", r"time_text_embed\..*", r"norm_out\..*", r"proj_out", r".*\.img_mlp\.gate"))
E4M3 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """One tiny model as a plain single file (no metadata: the config from its shapes), the same under ComfyUI's
    prefix beside a bundled VAE tensor, and diffusers' own save_pretrained folder (sharded)."""
    folder = tmp_path_factory.mktemp("nucleus_image")
    reference = tiny_diffusers()
    sd = {k: v.contiguous() for k, v in reference.state_dict().items()}
    save_file(sd, folder / "nucleus_image.safetensors")
    save_file({**{COMFY_PREFIX + k: v for k, v in sd.items()}, "vae.decoder.conv_in.weight": torch.ones(2)},
              folder / "comfy.safetensors")
    reference.save_pretrained(folder / "pipeline" / "transformer", max_shard_size="200KB")
    return {"reference": reference, "single": str(folder / "nucleus_image.safetensors"),
            "comfy": str(folder / "comfy.safetensors"), "diffusers": str(folder / "pipeline")}


def test_single_comfy_and_diffusers_files_load_the_same_model(files):
    models = [load_nucleus_image(files[kind]) for kind in ("single", "comfy", "diffusers")]
    shards = [f for f in os.listdir(os.path.join(files["diffusers"], "transformer")) if f.endswith(".safetensors")]
    assert len(shards) > 1
    assert all(m.config == tiny_config() for m in models)  # the shapes alone give the tiny config
    weights = [m.state_dict() for m in models]
    assert all(w.keys() == weights[0].keys() and all(torch.equal(w[k], weights[0][k]) for k in w) for w in weights)
    x = inputs()
    expected = diffusers_forward(files["reference"], x)
    with torch.no_grad():
        outs = [m(**x) for m in models]
    assert all(torch.equal(o, outs[0]) for o in outs) and (outs[0] - expected).abs().max().item() <= 2e-5


def test_our_files_load_in_diffusers_and_back(files, tmp_path):
    """Our diffusers folder loads in diffusers (the same output); our single file keeps a config the shapes cannot
    tell (other capacity factors, a sigmoid router) in its metadata; the planner's meta load reads headers only."""
    model = load_nucleus_image(files["single"])
    save_nucleus_image_diffusers(model, None, str(tmp_path / "transformer"))
    pretrained = NucleusMoEImageTransformer2DModel.from_pretrained(str(tmp_path / "transformer"))
    assert pretrained.config.use_grouped_mm  # as released: diffusers' grouped GEMM runs on this CPU too
    x = inputs()
    with torch.no_grad():
        assert (model(**x) - diffusers_forward(pretrained, x)).abs().max().item() <= 2e-5
    other = tiny_config(capacity_factors=(0, 0, 0, 3, 1, 2.5), use_sigmoid=True, route_scale=1.5)
    save_nucleus_image_single_file(model.state_dict(), str(tmp_path / "comfy.safetensors"), other, prefix=COMFY_PREFIX)
    for path, config in ((tmp_path, model.config), (tmp_path / "comfy.safetensors", other)):
        again = load_nucleus_image(str(path))
        assert again.config == config
        assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), model.state_dict().values()))
    planned = load_nucleus_image(files["comfy"], dtype=torch.bfloat16, read_weights=False)
    assert {p.device.type for p in planned.parameters()} == {"meta"} and planned.compute_dtype == torch.bfloat16


def test_released_config_json_reads_as_the_released_config():
    """The released config.json is NUCLEUS_IMAGE and back; a key diffusers' class does not know is refused, naming it;
    a config.json that omits keys builds what diffusers builds from it (its defaults)."""
    assert config_from_diffusers(RELEASED_CONFIG_JSON) == NUCLEUS_IMAGE
    released = {k: v for k, v in RELEASED_CONFIG_JSON.items() if k != "_diffusers_version"}
    assert diffusers_config(NUCLEUS_IMAGE) == released
    with pytest.raises(CheckpointError, match=r"config.json: unknown NucleusMoEImageTransformer2DModel config keys "
                                              r"\['x'\]"):
        config_from_diffusers({**RELEASED_CONFIG_JSON, "x": 1})
    with pytest.raises(CheckpointError, match=r"c.json: capacity_factors\[3\] = 99.0 is outside"):
        config_from_diffusers({**RELEASED_CONFIG_JSON, "capacity_factors": [99.0] * 32}, "c.json")
    defaults = config_from_diffusers({"_class_name": "NucleusMoEImageTransformer2DModel"})
    assert defaults.capacity_factors == (8.0,) * 24 and defaults.moe_blocks == tuple(range(3, 23))
    with torch.device("meta"):
        ours, theirs = NucleusImage(defaults).state_dict(), NucleusMoEImageTransformer2DModel().state_dict()
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in theirs.items()}


@pytest.mark.parametrize("strategy", ["leave_first_three_and_last_block_dense", "leave_first_block_dense", "all_moe"])
def test_the_shapes_say_the_depth_widths_and_which_blocks_are_moe(strategy):
    """The released shapes give the released config (the capacity pattern included); another strategy's keys give
    that strategy, its MoE blocks the released pattern of factors; a dense width that is no mlp_ratio's is refused."""
    with torch.device("meta"):
        released = {k: tuple(v.shape) for k, v in NucleusImage().state_dict().items()}
        other = tiny_config(dense_moe_strategy=strategy, num_experts=4, moe_intermediate_dim=64)
        shapes = {k: tuple(v.shape) for k, v in NucleusImage(other).state_dict().items()}
    assert config_from_shapes(released) == NUCLEUS_IMAGE
    found = config_from_shapes(shapes)
    moe = found.moe_blocks
    assert moe == other.moe_blocks and found.dense_moe_strategy == strategy
    assert found.capacity_factors == tuple(0.0 if i not in moe else 4.0 if i in moe[:2] else 2.0 for i in range(6))
    assert dataclasses.replace(found, capacity_factors=other.capacity_factors) == other
    if moe != tuple(range(6)):
        dense = next(i for i in range(6) if i not in moe)
        shapes[f"transformer_blocks.{dense}.img_mlp.net.0.proj.weight"] = (2 * 200, 128)
        with pytest.raises(CheckpointError, match="a dense MLP of width 200 at dim 128 is no mlp_ratio's"):
            config_from_shapes(shapes, "f.safetensors")


def test_bf16_weights_compute_in_bf16_close_to_fp32(files):
    """Measured 0.093 of the fp32 output's norm, against 0.013 for the same model with dense MLPs only: in bf16 the
    routers' logits move 2-5 of each MoE layer's 144-288 expert slots to other tokens (near ties at a top-k border;
    float32 scores change nothing, float32 logits halve it), and a token one expert took gets route_scale times that
    expert's output whatever its score. diffusers' bf16 forward: 0.52, most of it its sigma rounded to bf16."""
    model, reference = load_nucleus_image(files["single"], dtype=torch.bfloat16), load_nucleus_image(files["single"])
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16} and model.compute_dtype == torch.bfloat16
    dense_config = tiny_config(moe_enabled=False)
    dense = ours_from(tiny_diffusers(dense_config), dense_config)
    dense16 = ours_from(tiny_diffusers(dense_config), dense_config).to(torch.bfloat16)
    dense16.compute_dtype = torch.bfloat16
    x = inputs()
    with torch.no_grad():
        out, expected, dense_out, dense_expected = model(**x), reference(**x), dense16(**x), dense(**x)
    assert out.dtype == dense_out.dtype == torch.bfloat16
    assert ((out.float() - expected).norm() / expected.norm()).item() < 0.15
    assert ((dense_out.float() - dense_expected).norm() / dense_expected.norm()).item() < 0.02


def test_a_wrong_shape_or_foreign_file_is_one_line_naming_file_key_and_shapes(files, tmp_path):
    sd = load_file(files["single"])
    key = "transformer_blocks.4.img_mlp.experts.down_proj"
    save_file({**sd, key: torch.zeros(8, 40, 128)}, tmp_path / "bad.safetensors")
    with pytest.raises(CheckpointError) as single_error:
        load_nucleus_image(str(tmp_path / "bad.safetensors"))
    assert str(single_error.value) == (f"{tmp_path / 'bad.safetensors'}: key '{key}' has shape (8, 40, 128), "
                                       f"expected (8, 48, 128)")
    folder = os.path.join(files["diffusers"], "transformer")
    bad = tmp_path / "bad_folder"
    bad.mkdir()
    (bad / "config.json").write_text(open(os.path.join(folder, "config.json")).read())
    save_file({**sd, "transformer_blocks.0.attn.add_v_proj.weight": torch.zeros(64, 7)},
              bad / "diffusion_pytorch_model.safetensors")
    with pytest.raises(CheckpointError, match=re.escape("diffusion_pytorch_model.safetensors: key "
                                                        "'transformer_blocks.0.attn.add_v_proj.weight' has shape "
                                                        "(64, 7), expected (64, 128)")) as folder_error:
        load_nucleus_image(str(bad))
    assert "\n" not in str(folder_error.value)
    without = {k: v for k, v in sd.items() if k != "transformer_blocks.5.img_mlp.shared_expert.net.2.weight"}
    save_file(without, tmp_path / "short.safetensors")
    with pytest.raises(CheckpointError, match="missing keys: transformer_blocks.5.img_mlp.shared_expert.net.2.weight"):
        load_nucleus_image(str(tmp_path / "short.safetensors"))
    save_file({"double_blocks.0.img_attn.qkv.weight": torch.zeros(6, 2)}, tmp_path / "other.safetensors")
    with pytest.raises(CheckpointError, match="not a Nucleus-Image transformer"):
        load_nucleus_image(str(tmp_path / "other.safetensors"))


def fp8_scaled(sd: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """ComfyUI's marker layout (every Linear e4m3 with a float32 scale_weight; the packed experts, no Linear, as
    they are) and what it dequantizes to."""
    stored, dequantized = {"scaled_fp8": torch.empty(0, dtype=E4M3)}, {}
    for key, w in sd.items():
        if w.dim() == 2:
            scale = w.abs().max() / 448
            stored[key], stored[key[: -len("weight")] + "scale_weight"] = (w / scale).to(E4M3), scale
            dequantized[key] = stored[key].float() * scale
        else:
            stored[key] = dequantized[key] = w
    return stored, dequantized


def test_a_comfyui_scaled_fp8_file_loads_as_stored(files, tmp_path, monkeypatch):
    """The Linears the keep rules leave to fp8 keep the file's codes and scales bit for bit, the kept ones hold
    codes * scale, the experts are as stored; the output is the dequantized float32 model's exactly. Without the
    family's rules (no spec.py, no fp8_rules) the file is refused in one line."""
    stored, dequantized = fp8_scaled(load_file(files["single"]))
    path = str(tmp_path / "nucleus_fp8_scaled.safetensors")
    save_file({COMFY_PREFIX + k: v for k, v in stored.items()}, path)
    loaded = load_nucleus_image(path, fp8_rules=FP8_RULES).eval()
    quantized = [n for n, m in loaded.named_modules() if isinstance(m, FP8Linear)]
    assert len(quantized) == 6 * 10  # img_mod, encoder_proj, q, k, v, add_k, add_v, out, and two MLP Linears
    for name in quantized:
        layer = loaded.get_submodule(name)
        assert torch.equal(layer.weight.view(torch.uint8), stored[f"{name}.weight"].view(torch.uint8)), name
        assert torch.equal(layer.weight_scale, stored[f"{name}.scale_weight"]), name
    router = loaded.transformer_blocks[3].img_mlp.gate
    assert type(router) is torch.nn.Linear
    assert torch.equal(router.weight, dequantized["transformer_blocks.3.img_mlp.gate.weight"])
    twin = NucleusImage(tiny_config())
    twin.load_state_dict(dequantized, strict=True)
    with torch.no_grad():
        assert torch.equal(loaded(**inputs()), twin.eval()(**inputs()))
    monkeypatch.setitem(sys.modules, "library.models.nucleus_image.spec", None)  # as before the spec exists
    with pytest.raises(CheckpointError, match=r"a pre-quantized \(fp8_tensor_scaled\) Nucleus-Image file needs the "
                                              r"family's fp8 keep rules"):
        load_nucleus_image(path)


def test_gguf_or_split_experts_are_refused_naming_the_tensor(files, tmp_path):
    """Some files split the experts per expert, a GGUF may store them in blocks: one line each, naming the tensor; a
    GGUF whose Linears are blocks and whose experts are F32 loads."""
    from tests.test_gguf import write_gguf

    sd = load_file(files["single"])
    key = "transformer_blocks.3.img_mlp.experts.gate_up_proj"
    split = "transformer_blocks.3.img_mlp.experts.gate_up_projs.0.weight"
    save_file({**sd, split: torch.zeros(96, 128)}, tmp_path / "split.safetensors")
    with pytest.raises(CheckpointError, match=f"'{re.escape(split)}': experts split per expert"):
        load_nucleus_image(str(tmp_path / "split.safetensors"))
    linears = {k: "Q8_0" for k, v in sd.items() if v.dim() == 2 and v.shape[1] % 32 == 0}
    with pytest.raises(CheckpointError, match=f"'{key}' is stored as Q8_0: Nucleus-Image's packed experts load in "
                                              f"bf16 / fp16 / fp32 / fp8 only"):
        load_nucleus_image(write_gguf(sd, tmp_path / "q8_experts.gguf", {**linears, key: "Q8_0"}))
    loaded = load_nucleus_image(write_gguf(sd, tmp_path / "q8.gguf", linears)).eval()
    blocks = {n: m for n, m in loaded.named_modules() if isinstance(m, GGUFLinear)}
    assert len(blocks) == len(linears)
    assert torch.equal(loaded.transformer_blocks[3].img_mlp.experts.gate_up_proj, sd[key])
    twin = NucleusImage(tiny_config())
    twin.load_state_dict({**sd, **{f"{n}.weight": m.dequantized_weight(torch.float32) for n, m in blocks.items()}})
    with torch.no_grad():
        out, expected = loaded(**inputs()), diffusers_forward(files["reference"], inputs())
        assert torch.equal(out, twin.eval()(**inputs()))
    assert ((out - expected).norm() / expected.norm()).item() < 0.05  # measured 0.036: Q8_0 routers move tokens


# ----------------------------------------------------------------------------------------------
# fp8 experts (precision/fp8_packed.py)

EXPERTS = [f"transformer_blocks.{i}.img_mlp.experts" for i in (3, 4, 5)]


def fp8_prepare(mode: str):
    """What the family's fp8_prepare hands the loader (with its spec's keep rules: here the test's)."""
    return lambda model: fp8_load_converter(prepare_fp8(model, mode, FP8_RULES))


def dequantized_twin(model: NucleusImage) -> NucleusImage:
    """The float32 model holding what the fp8 model's weights dequantize to."""
    sd = {k: v.float() for k, v in model.state_dict().items() if v.dtype != E4M3 and not k.endswith("_scale")}
    for name, module in model.named_modules():
        if isinstance(module, FP8Linear):
            sd[f"{name}.weight"] = module.dequantized_weight(torch.float32)
        elif isinstance(module, SwiGLUExperts):
            sd[f"{name}.gate_up_proj"], sd[f"{name}.down_proj"] = module.matrices(torch.float32)
    twin = NucleusImage(model.config)
    twin.load_state_dict(sd, strict=True)
    return twin.eval().requires_grad_(False)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_fp8_scaled_experts_compute_as_their_dequantized_twin(files, monkeypatch):
    """Loaded with base precision fp8_scaled, the experts are fp8 codes + bf16 block scales (quantized while
    streaming); in float32 compute the model's output and its input gradient are its dequantized twin's, chunks of
    one expert change nothing; model.to(bf16) keeps the codes. Measured against the float32 model (of the output's
    norm): fp8_scaled 0.192 in float32 and 0.193 in bf16, the bf16 model 0.093. The routers (kept in high precision)
    see inputs fp8 moved, and top-k border flips amplify it, as bf16's: fp8_scaled experts alone 0.119, Linears alone
    0.167; a dense-only config (no routing) 0.055."""
    model = load_nucleus_image(files["single"], prepare=fp8_prepare("fp8_scaled")).eval().requires_grad_(False)
    for name in EXPERTS:
        experts = model.get_submodule(name)
        assert experts.packed_modes == {"gate_up_proj": "fp8_scaled", "down_proj": "fp8_scaled"}
        assert experts.gate_up_proj.dtype == E4M3 and experts.gate_up_proj_scale.shape == (8, 2, 96)
        assert experts.down_proj_scale.shape == (8, 1, 128)  # inner 48: per (expert, column)
    twin, reference = dequantized_twin(model), load_nucleus_image(files["single"]).eval()
    x = inputs()
    img = x["img"].clone().requires_grad_(True)
    out = model(**{**x, "img": img})
    (grad,) = torch.autograd.grad(out.square().mean(), img)
    img_twin = x["img"].clone().requires_grad_(True)
    expected = twin(**{**x, "img": img_twin})
    (grad_twin,) = torch.autograd.grad(expected.square().mean(), img_twin)
    print(f"fp8_scaled vs its twin: output {rel(out, expected):.1e}, input gradient {rel(grad, grad_twin):.1e}")
    assert rel(out, expected) <= 1e-6 and rel(grad, grad_twin) <= 1e-6
    monkeypatch.setattr(fp8_packed, "DEQUANTIZED_CHUNK_BYTES", 1)
    assert len(model.transformer_blocks[3].img_mlp.experts.expert_chunks(torch.float32)) == 8
    with torch.no_grad():
        assert rel(model(**x), out) <= 1e-6
        errors = {"fp8_scaled": rel(out, reference(**x))}
        bf16 = load_nucleus_image(files["single"], dtype=torch.bfloat16).eval()
        errors["bf16"] = rel(bf16(**x), reference(**x))
        experts = model.transformer_blocks[4].img_mlp.experts
        codes = experts.down_proj.clone()
        model.to(torch.bfloat16).compute_dtype = torch.bfloat16
        assert torch.equal(experts.down_proj.view(torch.uint8), codes.view(torch.uint8))
        errors["fp8_scaled in bf16"] = rel(model(**x), reference(**x))
    print("against the float32 model: " + ", ".join(f"{k} {v:.3f}" for k, v in errors.items()))
    assert errors["fp8_scaled"] < 0.25 and errors["bf16"] < 0.15 and errors["fp8_scaled in bf16"] < 0.25


def test_fp8_experts_under_checkpointing_and_block_swap_give_the_same_gradients(files):
    """The fp8 experts' autograd holds the codes and scales themselves (no saved copy): checkpointing's recompute and
    block swap, which releases and reloads the swapped blocks' codes under the same tensors, give the plain run's
    input gradient bit for bit."""
    x = inputs()
    grads = []
    for ckpt, swap in ((False, 0), (True, 0), (True, 3)):
        model = load_nucleus_image(files["single"], prepare=fp8_prepare("fp8_scaled")).eval().requires_grad_(False)
        model.gradient_checkpointing = ckpt
        if swap:
            enable_block_swap(model, swap, "cpu")
        img = x["img"].clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(model(**{**x, "img": img}).square().mean(), img)
        grads.append(grad)
    assert grads[0].abs().max() > 0 and all(torch.equal(g, grads[0]) for g in grads[1:])


# Measured: experts 15,804,923,904 bytes (1.03125 a weight: e4m3 + a bf16 scale per 64), the whole base
# 17,500,119,040 (bf16: 33,845,358,592; plain fp8: 16,972,853,248).
def test_the_released_size_prepared_fp8_scaled_weighs_a_byte_a_weight():
    """What the memory planner counts (module_bytes of the meta model as the fp8_scaled load builds it)."""
    with torch.device("meta"):
        model = NucleusImage(NUCLEUS_IMAGE).to(torch.bfloat16)
    prepare_fp8(model, "fp8_scaled", FP8_RULES)
    experts = sum(module_bytes(b.img_mlp.experts) for b in model.transformer_blocks if b.moe_enabled)
    total = module_bytes(model)
    print(f"released size, fp8_scaled: experts {experts:,} bytes, the base {total:,} bytes")
    assert experts == 15_325_986_816 * (1 + 2 / 64) == 15_804_923_904
    assert total == 17_500_119_040 and total / 2**30 < 16.5  # bf16: 31.5 GiB


# Measured: experts nf4 8,620,867,584 bytes (0.5625 a weight), nf4_dq 7,906,218,496 (0.5159), int8 15,361,146,880
# (1 + 4 / K); the whole base 8.93 / 8.20 / 15.84 GiB, where with the experts left bf16 it was 29.45 (nf4) / 30.08
# GiB (int8) in tools/plan_memory.py (fp8_scaled: 16.30).
PACKED_EXPERT_BYTES = {"nf4": 8_620_867_584, "nf4_dq": 7_906_218_496, "int8": 15_361_146_880}
BASE_BYTES = {"nf4": 9_591_132_160, "nf4_dq": 8_804_368_864, "int8": 17_010_813_440}


@pytest.mark.parametrize("mode", ["nf4", "nf4_dq", "int8"])
def test_the_released_size_prepared_for_bitsandbytes_stores_its_experts_so(mode):
    """What the memory planner counts under nf4 / nf4_dq / int8: the experts in the format (bnb_weights.packed_shapes,
    per expert [2048, 2688] gate_up and [1344, 2048] down, 64 experts in 29 MoE blocks), not bf16."""
    from library.precision.bnb_weights import prepare_bnb

    with torch.device("meta"):
        model = NucleusImage(NUCLEUS_IMAGE).to(torch.bfloat16)
    prepare_bnb(model, mode, FP8_RULES)
    experts = sum(module_bytes(b.img_mlp.experts) for b in model.transformer_blocks if b.moe_enabled)
    total = module_bytes(model)
    print(f"released size, {mode}: experts {experts:,} bytes, the base {total:,} bytes ({total / 2**30:.2f} GiB)")
    per_expert = {"nf4": (2048 * 2688 + 1344 * 2048) * 0.5625,
                  "nf4_dq": sum(n // 2 + n // 64 + n // 64 // 256 * 4 + 4 for n in (2048 * 2688, 1344 * 2048)),
                  "int8": 2048 * 2688 + 4 * 2688 + 1344 * 2048 + 4 * 2048}[mode]
    assert experts == 29 * 64 * per_expert == PACKED_EXPERT_BYTES[mode]
    assert total == BASE_BYTES[mode]


def test_a_saved_fp8_model_loads_back_as_stored_bit_for_bit(files, tmp_path):
    """Our fp8_scaled model saved as a single file (the Linears' weight_scale, the experts' <name>_scale) loads as
    stored: every tensor bit for bit, the same output; the planner's meta load of it holds the same meta fp8."""
    model = load_nucleus_image(files["single"], dtype=torch.bfloat16, prepare=fp8_prepare("fp8_scaled")).eval()
    path = str(tmp_path / "nucleus_fp8_scaled.safetensors")
    save_nucleus_image_single_file(model, path)
    assert load_file(path)[EXPERTS[0] + ".gate_up_proj_scale"].dtype == torch.bfloat16
    again = load_nucleus_image(path, dtype=torch.bfloat16, fp8_rules=FP8_RULES).eval()
    assert again.get_submodule(EXPERTS[1]).packed_modes == {"gate_up_proj": "fp8_scaled", "down_proj": "fp8_scaled"}
    saved, loaded = model.state_dict(), again.state_dict()
    assert saved.keys() == loaded.keys()
    for key, value in saved.items():
        assert loaded[key].dtype == value.dtype and torch.equal(loaded[key].view(torch.uint8), value.view(torch.uint8))
    with torch.no_grad():
        assert torch.equal(again(**inputs()), model(**inputs()))
    planned = load_nucleus_image(path, dtype=torch.bfloat16, read_weights=False, fp8_rules=FP8_RULES)
    assert {k: (v.shape, v.dtype) for k, v in planned.state_dict().items()} == \
        {k: (v.shape, v.dtype) for k, v in saved.items()}


def test_comfyui_fp8_experts_load_as_stored(files, tmp_path):
    """ComfyUI's fp8 files quantize the packed experts too: e4m3 with one float32 scale per tensor (its `_scale`, or a
    Linear's `.scale_weight`) beside the scaled Linears, or plain e4m3. They load as stored (the codes bit for bit) and
    the output is the dequantized float32 model's exactly."""
    sd = load_file(files["single"])
    stored, dequantized = fp8_scaled(sd)
    for i, name in enumerate(f"{e}.{w}" for e in EXPERTS for w in ("gate_up_proj", "down_proj")):
        if i % 3 == 2:  # plain e4m3
            stored[name] = sd[name].to(E4M3)
            dequantized[name] = stored[name].float()
            continue
        scale = sd[name].abs().max() / 448
        stored[name] = (sd[name] / scale).to(E4M3)
        stored[name + ("_scale" if i % 3 == 0 else ".scale_weight")] = scale
        dequantized[name] = stored[name].float() * scale
    path = str(tmp_path / "comfy_fp8_experts.safetensors")
    save_file({COMFY_PREFIX + k: v for k, v in stored.items()}, path)
    loaded = load_nucleus_image(path, fp8_rules=FP8_RULES).eval()
    modes = {e: loaded.get_submodule(e).packed_modes for e in EXPERTS}
    assert modes[EXPERTS[0]] == {"gate_up_proj": "fp8_tensor_scaled", "down_proj": "fp8_tensor_scaled"}
    assert modes[EXPERTS[1]] == {"gate_up_proj": "fp8", "down_proj": "fp8_tensor_scaled"}
    for e in EXPERTS:
        for w in ("gate_up_proj", "down_proj"):
            codes = getattr(loaded.get_submodule(e), w)
            assert torch.equal(codes.view(torch.uint8), stored[f"{e}.{w}"].view(torch.uint8))
    twin = NucleusImage(tiny_config())
    twin.load_state_dict(dequantized, strict=True)
    with torch.no_grad():
        assert torch.equal(loaded(**inputs()), twin.eval()(**inputs()))
