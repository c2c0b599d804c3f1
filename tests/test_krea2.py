"""Krea 2 transformer: parity with diffusers' Krea2Transformer2DModel, the released size on `meta`,
both checkpoint layouts (the released single file and diffusers folders), the one-line errors."""

import os

import pytest
import torch
from diffusers import Krea2Transformer2DModel
from diffusers.loaders.single_file_utils import convert_krea2_transformer_checkpoint_to_diffusers
from safetensors.torch import load_file, save_file

from library.io import CheckpointError
from library.models.krea2.checkpoint import diffusers_config, load_krea2, to_diffusers_state_dict
from library.models.krea2.model import KREA2_CONFIGS, Krea2, joint_positions
from library.models.krea2.tiny import random_krea2, tiny_config, write_krea2
from library.models.latents import pack_latents, unpack_latents

C = 16  # latent channels


def randomize(model: torch.nn.Module) -> torch.nn.Module:
    """Every parameter random, the zero-centred norm scales and modulation tables included."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.2 * torch.randn(p.shape, generator=g))
    return model.eval()


def loaded_pair():
    """(diffusers' model, ours) with the same random weights, ours through our diffusers name map."""
    config = {k: v for k, v in diffusers_config(tiny_config()).items() if not k.startswith("_")}
    reference = randomize(Krea2Transformer2DModel(**config))
    model = Krea2(tiny_config()).eval()
    theirs = reference.state_dict()
    ours = {k: theirs[d].reshape(v.shape) for k, d, v in
            ((k, d, v) for (k, v), d in zip(model.state_dict().items(), to_diffusers_state_dict(model.state_dict())))}
    model.load_state_dict(ours, strict=True)
    return reference, model


def inputs(h: int, w: int, lengths: tuple[int, ...]):
    """Latents [B, 16, 2h, 2w], tapped text states [B, T, 3, 32] with a mask (real tokens first), sigmas."""
    g = torch.Generator().manual_seed(2)
    b, t = len(lengths), max(lengths)
    latents = torch.randn(b, C, 2 * h, 2 * w, generator=g)
    txt = torch.randn(b, t, 3, 32, generator=g)
    mask = torch.arange(t)[None] < torch.tensor(lengths)[:, None]
    return latents, txt, mask, torch.rand(b, generator=g)


def diffusers_velocity(model, latents, txt, mask, sigmas) -> torch.Tensor:
    # As Krea2Pipeline calls it: packed latents, timestep = sigma, position ids of [text, image], the mask.
    h, w = latents.shape[2] // 2, latents.shape[3] // 2
    positions = joint_positions(txt.shape[1], h, w).float()
    with torch.no_grad():
        out = model(pack_latents(latents), txt, sigmas, positions, encoder_attention_mask=mask, return_dict=False)[0]
    return unpack_latents(out, 2 * h, 2 * w)


def ours_velocity(model, latents, txt, mask, sigmas) -> torch.Tensor:
    h, w = latents.shape[2] // 2, latents.shape[3] // 2
    with torch.no_grad():
        return unpack_latents(model(pack_latents(latents), txt, sigmas, h, w, txt_mask=mask), 2 * h, 2 * w)


# (h, w) in 2x2 patches and caption lengths: non-square with ragged captions (masked batch), square
# with equal captions (no mask), an odd grid with one caption.
CASES = [((3, 5), (7, 4)), ((4, 4), (6, 6)), ((5, 7), (9,))]


@pytest.mark.parametrize("grid,lengths", CASES)
def test_krea2_matches_diffusers_fp32(grid, lengths):
    reference, model = loaded_pair()
    x = inputs(*grid, lengths)
    expected, out = diffusers_velocity(reference, *x), ours_velocity(model, *x)
    assert out.shape == expected.shape and out.dtype == torch.float32
    assert expected.abs().mean() > 0.1  # a real signal
    diff = (out - expected).abs().max().item()
    print(f"Krea 2 {grid} captions {lengths}: max abs diff {diff:.2e}")
    assert diff == 0.0  # measured: the same float32 operations in the same order


def test_padded_tokens_count_for_nothing():
    """Krea2Pipeline pads every prompt in the middle of its template and masks the pads; we cache and
    pass only the real tokens. The masked 7-token row and its 4 real tokens alone give the same output."""
    _, model = loaded_pair()
    latents, txt, mask, sigmas = inputs(3, 5, (7, 4))
    padded = ours_velocity(model, latents, txt, mask, sigmas)[1:]
    alone = ours_velocity(model, latents[1:], txt[1:, :4], None, sigmas[1:])
    assert (padded - alone).abs().max() <= 1e-5 * padded.abs().max()


def test_released_parameter_count_on_meta():
    with torch.device("meta"):
        ours = Krea2(KREA2_CONFIGS["raw"])
        theirs = Krea2Transformer2DModel()  # diffusers' defaults are the released config
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in theirs.parameters()) == 12_820_073_036
    assert set(to_diffusers_state_dict(ours.state_dict())) == set(theirs.state_dict())
    assert KREA2_CONFIGS["turbo"] == KREA2_CONFIGS["raw"]  # one transformer config, two sets of weights
    assert len(ours.swappable_blocks()) == 2 + 2 + 28


