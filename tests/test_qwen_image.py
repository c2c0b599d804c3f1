"""Qwen-Image transformer: parity with diffusers' QwenImageTransformer2DModel, loading, precision.

Tiny random models with the real architecture: 2 blocks, 2 heads x 32, RoPE axes (8, 12, 12),
joint_attention_dim 32; latents of 16 x 24 patches, 9 text tokens, sample 0 padded to 5.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from diffusers import QwenImageTransformer2DModel
from diffusers.models.transformers.transformer_qwenimage import get_timestep_embedding

from library.models import core
from library.io import CheckpointError, save_safetensors
from library.models.qwen_image.model import (
    QWEN_IMAGE,
    QwenImage,
    QwenImageConfig,
    image_positions,
    joint_positions,
    load_qwen_image,
    save_qwen_image_diffusers,
)
from library.models.registry import arch_spec

TINY = QwenImageConfig(
    num_layers=2, attention_head_dim=32, num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(8, 12, 12)
)
BATCH, H, W, TEXT, VALID = 2, 16, 24, 9, 5
IMG_SHAPES = [(1, H, W)] * BATCH


def randomize_(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Every parameter random, zero-initialised ones and norm weights included (norms around 1)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator)
            if "norm" in name and p.dim() == 1:
                p.copy_(1 + 0.2 * noise)
            elif p.dim() == 2:
                p.copy_(noise / p.shape[1] ** 0.5)
            else:
                p.copy_(0.1 * noise)


def random_model(config: QwenImageConfig, seed: int) -> QwenImage:
    model = QwenImage(config)
    randomize_(model, torch.Generator().manual_seed(seed))
    return model


def tiny_inferable_model() -> QwenImage:
    """Head dim 128, so the config (incl. RoPE axes) can be inferred from key shapes alone."""
    config = QwenImageConfig(num_layers=1, attention_head_dim=128, num_attention_heads=1, joint_attention_dim=32)
    return random_model(config, 3)


def tiny_rope_tables(img_shapes):
    with torch.device("meta"):
        model = QwenImage(TINY)
    return model.rope(img_shapes, TEXT, torch.device("cpu"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A random diffusers model saved as a pipeline folder (`<root>/transformer/`)."""
    model = QwenImageTransformer2DModel(**{k: v for k, v in TINY.to_diffusers().items() if not k.startswith("_")})
    randomize_(model, torch.Generator().manual_seed(1))
    root = tmp_path_factory.mktemp("pipeline")
    model.save_pretrained(root / "transformer")
    return model, root


@pytest.fixture(scope="module")
def inputs():
    g = torch.Generator().manual_seed(2)
    img = torch.randn(BATCH, H * W, 64, generator=g)
    txt = torch.randn(BATCH, TEXT, 32, generator=g)
    mask = torch.ones(BATCH, TEXT, dtype=torch.long)  # the pipeline's prompt_embeds_mask is 0/1 long
    mask[0, VALID:] = 0
    return img, txt, mask


def run_diffusers(model, img, txt, mask, sigma):
    # QwenImagePipeline: timestep=t/1000 with t = sigma*1000, img_shapes=[[(1, h, w)]] * batch
    with torch.no_grad():
        return model(hidden_states=img, encoder_hidden_states=txt, encoder_hidden_states_mask=mask,
                     timestep=sigma, img_shapes=[[s] for s in IMG_SHAPES], return_dict=False)[0]


def test_qwen_image_matches_diffusers_fp32(reference, inputs):
    ref, root = reference
    ours = load_qwen_image(str(root))
    assert ours.config == TINY and ours.compute_dtype == torch.float32
    img, txt, mask = inputs
    # Arbitrary sigmas: core.timestep_embedding(scale_first=False) takes diffusers' (sigma*f)*1000
    # order, so the sinusoids agree bit for bit and the whole model is compared at 1e-5.
    for sigma in (torch.tensor([0.5, 0.125]), torch.tensor([0.37, 0.81])):
        assert torch.equal(
            core.timestep_embedding(sigma, 256, scale_first=False), get_timestep_embedding(sigma, 256, True, 0, 1000)
        )
        expected = run_diffusers(ref, img, txt, mask, sigma)
        with torch.no_grad():
            got = ours(img, txt, mask.bool(), sigma, IMG_SHAPES)
        assert got.shape == (BATCH, H * W, 64)
        assert (got - expected).abs().max().item() <= 1e-5


