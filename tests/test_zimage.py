"""Z-Image transformer and prompt encoding: parity with diffusers' ZImageTransformer2DModel and
ZImagePipeline.encode_prompt, released sizes on `meta`, both checkpoint layouts, the one-line error."""

import os

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
from diffusers.loaders.single_file_utils import convert_z_image_transformer_checkpoint_to_diffusers
from safetensors.torch import load_file, save_file

import library.models.zimage.model as zimage_model
from library.io import CheckpointError
from library.models.latents import pack_latents, unpack_latents
from library.models.zimage.checkpoint import (
    diffusers_config,
    from_single_file_state_dict,
    load_zimage,
    save_zimage_single_file,
    to_single_file_state_dict,
)
from library.models.zimage.model import ZIMAGE_CONFIGS, ZImage
from library.models.zimage.text_encoder import ZImageTextEncoder, load_zimage_text_encoder
from library.models.zimage.tiny import tiny_config, write_zimage, write_zimage_text_encoder

C = 16  # latent channels


def tiny_diffusers() -> ZImageTransformer2DModel:
    config = {k: v for k, v in diffusers_config(tiny_config()).items() if not k.startswith("_")}
    return randomize(ZImageTransformer2DModel(**config))


def randomize(model: torch.nn.Module) -> torch.nn.Module:
    """Every parameter random: norms around 1, the rest (pad tokens, biases included) N(0, 0.1)."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g) if "norm" in name else 0.1 * torch.randn(p.shape, generator=g))
    return model.eval()


def inputs(h: int, w: int, lengths: tuple[int, ...]):
    """Latents [B, 16, 2h, 2w], ragged caption features (as the pipeline's list and as tensor + mask), sigmas."""
    g = torch.Generator().manual_seed(2)
    b, t = len(lengths), max(lengths)
    latents = torch.randn(b, C, 2 * h, 2 * w, generator=g)
    txt = torch.randn(b, t, tiny_config().cap_feat_dim, generator=g)
    mask = torch.arange(t)[None] < torch.tensor(lengths)[:, None]
    return latents, txt * mask[..., None], mask, torch.rand(b, generator=g)


def diffusers_velocity(model, latents, txt, mask, sigmas) -> torch.Tensor:
    # As ZImagePipeline calls it: one [C, 1, H, W] latent and one [n_i, D] caption per prompt, the
    # timestep (1000 - 1000 sigma) / 1000 = 1 - sigma, and the output negated.
    with torch.no_grad():
        out = model([z[:, None] for z in latents], 1 - sigmas, [t[m] for t, m in zip(txt, mask)], return_dict=False)[0]
    return -torch.stack(out).squeeze(2)


def ours_velocity(model, latents, txt, mask, sigmas) -> torch.Tensor:
    h, w = latents.shape[2] // 2, latents.shape[3] // 2
    with torch.no_grad():
        return unpack_latents(model(pack_latents(latents), txt, sigmas, h, w, txt_mask=mask), 2 * h, 2 * w)


def loaded_pair():
    reference = tiny_diffusers()
    model = ZImage(tiny_config()).eval()
    model.load_state_dict(reference.state_dict(), strict=True)  # diffusers' names are ours
    return reference, model


# (h, w) in 2x2 patches and caption lengths: non-square with ragged captions padded to 32 and 64 (masked
# batch); square with both captions padded to 32 (no mask); 32 patches exactly (no image pad) with a
# 33-token caption; an odd grid.
CASES = [((6, 8), (7, 40)), ((8, 8), (5, 9)), ((4, 8), (33,)), ((5, 7), (12, 3))]


@pytest.mark.parametrize("grid,lengths", CASES)
def test_zimage_matches_diffusers_fp32(grid, lengths):
    reference, model = loaded_pair()
    x = inputs(*grid, lengths)
    expected, out = diffusers_velocity(reference, *x), ours_velocity(model, *x)
    assert out.shape == expected.shape and out.dtype == torch.float32
    assert expected.abs().mean() > 0.1  # a real signal
    diff = (out - expected).abs().max().item()
    print(f"Z-Image {grid} captions {lengths}: max abs diff {diff:.2e}")
    # Measured 2.6e-6 to 3.8e-6 (outputs ~0.9): all from the RoPE tables, see the next test.
    assert diff <= 1e-5


def test_zimage_is_bitwise_diffusers_with_its_rope_rounding(monkeypatch):
    """The only difference is RoPE: diffusers rounds each angle to float32 before cos/sin (complex64
    polar), our core takes cos/sin of the float64 angle. With its rounding our output is identical."""

    def rounded_tables(positions, axes_dims, theta):
        cos, sin = [], []
        for i, dim in enumerate(axes_dims):
            freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
            angles = (positions[..., i : i + 1].double() * freqs).float()
            rotation = torch.polar(torch.ones_like(angles), angles)  # complex64, as diffusers' RopeEmbedder
            cos.append(rotation.real)
            sin.append(rotation.imag)
        return torch.cat(cos, -1), torch.cat(sin, -1)

    monkeypatch.setattr(zimage_model, "rope_tables", rounded_tables)
    reference, model = loaded_pair()
    x = inputs(6, 8, (7, 40))
    assert torch.equal(ours_velocity(model, *x), diffusers_velocity(reference, *x))


def test_released_parameter_count_on_meta():
    with torch.device("meta"):
        ours = ZImage(ZIMAGE_CONFIGS["turbo"])
        theirs = ZImageTransformer2DModel(**{k: v for k, v in diffusers_config(ZIMAGE_CONFIGS["turbo"]).items()
                                             if not k.startswith("_")})
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in theirs.parameters()) == 6_154_908_736
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    assert ZIMAGE_CONFIGS["base"] == ZIMAGE_CONFIGS["turbo"]  # the two releases share one transformer config


