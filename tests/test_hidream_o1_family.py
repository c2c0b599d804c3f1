"""HiDream-O1-Image as a trainable family on the tiny models: train_lora.py trains (musubi-tuner's settings: uniform
sigma, the x0 loss as sigma_sq, the release's noise; fp8 scaled base) and saves a kohya LoRA in musubi-tuner's names;
the loss is musubi-tuner's (MSE of the predicted x0 on x_t = (1 - sigma) x0 + sigma s clip(n)), computed from its
formula on the same model; Dev's flash sampling step is the scheduler's; the LoRA converts to ComfyUI's / ai-toolkit's
names and reads back; the release comes from model_version or the file name."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import train_lora
from library.models.hidream_o1.family import DEV, DEV_TIMESTEPS, FULL, HiDreamO1Family, release_in_name, shaped_noise
from tests.test_train_lora import read_losses, sample_png


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny transformer with its tokenizer beside, and the tiny dataset at 32 px bucket steps."""
    from library.models.hidream_o1.tiny import write_hidream_o1
    from tools.make_tiny_dataset import make_tiny_dataset

    root = tmp_path_factory.mktemp("hidream_o1")
    paths = {**write_hidream_o1(str(root / "models"), 0), **make_tiny_dataset(str(root / "dataset"))}
    config = root / "dataset32.toml"
    config.write_text(open(paths["dataset_config"]).read().replace("bucket_reso_steps = 16", "bucket_reso_steps = 32"))
    return {**paths, "dataset_config": str(config)}


def run_args(tiny, out, *more) -> list[str]:
    return ["--model_type", "hidream_o1", "--pretrained_model_name_or_path", tiny["hidream_o1"], "--dataset_config",
            tiny["dataset_config"], "--sample_prompts", tiny["sample_prompts"], "--output_dir", str(out),
            "--output_name", "o1", "--max_train_steps", "3", "--mixed_precision", "no", "--fp8_base", "--fp8_scaled",
            "--network_dim", "4", "--network_alpha", "4", "--optimizer_type", "AdamW", "--learning_rate", "3e-3",
            "--save_every_n_steps", "0", "--timestep_sampling", "uniform", "--weighting_scheme", "sigma_sq", *more]