def test_single_file_names_are_what_diffusers_converter_reads():
    """Our state dict (the released single-file names) through diffusers' own converter gives the
    diffusers names and tensors our map gives."""
    sd = random_krea2(tiny_config()).state_dict()
    theirs = convert_krea2_transformer_checkpoint_to_diffusers({"model.diffusion_model." + k: v.clone() for k, v in sd.items()})
    ours = to_diffusers_state_dict(sd)
    assert theirs.keys() == ours.keys() and all(torch.equal(theirs[k], ours[k]) for k in ours)


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    return write_krea2(str(tmp_path_factory.mktemp("krea2_tiny")), 0)


def test_both_layouts_load_identical_weights(tiny_files, tmp_path):
    single = load_krea2(tiny_files["krea2"])
    folder = load_krea2(tiny_files["krea2_diffusers"])
    a, b = single.state_dict(), folder.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert single.config == folder.config == tiny_config()
    assert load_krea2(os.path.dirname(tiny_files["krea2_diffusers"])).config == tiny_config()  # the pipeline folder
    # A ComfyUI-prefixed file without our config metadata: the config from its shapes.
    comfy = str(tmp_path / "comfy.safetensors")
    save_file({"model.diffusion_model." + k: v for k, v in load_file(tiny_files["krea2"]).items()}, comfy)
    prefixed = load_krea2(comfy, dtype=torch.bfloat16)
    assert prefixed.config == tiny_config() and prefixed.compute_dtype == torch.bfloat16
    assert all(torch.equal(prefixed.state_dict()[k], a[k].to(torch.bfloat16)) for k in a)
    # diffusers reads our folder too, and computes what we compute.
    reference = Krea2Transformer2DModel.from_pretrained(tiny_files["krea2_diffusers"]).eval()
    x = inputs(3, 4, (6, 3))
    assert (ours_velocity(single, *x) - diffusers_velocity(reference, *x)).abs().max() == 0.0


def test_meta_load_reads_no_weights(tiny_files):
    model = load_krea2(tiny_files["krea2"], dtype=torch.bfloat16, read_weights=False)
    assert model.config == tiny_config()
    assert all(p.is_meta and p.dtype == torch.bfloat16 for p in model.parameters())


def test_wrong_file_is_one_error_naming_it(tiny_files, tmp_path):
    other = str(tmp_path / "other.safetensors")
    save_file({"double_blocks.0.img_attn.qkv.weight": torch.zeros(6, 2)}, other)
    with pytest.raises(CheckpointError, match=r"other\.safetensors: not a Krea 2 transformer .*txtfusion\.projector"):
        load_krea2(other)
    wrong = str(tmp_path / "wrong.safetensors")
    sd = load_file(tiny_files["krea2"])
    sd["blocks.1.mlp.down.weight"] = torch.zeros(3, 3)
    save_file(sd, wrong, metadata={})
    with pytest.raises(CheckpointError, match=r"wrong\.safetensors: key 'blocks\.1\.mlp\.down\.weight' has shape"):
        load_krea2(wrong)


