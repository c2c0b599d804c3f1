"""Krea 2 edit (ai-toolkit's `edit: true` scheme): the transformer forward with clean reference latents.

The source is ai-toolkit's krea2/src/mmdit.py + pipeline.py (no diffusers pipeline exists); the math
restated: the references' packed tokens join the sequence after the target, at positions (i + 1, r, c)
for reference i; in every block they are modulated with tproj(tmlp(t = 0)) while text and target keep
the noisy t; with kv_cache (isolate_refs) a reference query attends only to reference keys; the output
is the target's tokens only. bench/bench_krea2_edit_vs_aitoolkit.py runs ai-toolkit's own module
(test_matches_aitoolkit_when_the_mirror_is_here, skipped without the mirror)."""

import os
import subprocess
import sys

import pytest
import torch

from library.models.krea2.model import References, joint_attention_mask, reference_positions
from library.models.krea2.tiny import random_krea2, tiny_config
from library.models.latents import pack_latents

C, H, W = 16, 3, 4  # latent channels, target patch grid
REF_GRIDS = [(2, 3), (3, 2)]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return random_krea2(tiny_config()).eval()


def inputs(seed=1, batch=1):
    g = torch.Generator().manual_seed(seed)
    img = pack_latents(torch.randn(batch, C, 2 * H, 2 * W, generator=g))
    txt = torch.randn(batch, 5, 3, 32, generator=g)
    refs = torch.cat([pack_latents(torch.randn(batch, C, 2 * h, 2 * w, generator=g)) for h, w in REF_GRIDS], dim=1)
    return img, txt, refs


def run(model, img, txt, sigma, refs=None, isolate=False, mask=None):
    """(velocity, the references' states after the last block) for one forward."""
    states = {}
    hook = model.blocks[-1].register_forward_hook(lambda m, a, out: states.update(out=out))
    try:
        with torch.no_grad():
            references = None if refs is None else References(refs, reference_positions(REF_GRIDS), isolate)
            v = model(img, txt, torch.tensor([sigma] * img.shape[0]), H, W, txt_mask=mask, refs=references)
    finally:
        hook.remove()
    n_refs = 0 if refs is None else refs.shape[1]
    return v, states["out"][:, states["out"].shape[1] - n_refs :]


def test_reference_positions_are_frames_on_the_first_axis():
    assert reference_positions([(1, 2), (2, 1)]).tolist() == [[1, 0, 0], [1, 0, 1], [2, 0, 0], [2, 1, 0]]
    assert reference_positions([]).shape == (0, 3)


def test_no_references_is_the_text_to_image_forward_exactly(model):
    img, txt, _ = inputs()
    plain, _ = run(model, img, txt, 0.6)
    empty = References(img[:, :0], reference_positions([]), isolate=True)
    with torch.no_grad():
        assert torch.equal(model(img, txt, torch.tensor([0.6]), H, W, refs=empty), plain)
    with_refs, _ = run(model, img, txt, 0.6, inputs()[2])
    assert with_refs.shape == plain.shape and (with_refs - plain).abs().max() > 1e-3  # the references count


def test_references_are_modulated_at_t0_not_the_noisy_timestep(model):
    # Isolated, a reference's states see only references and its own modulation: if that were the noisy
    # t's, they would change with sigma. Not isolated, they change through attention to the target.
    img, txt, refs = inputs()
    _, at_low = run(model, img, txt, 0.1, refs, isolate=True)
    _, at_high = run(model, img, txt, 0.9, refs, isolate=True)
    torch.testing.assert_close(at_low, at_high, rtol=0, atol=1e-6)
    _, open_low = run(model, img, txt, 0.1, refs)
    _, open_high = run(model, img, txt, 0.9, refs)
    assert (open_low - open_high).abs().max() > 1e-3


def test_split_modulation_with_equal_times_is_the_single_one(model):
    # The span path (text + target with tvec, references with ref_tvec) is the plain block when both are
    # the same vector, and differs when they are not.
    g = torch.Generator().manual_seed(3)
    block, d = model.blocks[0], model.config.hidden_size
    x, tvec, other = torch.randn(1, 9, d, generator=g), torch.randn(1, 1, 6 * d, generator=g), torch.randn(1, 1, 6 * d, generator=g)
    from library.models.core import rope_tables
    cos, sin = rope_tables(torch.zeros(9, 3, dtype=torch.int64), model.config.axes_dims_rope, model.config.rope_theta)
    with torch.no_grad():
        plain = block(x, tvec, cos, sin)
        torch.testing.assert_close(block(x, tvec, cos, sin, None, tvec, 4), plain, rtol=0, atol=1e-6)
        split = block(x, tvec, cos, sin, None, other, 4)
    assert (split[:, 5:] - plain[:, 5:]).abs().max() > 1e-3


def test_kv_cache_references_ignore_the_target(model):
    img, txt, refs = inputs()
    other = inputs(seed=7)[0]
    _, refs_a = run(model, img, txt, 0.5, refs, isolate=True)
    _, refs_b = run(model, other, txt, 0.5, refs, isolate=True)
    torch.testing.assert_close(refs_a, refs_b, rtol=0, atol=1e-6)
    _, open_a = run(model, img, txt, 0.5, refs)
    _, open_b = run(model, other, txt, 0.5, refs)
    assert (open_a - open_b).abs().max() > 1e-3
    va, _ = run(model, img, txt, 0.5, refs, isolate=True)
    vb, _ = run(model, img, txt, 0.5, refs)
    assert (va - vb).abs().max() > 1e-4  # the target still sees the references, differently


def test_kv_cache_mask_with_padded_text():
    key = torch.tensor([[True, True, False], [True, True, True]])
    mask = joint_attention_mask(key, 3, 2, 2, True, "cpu")
    assert mask.shape == (2, 7, 7)
    assert mask[0, :5].tolist() == [[True, True, False, True, True, True, True]] * 5  # text, target: all real keys
    assert mask[0, 5:].tolist() == [[False] * 5 + [True, True]] * 2  # references: references only
    assert joint_attention_mask(None, 3, 2, 2, False, "cpu") is None
    assert joint_attention_mask(key, 3, 2, 2, False, "cpu").shape == (2, 7)


def test_padded_text_and_gradient_checkpointing(model):
    img, txt, refs = inputs(batch=2)
    mask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    v, _ = run(model, img, txt, 0.4, refs, isolate=True, mask=mask)
    short, _ = run(model, img[1:], txt[1:, :3], 0.4, refs[1:], isolate=True)
    torch.testing.assert_close(v[1:], short, rtol=0, atol=1e-5)  # padded text counts for nothing
    model.gradient_checkpointing = True
    try:
        with torch.enable_grad():
            out = model(img, txt, torch.tensor([0.4, 0.4]), H, W, txt_mask=mask,
                        refs=References(refs, reference_positions(REF_GRIDS), True))
        torch.testing.assert_close(out.detach(), v, rtol=0, atol=1e-6)
    finally:
        model.gradient_checkpointing = False


MIRROR = "/work/.mirror/ostris+ai-toolkit/repo"


@pytest.mark.skipif(not os.path.isdir(MIRROR), reason="ai-toolkit's mirror is not on this machine")
def test_matches_aitoolkit_when_the_mirror_is_here():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, os.path.join(root, "bench", "bench_krea2_edit_vs_aitoolkit.py")],
                         capture_output=True, text=True, cwd=root)
    assert out.returncode == 0, out.stdout + out.stderr
    worst = float(out.stdout.strip().splitlines()[-1].split()[-1])
    assert worst <= 1e-5