@pytest.fixture(scope="module")
def trained(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("hidream_o1_run")
    assert train_lora.main(run_args(tiny, out, "--noise_clip_std", "0")) == 0  # Full's own: the header records it
    return out


def test_hidream_o1_lora_trains_saves_and_samples_in_musubis_names(trained):
    losses = read_losses(trained, "o1")
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    names = {k.split(".")[0] for k in load_file(trained / "o1.safetensors")}
    # musubi-tuner's text-to-image targets: 2 layers x (q, k, v, o, gate, up, down), proj1, proj2, the final layer
    assert {"lora_unet_model_language_model_layers_0_self_attn_q_proj",
            "lora_unet_model_language_model_layers_1_mlp_down_proj", "lora_unet_model_x_embedder_proj1",
            "lora_unet_model_x_embedder_proj2", "lora_unet_model_final_layer2_linear"} <= names
    assert len(names) == 2 * 7 + 3
    with safe_open(str(trained / "o1.safetensors"), "pt") as f:
        meta = f.metadata()
    assert (meta["ss_base_model_version"], meta["modelspec.architecture"]) == (FULL, "HiDream-O1-Image/lora")
    assert json.loads(meta["ss_trained_keys"]) == {"noise_clip_std": 0.0}
    assert sample_png(trained, "o1", "final").stat().st_size > 0


@pytest.mark.parametrize("version, keys", [
    (FULL, {}), (DEV, {}), (FULL, {"noise_scale_start": 2.0, "noise_scale_end": 6.0, "noise_clip_std": 1.5}),
    (DEV, {"noise_scale_start": 3.0})])
def test_the_loss_is_musubis_x0_mse_on_its_noise(tiny, version, keys):
    """sigma_sq weighting of our velocity loss = musubi-tuner's MSE(x0_pred, x0) with x_t = (1 - s) x0 + s k clip(n)
    (hidream_o1_train_network.py: k = start + (end - start)(1 - s), the release's unless its noise_scale_start /
    noise_scale_end / noise_clip_std (ours' keys) say otherwise, the end the start's; clip at noise_clip_std x the
    noise's std), on the same model, noise and sigmas; its x0_pred taken from the model directly."""
    family = HiDreamO1Family(tiny["hidream_o1"], model_version=version, **keys)
    model = family.load_transformer(torch.float32)
    encoded = family.load_text_encoder()(["a red circle", "a blue square on a table"])
    longest = max(len(t["input_ids"]) for t in encoded)  # right-padded with zeros, as the dataset collates
    text = {"input_ids": torch.stack([torch.nn.functional.pad(t["input_ids"], (0, longest - len(t["input_ids"])))
                                      for t in encoded]), "length": torch.stack([t["length"] for t in encoded])}
    g = torch.Generator().manual_seed(0)
    x0 = torch.rand(2, 3, 64, 96, generator=g) * 2 - 1
    noise, sigmas = torch.randn(x0.shape, generator=g), torch.tensor([0.3, 0.8])
    ours = family.loss_at(model, x0, text, noise, sigmas, None, "sigma_sq")
    start, _, clip = {FULL: (8.0, 8.0, 0.0), DEV: (7.5, 7.5, 2.5)}[version]
    start, clip = keys.get("noise_scale_start", start), keys.get("noise_clip_std", clip)
    end = keys.get("noise_scale_end", start)
    n = noise.clamp(-clip * noise.std(), clip * noise.std()) if clip else noise
    s = sigmas.reshape(-1, 1, 1, 1)
    x_t = (1 - s) * x0 + s * (start + (end - start) * (1 - s)) * n
    x0_pred = model(family.pack_target(x_t), text["input_ids"], text["length"], sigmas, 2, 3)
    theirs = (x0_pred - family.pack_target(x0)).pow(2).mean()
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    if clip:
        assert (n != noise).any()  # the clip bites on a 2.5-std bound of 36,864 draws


def test_dev_samples_with_the_flash_scheduler_on_its_timesteps(tiny, monkeypatch):
    """Dev at 28 steps: each step the model's x0, re-noised to the next timestep / 1000 with fresh noise clipped at
    2.5 std and scaled 7.5 (the flash scheduler's step); from 7.5 x randn. A stand-in model returning x_t / 2 shows
    the recurrence."""
    family = HiDreamO1Family(tiny["hidream_o1"], model_version=DEV)
    seen = []

    def model(img, input_ids, lengths, sigmas, h, w):
        seen.append(sigmas[0].item())
        return img / 2

    text = {"input_ids": torch.zeros(1, 5, dtype=torch.int64), "length": torch.tensor([5])}
    out = family.sample_latents(model, text, 64, 32, 28, seed=3, guidance=0.0)
    assert seen == pytest.approx([t / 1000 for t in DEV_TIMESTEPS])
    gen = torch.Generator("cpu").manual_seed(3 + 1)  # the pipelines' seed + 1
    x = 7.5 * torch.randn(1, 3, 32, 64, generator=gen)
    sigmas = [t / 1000 for t in DEV_TIMESTEPS] + [0.0]
    for following in sigmas[1:]:
        fresh = torch.randn(x.shape, generator=gen)
        x = following * shaped_noise(fresh, torch.zeros(1), 7.5, 7.5, 2.5) + (1 - following) * (x / 2)
    torch.testing.assert_close(out, x)


@pytest.mark.parametrize("version", [FULL, DEV])
def test_samples_start_from_the_pipelines_noise_of_seed_plus_one(tiny, version):
    """The official pipeline (musubi-tuner's hidream_o1/pipeline.py, ai-toolkit's copy) draws the starting noise as
    noise_scale x randn((1, 3, H, W), generator=Generator("cpu").manual_seed(seed + 1)) in 32 px patches: the same
    seed gives its image (ours drew from seed: its seed - 1's)."""
    family = HiDreamO1Family(tiny["hidream_o1"], model_version=version)
    first = []

    def model(img, *args):
        first.append(img.clone()) if not first else None
        return img

    text = {"input_ids": torch.zeros(1, 5, dtype=torch.int64), "length": torch.tensor([5])}
    family.sample_latents(model, text, 64, 32, 28, seed=3, guidance=0.0)
    scale = {FULL: 8.0, DEV: 7.5}[version]
    theirs = scale * torch.randn((1, 3, 32, 64), generator=torch.Generator("cpu").manual_seed(3 + 1))
    torch.testing.assert_close(first[0], family.pack_target(theirs))


def test_the_release_comes_from_model_version_or_the_name(tiny):
    assert release_in_name("checkpoints/hidream_o1_image_dev_bf16.safetensors") == DEV
    assert release_in_name("HiDream-O1-Image") is None
    family = HiDreamO1Family(tiny["hidream_o1"])
    assert (family.version, family.sample_steps, family.sample_guidance) == (FULL, 50, 5.0)
    dev = HiDreamO1Family(tiny["hidream_o1"], model_version=DEV)
    assert (dev.sample_steps, dev.sample_guidance) == (28, 0.0)
    noise = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(family.model_noise(noise, torch.tensor([0.1, 0.9])), 8 * noise)
    with pytest.raises(ValueError, match="hidream-o1-full or hidream-o1-dev"):
        HiDreamO1Family(tiny["hidream_o1"], model_version="hidream-o1")


def test_the_noise_keys_set_the_samples_noise_too_and_a_bad_one_is_named(tiny):
    """The model learns the noise it is trained on: samples start from noise_scale_start x randn, and Dev's flash
    steps re-noise at its scale and clip. A scale of 0 or less, a negative clip: one ValueError naming the key."""
    family = HiDreamO1Family(tiny["hidream_o1"], model_version=DEV, noise_scale_start=2.0, noise_clip_std=0)
    assert family.noise == (2.0, 2.0, 0.0)
    drawn = family.initial_noise(1, 32, 32, torch.Generator().manual_seed(0))
    torch.testing.assert_close(drawn, 2.0 * torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0)))
    text = {"input_ids": torch.zeros(1, 5, dtype=torch.int64), "length": torch.tensor([5])}
    out = family.sample_latents(lambda img, *args: img / 2, text, 64, 32, 28, seed=3, guidance=0.0)
    gen = torch.Generator("cpu").manual_seed(3 + 1)
    x = 2.0 * torch.randn(1, 3, 32, 64, generator=gen)
    sigmas = [t / 1000 for t in DEV_TIMESTEPS] + [0.0]
    for following in sigmas[1:]:  # the flash steps of test_dev_samples_with_the_flash_scheduler_on_its_timesteps
        x = following * 2.0 * torch.randn(x.shape, generator=gen) + (1 - following) * (x / 2)
    torch.testing.assert_close(out, x)
    for key, value in (("noise_scale_start", 0.0), ("noise_scale_end", -1.0), ("noise_clip_std", -0.5)):
        with pytest.raises(ValueError, match=f"{key} = {value}: expected"):
            HiDreamO1Family(tiny["hidream_o1"], **{key: value})


