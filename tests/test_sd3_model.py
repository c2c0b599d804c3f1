"""The SD3 / SD3.5 MMDiT (library/models/sd3/model.py) against diffusers' SD3Transformer2DModel on the same random
weights (converted with checkpoint.py's table), its position table, the released sizes on meta, and every file
layout (checkpoint.py).

Convention (stated once, proved by the parity): our forward takes sigma in [0, 1] (1 = pure noise) where diffusers'
model takes the scheduler's timestep 1000 sigma, and returns the flow velocity v = noise - x0 (the scheduler's Euler
step x + (sigma_next - sigma) v goes from noise to the image) in pack_latents' token layout."""

import numpy as np
import logging
import re

import pytest
import torch
import torch.nn.functional as F
from diffusers import SD3Transformer2DModel
from diffusers.models.embeddings import get_2d_sincos_pos_embed_from_grid
from safetensors.torch import load_file, save_file

from library.io import CheckpointError
from library.models.latents import pack_latents, unpack_latents
from library.models.sd3 import model as M
from library.models.sd3.checkpoint import (
    diffusers_config, load_sd3, module_map, save_sd3_diffusers, save_sd3_single_file, to_diffusers_state_dict,
)
from library.models.sd3.model import SD3, SD3_MEDIUM, SD35_LARGE, SD35_MEDIUM, SD3Config
from library.models.sd3.tiny import tiny_config, write_sd3
from tests.model_checks import checkpointing_gradients, randomized

# Tiny stand-ins of the three releases (heads of 64 as released; a 16 x 16 position table).
TINY = {
    "sd3_medium": SD3Config(depth=3, hidden_size=128, context_dim=48, pooled_dim=40, pos_embed_max_size=16,
                            qk_norm=False),
    "sd35_medium": SD3Config(depth=3, hidden_size=128, context_dim=48, pooled_dim=40, pos_embed_max_size=16,
                             dual_attention_layers=(0, 1)),
    "sd35_large": SD3Config(depth=3, hidden_size=128, context_dim=48, pooled_dim=40, pos_embed_max_size=16),
}


def pair(config: SD3Config, seed: int = 1):
    """(ours randomized, diffusers' model on the same weights)."""
    ours = randomized(SD3(config), seed)
    ref = SD3Transformer2DModel(**{k: v for k, v in diffusers_config(config).items() if not k.startswith("_")})
    ref.load_state_dict(to_diffusers_state_dict(ours.state_dict(), config), strict=True)
    return ours, ref.eval()


def inputs(config: SD3Config, h: int, w: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, config.in_channels, 2 * h, 2 * w, generator=g),
            torch.randn(2, 9, config.context_dim, generator=g), torch.randn(2, config.pooled_dim, generator=g),
            torch.tensor([0.3, 0.8]))