@pytest.mark.parametrize("mode, scale", [("fp8_tensor_scaled", "scale_weight"), ("fp8_scaled", "weight_scale")])
def test_a_pre_quantized_file_is_refused_as_such_not_for_its_scale_keys(tiny_files, tmp_path, mode, scale):
    """The key check ran first and named the first stored scale an unexpected key."""
    from library.precision.fp8 import FP8_DTYPE, quantize_weight

    sd = load_file(tiny_files["krea2"])
    q, s = quantize_weight(sd["blocks.0.attn.gate.weight"].float(), mode)
    sd.update({"blocks.0.attn.gate.weight": q, f"blocks.0.attn.gate.{scale}": s})
    if mode == "fp8_tensor_scaled":
        sd["scaled_fp8"] = torch.zeros(2, dtype=FP8_DTYPE)  # ComfyUI's marker
    save_file(sd, tmp_path / "fp8.safetensors")
    with pytest.raises(CheckpointError, match=rf"fp8\.safetensors: a pre-quantized \({mode}\) Krea 2 file is not read yet"):
        load_krea2(str(tmp_path / "fp8.safetensors"))


def test_fp8_prepare_hook_quantizes_the_blocks_only(tiny_files):
    from library.models.family import fp8_prepare
    from library.precision.fp8 import FP8Linear

    model = load_krea2(tiny_files["krea2"], dtype=torch.bfloat16, prepare=fp8_prepare("fp8_scaled", "krea2"))
    assert isinstance(model.blocks[0].attn.wk, FP8Linear) and isinstance(model.blocks[1].mlp.down, FP8Linear)
    kept = (model.first, model.tmlp[0], model.tproj[1], model.txtmlp[1], model.last.linear,
            model.txtfusion.projector, model.txtfusion.layerwise_blocks[0].attn.wq)
    assert all(type(m) is torch.nn.Linear for m in kept)
    reference = load_krea2(tiny_files["krea2"])
    x = inputs(3, 4, (6,))
    want, got = ours_velocity(reference, *x), ours_velocity(model, *x).float()
    assert ((got - want).norm() / want.norm()).item() < 0.1


def test_gradient_checkpointing_block_swap_and_meta():
    from library.models.block_swap import enable_block_swap

    _, model = loaded_pair()
    latents, txt, mask, sigmas = inputs(3, 4, (5, 3))
    grads = []
    for ckpt in (False, True):
        model.zero_grad()
        model.gradient_checkpointing = ckpt
        model(pack_latents(latents), txt, sigmas, 3, 4, txt_mask=mask).square().mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert torch.equal(grads[0], grads[1]) and grads[0].abs().max() > 0
    model.gradient_checkpointing = False
    want = ours_velocity(model, latents, txt, mask, sigmas)
    model.requires_grad_(False)
    swap = enable_block_swap(model, 5, "cpu")  # all but the first layerwise text block
    # Not bit-exact on every CPU: the swapped weights are new buffers, whose alignment can pick another GEMM
    # kernel (last-ulp differences seen on one machine); a wrong block order would be off by O(1).
    torch.testing.assert_close(ours_velocity(model, latents, txt, mask, sigmas), want, rtol=1e-5, atol=1e-5)
    assert [i for op, i in swap.log if op == "load"] == [1, 2, 3, 4, 5]
    with torch.device("meta"):
        out = Krea2(tiny_config())(torch.empty(2, 12, 64), torch.empty(2, 5, 3, 32), torch.empty(2), 3, 4)
    assert out.shape == (2, 12, 64) and out.is_meta