# odd sizes centre asymmetrically; two images (edit pipelines) take frame ids 0 and 1
@pytest.mark.parametrize("images", [[(1, H, W)], [(1, 5, 7)], [(1, 4, 6), (1, 6, 4)]])
def test_rope_tables_match_diffusers_qwen_embed_rope(reference, images):
    ref, _ = reference
    vid, txt = ref.pos_embed([images], max_txt_seq_len=TEXT, device=torch.device("cpu"))
    expected = torch.cat([txt, vid])  # complex64 [T + L, 16], joint order [text, image]
    cos, sin = tiny_rope_tables([images])
    assert cos.dtype == torch.float32 and cos.shape == (1, TEXT + sum(f * h * w for f, h, w in images), 16)
    assert (cos[0] - expected.real).abs().max().item() <= 1e-6
    assert (sin[0] - expected.imag).abs().max().item() <= 1e-6


def test_image_token_count_must_match_img_shapes(inputs):
    img, txt, mask = inputs
    with pytest.raises(ValueError, match="give 352 image tokens, img has 384"):
        random_model(TINY, 5)(img, txt, mask, torch.tensor([0.5, 0.5]), [(1, H, W - 2)] * BATCH)


def test_text_padding_does_not_reach_image_tokens(reference, inputs):
    ours = load_qwen_image(str(reference[1]))
    img, txt, mask = inputs
    sigma = torch.tensor([0.5, 0.5])
    changed_padding, changed_text = txt.clone(), txt.clone()
    changed_padding[0, VALID:] += 10.0
    changed_text[0, : VALID] += 10.0
    with torch.no_grad():
        base = ours(img, txt, mask, sigma, IMG_SHAPES)
        assert (ours(img, changed_padding, mask, sigma, IMG_SHAPES) - base)[0].abs().max().item() <= 1e-6
        assert (ours(img, changed_text, mask, sigma, IMG_SHAPES) - base)[0].abs().max().item() >= 1e-2


def test_unpadded_text_runs_attention_without_a_mask(reference, inputs, monkeypatch):
    """An all-true text mask (batch 1, or captions of one length) is no mask: SDPA gets None, which
    keeps the flash kernel eligible on CUDA (a boolean mask forces the slower memory-efficient one),
    with the same output."""
    ours = load_qwen_image(str(reference[1]))
    img, txt, _ = inputs
    full = torch.ones(BATCH, TEXT, dtype=torch.bool)
    masks = []

    def spy(q, k, v, attn_mask=None, **kw):
        masks.append(attn_mask)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(core, "sdpa", spy)
    with torch.no_grad():
        unmasked = ours(img, txt, full, torch.tensor([0.5, 0.5]), IMG_SHAPES)
        assert masks and all(m is None for m in masks), "an all-true text mask reached SDPA"
        masks.clear()
        padded = full.clone()
        padded[0, VALID:] = False
        ours(img, txt, padded, torch.tensor([0.5, 0.5]), IMG_SHAPES)
        assert all(m is not None for m in masks)
    monkeypatch.undo()
    with torch.no_grad():
        assert torch.equal(unmasked, ours(img, txt, None, torch.tensor([0.5, 0.5]), IMG_SHAPES))


