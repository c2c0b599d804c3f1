"""Masked loss and regularization images (library/data/masks.py): a mask that zeroes half the
image zeroes that half's gradient and the loss is the hand-computed masked MSE; masks come from the
alpha channel or mask_dir, follow the image's crop and flip, and invalidate the latent cache when
they change; regularization repeats are balanced as sd-scripts balances them and their loss is
scaled by prior_loss_weight; both run through train_lora.py on tiny FLUX and Qwen-Image."""

import os
import re
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

import train_lora
from library.data import caches, dataset as D, image_folders
from library.data.dataset_config import load_dataset_config, parse_dataset_config
from library.data.masks import balance_reg_repeats, load_mask, on_latent_grid
from library.models.family import pack_latents
from library.models.flux1.family import FluxFamily
from library.models import flow_matching as fm
from tests.test_training_objective import loss_args


def rgba(path, w, h, alpha_left=0, color=(200, 30, 30)):
    """An image whose alpha is alpha_left on the left half and 255 on the right."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    array = np.zeros((h, w, 4), dtype=np.uint8)
    array[..., :3] = color
    array[..., 3] = 255
    array[:, : w // 2, 3] = alpha_left
    Image.fromarray(array, "RGBA").save(path)
    return str(path)


def gray(path, w, h, left=0, right=255):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    array = np.full((h, w), right, dtype=np.uint8)
    array[:, : w // 2] = left
    Image.fromarray(array, "L").save(path)
    return str(path)


def blueprint(subsets, resolution=64, **dataset):
    return parse_dataset_config({"datasets": [{"resolution": resolution, **dataset, "subsets": subsets}]}, source="t.toml")


# ----------------------------------------------------------------------------------------------
# The loss


def test_loss_masks_repeat_onto_a_finer_latent_grid_and_pool_onto_a_coarser_one():
    """Cached on the 8 px grid: area-averaged to a 16x VAE's grid as before, and repeated (nearest) onto the
    pixels of a model without a VAE, each mask element over its 8 x 8 pixels."""
    masks = torch.rand(2, 1, 8, 12)
    pixels = on_latent_grid(masks, (64, 96))
    assert pixels.shape == (2, 1, 64, 96)
    assert torch.equal(pixels[:, :, 8 * 3:8 * 4, 8 * 5:8 * 6], masks[:, :, 3:4, 5:6].expand(2, 1, 8, 8))
    assert on_latent_grid(masks, (8, 12)) is masks
    assert torch.equal(on_latent_grid(masks, (4, 6)), torch.nn.functional.avg_pool2d(masks, 2))
    with pytest.raises(ValueError, match="loss masks of 8 x 12 do not repeat onto the 60 x 96 latent grid"):
        on_latent_grid(masks, (60, 96))


def test_a_mask_that_zeroes_the_left_half_zeroes_its_gradient_and_gives_the_masked_mse(tiny_set):
    family = FluxFamily(tiny_set["flux_bfl"])
    model = family.load_transformer(torch.float32)
    torch.manual_seed(0)
    latents, noise = torch.randn(2, 16, 8, 8), torch.randn(2, 16, 8, 8)
    sigmas = torch.tensor([0.3, 0.7])
    text = {"t5": torch.randn(2, 7, 32), "clip_pooled": torch.randn(2, 32)}
    mask = torch.ones(2, 1, 8, 8)
    mask[:, :, :, :4] = 0.0  # the left half of the latent grid
    captured = {}
    predict = family.predict

    def recording_predict(*args, **kwargs):
        captured["pred"] = out = predict(*args, **kwargs)
        out.retain_grad()
        return out

    family.predict = recording_predict
    loss = family.loss_at(model, latents, text, noise, sigmas, 1.0, mask=mask)
    loss.backward()
    pred, grad = captured["pred"], captured["pred"].grad
    target = pack_latents(noise - latents)
    expected = ((pred - target) ** 2 * pack_latents(mask.expand_as(latents))).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    left = pack_latents(mask.expand_as(latents)) == 0  # packed [B, tokens, 64]: whole tokens of the left half
    assert left.any() and (~left).any()
    assert torch.count_nonzero(grad[left]) == 0 and torch.count_nonzero(grad[~left]) == grad[~left].numel()
    family.predict = predict
    plain = family.loss_at(model, latents, text, noise, sigmas, 1.0)
    ones = family.loss_at(model, latents, text, noise, sigmas, 1.0, mask=torch.ones(2, 1, 8, 8))
    assert torch.equal(plain, ones)


def test_sample_weights_scale_each_sample_as_sd_scripts_loss_weights():
    pred, target = torch.randn(3, 4, 8), torch.randn(3, 4, 8)
    per_sample = ((pred - target) ** 2).mean(dim=(1, 2))
    weights = torch.tensor([1.0, 0.5, 1.0])
    assert fm.flow_loss(pred, target, weights).item() == pytest.approx((per_sample * weights).mean().item(), rel=1e-6)


# ----------------------------------------------------------------------------------------------
# Masks from files


def test_alpha_mask_follows_the_crop_and_flip_of_its_image(tmp_path):
    path = rgba(tmp_path / "a.png", 128, 64, alpha_left=0)
    mask = load_mask(path, None, (64, 64), flip=False)  # cover 64x64 -> centre crop keeps x in [32, 96)
    assert mask.shape == (1, 8, 8) and mask.dtype == torch.float32
    assert torch.equal(mask[0, :, :4], torch.zeros(8, 4)) and torch.equal(mask[0, :, 4:], torch.ones(8, 4))
    assert torch.equal(load_mask(path, None, (64, 64), flip=True), mask.flip(-1))
    Image.new("RGB", (64, 64)).save(tmp_path / "opaque.png")
    assert torch.equal(load_mask(str(tmp_path / "opaque.png"), None, (64, 64), False), torch.ones(1, 8, 8))


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16])
def test_alpha_mask_reads_a_grey_pngs_transparent_value_at_8_and_16_bits(tmp_path, dtype):
    """A 16-bit grey PNG whose tRNS key makes one value transparent trained fully (Pillow's RGBA conversion
    of I;16 drops the key; has_alpha said it had alpha, so nothing warned); the 8-bit one read 0 there."""
    grey = np.full((64, 128), 200 if dtype == np.uint8 else 0x4000, dtype)
    key = 17 if dtype == np.uint8 else 0x1234
    grey[:, 64:] = key
    path = str(tmp_path / "grey.png")
    Image.fromarray(grey).save(path, transparency=key)
    mask = load_mask(path, None, (128, 64), flip=False)
    assert torch.equal(mask[0, :, :8], torch.ones(8, 8)) and torch.equal(mask[0, :, 8:], torch.zeros(8, 8))
    # Its RGBA view has that alpha too (the check's transparency note; the 16-bit one read opaque, 2026-12-01)
    from library.data.images import load_rgb

    alpha = np.asarray(load_rgb(path, "RGBA"))[..., 3]
    assert (alpha[:, :64] == 255).all() and (alpha[:, 64:] == 0).all()


def test_masks_are_cached_with_the_latents_and_a_changed_mask_recomputes(tmp_path):
    from tests.test_dataset import CountingEncoder

    for i in range(2):
        Image.new("RGB", (64, 64), (200, 30, 30)).save(tmp_path / f"{i}.png")
        gray(tmp_path / "masks" / f"{i}.png", 64, 64, left=0 if i == 0 else 255)
    bp = blueprint([{"image_dir": str(tmp_path), "mask_dir": str(tmp_path / "masks"), "class_tokens": "x",
                     "flip_aug": True}])
    ds, enc = D.ImageDataset(bp), CountingEncoder()
    assert caches.cache_latents(ds.items, enc.latents, "flux") == 2
    masks = {os.path.basename(ds[(e, 0)]["image_path"]): ds[(e, 0)]["mask"] for e in range(2)}
    assert masks["0.png"].sum() == 32 and torch.equal(masks["1.png"], torch.ones(1, 8, 8))
    again = D.ImageDataset(bp)
    assert caches.cache_latents(again.items, enc.latents, "flux") == 0
    gray(tmp_path / "masks" / "1.png", 64, 64, left=128)
    assert caches.cache_latents(D.ImageDataset(bp).items, enc.latents, "flux") == 1  # only the changed one
    batch = D.collate_batch([ds[(0, 0)], ds[(1, 0)]])
    assert batch["masks"].shape == (2, 1, 8, 8)


@pytest.mark.parametrize("case, message", [
    ("missing", "1.png: no mask '1.png' (or another image type) in mask_dir"),
    ("size", "mask is 32x32, its image"),
    ("both", "keys 'alpha_mask' and 'mask_dir' both set"),
    ("not_a_folder", "key 'mask_dir' '/nonexistent' is not a folder"),
    ("reg_validation", "key 'is_reg' is for training subsets"),
    ("reg_only", "every subset has is_reg = true"),  # was a dataset of 0 entries: train_lora looped over empty epochs
    ("two_of_one_name", "masks '1.jpg' and '1.png' share the name '1'"),  # the last sorted was the mask (2026-11-27)
])
def test_mask_and_reg_errors_name_the_file_and_key(tmp_path, case, message):
    for i in range(2):
        Image.new("RGB", (64, 64)).save(tmp_path / f"{i}.png")
    gray(tmp_path / "masks" / "0.png", 64, 64)
    subset = {"image_dir": str(tmp_path), "class_tokens": "x", "mask_dir": str(tmp_path / "masks")}
    with pytest.raises(ValueError, match=re.escape(message)):
        if case == "size":
            gray(tmp_path / "masks" / "1.png", 32, 32)
        elif case == "both":
            subset["alpha_mask"] = True
        elif case == "not_a_folder":
            subset["mask_dir"] = "/nonexistent"
        elif case == "two_of_one_name":
            gray(tmp_path / "masks" / "1.png", 64, 64)
            Image.new("L", (64, 64), 0).save(tmp_path / "masks" / "1.jpg")
        elif case == "reg_only":
            parse_dataset_config({"datasets": [{"resolution": 64, "subsets": [{"image_dir": str(tmp_path), "is_reg": True}]}]},
                                 source="t.toml")
        elif case == "reg_validation":
            parse_dataset_config({"datasets": [{"resolution": 64, "subsets": [subset]}], "validation_datasets": [
                {"resolution": 64, "subsets": [{"image_dir": str(tmp_path), "is_reg": True}]}]}, source="t.toml")
        D.ImageDataset(blueprint([subset]))


@pytest.mark.parametrize("mode", ["LA", "RGBA", "P"])
def test_a_mask_painted_as_transparency_is_refused_an_opaque_one_with_alpha_is_read(tmp_path, mode):
    """A mask drawn as alpha over black (LA / RGBA, or a palette with a transparent index) was read by its grey
    alone: all black, the image trained nowhere, without a word. Now refused naming the file and a pixel; one with
    an alpha channel all opaque is read by its grey."""
    Image.new("RGB", (64, 64)).save(tmp_path / "0.png")
    (tmp_path / "masks").mkdir()
    alpha = Image.new("L", (64, 64), 0)
    alpha.paste(255, (0, 0, 32, 64))  # the left half trains, painted as opacity
    black = Image.new("RGB", (64, 64))
    mask = black.convert("RGBA")
    mask.putalpha(alpha)
    if mode == "P":  # one palette index transparent
        mask = Image.new("P", (64, 64), 1)
        mask.putpalette([0, 0, 0, 255, 255, 255])
        mask.paste(0, (32, 0, 64, 64))
        mask.info["transparency"] = 0
        mask.save(tmp_path / "masks" / "0.png", transparency=0)
    else:
        mask.convert(mode).save(tmp_path / "masks" / "0.png")
    subset = {"image_dir": str(tmp_path), "class_tokens": "x", "mask_dir": str(tmp_path / "masks")}
    with pytest.raises(ValueError, match=re.escape("0.png: mask has transparent pixels (alpha 0 at pixel (32, 0)); "
                                                   "a mask is read by its grey alone")):
        D.ImageDataset(blueprint([subset]))
    Image.new("L", (64, 64), 200).convert(mode.replace("P", "LA")).save(tmp_path / "masks" / "0.png")  # opaque
    (item,) = D.ImageDataset(blueprint([subset])).items
    assert float(load_mask(item.image_path, item.mask_path, (64, 64), False)[0, 1, 1]) == pytest.approx(200 / 255)


@pytest.mark.parametrize("mode, pixel, refused", [
    ("RGB", (255, 0, 0), True),  # sd-scripts: weight 1 (its R), luminance: 0.30
    ("RGB", (0, 0, 255), True),  # sd-scripts: weight 0, luminance: 0.11
    ("RGB", (128, 128, 128), False),  # a grey mask saved as RGB
    ("RGB", (128, 131, 126), False),  # and as an RGB JPEG, with a few levels of chroma noise
    ("RGBA", (200, 200, 200), False),
    ("P", (102, 102, 102), False),  # web palette levels
    ("P", (0, 204, 0), True),
    ("CMYK", (0, 0, 0), False),
])
def test_a_mask_in_colour_is_refused_naming_the_file_and_pixel_a_grey_one_in_any_mode_is_read(tmp_path, mode, pixel,
                                                                                               refused):
    Image.new("RGB", (64, 64)).save(tmp_path / "0.png")
    mask = Image.new("RGB", (64, 64), (255, 255, 255))
    mask.paste(pixel, (3, 5, 64, 64))
    (tmp_path / "masks").mkdir()
    mask.convert(mode).save(tmp_path / "masks" / ("0.jpg" if mode == "CMYK" else "0.png"))
    subset = {"image_dir": str(tmp_path), "class_tokens": "x", "mask_dir": str(tmp_path / "masks")}
    if refused:
        with pytest.raises(ValueError, match=re.escape(f"0.png: mask is in colour (R, G, B = {pixel} at pixel (3, 5)); "
                                                       "expected a grayscale mask")):
            D.ImageDataset(blueprint([subset]))
        return
    (item,) = D.ImageDataset(blueprint([subset])).items
    weight = float(load_mask(item.image_path, item.mask_path, (64, 64), False)[0, 1, 1])  # latent (1, 1): pixels 8..15
    assert weight == pytest.approx(sum(pixel) / 3 / 255, abs=0.02)


# ----------------------------------------------------------------------------------------------
# Regularization images


def make_set(folder, count):
    for i in range(count):
        Image.new("RGB", (64, 64), (10 * i, 0, 0)).save(os.path.join(folder, f"{i}.png"))


@pytest.mark.parametrize("train, reg, expected", [
    ((3, 2), (4, 1), [2, 2, 1, 1]),  # 6 training entries: a second pass adds 1 to the first two
    ((3, 2), (10, 1), [1] * 6 + [0] * 4),  # more reg images than needed: the first 6 only
    ((2, 1), (2, 3), [3, 0]),  # the first reg image's 3 repeats already pass the 2 training entries
])
def test_reg_repeats_are_balanced_to_the_training_images_as_sd_scripts(tmp_path, train, reg, expected):
    os.makedirs(tmp_path / "train"), os.makedirs(tmp_path / "reg")
    make_set(str(tmp_path / "train"), train[0]), make_set(str(tmp_path / "reg"), reg[0])
    bp = blueprint([{"image_dir": str(tmp_path / "train"), "num_repeats": train[1], "class_tokens": "sks dog"},
                    {"image_dir": str(tmp_path / "reg"), "num_repeats": reg[1], "class_tokens": "dog", "is_reg": True}],
                   validation_split=0.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ds = D.ImageDataset(bp)
    reg_items = [it for it in ds.drawn_items() if it.subset.is_reg]
    counts = [sum(1 for e in ds.entries if ds.items[e] is it) for it in reg_items]
    # the unused ones are not drawn, so caching does not encode them (it did until 2026-11-28)
    assert counts == [n for n in expected if n] and len(reg_items) == reg[0] - expected.count(0)
    unused_lines = [str(w.message) for w in caught if "regularization images are not used" in str(w.message)]
    first_unused = str(tmp_path / "reg" / f"{expected.index(0)}.png") if 0 in expected else None
    assert unused_lines == ([f"dataset 0: {expected.count(0)} of {len(expected)} regularization images are not used "
                             f"(first: {first_unused}); reg images are used in file order until "
                             f"they match the {train[0] * train[1]} training images x num_repeats per epoch: raise the "
                             f"training subsets' num_repeats to use more"] if 0 in expected else [])
    assert counts == [balance_reg_repeats(train[0] * train[1], reg_items)[id(it)] for it in reg_items]
    assert all(ds[(e, 0)]["is_reg"] == ds.items[ds.entries[e]].subset.is_reg for e in range(len(ds)))


def test_validation_split_never_holds_out_reg_images(tmp_path):
    os.makedirs(tmp_path / "train"), os.makedirs(tmp_path / "reg")
    make_set(str(tmp_path / "train"), 10), make_set(str(tmp_path / "reg"), 10)
    bp = blueprint([{"image_dir": str(tmp_path / "train"), "class_tokens": "a"},
                    {"image_dir": str(tmp_path / "reg"), "class_tokens": "b", "is_reg": True}], validation_split=0.2)
    train, held_out = image_folders.split_validation(image_folders.scan_images(bp), bp)
    assert len(held_out) == 2 and not any(it.subset.is_reg for it in held_out)


# ----------------------------------------------------------------------------------------------
# End to end


@pytest.mark.parametrize("family", ["flux", "qwen"])
def test_masked_and_reg_training_runs_on_both_families(tiny_set, tmp_path, family, monkeypatch):
    from library.training.diffusion_task import DiffusionTask
    from tests.test_captions import qwen_args
    from tests.test_train_lora import flux_args

    for i in range(2):
        rgba(tmp_path / "train" / f"{i}.png", 64, 64, alpha_left=0, color=(200, 40 * i, 30))
    os.makedirs(tmp_path / "reg")
    make_set(str(tmp_path / "reg"), 2)
    (tmp_path / "ds.toml").write_text(
        f'[[datasets]]\nresolution = 64\nbatch_size = 2\n[[datasets.subsets]]\nimage_dir = "{tmp_path / "train"}"\n'
        f'class_tokens = "sks square"\nalpha_mask = true\n[[datasets.subsets]]\nimage_dir = "{tmp_path / "reg"}"\n'
        f'class_tokens = "square"\nis_reg = true\n')
    seen = []
    inputs = DiffusionTask.batch_inputs

    def recording(self, batch, step):
        out = inputs(self, batch, step)
        seen.append((out[3], out[4]))
        return out

    monkeypatch.setattr(DiffusionTask, "batch_inputs", recording)
    make_args = flux_args if family == "flux" else qwen_args
    out = tmp_path / "run"
    assert train_lora.main(make_args(tiny_set, out, "--dataset_config", str(tmp_path / "ds.toml"),
                                     "--max_train_steps", "4", "--prior_loss_weight", "0.25", "--sample_prompts", "")) == 0
    masks = [m for m, _ in seen if m is not None]
    weights = torch.cat([w for _, w in seen if w is not None])
    assert masks and all(m.shape[1:] == (1, 8, 8) for m in masks)
    assert set(weights.tolist()) <= {1.0, 0.25} and 0.25 in weights.tolist()
    assert any(sample[:, :, :4].sum() == 0 and sample[:, :, 4:].min() == 1 for m in masks for sample in m)  # alpha


def test_regularization_images_past_the_balance_are_not_cached(tiny_set, tmp_path):
    """2 training images, 5 reg images: 2 reg images are drawn an epoch, the other 3 were VAE- and text-encoded for
    nothing (thousands of class images, most of them never drawn). The header counts them all, as sd-scripts."""
    from safetensors import safe_open

    from tests.test_train_lora import flux_args

    for folder, count in (("train", 2), ("reg", 5)):
        os.makedirs(tmp_path / folder)
        make_set(str(tmp_path / folder), count)
    (tmp_path / "ds.toml").write_text(
        f'[[datasets]]\nresolution = 64\nbatch_size = 2\n[[datasets.subsets]]\nimage_dir = "{tmp_path / "train"}"\n'
        f'class_tokens = "sks square"\n[[datasets.subsets]]\nimage_dir = "{tmp_path / "reg"}"\nclass_tokens = "square"\n'
        f'is_reg = true\n')
    out = tmp_path / "run"
    assert train_lora.main(flux_args(tiny_set, out, "--dataset_config", str(tmp_path / "ds.toml"), "--max_train_steps", "1",
                                     "--sample_prompts", "")) == 0
    cached = {f.name.split("_")[0] for f in (tmp_path / "reg").rglob("*.safetensors")}
    assert cached == {"0", "1"}, sorted(cached)  # file order: the first two
    with safe_open(str(out / "tiny_flux_lora.safetensors"), "pt") as f:
        assert f.metadata()["ss_num_reg_images"] == "5"
