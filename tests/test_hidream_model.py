"""The HiDream-I1 sparse DiT (library/models/hidream/model.py) against diffusers' HiDreamImageTransformer2DModel on the
same random weights (the names are equal: a strict load_state_dict), its MoE routing, the released size on meta, and
every file layout (checkpoint.py).

Convention (stated once, proved by the parity): our forward takes sigma in [0, 1] (1 = pure noise) where diffusers'
model takes the scheduler's timestep 1000 sigma, and returns the flow velocity v = noise - x0, which is minus
diffusers' output (the pipeline's `noise_pred = -noise_pred`; the scheduler's Euler step x + (sigma_next - sigma) v
goes from noise to the image), in pack_latents' token layout."""

import json
import time

import pytest
import torch
from diffusers import HiDreamImageTransformer2DModel
from safetensors.torch import load_file, save_file

from library.io import CheckpointError
from library.models.hidream import model as M
from library.models.hidream.checkpoint import (
    diffusers_config, load_hidream, save_hidream_diffusers, save_hidream_single_file,
)
from library.models.hidream.model import HIDREAM_I1, HiDream, HiDreamConfig
from library.models.hidream.tiny import tiny_config, write_hidream
from library.models.latents import pack_latents, unpack_latents
from tests.model_checks import checkpointing_gradients, randomized

# 2 double + 2 single blocks of 2 heads x 32 (RoPE axes (16, 8, 8): the released split of the head), 4 experts top-2,
# narrow text widths, 3 Llama layers (blocks read 0, 1, 2, 2), diffusers' padding to 8 x 8 = 64 image tokens
TINY = HiDreamConfig(num_layers=2, num_single_layers=2, attention_head_dim=32, num_attention_heads=2,
                     axes_dims_rope=(16, 8, 8), t5_dim=24, llama_dim=40, text_emb_dim=48, llama_layers=(0, 1, 2, 2),
                     max_resolution=(16, 16))


def pair(config: HiDreamConfig = TINY, seed: int = 1):
    """(ours randomized, diffusers' model on the same weights), both in eval mode."""
    ours = randomized(HiDream(config), seed)
    ref = HiDreamImageTransformer2DModel(**{k: v for k, v in diffusers_config(config).items() if k[0] != "_"})
    ref.load_state_dict(ours.state_dict(), strict=True)
    return ours, ref.eval()