def patch_as_linear(module, args, out):
    """diffusers' patch Conv2d computed as our Linear on packed tokens (the same sum in another order)."""
    (z,) = args
    y = F.linear(pack_latents(z), module.weight.flatten(1), module.bias)
    return y.transpose(1, 2).reshape(z.shape[0], -1, z.shape[2] // 2, z.shape[3] // 2)


@pytest.mark.parametrize("variant", sorted(TINY))
@pytest.mark.parametrize("grid", [(6, 6), (5, 7)])
def test_sd3_matches_diffusers_fp32(variant, grid):
    """Each release's shape (no qk norm / MMDiT-X + qk norm / qk norm), a square and a non-square grid smaller than
    the 16 x 16 table (an off-centre crop), a batch of 2 with two sigmas. With diffusers' patch Conv2d computed as
    the Linear we apply, the outputs are identical (0.0); as diffusers runs it, the conv's other summation order
    (~7e-7 at the input) is what remains: the random weights' unnormalised attention logits (std ~20 without qk
    norm) amplify it to ~5e-5 of an output ~20, so that comparison is bounded relative to the output (5e-6;
    measured up to 3.8e-6)."""
    config, (h, w) = TINY[variant], grid
    ours, ref = pair(config)
    z, txt, pooled, sigma = inputs(config, h, w)
    with torch.no_grad():
        packed = ours(img=pack_latents(z), txt=txt, pooled=pooled, timesteps=sigma, h=h, w=w)
        got = unpack_latents(packed, 2 * h, 2 * w)
        as_released = ref(z, txt, pooled, sigma * 1000, return_dict=False)[0]
        ref.pos_embed.proj.register_forward_hook(patch_as_linear)
        same_sum = ref(z, txt, pooled, sigma * 1000, return_dict=False)[0]
    diff, released_diff, scale = [(got - same_sum).abs().max().item(), (got - as_released).abs().max().item(),
                                  as_released.abs().max().item()]
    print(f"{variant} {grid}: max abs diff {diff:.2e} (diffusers' conv: {released_diff:.2e} of {scale:.1f})")
    assert diff <= 1e-5 and released_diff <= 5e-6 * scale
    assert (got[0] - got[1]).abs().max() > 1e-2  # the batch rows differ: nothing broadcast one to both


def test_the_crop_moved_by_one_changes_the_output():
    """A position table window one row lower (the crop diffusers takes is centred) moves the output: the table is
    used, and where."""
    config = TINY["sd35_large"]
    ours = randomized(SD3(config), 1)
    z, txt, pooled, sigma = inputs(config, 5, 7)
    kwargs = dict(img=pack_latents(z), txt=txt, pooled=pooled, timesteps=sigma, h=5, w=7)
    with torch.no_grad():
        out = ours(**kwargs)
        top, left = M.crop_offset(config, 5, 7)
        centred = M.cropped_pos_embed
        M.cropped_pos_embed = lambda cfg, h, w, device=None, table=None: centred(cfg, h, w, device, (top + 1, left))
        try:
            moved = ours(**kwargs)
        finally:
            M.cropped_pos_embed = centred
    print(f"crop one row lower: output moves by {(moved - out).abs().max().item():.2e}")
    assert (moved - out).abs().max().item() > 1e-3


def test_a_grid_past_the_table_is_one_clear_error():
    config = TINY["sd35_large"]
    with pytest.raises(ValueError, match=r"patch grid of 17 x 4 exceeds pos_embed_max_size 16"):
        SD3(config)(img=torch.zeros(1, 68, 64), txt=torch.zeros(1, 2, 48), pooled=torch.zeros(1, 40),
                    timesteps=torch.ones(1), h=17, w=4)
    assert M.max_patch_grid(SD35_MEDIUM) == 384 and M.max_patch_grid(SD35_LARGE) == 192


def test_the_position_table_is_diffusers_sincos_of_sais_grid():
    """Our float64 table, per token [column | row], equals diffusers' get_2d_sincos_pos_embed_from_grid on the same
    grid (its layout: "w goes first", sin then cos) to float32 rounding, and its grid is the one sd-scripts'
    get_scaled_2d_sincos_pos_embed(width, N, sample_size=64, base_size=16) spans (its note: what SD3.5's state dict
    holds), recomputed here from that formula: step 1/4, position 0 at the centred 64 x 64 crop's corner."""
    for config in (SD3Config(depth=2, hidden_size=128, pos_embed_max_size=24),
                   SD3Config(depth=2, hidden_size=256, pos_embed_max_size=384)):
        n = config.pos_embed_max_size
        scale = 16 * n / 64  # sd-scripts: scale_h = base_size * grid / sample_size; shift_h = scale (N - 64) / 2N
        sd_scripts_grid = np.arange(n, dtype=np.float64) / n * scale - scale * (n - 64) / (2 * n)
        assert np.abs(M.table_positions(config).numpy() - sd_scripts_grid).max() < 1e-12
        grid = torch.from_numpy(np.stack(np.meshgrid(sd_scripts_grid, sd_scripts_grid))).reshape(2, 1, n, n)
        theirs = get_2d_sincos_pos_embed_from_grid(config.hidden_size, grid).float()
        ours = M.pos_embed_table(config)
        assert ours.dtype == torch.float32 and (ours - theirs).abs().max().item() <= 1e-6
        top, left = M.crop_offset(config, 5, 7)
        window = ours.reshape(n, n, -1)[top: top + 5, left: left + 7].reshape(1, 35, -1)
        assert torch.equal(M.cropped_pos_embed(config, 5, 7), window)


def test_the_position_table_survives_a_bf16_model():
    """model.to(bfloat16) leaves the positions float32 (they are no buffer) and the bf16 forward stays near fp32."""
    config = TINY["sd35_large"]
    ours = randomized(SD3(config), 1)
    z, txt, pooled, sigma = inputs(config, 6, 6)
    kwargs = dict(img=pack_latents(z), txt=txt, pooled=pooled, timesteps=sigma, h=6, w=6)
    with torch.no_grad():
        full = ours(**kwargs)
        ours.to(torch.bfloat16).compute_dtype = torch.bfloat16
        half = ours(**kwargs)
    assert not list(ours.buffers()) and half.dtype == torch.bfloat16
    assert (half.float() - full).abs().max() <= 0.05 * full.abs().max()


RELEASED = {"SD3-Medium": (SD3_MEDIUM, 2_028_328_000), "SD3.5-Medium": (SD35_MEDIUM, 2_243_171_520),
            "SD3.5-Large": (SD35_LARGE, 8_056_627_520)}


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_released_configs_on_meta(name):
    """Parameters, ours = diffusers' at the released config: SD3-Medium 2.028 B, SD3.5-Medium 2.243 B, SD3.5-Large
    8.057 B; with diffusers' position buffer (N^2 x width: 56.6 M, 226.5 M, 89.7 M) 2.085 B, 2.470 B and 8.146 B, the
    released "2 B / 2.5 B / 8.1 B"."""
    config, count = RELEASED[name]
    with torch.device("meta"):
        ours = SD3(config)
        ref = SD3Transformer2DModel(**{k: v for k, v in diffusers_config(config).items() if not k.startswith("_")})
    n = sum(p.numel() for p in ours.parameters())
    table = config.pos_embed_max_size ** 2 * config.hidden_size
    print(f"{name}: {n:,} parameters, {n + table:,} with the position table")
    assert n == count == sum(p.numel() for p in ref.parameters())
    assert table == sum(b.numel() for b in ref.buffers())
    assert len(ours.swappable_blocks()) == config.depth and config.num_heads == config.depth


def test_gradient_checkpointing_gives_the_plain_gradients():
    config = TINY["sd35_medium"]
    ours = randomized(SD3(config), 2).train()
    z, txt, pooled, sigma = inputs(config, 4, 6)
    plain, checkpointed = checkpointing_gradients(ours, dict(img=pack_latents(z), txt=txt, pooled=pooled,
                                                             timesteps=sigma, h=4, w=6))
    unused = {"joint_blocks.2.context_block.attn.ln_q.weight"}  # the pre-only text stream's queries are never read
    assert plain.keys() == checkpointed.keys() and all((g.abs().max() > 0) != (k in unused) for k, g in plain.items())
    diff = max((plain[k] - checkpointed[k]).abs().max().item() for k in plain)
    print(f"checkpointing: max gradient diff {diff:.2e}")
    assert diff <= 1e-6


# ----------------------------------------------------------------------------------------------
# Files


def test_every_layout_loads_the_same_weights(tmp_path):
    """SAI's single file (as the tiny writer makes it: bf16, prefixed, no metadata), the same bare and under
    ComfyUI's "diffusion_model.", an all-in-one file with text_encoders.* / first_stage_model.* beside it, and a
    diffusers folder: the same config (from the shapes / config.json) and the same tensors."""
    path = write_sd3(str(tmp_path), seed=0)["sd3"]
    want = load_sd3(path)
    assert want.config == tiny_config() and want.config.dual_attention_layers == (0,)
    sd = {k: v.to(torch.bfloat16) for k, v in want.state_dict().items()}
    file = load_file(path)
    layouts = {"bare": tmp_path / "bare.safetensors", "comfy": tmp_path / "comfy.safetensors",
               "aio": tmp_path / "aio.safetensors", "diffusers": tmp_path / "transformer"}
    save_sd3_single_file(sd, str(layouts["bare"]), want.config, prefix="")
    save_sd3_single_file(sd, str(layouts["comfy"]), want.config, prefix="diffusion_model.", write_config=False)
    with pytest.raises(ValueError, match="without 'pos_embed' needs its SD3Config"):
        save_sd3_single_file(sd, str(tmp_path / "unsized.safetensors"))
    save_file({**file, "text_encoders.clip_l.transformer.text_model.final_layer_norm.weight": torch.ones(8),
               "first_stage_model.decoder.conv_in.weight": torch.ones(4, 16, 3, 3)}, str(layouts["aio"]))
    save_sd3_diffusers(sd, want.config, str(layouts["diffusers"]))
    for name, where in layouts.items():
        got = load_sd3(str(where))
        assert got.config == want.config, name
        assert all(torch.equal(got.state_dict()[k], v) for k, v in want.state_dict().items()), name
    meta = load_sd3(path, torch.bfloat16, read_weights=False)
    assert meta.compute_dtype == torch.bfloat16 and next(meta.parameters()).device.type == "meta"


def test_the_diffusers_folder_is_what_diffusers_loads(tmp_path):
    """Our diffusers folder loads in SD3Transformer2DModel.from_pretrained with no key left over, and the module map
    names a row range of its modules for every Linear but the two adaLNs diffusers stores swapped."""
    config = TINY["sd35_medium"]
    ours = randomized(SD3(config), 3)
    save_sd3_diffusers(ours, None, str(tmp_path / "transformer"))
    ref = SD3Transformer2DModel.from_pretrained(str(tmp_path / "transformer"))
    z, txt, pooled, sigma = inputs(config, 4, 4)
    ref.pos_embed.proj.register_forward_hook(patch_as_linear)
    with torch.no_grad():
        got = unpack_latents(ours(img=pack_latents(z), txt=txt, pooled=pooled, timesteps=sigma, h=4, w=4), 8, 8)
        assert (got - ref(z, txt, pooled, sigma * 1000, return_dict=False)[0]).abs().max() <= 1e-5
    shapes = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    mapped = module_map(shapes, shapes.__getitem__)
    linears = {n for n, m in ours.named_modules() if isinstance(m, torch.nn.Linear)}
    swapped = {"final_layer.adaLN_modulation.1", "joint_blocks.2.context_block.adaLN_modulation.1"}
    assert set(mapped) == linears - swapped
    assert mapped["joint_blocks.0.x_block.attn2.qkv"] == [("transformer_blocks.0.attn2.to_q", 0, 128),
                                                          ("transformer_blocks.0.attn2.to_k", 128, 256),
                                                          ("transformer_blocks.0.attn2.to_v", 256, 384)]


def test_other_families_files_are_refused_in_one_line(tmp_path):
    """A FLUX.1 single file and a FLUX.1 diffusers folder: one CheckpointError each, saying what was expected."""
    flux = tmp_path / "flux1.safetensors"
    save_file({"double_blocks.0.img_attn.qkv.weight": torch.zeros(6, 2), "img_in.weight": torch.zeros(2, 64)},
              str(flux))
    with pytest.raises(CheckpointError, match=r"not an SD3 / SD3.5 MMDiT transformer \(no key "
                                              r"'joint_blocks.0.context_block.attn.qkv.weight'") as e:
        load_sd3(str(flux))
    assert "\n" not in str(e.value)
    folder = tmp_path / "flux_diffusers"
    folder.mkdir()
    (folder / "config.json").write_text('{"_class_name": "FluxTransformer2DModel"}')
    save_file({"x_embedder.weight": torch.zeros(2, 64)}, str(folder / "diffusion_pytorch_model.safetensors"))
    with pytest.raises(CheckpointError, match="_class_name is 'FluxTransformer2DModel', expected 'SD3Transformer2D"):
        load_sd3(str(folder))


def test_a_file_whose_position_table_differs_keeps_its_own(tmp_path):
    """The loader compares the file's pos_embed with the computed table: ours where they agree to bf16 rounding; a file
    holding another grid (here diffusers' own init grid, position i * 64 / N) runs its own table, as the references do,
    with one warning naming the grid it found; the model's output is then the file's positions'."""
    path = write_sd3(str(tmp_path), seed=0)["sd3"]
    file = load_file(path)
    config = tiny_config()
    n = config.pos_embed_max_size
    grid = torch.arange(n, dtype=torch.float64) * 64 / n
    axis = M.sincos_1d(grid, config.hidden_size // 2)
    table = torch.cat((axis[None].expand(n, n, -1), axis[:, None].expand(n, n, -1)), dim=-1).reshape(1, n * n, -1)
    other = tmp_path / "other.safetensors"
    save_file({**file, "model.diffusion_model.pos_embed": table.to(torch.bfloat16)}, str(other))
    assert load_sd3(path).stored_pos_embed is None
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("library.models.sd3.checkpoint")
    logger.addHandler(handler)
    try:
        model = load_sd3(str(other))
    finally:
        logger.removeHandler(handler)
    # (bf16 reads the last column as 61.79: the lowest frequency's sin rounded)
    assert re.search(r"key 'model.diffusion_model.pos_embed' is not the position table .*its columns run from "
                     r"position 0 to 6[12].*, ours from 4 to 11.75", records[0].getMessage())
    assert torch.equal(model.stored_pos_embed, table[0].to(torch.bfloat16))
    h, w = 5, 7
    top, left = M.crop_offset(config, h, w)
    window = table[0].to(torch.bfloat16).float().view(n, n, -1)[top: top + h, left: left + w].reshape(1, h * w, -1)
    assert torch.equal(M.cropped_pos_embed(config, h, w, table=model.stored_pos_embed), window)
    g = torch.Generator().manual_seed(0)
    inputs = dict(img=torch.randn(1, h * w, 64, generator=g), txt=torch.randn(1, 3, config.context_dim, generator=g),
                  pooled=torch.randn(1, config.pooled_dim, generator=g), timesteps=torch.tensor([0.5]), h=h, w=w)
    with torch.no_grad():
        assert (model(**inputs) - load_sd3(path)(**inputs)).abs().max() > 1e-3  # the file's positions are used