def test_single_file_names_are_what_diffusers_converter_reads():
    """Our single-file state dict through diffusers' own converter gives our names and the same tensors."""
    sd = {k: v.clone() for k, v in randomize(ZImage(tiny_config())).state_dict().items()}
    single = to_single_file_state_dict(sd)
    assert "layers.0.attention.qkv.weight" in single and "x_embedder.weight" in single
    theirs = convert_z_image_transformer_checkpoint_to_diffusers({"model.diffusion_model." + k: v for k, v in single.items()})
    assert theirs.keys() == sd.keys() and all(torch.equal(theirs[k], sd[k]) for k in sd)
    back = from_single_file_state_dict(single)
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("zimage_tiny"))
    return {**write_zimage(out, 0), **write_zimage_text_encoder(out, 0)}


def test_both_layouts_load_identical_weights(tiny_files, tmp_path):
    folder = load_zimage(tiny_files["zimage_diffusers"])
    single = load_zimage(tiny_files["zimage"])
    a, b = folder.state_dict(), single.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert folder.config == single.config == tiny_config()
    # The pipeline folder (transformer/ inside) and a ComfyUI-prefixed file without config metadata.
    assert load_zimage(os.path.dirname(tiny_files["zimage_diffusers"])).config == tiny_config()
    comfy = str(tmp_path / "comfy.safetensors")
    save_file({"model.diffusion_model." + k: v for k, v in load_file(tiny_files["zimage"]).items()}, comfy)
    prefixed = load_zimage(comfy, dtype=torch.bfloat16)
    assert prefixed.config == tiny_config() and prefixed.compute_dtype == torch.bfloat16
    assert all(torch.equal(prefixed.state_dict()[k], a[k].to(torch.bfloat16)) for k in a)
    # diffusers reads our folder too, and computes what we compute.
    reference = ZImageTransformer2DModel.from_pretrained(tiny_files["zimage_diffusers"]).eval()
    x = inputs(3, 4, (6, 35))
    assert (ours_velocity(folder, *x) - diffusers_velocity(reference, *x)).abs().max() <= 1e-5


def test_meta_load_reads_no_weights(tiny_files):
    model = load_zimage(tiny_files["zimage"], dtype=torch.bfloat16, read_weights=False)
    assert model.config == tiny_config()
    assert all(p.is_meta and p.dtype == torch.bfloat16 for p in model.parameters())