def test_centred_grid_borders_carry_largest_positions():
    ids = image_positions(1, H, W).reshape(H, W, 3)
    assert ids.dtype == torch.int64
    rows, cols = ids[..., 1], ids[..., 2]
    assert rows[:, 0].tolist() == list(range(-8, 8)) and cols[0].tolist() == list(range(-12, 12))
    assert ids[H // 2, W // 2].tolist() == [0, 0, 0]  # the centre patch
    # |position| is largest on the first row / first column, i.e. on the border.
    assert (rows.abs() == rows.abs().max()).nonzero()[:, 0].unique().tolist() == [0]
    assert (cols.abs() == cols.abs().max()).nonzero()[:, 1].unique().tolist() == [0]
    # Text ids start after the largest image id max(h//2, w//2) = 12, on all three axes.
    joint = joint_positions(IMG_SHAPES, TEXT)
    assert joint.dtype == torch.int64 and joint.shape == (BATCH, TEXT + H * W, 3)
    assert joint[0, :TEXT, 0].tolist() == list(range(12, 12 + TEXT))
    assert torch.equal(joint[0, :TEXT, 0], joint[0, :TEXT, 1]) and torch.equal(joint[0, :TEXT, 0], joint[0, :TEXT, 2])


def test_rope_tables_stay_float32_after_model_cast_to_bf16():
    with torch.device("meta"):
        model = QwenImage(TINY).to(torch.bfloat16)
    cos, sin = model.rope(IMG_SHAPES, TEXT, torch.device("cpu"))
    assert cos.dtype == sin.dtype == torch.float32
    reference_cos, _ = tiny_rope_tables(IMG_SHAPES)
    assert torch.equal(cos[0], reference_cos[0])


def test_bf16_run_close_to_fp32(reference, inputs):
    # Measured: 0.6% relative L2. sigma stays float32 in a bf16 model; diffusers casts the timestep
    # to the model dtype (0.37 -> 0.369, a whole step of 1000) and lands ~10% off at these sigmas.
    img, txt, mask = inputs
    sigma = torch.tensor([0.37, 0.81])
    fp32 = load_qwen_image(str(reference[1]))
    bf16 = load_qwen_image(str(reference[1]), dtype=torch.bfloat16)
    assert bf16.compute_dtype == torch.bfloat16 and bf16.img_in.weight.dtype == torch.bfloat16
    with torch.no_grad():
        expected = fp32(img, txt, mask, sigma, IMG_SHAPES)
        got = bf16(img, txt, mask, sigma, IMG_SHAPES)
    assert got.dtype == torch.bfloat16
    relative = (got.float() - expected).norm() / expected.norm()
    assert relative.item() <= 0.02


def test_gradient_checkpointing_gives_same_grads(reference, inputs):
    img, txt, mask = inputs
    sigma = torch.tensor([0.37, 0.81])
    model = load_qwen_image(str(reference[1]))
    calls = []
    # a pre-hook: non-reentrant recomputation stops early, before forward hooks would run
    model.transformer_blocks[0].register_forward_pre_hook(lambda *args: calls.append(1))

    def grads(checkpointing: bool) -> dict[str, torch.Tensor]:
        model.gradient_checkpointing = checkpointing
        model.zero_grad()
        model(img, txt, mask, sigma, IMG_SHAPES).square().mean().backward()
        # The last block's text output is unused, so its txt-only modules get no grad (as in diffusers).
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain = grads(False)
    assert len(calls) == 1
    checkpointed = grads(True)
    assert len(calls) == 3  # the block ran again during backward: checkpointing was active
    assert plain.keys() == checkpointed.keys() and len(plain) == len(list(model.parameters())) - 6
    assert max((plain[n] - checkpointed[n]).abs().max().item() for n in plain) <= 1e-6


def test_meta_param_count_and_names_match_diffusers():
    with torch.device("meta"):
        ours = QwenImage(QWEN_IMAGE)
        ref = QwenImageTransformer2DModel()
    assert sum(p.numel() for p in ours.parameters()) == 20_430_401_088
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in ref.state_dict().items()}


