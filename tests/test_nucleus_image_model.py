"""Nucleus-Image transformer: parity with diffusers' NucleusMoEImageTransformer2DModel (dense and expert-choice MoE
blocks, per-layer capacities, masked text of different lengths, an odd grid), the experts' batched path against
the loop and diffusers' layer, the released size on `meta`, checkpointing and block swap."""

import math

import pytest
import torch
from diffusers import NucleusMoEImageTransformer2DModel
from diffusers.models.transformers.transformer_nucleusmoe_image import NucleusMoELayer

from library.models.block_swap import enable_block_swap
from library.models.nucleus_image import model as nucleus_model
from library.models.nucleus_image.model import (
    NUCLEUS_IMAGE, NucleusImage, NucleusImageConfig, expert_capacity, joint_positions, random_inputs,
)

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


def test_block_swap_changes_nothing():
    model = ours_from(tiny_diffusers()).requires_grad_(False)
    x = inputs()
    with torch.no_grad():
        expected = model(**x)
        swap = enable_block_swap(model, 3, "cpu")
        out = model(**x)
    assert torch.equal(out, expected) and not swap.resident and not swap.pending