def test_a_kohya_lora_converts_to_comfyuis_names_and_reads_back(trained, tmp_path):
    """--to comfy writes ai-toolkit's / ComfyUI's diffusion_model.language_model... (the root's model. dropped); ours
    reads it back as the kohya file."""
    from tools import convert_lora

    comfy = tmp_path / "comfy.safetensors"
    assert convert_lora.main([str(trained / "o1.safetensors"), str(comfy), "--to", "comfy"]) == 0
    keys = load_file(comfy)
    assert "diffusion_model.language_model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    assert "diffusion_model.x_embedder.proj1.lora_B.weight" in keys
    back = tmp_path / "back.safetensors"
    assert convert_lora.main([str(comfy), str(back), "--to", "kohya", "--model_type", "hidream_o1"]) == 0
    ours, read = load_file(trained / "o1.safetensors"), load_file(back)
    for key in ours:
        if key.endswith("lora_down.weight"):
            base = key[: -len("lora_down.weight")]
            scale = (ours[base + "alpha"] / ours[key].shape[0]).item()
            scale_back = (read[base + "alpha"] / read[key].shape[0]).item()
            delta = scale * ours[base + "lora_up.weight"].float() @ ours[key].float()
            delta_back = scale_back * read[base + "lora_up.weight"].float() @ read[key].float()
            torch.testing.assert_close(delta_back, delta, rtol=1e-3, atol=1e-5)


def test_the_planner_steps_hidream_o1_on_meta(tiny):
    from library.training import memory_plan
    from tools import plan_memory

    family = HiDreamO1Family(tiny["hidream_o1"])
    args = plan_memory.default_args("hidream_o1")
    small, large = (memory_plan.training_plan(family, args, side, side, 1, 16) for side in (64, 128))
    assert 0 < small.activations < large.activations
    # the released config on meta (--preset hidream-o1): its release is the preset's (no path to read it from)
    preset = plan_memory.PresetFamily("hidream-o1")
    assert preset.version == FULL and memory_plan.training_plan(preset, args, 64, 64, 1, 16).activations > 0