def test_wrong_file_is_one_error_naming_it(tiny_files, tmp_path):
    other = str(tmp_path / "other.safetensors")
    save_file({"double_blocks.0.img_attn.qkv.weight": torch.zeros(6, 2)}, other)
    with pytest.raises(CheckpointError, match=r"other\.safetensors: not a Z-Image transformer .*layers\.0\.adaLN_modulation"):
        load_zimage(other)
    wrong = str(tmp_path / "wrong.safetensors")
    sd = load_file(tiny_files["zimage"])
    sd["layers.1.feed_forward.w2.weight"] = torch.zeros(3, 3)
    save_file(sd, wrong, metadata={})
    with pytest.raises(CheckpointError, match=r"wrong\.safetensors: key 'layers\.1\.feed_forward\.w2\.weight' has shape"):
        load_zimage(wrong)


def test_fp8_prepare_hook_quantizes_while_loading(tiny_files):
    from library.models.family import fp8_prepare
    from library.precision.fp8 import FP8Linear

    model = load_zimage(tiny_files["zimage"], dtype=torch.bfloat16, prepare=fp8_prepare("fp8_scaled", "zimage"))
    assert isinstance(model.layers[0].attention.to_k, FP8Linear)  # a part of the fused qkv
    assert isinstance(model.layers[0].adaLN_modulation[0], FP8Linear)  # per-block modulation: quantized
    assert type(model.cap_embedder[1]) is torch.nn.Linear and type(model.t_embedder.mlp[0]) is torch.nn.Linear
    reference = load_zimage(tiny_files["zimage"])
    x = inputs(3, 4, (6,))
    want = ours_velocity(reference, *x)
    got = ours_velocity(model, *x).float()
    assert ((got - want).norm() / want.norm()).item() < 0.1


def test_gradient_checkpointing_and_swappable_blocks():
    _, model = loaded_pair()
    assert len(model.swappable_blocks()) == 2 + 2 + 2 and model.swappable_blocks()[0] is model.noise_refiner[0]
    latents, txt, mask, sigmas = inputs(3, 4, (5, 40))
    grads = []
    for ckpt in (False, True):
        model.zero_grad()
        model.gradient_checkpointing = ckpt
        model(pack_latents(latents), txt, sigmas, 3, 4, txt_mask=mask).square().mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert torch.equal(grads[0], grads[1]) and grads[0].abs().max() > 0


def test_encode_prompt_matches_pipeline(tiny_files):
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    text_encoder = Qwen3ForCausalLM.from_pretrained(tiny_files["zimage_text_encoder"]).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_files["zimage_tokenizer"])
    pipe = ZImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=None, text_encoder=text_encoder,
                          tokenizer=tokenizer, transformer=None)
    prompts = ["a photo of a cat sitting on a red chair", "a dog"]
    with torch.no_grad():
        expected, _ = pipe.encode_prompt(list(prompts), device="cpu", do_classifier_free_guidance=False)
    ours = load_zimage_text_encoder(os.path.dirname(tiny_files["zimage_text_encoder"]))
    assert len(ours.llm.model.layers) == 3  # hidden_states[-2] of 4 layers: layer 3's output, the 4th never loaded
    got = ours.encode_list(prompts)
    embeds, mask = ours.encode(prompts)
    assert [e.shape for e in got] == [e.shape for e in expected] and expected[0].shape[0] > expected[1].shape[0]
    assert embeds.shape == (2, expected[0].shape[0], 32) and mask.sum(1).tolist() == [len(e) for e in expected]
    diffs = [(g - e).abs().max().item() for g, e in zip(got, expected)]
    print(f"Z-Image encode_prompt: max abs diff {max(diffs):.2e}")
    assert max(diffs) <= 1e-5
    assert isinstance(ours, ZImageTextEncoder) and embeds.dtype == torch.float32