@pytest.mark.parametrize("prefix", ["", "model.diffusion_model.", "diffusion_model."])
def test_single_file_loads_with_prefix_and_inferred_config(tmp_path, prefix):
    model = tiny_inferable_model()
    path = str(tmp_path / "qwen_image.safetensors")
    save_safetensors({prefix + k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}, path)
    loaded = load_qwen_image(path, dtype=torch.float32)
    assert loaded.config == model.config
    assert loaded.txt_in.weight.dtype == torch.float32
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor.to(torch.bfloat16).float()), name


def test_shape_mismatch_names_key_and_shapes(tmp_path):
    model = tiny_inferable_model()
    state = model.state_dict()
    state["txt_in.weight"] = state["txt_in.weight"][:, :31]
    path = str(tmp_path / "bad.safetensors")
    save_safetensors(state, path)
    with pytest.raises(CheckpointError, match=r"key 'txt_in\.weight' has shape \(128, 31\), expected \(128, 32\)"):
        load_qwen_image(path, config=model.config)


def test_saved_diffusers_folder_loads_in_diffusers_and_back(tmp_path, inputs):
    model = random_model(TINY, 4)
    folder = str(tmp_path / "transformer")
    save_qwen_image_diffusers(model.state_dict(), TINY, folder)
    ref = QwenImageTransformer2DModel.from_pretrained(folder)
    again = load_qwen_image(folder)
    img, txt, mask = inputs
    sigma = torch.tensor([0.5, 0.125])
    with torch.no_grad():
        ours = model(img, txt, mask, sigma, IMG_SHAPES)
        assert torch.equal(again(img, txt, mask, sigma, IMG_SHAPES), ours)
    assert (run_diffusers(ref, img, txt, mask, sigma) - ours).abs().max().item() <= 1e-5