def test_the_caption_cache_is_keyed_by_the_tokenizer_and_template_not_a_precision(tiny, monkeypatch):
    """The ids depend on the tokenizer's files (found beside the model) and the template (text_encoding_constants):
    another template re-encodes, another text_encoder_precision does not."""
    family = HiDreamO1Family(tiny["hidream_o1"])
    key = family.text_cache_key({}, "bf16")
    assert family.text_cache_key({}, "fp8") == key
    assert any(f.endswith("tokenizer_config.json") for f in family.text_files())
    monkeypatch.setattr(HiDreamO1Family, "text_encoding_constants", lambda self: {"template": "another"})
    assert family.text_cache_key({}, "bf16") != key


def test_the_patch_is_the_files(tiny, tmp_path):
    """The family packs pixels in the file's patch_size (released 32), read from its header, as the model builds its
    embedder from it: a 16 px file's 64 px image is 4 x 4 tokens of 768 values, and its loss runs on them."""
    from library.models.hidream_o1.checkpoint import save_hidream_o1_single_file
    from library.models.hidream_o1.tiny import random_hidream_o1, tiny_config

    assert HiDreamO1Family(tiny["hidream_o1"]).patch == 32
    config = tiny_config(vocab_size=1088)
    small = type(config)(**{**config.__dict__, "patch_size": 16})
    path = str(tmp_path / "o1-patch16.safetensors")
    save_hidream_o1_single_file(random_hidream_o1(small).state_dict(), path, small)
    family = HiDreamO1Family(path)
    assert family.patch == 16
    pixels = torch.rand(1, 3, 64, 64) * 2 - 1
    assert family.pack_target(pixels).shape == (1, 16, 768)
    ids = {"input_ids": torch.tensor([[5, 6, 1087]]), "length": torch.tensor([3])}
    loss = family.loss_at(family.load_transformer(torch.float32), pixels, ids, torch.randn_like(pixels),
                          torch.tensor([0.5]), None)
    assert torch.isfinite(loss)


def test_a_tokenizer_whose_tms_id_is_not_the_transformers_is_refused_before_caching(tiny, tmp_path, capsys):
    """The tokenizer's <|tms_token|> must be the transformer config's tms_token_id (the model replaces that id's
    embedding by the time): a file of another id beside the tiny tokenizer (as a released-shape file, read with the
    released 151673, beside a small tokenizer) would train and sample with no time in the model and fail nowhere.
    train_lora stops before caching with one line naming the tokenizer's folder and both ids."""
    import os
    import shutil

    from library.models.hidream_o1.tiny import write_tiny_hidream_o1

    folder = os.path.join(os.path.dirname(tiny["hidream_o1"]), "tokenizer")
    tms = HiDreamO1Family(tiny["hidream_o1"]).prompt_ids.tms_id
    path = write_tiny_hidream_o1(str(tmp_path), 0, tms_token_id=tms - 1)["hidream_o1"]
    shutil.copytree(folder, os.path.join(os.path.dirname(path), "tokenizer"))
    args = run_args(tiny, tmp_path / "out", "--pretrained_model_name_or_path", path)
    assert train_lora.main(args) == 2
    err = capsys.readouterr().err
    assert f"the tokenizer's <|tms_token|> is id {tms}, the transformer's" in err
    assert f"tms_token_id is {tms - 1}" in err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_a_lora_trained_at_another_noise_renders_at_it():
    """The noise keys are ConfigKey.renders keys: the LoRA's header records them (ss_trained_keys) and tools/generate.py
    sets them where left unset."""
    import argparse

    from library.lora_spec import LoRASpec
    from tools.generate import honour_lora_options

    header = {"ss_trained_keys": json.dumps({"noise_scale_start": 1.0, "noise_clip_std": 0.0})}
    assert HiDreamO1Family.lora_trained_options(header) == {"noise_scale_start": (1.0, "ss_trained_keys"),
                                                           "noise_clip_std": (0.0, "ss_trained_keys")}
    args = argparse.Namespace(model_type="hidream_o1", **dict.fromkeys(("noise_scale_start", "noise_scale_end",
                                                                        "noise_clip_std")))
    honour_lora_options(args, [LoRASpec("a.safetensors", 1.0)], [header])
    assert (args.noise_scale_start, args.noise_scale_end, args.noise_clip_std) == (1.0, None, 0.0)