def test_encode_runs_only_the_longest_prompts_real_tokens(tiny_files):
    """The pipeline runs all 512 padded positions and drops the pads' outputs; we run the longest
    prompt's real tokens only (the pads cannot reach a real token): same values, ~17x less work."""
    ours = load_zimage_text_encoder(os.path.dirname(tiny_files["zimage_text_encoder"]))
    prompts = ["a photo of a cat sitting on a red chair", "a dog"]
    seen = []
    hook = ours.llm.model.embed_tokens.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[1]))
    embeds, mask = ours.encode(prompts)
    hook.remove()
    assert seen == [int(mask.sum(1).max())] == [embeds.shape[1]] and seen[0] < ours.max_length
    tokens = ours.tokenize(prompts)  # the padded run, as the pipeline makes it
    full_mask = tokens.attention_mask.bool()
    (full,) = ours.llm.selected_hidden_states(tokens.input_ids, full_mask, (ours.layer,),
                                              position_ids=torch.arange(ours.max_length))
    full = full[:, : embeds.shape[1]].float() * mask[..., None]
    assert (embeds - full).abs().max() <= 1e-6


def test_forward_without_mask_runs_on_meta_and_equals_a_full_mask():
    _, model = loaded_pair()
    latents, txt, _, sigmas = inputs(3, 4, (9, 9))
    full = torch.ones(2, 9, dtype=torch.bool)
    assert torch.equal(ours_velocity(model, latents, txt, None, sigmas), ours_velocity(model, latents, txt, full, sigmas))
    with torch.device("meta"):
        meta = ZImage(tiny_config())
        out = meta(torch.empty(2, 12, 64), torch.empty(2, 9, 32), torch.empty(2), 3, 4)
    assert out.shape == (2, 12, 64) and out.is_meta


def test_block_swap_runs_every_block_in_order_and_keeps_the_output():
    from library.models.block_swap import enable_block_swap

    _, model = loaded_pair()
    x = inputs(3, 4, (5, 40))
    want = ours_velocity(model, *x)
    model.requires_grad_(False)
    swap = enable_block_swap(model, 5, "cpu")  # all but the first noise-refiner block
    assert torch.equal(ours_velocity(model, *x), want)
    assert [i for op, i in swap.log if op == "load"] == [1, 2, 3, 4, 5]


def test_bf16_compute_stays_close_to_fp32(tiny_files):
    x = inputs(3, 4, (6, 35))
    want = ours_velocity(load_zimage(tiny_files["zimage"]), *x)
    got = ours_velocity(load_zimage(tiny_files["zimage"], dtype=torch.bfloat16), *x)
    assert got.dtype == torch.bfloat16
    assert ((got.float() - want).norm() / want.norm()).item() < 0.02


def test_sigma_in_velocity_out_is_what_the_pipeline_samples_with():
    """ZImagePipeline (Turbo's scheduler: static shift 3, no CFG) against a plain Euler loop over our
    forward: the pipeline's (1000 - timestep) / 1000 and its negated output are our sigma and velocity."""
    reference, model = loaded_pair()
    pipe = ZImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=None, text_encoder=None,
                          tokenizer=None, transformer=reference)
    _, txt, mask, _ = inputs(3, 4, (7, 40))
    g = torch.Generator().manual_seed(3)
    noise = torch.randn(2, C, 6, 8, generator=g)
    prompt_embeds = [t[m] for t, m in zip(txt, mask)]
    latents = pipe(prompt_embeds=prompt_embeds, height=48, width=64, num_inference_steps=3, guidance_scale=0.0,
                   latents=noise.clone(), output_type="latent", return_dict=False)[0]
    sigmas = pipe.scheduler.sigmas  # linspace(1, 1/3, 3) shifted by 3, then 0
    x = pack_latents(noise)
    with torch.no_grad():
        for s, s_next in zip(sigmas[:-1], sigmas[1:]):
            x = x + (s_next - s) * model(x, txt, s.expand(2), 3, 4, txt_mask=mask)
    diff = (unpack_latents(x, 6, 8) - latents).abs().max().item()
    print(f"Z-Image 3 Euler steps vs ZImagePipeline: max abs diff {diff:.2e}")
    # Measured 5.7e-5 (latents ~1.1): the pipeline's t = (1000 - 1000 sigma) / 1000 is 1 - sigma to within
    # 3e-8 in float32 (up to 3e-5 rad in the 1000 t embedding), and these random weights amplify it.
    assert diff <= 2e-4