def test_sharded_diffusers_folder_loads(reference, tmp_path):
    ref, _ = reference
    ref.save_pretrained(tmp_path, max_shard_size="100KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    loaded = load_qwen_image(str(tmp_path))
    for name, tensor in ref.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_fp8_scaled_load_through_prepare_hook(reference, inputs):
    from library.precision.fp8 import FP8Linear, fp8_load_converter, prepare_fp8

    img, txt, mask = inputs
    sigma = torch.tensor([0.37, 0.81])
    root = str(reference[1])
    model = load_qwen_image(root, dtype=torch.bfloat16,
                            prepare=lambda m: fp8_load_converter(prepare_fp8(m, "fp8_scaled", arch_spec("qwen_image").fp8)))
    attn = model.transformer_blocks[0].attn
    assert isinstance(attn.to_q, FP8Linear) and attn.to_q.weight.dtype == torch.float8_e4m3fn
    assert type(model.img_in) is torch.nn.Linear and model.img_in.weight.dtype == torch.bfloat16
    with torch.no_grad():
        expected = load_qwen_image(root)(img, txt, mask, sigma, IMG_SHAPES)
        got = model(img, txt, mask, sigma, IMG_SHAPES).float()
    relative = ((got - expected).norm() / expected.norm()).item()
    assert relative <= 0.04, relative  # measured 1.3% (bf16 alone: 0.6%)


def test_pretraining_vae_starts_each_one_frame_kernel_at_conv2d_init():
    """The pretrainer's fresh VAE (learned.new_vae): each causal Conv3d's last time tap, the 2-D kernel
    its one frame meets, is drawn as nn.Conv2d's (kaiming-uniform, bound 1/sqrt(C x 3 x 3)), not
    Conv3d's sqrt(3) smaller one (fan-in C x 3 x 3 x 3), which fitted slower."""
    from diffusers.models.autoencoders.autoencoder_kl_qwenimage import QwenImageCausalConv3d

    from library.models.qwen_image.learned import new_vae

    torch.manual_seed(0)
    convs = [m for m in new_vae(64).modules() if isinstance(m, QwenImageCausalConv3d) and m.kernel_size == (3, 3, 3)]
    assert len(convs) > 10
    for conv in convs:
        bound = 1 / math.sqrt(conv.in_channels * 9)  # nn.Conv2d's weight and bias bound
        tap = conv.weight[:, :, -1].abs().max().item()
        assert bound / math.sqrt(3) * 1.2 < tap <= bound * (1 + 1e-6), (conv, tap, bound)
        assert conv.bias.abs().max().item() <= bound * (1 + 1e-6)


def test_pretraining_vae_computes_what_the_released_class_computes():
    """learned.ImageQwenVAE (the pretrainer's: no frame cache, Conv3d on one frame as its last time tap,
    F.normalize as x * rsqrt(sum x^2)) equals diffusers' AutoencoderKLQwenImage on the same weights:
    the encoder's posterior, the decoded images and every parameter's gradient of a reconstruction loss
    (the other time taps get none in either)."""
    from diffusers import AutoencoderKLQwenImage

    from library.models.qwen_image.learned import VAE_CONFIG, ImageQwenVAE

    torch.manual_seed(0)
    fast = ImageQwenVAE(**VAE_CONFIG)
    released = AutoencoderKLQwenImage(**VAE_CONFIG)
    released.load_state_dict(fast.state_dict())
    x = torch.rand(2, 3, 32, 32) * 2 - 1
    noise = torch.randn(2, VAE_CONFIG["z_dim"], 4, 4)

    def step(vae, frames: bool):
        vae.zero_grad()
        posterior = vae.encode(x[:, :, None] if frames else x).latent_dist
        mean, std = (posterior.mean[:, :, 0], posterior.std[:, :, 0]) if frames else (posterior.mean, posterior.std)
        decoded = vae.decode((mean + std * noise)[:, :, None] if frames else mean + std * noise).sample
        decoded = decoded[:, :, 0] if frames else decoded
        (decoded - x).pow(2).mean().backward()
        return mean.detach(), decoded.detach(), {n: p.grad for n, p in vae.named_parameters()}

    mean_f, decoded_f, grads_f = step(fast, False)
    mean_r, decoded_r, grads_r = step(released, True)
    torch.testing.assert_close(mean_f, mean_r, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(decoded_f, decoded_r, rtol=1e-5, atol=1e-5)
    assert grads_f.keys() == grads_r.keys()
    for name in grads_r:
        if grads_r[name] is None:
            assert grads_f[name] is None, name
        else:
            torch.testing.assert_close(grads_f[name], grads_r[name], rtol=1e-4, atol=1e-7, msg=name)


def test_a_sample_without_a_negative_runs_cfg_against_the_model_cards_space(tiny_set, tmp_path, monkeypatch):
    """The Qwen-Image model cards pass negative_prompt " " (QwenImagePipeline runs no CFG without one; musubi-tuner's
    samples default to " "); a prompt without --n ran CFG against "", a negative one token shorter that no user's
    pipeline encodes. Any other family keeps its pipeline's empty negative."""
    from library.models.family import FAMILIES, family_class
    from library.models.qwen_image import text_encoder as te
    from tools import generate

    seen, encode = [], te.QwenImageTextEncoder.encode
    monkeypatch.setattr(te.QwenImageTextEncoder, "encode",
                        lambda self, prompts: (seen.extend(prompts), encode(self, prompts))[1])
    assert generate.main(["--model_type", "qwen_image", "--model", tiny_set["qwen_image"],
                          "--ae", tiny_set["qwen_image_vae"], "--text_encoder", tiny_set["qwen_image_text_encoder"],
                          "--prompt", "a red square",
                          "--width", "64", "--height", "64", "--steps", "1", "--dtype", "fp32",
                          "--out", str(tmp_path / "out")]) == 0
    assert seen == ["a red square", " "]
    cards_space = {"qwen_image", "qwen_image_edit", "qwen_image_layered", "hidream_o1"}
    for name in FAMILIES:
        family = family_class(name)
        assert family.sample_negative("") == (" " if name in cards_space else ""), name
        assert family.sample_negative("blurry") == "blurry"