def inputs(config: HiDreamConfig, h: int, w: int, seed: int = 0):
    """(latents [2, 16, 2h, 2w], T5 [2, 7, t5], Llama [3 layers, 2, 5, llama], pooled, two sigmas)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, config.in_channels, 2 * h, 2 * w, generator=g),
            torch.randn(2, 7, config.t5_dim, generator=g), torch.randn(3, 2, 5, config.llama_dim, generator=g),
            torch.randn(2, config.text_emb_dim, generator=g), torch.tensor([0.3, 0.8]))


def ours_on(model, z, t5, llama, pooled, sigma, **kwargs):
    h, w = z.shape[2] // 2, z.shape[3] // 2
    return unpack_latents(model(img=pack_latents(z), t5=t5, llama=llama, pooled=pooled, timesteps=sigma, h=h, w=w,
                                **kwargs), 2 * h, 2 * w)


PATCH_AREA = 4  # 2 x 2 features per channel in diffusers' training output


def diffusers_velocity(out: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """-diffusers' output as latents [B, 16, 2h, 2w]: eval mode gives them; train mode (is_training unpatchify) gives
    [B, 16, tokens (padded), (row, col)] per channel, the real tokens first."""
    if out.dim() == 4 and out.shape[-1] == PATCH_AREA and out.shape[-2] != 2 * h:
        b, c = out.shape[:2]
        out = unpack_latents(out[:, :, : h * w].permute(0, 2, 1, 3).reshape(b, h * w, c * PATCH_AREA), 2 * h, 2 * w)
    return -out



@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("grid", [(6, 6), (5, 7)])
def test_hidream_matches_diffusers_fp32(grid, training):
    """A square grid and a non-square one (diffusers pads it to max_seq = 64 tokens: ours with pad_like_diffusers),
    a batch of 2 with two sigmas, in eval mode (diffusers' moe_infer) and train mode (its repeat_interleave MoE
    path and its training unpatchify): identical (measured 0.0 in all four)."""
    (h, w), config = grid, TINY
    ours, ref = pair(config)
    ours.train(training), ref.train(training)
    z, t5, llama, pooled, sigma = inputs(config, h, w)
    with torch.no_grad():
        got = ours_on(ours, z, t5, llama, pooled, sigma, pad_like_diffusers=True)
        want = diffusers_velocity(ref(z, sigma * 1000, t5, llama, pooled, return_dict=False)[0], h, w)
    diff = (got - want).abs().max().item()
    print(f"{grid} {'train' if training else 'eval'}: max abs diff {diff:.2e} of {want.abs().max().item():.1f}")
    assert diff <= 1e-5
    assert (got[0] - got[1]).abs().max() > 1e-2  # the batch rows differ: nothing broadcast one to both


def test_real_tokens_only_is_comfyuis_arithmetic():
    """Our default on a non-square grid runs the real tokens only, as ComfyUI does: diffusers' forward given the real
    tokens only (3-D hidden_states with an all-ones hidden_states_masks, img_ids and img_sizes: no padding, every key
    kept) gives the same output (measured 0.0)."""
    ours, ref = pair()
    h, w = 5, 7
    z, t5, llama, pooled, sigma = inputs(TINY, h, w)
    tokens = M.to_patch_order(pack_latents(z))  # diffusers' (row, col, channel) patch features
    ids = M.image_positions(h, w).float()[None].expand(2, -1, -1)
    with torch.no_grad():
        real = ours_on(ours, z, t5, llama, pooled, sigma)
        theirs = -ref(tokens, sigma * 1000, t5, llama, pooled, img_ids=ids, img_sizes=[(h, w)] * 2,
                      hidden_states_masks=torch.ones(2, h * w), return_dict=False)[0]
    print(f"real tokens vs diffusers fed them: {(real - theirs).abs().max().item():.2e}")
    assert (real - theirs).abs().max().item() <= 1e-5


def test_diffusers_padding_moves_the_output():
    """diffusers' padding of a non-square grid to max_seq (the released 4096 tokens; the padding's keys zeroed, its
    values still weighted) against the real tokens only, on the tiny writer's model (torch's init) at 16 x 24
    patches: 4.5e-2 of the output's max apart (5.8e-2 in norm; measured 5.7e-2 at 5 x 7 and 2.9e-2 at 32 x 48): what
    a LoRA trained through diffusers' padding (ai-toolkit) saw that ComfyUI's forward does not."""
    from library.models.hidream.tiny import random_hidream

    torch.manual_seed(0)
    model = random_hidream(tiny_config())
    assert model.config.max_seq == 4096
    g = torch.Generator().manual_seed(0)
    h, w = 16, 24
    kwargs = dict(img=torch.randn(1, h * w, 64, generator=g), t5=torch.randn(1, 128, 64, generator=g),
                  llama=torch.randn(2, 1, 128, 64, generator=g), pooled=torch.randn(1, 64, generator=g),
                  timesteps=torch.tensor([0.5]), h=h, w=w)
    with torch.no_grad():
        real, padded = model(**kwargs), model(**kwargs, pad_like_diffusers=True)
    apart = ((padded - real).abs().max() / real.abs().max()).item()
    print(f"padded vs real tokens only: {apart:.2e} of the output's max")
    assert 1e-2 < apart < 0.2


def test_released_config_on_meta():
    """HiDream-I1 (Full / Dev / Fast): 17,105,733,184 parameters, ours = diffusers' class at the released config on
    meta (the "17 B" of the release); the 4 x 48 routed experts hold 10,192,158,720 of them (2 of 4 run per token:
    ~12 B active)."""
    with torch.device("meta"):
        ours = HiDream(HIDREAM_I1)
        ref = HiDreamImageTransformer2DModel(**{k: v for k, v in diffusers_config(HIDREAM_I1).items() if k[0] != "_"})
    n = sum(p.numel() for p in ours.parameters())
    routed = sum(p.numel() for name, p in ours.named_parameters() if ".ff_i.experts." in name)
    print(f"HiDream-I1: {n:,} parameters, {routed:,} in the routed experts")
    assert n == sum(p.numel() for p in ref.parameters()) == 17_105_733_184
    assert ours.state_dict().keys() == ref.state_dict().keys()
    assert len(ours.swappable_blocks()) == 48 and HIDREAM_I1.width == 2560
    assert HIDREAM_I1.llama_layers == tuple(range(32)) + (31,) * 16


def test_routing_is_decided_in_float32():
    """The gate decides on float32 logits of the bf16 activations and weight: the same experts whatever rounding the
    activation dtype's GEMM would add. On the tiny model's bf16 tokens (4096 of them, N(0, 1)) bf16 logits pick
    another top-2 set than float32 ones for 11 tokens (0.27 %, measured): those are the near-ties a bf16 gate
    (diffusers' in bf16) decides by rounding."""
    torch.manual_seed(0)
    moe = M.MOEFeedForwardSwiGLU(128, 4, 2).to(torch.bfloat16)
    x = torch.randn(4096, 128).to(torch.bfloat16)
    index, probs = moe.gate(x)
    want = torch.nn.functional.linear(x.float(), moe.gate.weight.float()).softmax(-1).topk(2, dim=-1)
    assert torch.equal(index.sort(-1).values, want.indices.sort(-1).values) and probs.dtype == torch.float32
    bf16_choice = torch.nn.functional.linear(x, moe.gate.weight).softmax(-1).topk(2, dim=-1).indices.sort(-1).values
    flips = int((bf16_choice != index.sort(-1).values).any(-1).sum())
    print(f"routing: bf16 logits pick another expert set for {flips} of {len(x)} tokens")
    assert 0 < flips < 0.05 * len(x)


def test_gradients_reach_the_chosen_experts_and_the_gate():
    """One token picks 2 of 4 experts: their three Linears and the shared expert's get gradients, the other two
    experts none (not run), and the gate weight one through the picked probabilities."""
    torch.manual_seed(1)
    moe = M.MOEFeedForwardSwiGLU(64, 4, 2)
    x = torch.randn(1, 1, 64)
    chosen = set(moe.gate(x[0])[0][0].tolist())  # the token's two experts
    moe(x).square().sum().backward()
    for e, expert in enumerate(moe.experts):
        for linear in (expert.w1, expert.w2, expert.w3):
            assert (linear.weight.grad is not None and linear.weight.grad.abs().max() > 0) == (e in chosen), e
    assert moe.gate.weight.grad.abs().max() > 0 and moe.shared_experts.w2.weight.grad.abs().max() > 0
    assert len(chosen) == 2


def test_gradient_checkpointing_gives_the_plain_gradients():
    ours = randomized(HiDream(TINY), 2).train()
    z, t5, llama, pooled, sigma = inputs(TINY, 4, 6)
    plain, checkpointed = checkpointing_gradients(ours, dict(img=pack_latents(z), t5=t5, llama=llama, pooled=pooled,
                                                             timesteps=sigma, h=4, w=6))
    assert plain.keys() == checkpointed.keys() and all(g.abs().max() > 0 for g in plain.values())
    diff = max((plain[k] - checkpointed[k]).abs().max().item() for k in plain)
    print(f"checkpointing: max gradient diff {diff:.2e}")
    assert diff <= 1e-6


def test_a_rope_row_moved_by_one_changes_the_output(monkeypatch):
    """One image token's row id one higher moves the output: the tables are used, and per token."""
    ours = randomized(HiDream(TINY), 1)
    z, t5, llama, pooled, sigma = inputs(TINY, 4, 4)
    with torch.no_grad():
        out = ours_on(ours, z, t5, llama, pooled, sigma)
        exact = M.image_positions

        def moved(h, w, padded_to=None):
            ids = exact(h, w, padded_to).clone()
            ids[5, 1] += 1
            return ids

        monkeypatch.setattr(M, "image_positions", moved)
        shifted = ours_on(ours, z, t5, llama, pooled, sigma)
    print(f"row moved: output moves by {(shifted - out).abs().max().item():.2e}")
    assert (shifted - out).abs().max().item() > 1e-3


def test_llama_layers_clip_to_what_the_encoder_gives():
    """The released rule on 4 blocks (0, 1, 2, 3) with 2 Llama layers given reads (0, 1, 1, 1); with 3 layers and
    TINY's list (0, 1, 2, 2) the list as it is."""
    ours = HiDream(HiDreamConfig(**{**TINY.__dict__, "llama_layers": (0, 1, 2, 3)}))
    assert ours.llama_layer_indices(2) == [0, 1, 1, 1] and HiDream(TINY).llama_layer_indices(3) == [0, 1, 2, 2]
    with pytest.raises(ValueError, match="one per block"):
        HiDreamConfig(num_layers=2, num_single_layers=2, llama_layers=(0, 1))


def test_positions_survive_a_bf16_model():
    """model.to(bfloat16) has no position buffer to round, and the bf16 forward of the tiny writer's model (torch's
    init) stays near fp32 (measured 6.6e-3 of the output's norm)."""
    from library.models.hidream.tiny import random_hidream

    torch.manual_seed(0)
    model = random_hidream(tiny_config())
    g = torch.Generator().manual_seed(0)
    kwargs = dict(img=torch.randn(1, 48, 64, generator=g), t5=torch.randn(1, 16, 64, generator=g),
                  llama=torch.randn(2, 1, 16, 64, generator=g), pooled=torch.randn(1, 64, generator=g),
                  timesteps=torch.tensor([0.5]), h=6, w=8)
    with torch.no_grad():
        full = model(**kwargs)
        model.to(torch.bfloat16).compute_dtype = torch.bfloat16
        half = model(**kwargs)
    error = ((half.float() - full).norm() / full.norm()).item()
    print(f"bf16 vs fp32: {error:.2e} of the output's norm")
    assert not list(model.buffers()) and half.dtype == torch.bfloat16 and error <= 0.05


def test_random_inputs_name_the_positions_rope_tables_gets(monkeypatch):
    """random_inputs (the precision doctor's conditioning) drives the model, and its expected positions are exactly
    those core.rope_tables receives, float64: the 3 x 5 text tokens' zeros, then the image's (0, row, col)."""
    seen = []

    def recording(positions, *args):
        seen.append(positions)
        return M.rope_tables.__wrapped__(positions, *args)

    recording.__wrapped__ = M.rope_tables
    monkeypatch.setattr(M, "rope_tables", recording)
    conditioning = M.random_inputs(TINY, 3, 4, 5, torch.Generator().manual_seed(0))
    model = randomized(HiDream(TINY), 1)
    with torch.no_grad():
        out = model(img=torch.randn(1, 12, 64), timesteps=torch.tensor([0.5]), **conditioning.fixed)
    assert out.shape == (1, 12, 64) and len(seen) == 1 and seen[0].dtype == torch.float64
    assert torch.equal(seen[0], conditioning.positions[0]) and conditioning.axes_dim == (16, 8, 8)
    assert conditioning.positions.shape == (1, 15 + 12, 3) and conditioning.positions[0, 15 + 5].tolist() == [0, 1, 1]


# ----------------------------------------------------------------------------------------------
# Files


def test_every_layout_loads_the_same_weights(tmp_path):
    """The tiny writer's file (bf16, bare as released, no metadata: the config from the shapes), the same under
    "model.diffusion_model." and "diffusion_model.", a diffusers folder, sharded with its index, and the pipeline
    folder above it: the same config and tensors; diffusers' from_pretrained reads our folder."""
    path = write_hidream(str(tmp_path), seed=0)["hidream"]
    assert not load_file(path).keys() - {k for k in HiDream(tiny_config()).state_dict()}
    want = load_hidream(path)
    assert want.config == tiny_config() and want.config.num_attention_heads == 1
    sd = {k: v.to(torch.bfloat16) for k, v in want.state_dict().items()}
    layouts = {"comfy": tmp_path / "comfy.safetensors", "lora_style": tmp_path / "prefixed.safetensors",
               "diffusers": tmp_path / "transformer", "pipeline": tmp_path}
    save_hidream_single_file(sd, str(layouts["comfy"]), want.config, prefix="model.diffusion_model.",
                             write_config=False)
    save_hidream_single_file(sd, str(layouts["lora_style"]), want.config, prefix="diffusion_model.")
    save_hidream_diffusers(sd, want.config, str(layouts["diffusers"]))
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text((layouts["diffusers"] / "config.json").read_text())
    keys = sorted(sd)
    shards = {"a.safetensors": keys[: len(keys) // 2], "b.safetensors": keys[len(keys) // 2:]}
    for name, part in shards.items():
        save_file({k: sd[k] for k in part}, str(sharded / name))
    index = {"weight_map": {k: name for name, part in shards.items() for k in part}}
    (sharded / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))
    layouts["sharded"] = sharded
    for name, where in layouts.items():
        got = load_hidream(str(where))
        assert got.config == want.config, name
        assert all(torch.equal(got.state_dict()[k], v) for k, v in want.state_dict().items()), name
    ref = HiDreamImageTransformer2DModel.from_pretrained(str(layouts["diffusers"]))
    assert all(torch.equal(ref.state_dict()[k], v.to(torch.bfloat16)) for k, v in want.state_dict().items())
    meta = load_hidream(path, torch.bfloat16, read_weights=False)
    assert meta.compute_dtype == torch.bfloat16 and next(meta.parameters()).device.type == "meta"


def test_prequantized_files_load_as_stored(tmp_path):
    """ComfyUI's scaled fp8 (`scaled_fp8` marker, e4m3 Linears with a float32 scale_weight; the MoE gates, no Linear,
    as they are) and a plain e4m3 file (every tensor, the gates too): loaded as stored through
    precision/stored_layouts.py with keep rules for the embedders, caption projections and final layer (the spec's
    FP8 is the family's to state), each computes as the float32 model of its dequantized tensors (measured 0.0)."""
    from library.models.spec import FP8Rules
    from library.precision.fp8 import FP8Linear

    rules = FP8Rules(keep=(r"x_embedder\.proj", r"[tp]_embedder\..*", r"caption_projection\..*", r"final_layer\..*"))
    e4m3 = torch.float8_e4m3fn
    sd = {k: v.float() for k, v in load_file(write_hidream(str(tmp_path), seed=0)["hidream"]).items()}
    scaled, dequantized = {"scaled_fp8": torch.empty(0, dtype=e4m3)}, {}
    for key, w in sd.items():
        if w.dim() == 2 and not key.endswith(".gate.weight"):
            scale = w.abs().max() / 448
            scaled[key], scaled[key[: -len("weight")] + "scale_weight"] = (w / scale).to(e4m3), scale
            dequantized[key] = scaled[key].float() * scale
        else:
            scaled[key] = dequantized[key] = w
    plain = {k: v.to(e4m3) for k, v in sd.items()}
    g = torch.Generator().manual_seed(0)
    kwargs = dict(img=torch.randn(1, 48, 64, generator=g), t5=torch.randn(1, 16, 64, generator=g),
                  llama=torch.randn(2, 1, 16, 64, generator=g), pooled=torch.randn(1, 64, generator=g),
                  timesteps=torch.tensor([0.5]), h=6, w=8)
    for name, stored, twin_sd in (("scaled", scaled, dequantized), ("plain", plain, None)):
        save_file(stored, str(tmp_path / f"{name}.safetensors"))
        loaded = load_hidream(str(tmp_path / f"{name}.safetensors"), fp8_rules=rules).eval()
        twin = HiDream(tiny_config())
        twin.load_state_dict(twin_sd or {k: v.float() for k, v in stored.items()})
        quantized = [n for n, m in loaded.named_modules() if isinstance(m, FP8Linear)]
        assert "double_stream_blocks.0.block.ff_i.experts.3.w2" in quantized and "final_layer.linear" not in quantized
        with torch.no_grad():
            assert torch.equal(loaded(**kwargs), twin.eval()(**kwargs)), name


def test_other_families_files_are_refused_in_one_line(tmp_path):
    """A FLUX.1 single file, an SD3 one and a FLUX.1 diffusers folder: one CheckpointError each, naming what was
    expected."""
    files = {"flux1": {"double_blocks.0.img_attn.qkv.weight": torch.zeros(6, 2), "img_in.weight": torch.zeros(2, 64)},
             "sd3": {"model.diffusion_model.joint_blocks.0.context_block.attn.qkv.weight": torch.zeros(6, 2)}}
    for name, tensors in files.items():
        save_file(tensors, str(tmp_path / f"{name}.safetensors"))
        with pytest.raises(CheckpointError, match=r"not a HiDream-I1 transformer \(no key "
                                                  r"'double_stream_blocks.0.block.adaLN_modulation.1.bias'") as e:
            load_hidream(str(tmp_path / f"{name}.safetensors"))
        assert "\n" not in str(e.value)
    folder = tmp_path / "flux_diffusers"
    folder.mkdir()
    (folder / "config.json").write_text('{"_class_name": "FluxTransformer2DModel"}')
    save_file({"x_embedder.weight": torch.zeros(2, 64)}, str(folder / "diffusion_pytorch_model.safetensors"))
    with pytest.raises(CheckpointError, match="_class_name is 'FluxTransformer2DModel', expected 'HiDreamImage"):
        load_hidream(str(folder))


def test_a_config_json_with_unknown_keys_is_refused(tmp_path):
    ours = randomized(HiDream(TINY), 3)
    save_hidream_diffusers(ours, None, str(tmp_path / "transformer"))
    config = json.loads((tmp_path / "transformer" / "config.json").read_text())
    assert load_hidream(str(tmp_path)).config == TINY
    (tmp_path / "transformer" / "config.json").write_text(json.dumps({**config, "num_experts": 8}))
    with pytest.raises(CheckpointError, match=r"unknown HiDreamImageTransformer2DModel config keys \['num_experts'\]"):
        load_hidream(str(tmp_path))


def test_the_tiny_file_runs_quickly():
    """The tiny transformer's forward at 16 x 16 patches (256 image + 384 text tokens: the released text length) on
    the CPU: under a second (the suite's budget)."""
    from library.models.hidream.tiny import random_hidream

    torch.manual_seed(0)
    model = random_hidream(tiny_config())
    g = torch.Generator().manual_seed(0)
    kwargs = dict(img=torch.randn(1, 256, 64, generator=g), t5=torch.randn(1, 128, 64, generator=g),
                  llama=torch.randn(2, 1, 128, 64, generator=g), pooled=torch.randn(1, 64, generator=g),
                  timesteps=torch.tensor([0.5]), h=16, w=16)
    start = time.perf_counter()
    with torch.no_grad():
        out = model(**kwargs)
    assert out.shape == (1, 256, 64) and torch.isfinite(out).all() and time.perf_counter() - start < 1.0
