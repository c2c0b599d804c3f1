"""Qwen-Image-2.1 transformer: parity with diffusers' QwenImage21Transformer2DModel in fp32 (plain
prompts with and without padding, square / non-square / thin grids, condition images at their
slots), the released size on `meta`, gradient checkpointing."""

import os

import pytest
import torch
from diffusers import QwenImage21Transformer2DModel

from library.models.qwen_image21.model import QwenImage21, QwenImage21Config, joint_layout

TINY = dict(patch_size=1, in_channels=8, out_channels=8, num_layers=2, attention_head_dim=16, num_attention_heads=2,
            context_in_dim=24, mlp_ratio=3, axes_dims_rope=(4, 6, 6))


def loaded_pair():
    """(diffusers' model, ours) with the same random weights, loaded by plain key."""
    reference = QwenImage21Transformer2DModel(**TINY).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in reference.parameters():  # the zero-centred norms too
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
    model = QwenImage21(QwenImage21Config(**TINY)).eval()
    model.load_state_dict(reference.state_dict(), strict=True)
    return reference, model


def velocities(reference, model, h, w, lengths, slots=None, control_shapes=()):
    """(diffusers', ours) for random inputs, called as QwenImage21Pipeline calls the transformer."""
    g = torch.Generator().manual_seed(2)
    b, t = len(lengths), max(lengths)
    txt = torch.randn(b, t, TINY["context_in_dim"], generator=g)
    mask = torch.arange(t)[None] < torch.tensor(lengths)[:, None]
    img = torch.randn(b, h * w, TINY["in_channels"], generator=g)
    n_control = sum(ch * cw for ch, cw in control_shapes)
    control = torch.randn(b, n_control, TINY["in_channels"], generator=g) if n_control else None
    sigmas = torch.rand(b, generator=g)
    prompt_slots = torch.zeros(t, dtype=torch.bool) if slots is None else slots
    img_mask = torch.cat([prompt_slots, torch.ones(h * w // 4, dtype=torch.bool)])[None].expand(b, -1)
    shapes = [[*[(1, ch, cw) for ch, cw in control_shapes], (1, h, w)]] * b
    hidden = img if control is None else torch.cat([control, img], 1)
    with torch.no_grad():  # one prompt per call, unpadded, as QwenImage21Pipeline encodes and calls it
        expected = torch.cat([reference(hidden_states=hidden[i : i + 1], encoder_hidden_states=txt[i : i + 1, :n],
                                        timestep=sigmas[i : i + 1], img_shapes=shapes[:1],
                                        img_mask=torch.cat([prompt_slots[:n], img_mask[0, t:]])[None],
                                        return_dict=False)[0][:, -h * w:] for i, n in enumerate(lengths)])
        out = model(img, txt, sigmas, h, w, txt_mask=mask, control=control, control_shapes=control_shapes,
                    image_slots=slots)
    return expected, out  # the pipeline keeps the target's tokens


# (h, w) latent grid and caption lengths: non-square with ragged captions (masked batch), square with
# equal captions (no mask), a thin 2 x 10 grid with one caption.
CASES = [((4, 6), (7, 4)), ((4, 4), (6, 6)), ((2, 10), (9,))]


@pytest.mark.parametrize("grid,lengths", CASES)
def test_qwen_image21_matches_diffusers_fp32(grid, lengths):
    expected, out = velocities(*loaded_pair(), *grid, lengths)
    assert out.shape == expected.shape and out.dtype == torch.float32
    assert expected.abs().mean() > 0.1  # a real signal
    diff = (out - expected).abs().max().item()
    print(f"Qwen-Image-2.1 {grid} captions {lengths}: max abs diff {diff:.2e}")
    assert diff <= 3e-5  # ours batched, diffusers a prompt per call: the GEMMs sum in another order (|v| ~ 15)


def test_condition_images_at_their_slots_match_diffusers():
    """Two condition images (2 x 4 and 2 x 6 latents: 2 and 3 slots) inside a ragged prompt of 12."""
    slots = torch.zeros(12, dtype=torch.bool)
    slots[3:5], slots[7:10] = True, True
    expected, out = velocities(*loaded_pair(), 4, 4, (12, 11), slots, ((2, 4), (2, 6)))
    diff = (out - expected).abs().max().item()
    print(f"Qwen-Image-2.1 with two condition images: max abs diff {diff:.2e}")
    assert diff <= 3e-5  # ours batched, diffusers a prompt per call: the GEMMs sum in another order (|v| ~ 15)


def test_layout_of_a_padded_prompt():
    """Padded text keys are hidden; each target sits where its own prompt ends (frame 5 after 5 real tokens,
    not 8: diffusers counts the pads, so a short caption trained in a batch at another position than the
    pipeline samples it alone), and the target's rows and columns are centred."""
    layout = joint_layout(8, 2, 2, txt_mask=torch.tensor([[True] * 5 + [False] * 3, [True] * 8]))
    assert layout.key_valid.tolist() == [[True] * 5 + [False] * 3 + [True] * 4, [True] * 12]
    assert layout.segments == [(0, 8, True)] and layout.prefix_len == 8
    assert layout.positions[0, 8:].tolist() == [[5, -1, -1], [5, -1, 0], [5, 0, -1], [5, 0, 0]]
    assert layout.positions[1, 8:, 0].tolist() == [8] * 4


def test_a_batch_predicts_each_sample_as_it_predicts_it_alone():
    """Two captions of 7 and 4 tokens in one padded batch: each sample's velocity equals its own unpadded call
    (the old layout put the short caption's target 3 frames later: 7e-3 apart)."""
    _, model = loaded_pair()
    g = torch.Generator().manual_seed(6)
    txt, img = torch.randn(2, 7, TINY["context_in_dim"], generator=g), torch.randn(2, 8, TINY["in_channels"], generator=g)
    mask = torch.tensor([[True] * 7, [True] * 4 + [False] * 3])
    with torch.no_grad():
        batch = model(img, txt, torch.tensor([0.3, 0.7]), 2, 4, txt_mask=mask)
        alone = model(img[1:], txt[1:, :4], torch.tensor([0.7]), 2, 4)
    assert (batch[1] - alone[0]).abs().max().item() <= 1e-5 and batch.abs().mean() > 1


def test_odd_grid_runs_where_diffusers_needs_h_w_divisible_by_4():
    """Ours appends the target's tokens, not h*w/4 slots, so a 3 x 5 grid works (diffusers' layout
    cannot express it); the output is finite and changes with the image."""
    _, model = loaded_pair()
    g = torch.Generator().manual_seed(3)
    txt, img = torch.randn(1, 6, 24, generator=g), torch.randn(2, 15, 8, generator=g)
    with torch.no_grad():
        out = model(img, txt.expand(2, -1, -1), torch.tensor([0.5, 0.5]), 3, 5)
    assert out.shape == (2, 15, 8) and torch.isfinite(out).all() and not torch.allclose(out[0], out[1])


def test_released_parameter_count_on_meta():
    with torch.device("meta"):
        ours, theirs = QwenImage21(), QwenImage21Transformer2DModel()
    assert set(ours.state_dict()) == set(theirs.state_dict())
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in theirs.parameters()) == 7_115_124_736
    assert all(p.is_meta for p in ours.parameters())


def test_gradient_checkpointing_gives_the_same_gradients():
    grads = []
    for checkpointing in (False, True):
        _, model = loaded_pair()
        model.gradient_checkpointing = checkpointing
        g = torch.Generator().manual_seed(4)
        txt, img = torch.randn(2, 5, 24, generator=g), torch.randn(2, 8, 8, generator=g)
        mask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
        model(img, txt, torch.tensor([0.3, 0.9]), 2, 4, txt_mask=mask).square().mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert torch.equal(grads[0], grads[1])


# ----------------------------------------------------------------------------------------------
# Checkpoints: the diffusers folder and the ComfyUI single file


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    from library.models.qwen_image21.tiny import write_qwen_image21

    return write_qwen_image21(str(tmp_path_factory.mktemp("qi21")), seed=0)


def test_both_layouts_load_identical_weights(tiny_files):
    from safetensors import safe_open

    from library.models.qwen_image21.checkpoint import load_qwen_image21

    folder, single = load_qwen_image21(tiny_files["qwen_image21"]), load_qwen_image21(tiny_files["qwen_image21_comfy"])
    a, b = folder.state_dict(), single.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert folder.config == single.config and folder.config.num_layers == 2
    with safe_open(tiny_files["qwen_image21_comfy"], "pt") as f:  # really the fused ComfyUI names
        keys = set(f.keys())
    assert "model.diffusion_model.transformer_blocks.0.img_mlp.gate_up.weight" in keys
    assert not any(k.endswith("img_mlp.proj.weight") for k in keys)


def test_single_file_reads_as_diffusers_converter_reads_it(tiny_files):
    """diffusers' own single-file conversion of our ComfyUI file gives the diffusers folder's tensors."""
    from diffusers.loaders.single_file_utils import convert_qwen_image21_transformer_checkpoint_to_diffusers
    from safetensors.torch import load_file

    converted = convert_qwen_image21_transformer_checkpoint_to_diffusers(load_file(tiny_files["qwen_image21_comfy"]))
    folder = load_file(os.path.join(tiny_files["qwen_image21"], "diffusion_pytorch_model.safetensors"))
    assert converted.keys() == folder.keys() and all(torch.equal(converted[k], folder[k]) for k in folder)


def test_loaded_folder_matches_diffusers_from_pretrained(tiny_files):
    from library.models.qwen_image21.checkpoint import load_qwen_image21

    reference = QwenImage21Transformer2DModel.from_pretrained(tiny_files["qwen_image21"]).eval()
    ours = load_qwen_image21(tiny_files["qwen_image21_comfy"]).eval()
    g = torch.Generator().manual_seed(5)
    txt, img = torch.randn(1, 6, 32, generator=g), torch.randn(1, 16, 64, generator=g)
    img_mask = torch.cat([torch.zeros(6, dtype=torch.bool), torch.ones(4, dtype=torch.bool)])[None]
    with torch.no_grad():
        expected = reference(img, txt, torch.tensor([0.4]), [[(1, 4, 4)]], img_mask, return_dict=False)[0]
        out = ours(img, txt, torch.tensor([0.4]), 4, 4)
    assert (out - expected[:, -16:]).abs().max().item() <= 1e-5


def test_meta_load_reads_no_weights(tiny_files):
    from library.models.qwen_image21.checkpoint import load_qwen_image21

    model = load_qwen_image21(tiny_files["qwen_image21_comfy"], dtype=torch.bfloat16, read_weights=False)
    assert all(p.is_meta and p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.compute_dtype == torch.bfloat16


def test_wrong_file_is_one_error_naming_the_key(tiny_files, tmp_path):
    from safetensors.torch import load_file, save_file

    from library.io import CheckpointError
    from library.models.qwen_image21.checkpoint import load_qwen_image21

    other = tmp_path / "other.safetensors"
    save_file({"double_blocks.0.img_attn.qkv.weight": torch.zeros(2, 2)}, str(other))
    with pytest.raises(CheckpointError, match="txt_in.text_norm.weight") as e:
        load_qwen_image21(str(other))
    assert "\n" not in str(e.value)
    from safetensors import safe_open

    with safe_open(tiny_files["qwen_image21_comfy"], "pt") as f:
        metadata = f.metadata()  # the config: the shapes are checked against it
    sd = load_file(tiny_files["qwen_image21_comfy"])
    sd["model.diffusion_model.transformer_blocks.1.attn.to_q.weight"] = torch.zeros(3, 3)
    broken = tmp_path / "broken.safetensors"
    save_file(sd, str(broken), metadata=metadata)
    with pytest.raises(CheckpointError, match=r"transformer_blocks\.1\.attn\.to_q\.weight' has shape \(3, 3\)") as e:
        load_qwen_image21(str(broken))
    assert "\n" not in str(e.value)
