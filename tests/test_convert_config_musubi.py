"""tools/convert_config.py on musubi-tuner's configs (library/training/peers/musubi_tuner.py, musubi_dataset.py):
its documented Qwen-Image command line and a Qwen-Image-Edit config file translate into files our loaders
accept, the script or the config names the model (else one line asking for --model_type), and each key's
verdict says what it became; a converted config trains."""

import os
import re
import shlex

import pytest
import toml
from safetensors.torch import load_file

from library.data.dataset_config import load_dataset_config
from library.training.config import load_config
from library.training.peers import musubi_models, musubi_tuner
from library.training.peers.musubi_dataset import bucket_sides
from library.training.peers.rules import DROPPED, KEPT, NOT_CARRIED, RENAMED, argv_to_dict
from tools import convert_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MUSUBI = os.path.join(ROOT, ".peers", "musubi-tuner", "src", "musubi_tuner")

# docs/qwen_image.md's LoRA training command, the paths ours (DIT, VAE, TE, DATASET, OUT filled in)
DOCUMENTED = """accelerate launch --num_cpu_threads_per_process 1 --mixed_precision bf16 src/musubi_tuner/qwen_image_train_network.py \\
    --dit {dit} --vae {vae} --text_encoder {te} --model_version original --dataset_config {dataset} \\
    --sdpa --mixed_precision bf16 --timestep_sampling shift --weighting_scheme none --discrete_flow_shift 2.2 \\
    --optimizer_type adamw8bit --learning_rate 5e-5 --gradient_checkpointing \\
    --max_data_loader_n_workers 2 --persistent_data_loader_workers --network_module networks.lora_qwen_image \\
    --network_dim 16 --max_train_epochs 16 --save_every_n_epochs 1 --seed 42 \\
    --output_dir {out} --output_name name-of-lora"""


def musubi_dataset(path, image_dir, cache_dir, resolution="[64, 64]", extra=""):
    """A dataset TOML in musubi-tuner's format (its docs/dataset_config.md sample)."""
    path.write_text(f'[general]\nresolution = {resolution}\ncaption_extension = ".txt"\nbatch_size = 1\n'
                    f'enable_bucket = true\nbucket_no_upscale = false\n\n[[datasets]]\n'
                    f'image_directory = "{image_dir}"\ncache_directory = "{cache_dir}"\nnum_repeats = 1\n{extra}')
    return str(path)


@pytest.fixture(scope="module")
def documented(tiny_set, tmp_path_factory):
    """The documented command converted: (our config, our dataset TOML, its report)."""
    root = tmp_path_factory.mktemp("musubi_qwen")
    dataset = musubi_dataset(root / "musubi_dataset.toml", tiny_set["image_dir"], root / "cache")
    command = DOCUMENTED.format(dit=tiny_set["qwen_image"], vae=tiny_set["qwen_image_vae"],
                                te=tiny_set["qwen_image_text_encoder"], dataset=dataset, out=root / "out")
    out = str(root / "ours.toml")
    assert convert_config.main(["--command", command, "--out", out]) == 0
    return out, out[:-len(".toml")] + "_dataset.toml"


def test_documented_qwen_image_command_converts_to_files_our_loaders_accept(documented, tiny_set):
    config, dataset = documented
    args = load_config(["--config_file", config])
    assert (args.model_type, args.pretrained_model_name_or_path, args.ae) == (
        "qwen_image", tiny_set["qwen_image"], tiny_set["qwen_image_vae"])
    assert (args.timestep_sampling, args.discrete_flow_shift, args.weighting_scheme) == ("shift", 2.2, "none")
    assert (args.network_module, args.network_dim, args.network_alpha) == ("networks.lora", 16, 1.0)  # their alpha 1
    assert args.network_args == ["train_modulation=true"]  # musubi-tuner's Qwen-Image LoRA trains img_mod / txt_mod
    assert (args.learning_rate, args.max_train_epochs, args.optimizer_type) == (5e-5, 16, "adamw8bit")
    assert args.dataset_config == dataset
    ours = load_dataset_config(dataset).datasets[0]
    assert (ours.resolution, ours.enable_bucket, ours.subsets[0].image_dir) == ((64, 64), True, tiny_set["image_dir"])
    assert (ours.min_bucket_reso, ours.max_bucket_reso, ours.bucket_reso_steps) == (32, 128, 16)


def test_bucket_grid_is_musubi_tunes_bucket_selector():
    # BucketSelector: widths from divisible_by(sqrt(area) // 2, 16), heights divisible_by(area // w, 16)
    assert bucket_sides([960, 544]) == (352, 1472)
    assert bucket_sides(1024) == (512, 2048)


def test_the_bucket_line_says_how_ours_differs_from_their_grid():
    """Old: "musubi-tuner's bucket grid", while ours held 48 buckets of 95 theirs has not (at their default
    960x544): an image may train at another aspect ratio there. Every one of theirs is among ours."""
    from library.data.dataset_config import make_buckets
    from library.training.peers.musubi_dataset import grid_note, peer_buckets

    theirs = peer_buckets([960, 544])
    assert len(theirs) == 47 and {(544, 960), (960, 544), (720, 720)} <= theirs and theirs <= set(
        make_buckets((960, 544), 352, 1472, 16))
    assert grid_note("musubi-tuner", [960, 544], 352, 1472) == (
        "every bucket of musubi-tuner's grid (47) and 48 more (ours has a height for every width on the grid): an "
        "image may train at a nearer aspect ratio than there")


@pytest.mark.parametrize("module, given, ours, verdict", [
    ("networks.lora_qwen_image", None, "bf16", RENAMED),  # accelerate's "no": a float32 LoRA over its bf16 DiT
    ("networks.lora_qwen_image", "no", "bf16", RENAMED),
    ("networks.lora_qwen_image", "bf16", "bf16", KEPT),
    ("networks.lora_zimage", None, "no", KEPT),  # its Z-Image DiT is float32 unless bf16 / fp16 is given
    ("networks.lora_zimage", "no", "no", KEPT),
    ("networks.lora_zimage", "fp16", "fp16", KEPT),
])
def test_mixed_precision_keeps_the_dit_in_the_dtype_its_script_loads(module, given, ours, verdict):
    """musubi-tuner's mixed_precision is its LoRA's dtype and autocast; its script loads the DiT in bf16 whatever it
    says (Z-Image's in float32 unless bf16 / fp16), and unset it is accelerate's ("no" by default). Ours' "no"
    computes the whole base in float32: it was kept as "no" (the base at twice its memory), and unset ours' bf16
    went without a line."""
    t = musubi_tuner.translate({"network_module": module, **({"mixed_precision": given} if given else {})}, "c.toml")
    assert t.config["mixed_precision"] == ours
    assert verdict_of(t, "mixed_precision" if given else "mixed_precision (unset)")[0] == verdict


@pytest.mark.parametrize("no_upscale", [False, True])
def test_the_bucket_line_says_where_no_upscale_sizes_large_images_otherwise(no_upscale):
    """BucketSelector with no_upscale gives an image over the area its grid's bucket of the nearest aspect ratio
    (3958 x 2077 at 960 x 544: 976 x 528); ours sizes it on its own (976 x 512). The line said "every bucket of its
    grid" as without no_upscale."""
    from library.data.image_folders import bucket_without_upscale

    dataset = {"general": {"resolution": [960, 544], "enable_bucket": True, "bucket_no_upscale": no_upscale},
               "datasets": [{"image_directory": "i"}]}
    t = musubi_tuner.translate({"network_module": "networks.lora_zimage"}, "c.toml", dataset=dataset,
                               dataset_source="d.toml")
    note = next(line.note for line in t.lines if line.key == "datasets[0] buckets")
    assert ("sized on its own" in note) == no_upscale and ("every bucket" in note) == (not no_upscale)
    assert bucket_without_upscale((3958, 2077), 960 * 544, 16) == (976, 512)  # what the note says differs
    assert bucket_without_upscale((900, 500), 960 * 544, 16) == (896, 496)  # within the area: as there


def test_a_converted_config_trains_two_steps(documented, tmp_path):
    import train_lora

    config, _ = documented
    code = train_lora.main(["--config_file", config, "--output_dir", str(tmp_path), "--max_train_epochs", "none",
                            "--max_train_steps", "2", "--mixed_precision", "no", "--optimizer_type", "AdamW",
                            "--max_data_loader_n_workers", "0", "--persistent_data_loader_workers", "false",
                            "--save_every_n_epochs", "0", "--gradient_checkpointing", "false"])
    assert code == 0
    tensors = load_file(tmp_path / "name-of-lora.safetensors")
    assert tensors["lora_unet_transformer_blocks_0_img_mod_1.alpha"].item() == 1.0  # modulation trained, at alpha 1
    assert tensors["lora_unet_transformer_blocks_0_attn_to_q.lora_down.weight"].shape[0] == 16


def test_qwen_image_edit_config_with_control_directory(tmp_path):
    images, control = tmp_path / "images", tmp_path / "control"
    images.mkdir()
    control.mkdir()
    dataset = musubi_dataset(tmp_path / "ds.toml", images, tmp_path / "cache", "[1024, 1024]",
                             f'control_directory = "{control}"\ncontrol_resolution = [1024, 1024]\n')
    config = tmp_path / "edit.toml"
    config.write_text(f'[model]\ndit = "edit_dit.safetensors"\nvae = "vae.safetensors"\n'
                      f'text_encoder = "qwen_2.5_vl_7b.safetensors"\nmodel_version = "edit-2511"\n'
                      f'dataset_config = "{dataset}"\n[network]\nnetwork_module = "networks.lora_qwen_image"\n'
                      f'network_dim = 32\nnetwork_alpha = 32\n[training]\nfp8_base = true\nfp8_scaled = true\n'
                      f'timestep_sampling = "qwen_shift"\nblocks_to_swap = 16\noutput_dir = "{tmp_path / "out"}"\n'
                      f'output_name = "edit"\n')
    assert convert_config.main([str(config)]) == 0
    args = load_config(["--config_file", str(tmp_path / "edit_converted.toml")])
    assert (args.model_type, args.model_version, args.timestep_sampling) == ("qwen_image_edit", "qwen-image-edit-2511", "qwen_shift")
    assert (args.fp8_base, args.fp8_scaled, args.blocks_to_swap, args.network_alpha) == (True, True, 16, 32.0)
    subset = load_dataset_config(args.dataset_config).datasets[0].subsets[0]
    assert (subset.image_dir, subset.control_directory) == (str(images), str(control))


@pytest.mark.parametrize("control, verdict", [([1024, 1024], DROPPED), ([512, 512], NOT_CARRIED)])
def test_control_resolution_is_carried_where_it_is_the_resolutions_area(tmp_path, control, verdict):
    dataset = {"general": {"resolution": [1024, 1024]},
               "datasets": [{"image_directory": "i", "control_directory": "c", "control_resolution": control}]}
    t = musubi_tuner.translate({"network_module": "networks.lora_qwen_image", "model_version": "edit"}, "c.toml",
                               dataset=dataset, dataset_source="d.toml")
    assert verdict_of(t, "datasets[0].control_resolution")[0] == verdict
    assert t.dataset["datasets"][0]["subsets"][0]["control_directory"] == "c"


def test_references_beside_the_training_images_are_not_carried(tmp_path):
    """musubi-tuner takes a control_directory equal to image_directory (the captioned images are the targets, name_0.png
    their references); ours reads every image of image_dir as a target, and the written dataset trained each image as
    its own reference (now refused by the loader): not carried, with why."""
    dataset = {"datasets": [{"image_directory": "i", "control_directory": "i/."}]}
    t = musubi_tuner.translate({"network_module": "networks.lora_qwen_image", "model_version": "edit"}, "c.toml",
                               dataset=dataset, dataset_source="d.toml")
    verdict, why = verdict_of(t, "datasets[0].control_directory")
    assert verdict == NOT_CARRIED and "folder of their own" in why, why
    assert "control_directory" not in t.dataset["datasets"][0]["subsets"][0]


@pytest.mark.parametrize("keys, verdicts", [
    ({}, {}), ({"no_resize_control": True}, {"no_resize_control": DROPPED}),
    ({"control_resolution": [1024, 1024], "no_resize_control": True},
     {"control_resolution": DROPPED, "no_resize_control": DROPPED}),
    ({"control_resolution": [512, 512]}, {"control_resolution": NOT_CARRIED})])
def test_flux2_references_keep_their_size_up_to_1_mp(keys, verdicts):
    """FLUX.2 trains on control_directory (was refused: "this model takes none here"); ours keeps a reference's own
    size up to 1 MP (the pipelines'), its default fits it to the target: said on the folder's line."""
    dataset = {"general": {"resolution": [512, 512]}, "datasets": [{"image_directory": "i", "control_directory": "c",
                                                                   **keys}]}
    t = musubi_tuner.translate({"network_module": "networks.lora_flux_2", "model_version": "klein-base-4b"}, "c.toml",
                               dataset=dataset, dataset_source="d.toml")
    assert t.dataset["datasets"][0]["subsets"][0]["control_directory"] == "c"
    line = [line for line in t.lines if line.key == "datasets[0].control_directory"][0]
    assert ("1024 x 1024" in line.note) == (not keys), line.note
    for key, verdict in verdicts.items():
        assert verdict_of(t, f"datasets[0].{key}")[0] == verdict


@pytest.mark.parametrize("version", ["klein-4b", "klein-base-9b"])
def test_flux2_model_version_is_carried_where_it_says_the_distilled_klein(version):
    """Its model_version klein-4b (the step-distilled [klein]) was dropped ("ours tells ... from the checkpoint"),
    which a single file cannot say: samples ran 50 steps with CFG on the distilled model. Carried now."""
    t = musubi_tuner.translate({"network_module": "networks.lora_flux_2", "model_version": version}, "c.toml")
    assert (t.config["model_type"], t.config["model_version"]) == ("flux2", version)


def test_command_tells_the_model_from_the_script(tmp_path):
    command = ("accelerate launch src/musubi_tuner/flux_kontext_train_network.py --dit flux1-kontext-dev.safetensors "
               "--vae ae.safetensors --text_encoder1 t5xxl_fp16.safetensors --text_encoder2 clip_l.safetensors "
               "--blocks_to_swap 10 --timestep_sampling flux_shift --network_module networks.lora_flux "
               f"--output_dir {tmp_path}")
    t = musubi_tuner.translate(argv_to_dict(shlex.split(command)[3:]), "command line",
                               script="src/musubi_tuner/flux_kontext_train_network.py")
    assert t.config["model_type"] == "flux_kontext"
    assert (t.config["t5xxl"], t.config["clip_l"]) == ("t5xxl_fp16.safetensors", "clip_l.safetensors")
    assert t.config["blocks_to_swap"] == 20  # their count: 5 double + 10 single blocks, ~20 single blocks' bytes
    assert t.config["network_args"] == ["train_modulation=false"]  # its default excludes the modulation
    assert t.config["network_alpha"] == 1.0 and t.config["learning_rate"] == 2e-6  # its defaults


# docs/ideogram4.md's LoRA training command: PowerShell, backtick continuations and Windows paths
DOCUMENTED_POWERSHELL = r"""accelerate launch --num_cpu_threads_per_process 1 --mixed_precision bf16 src/musubi_tuner/ideogram4_train_network.py `
  --dataset_config path\to\dataset.toml `
  --dit path\to\ideogram4_fp8_scaled.safetensors `
  --network_module networks.lora_ideogram4 `
  --output_dir outputs\i4_lora `
  --output_name my_i4_lora `
  --mixed_precision bf16 `
  --sdpa"""


def test_a_powershell_command_keeps_its_paths_and_continuations_are_no_values(tmp_path, capsys):
    """POSIX splitting dropped the backslashes (pathtoideogram4_fp8_scaled.safetensors) and read each backtick as a
    second value: dit = ['...', '`'], a config train_lora.py refused."""
    dataset = musubi_dataset(tmp_path / "dataset.toml", "images", "cache")
    out = str(tmp_path / "i4.toml")
    assert convert_config.main(["--command", DOCUMENTED_POWERSHELL, "--dataset_config", dataset, "--out", out]) == 0
    written = toml.load(out)
    assert (written["model_type"], written["pretrained_model_name_or_path"], written["output_dir"]) == (
        "ideogram4", "path\\to\\ideogram4_fp8_scaled.safetensors", "outputs\\i4_lora")
    assert (written["output_name"], written["mixed_precision"]) == ("my_i4_lora", "bf16")
    assert "\n  not carried " not in capsys.readouterr().out  # no line: every key read


def verdict_of(t, key):
    line = next(line for line in t.lines if line.key == key)
    return line.verdict, line.text


@pytest.mark.parametrize("config, key, verdict, ours", [
    ({"timestep_sampling": "flux2_shift", "model_version": "klein-4b"}, "timestep_sampling", RENAMED, "flux_shift"),
    ({"timestep_sampling": "flux2_shift", "network_module": "networks.lora_zimage"}, "timestep_sampling", NOT_CARRIED, None),
    ({"timestep_sampling": "qwen_shift", "model_version": "dev"}, "timestep_sampling", NOT_CARRIED, None),
    ({"timestep_sampling": "logsnr", "network_module": "networks.lora_qwen_image"}, "timestep_sampling", KEPT,
     "logsnr"),
    ({"timestep_sampling": "logsnr", "logit_mean": -6.0, "network_module": "networks.lora_qwen_image"}, "logit_mean",
     RENAMED, ("logsnr_mean", -6.0)),
    ({"timestep_sampling": "logsnr", "logit_std": 2.0, "network_module": "networks.lora_qwen_image"},
     "logit_mean (unset)", KEPT, ("logsnr_mean", 0.0)),
    ({"timestep_sampling": "qinglong_qwen", "network_module": "networks.lora_qwen_image"}, "timestep_sampling",
     RENAMED, ("timestep_sampling", "qinglong")),
    ({"weighting_scheme": "logit_normal", "logit_std": 1.5, "network_module": "networks.lora_zimage"},
     "logit_std", RENAMED, ("sigmoid_scale", 1.5)),
    ({"weighting_scheme": "logit_normal", "logit_mean": 0.5, "network_module": "networks.lora_zimage"},
     "logit_mean", RENAMED, ("sigmoid_mean", -0.5)),  # its sigma 1 - u (not carried before 2026-12-05)
    ({"weighting_scheme": "mode", "mode_scale": 1.0, "network_module": "networks.lora_zimage"},
     "mode_scale", KEPT, ("mode_scale", 1.0)),
    ({"weighting_scheme": "mode", "network_module": "networks.lora_zimage"},
     "timestep_sampling (unset)", KEPT, ("timestep_sampling", "mode")),
    ({"weighting_scheme": "mode", "mode_scale": 2.0, "network_module": "networks.lora_zimage"},
     "timestep_sampling (unset)", NOT_CARRIED, None),
    ({"weighting_scheme": "logit_normal", "mode_scale": 1.0, "network_module": "networks.lora_zimage"},
     "mode_scale", DROPPED, None),
    ({"xformers": True, "network_module": "networks.lora_zimage"}, "xformers", DROPPED, None),
    ({"sage_attn": True, "network_module": "networks.lora_zimage"}, "sage_attn", NOT_CARRIED, None),
    ({"fp8_vl": True, "network_module": "networks.lora_qwen_image"}, "fp8_vl", RENAMED, ("text_encoder_precision", "fp8")),
    ({"resume": "out/state", "network_module": "networks.lora_krea2"}, "resume", NOT_CARRIED, None),
    ({"lr_scheduler": "rex", "network_module": "networks.lora_krea2"}, "lr_scheduler", KEPT, "rex"),
    ({"lr_scheduler": "adafactor", "network_module": "networks.lora_krea2"}, "lr_scheduler", NOT_CARRIED, None),
    ({"min_timestep": 100, "timestep_sampling": "shift", "network_module": "networks.lora_krea2"}, "min_timestep",
     KEPT, 100),
    ({"min_timestep": 100, "network_module": "networks.lora_krea2"}, "min_timestep", RENAMED,  # its sigma draw:
     ("max_timestep", 900)),  # the range mirrored (test_its_sigma_draws_range_is_mirrored_into_ours)
    ({"max_timestep": 900, "preserve_distribution_shape": True, "timestep_sampling": "shift",
      "network_module": "networks.lora_krea2"}, "preserve_distribution_shape", KEPT, True),
    ({"max_timestep": 900, "preserve_distribution_shape": True, "network_module": "networks.lora_krea2"},
     "preserve_distribution_shape", DROPPED, None),
    ({"guidance_scale": 3.5, "network_module": "networks.lora_qwen_image"}, "guidance_scale", DROPPED, None),
    ({"num_timestep_buckets": 5, "timestep_sampling": "shift", "network_module": "networks.lora_krea2"},
     "num_timestep_buckets", KEPT, 5),
    ({"num_timestep_buckets": 1, "network_module": "networks.lora_krea2"}, "num_timestep_buckets", DROPPED, None),
    ({"num_timestep_buckets": 5, "timestep_sampling": "sigma", "network_module": "networks.lora_krea2"},
     "num_timestep_buckets", DROPPED, None),
    ({"num_timestep_buckets": 5, "max_timestep": 900, "preserve_distribution_shape": True, "timestep_sampling": "shift",
      "network_module": "networks.lora_krea2"}, "num_timestep_buckets", NOT_CARRIED, None),
    ({"network_module": "networks.lokr", "model_version": "edit-2509"}, "network_module", RENAMED,
     ("network_module", "lycoris.kohya")),
    ({"base_weights": ["a.safetensors"], "base_weights_multiplier": [0.5], "network_module": "networks.lora_zimage"},
     "base_weights", RENAMED, ("base_loras", ["a.safetensors:0.5"])),
    ({"save_last_n_steps": 300, "save_every_n_steps": 100, "network_module": "networks.lora_zimage"},
     "save_last_n_steps", RENAMED, ("save_last_n_saves", 4)),
])
def test_each_key_says_what_it_became(config, key, verdict, ours):
    t = musubi_tuner.translate(config, "c.toml")
    assert verdict_of(t, key)[0] == verdict
    if isinstance(ours, tuple):
        assert t.config[ours[0]] == ours[1]
    elif ours is not None:
        assert t.config[key] == ours


def test_sample_intervals_are_both_kept_as_musubi_tuner_renders_both(tmp_path):
    """musubi-tuner's should_sample_images fires on either interval; the steps' were dropped "(with
    sample_every_n_epochs musubi-tuner renders the epochs' samples only)", sd-scripts' reading. sd-scripts' still."""
    from library.training.peers import sd_scripts

    (tmp_path / "p.txt").write_text("a cat --w 64 --h 64\n")
    given = {"sample_prompts": str(tmp_path / "p.txt"), "sample_every_n_steps": 100, "sample_every_n_epochs": 1}
    t = musubi_tuner.translate({**given, "network_module": "networks.lora_zimage"}, "c.toml")
    assert (t.config["sample_every_n_steps"], t.config["sample_every_n_epochs"]) == (100, 1)
    t = sd_scripts.translate({**given, "network_train_unet_only": True}, "c.toml")
    assert "sample_every_n_steps" not in t.config and verdict_of(t, "sample_every_n_steps")[0] == DROPPED


@pytest.mark.parametrize("config", [{"network_module": "networks.lora_flux"}, {"model_version": "dev"}])
def test_guidance_scale_is_dropped_where_its_training_feeds_the_guidance_embedding_1(config):
    """musubi-tuner's FLUX.1 Kontext and FLUX.2 [dev] training pass guidance 1.0 and only write guidance_scale into the
    header: it was kept, and ours then trained at 3.5."""
    t = musubi_tuner.translate({"guidance_scale": 3.5, **config}, "c.toml")
    assert verdict_of(t, "guidance_scale")[0] == DROPPED
    assert "guidance_scale" not in t.config


def test_musubi_tuners_defaults_are_written_where_they_differ():
    # its sigma draw (uniform, unshifted), alpha 1, dim 4, lr 2e-6, fp8_base's plain cast, 8 workers
    t = musubi_tuner.translate({"network_module": "networks.lora_zimage", "fp8_base": True,
                                "persistent_data_loader_workers": True}, "c.toml")
    assert {k: t.config[k] for k in ("timestep_sampling", "network_alpha", "network_dim", "learning_rate", "fp8_scaled",
                                     "max_data_loader_n_workers")} == {
        "timestep_sampling": "uniform", "network_alpha": 1.0, "network_dim": 4, "learning_rate": 2e-6,
        "fp8_scaled": False, "max_data_loader_n_workers": 8}
    shifted = musubi_tuner.translate({"network_module": "networks.lora_zimage", "timestep_sampling": "shift"}, "c.toml")
    assert shifted.config["discrete_flow_shift"] == 1.0  # theirs; ours would be 3


def test_a_config_that_does_not_say_the_model_asks_for_model_type(tmp_path, capsys):
    config = tmp_path / "musubi.toml"
    config.write_text('dit = "dit.safetensors"\nvae = "vae.safetensors"\nnetwork_dim = 16\n')
    assert convert_config.main([str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    modules = ", ".join(musubi_models.lora_modules())
    assert err == [f"error: {config}: musubi-tuner's config does not say the model (its training script does): add "
                   f"its network_module to it ({modules}), or give --model_type (one of "
                   f"{', '.join(musubi_tuner.MODEL_TYPES)})"]
    assert not (tmp_path / "musubi_converted.toml").exists()
    assert convert_config.main([str(config), "--model_type", "zimage"]) == 0


def test_the_script_and_the_config_disagreeing_is_one_error():
    with pytest.raises(ValueError, match="zimage_train_network.py trains zimage, network_module networks.lora_qwen_image "
                                         "qwen_image: they disagree"):
        musubi_tuner.translate({"network_module": "networks.lora_qwen_image"}, "command line",
                               script="zimage_train_network.py")


def converted_prompts(tmp_path, module: str, text: str) -> tuple[str, str]:
    """A musubi-tuner config of `module` with a prompt file holding `text`, converted: (its prompt file, ours)."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(text)
    config = tmp_path / "c.toml"
    config.write_text(f'dit = "d"\nnetwork_module = "{module}"\nsample_prompts = "{prompts}"\n')
    assert convert_config.main([str(config)]) == 0
    return str(prompts), toml.load(tmp_path / "c_converted.toml")["sample_prompts"]


@pytest.mark.parametrize("module, lines", [
    ("networks.lora_krea2", {"A fox. --l 1 --d 0": "A fox. --d 0 --l 0",
                             "A fox. --l 5.5 --n blurry": "A fox. --n blurry --l 4.5",
                             "A fox. --n blurry": "A fox. --n blurry --l 4.5", "A fox. --l 7": "A fox. --l 0"}),
    ("networks.lora_zimage", {"A fox. --l 1": "A fox. --l 0", "A fox. --l 5.5 --n blurry": "A fox. --n blurry --l 5.5",
                              "A fox.": "A fox. --l 4"}),
])
def test_sample_prompts_cfg_scale_is_what_its_samples_rendered_with(tmp_path, module, lines):
    """musubi-tuner's Krea 2 samples run standard CFG at --l (its official guidance + 1: 5.5 unset) only with a --n
    and above 1, its Z-Image ones above 1 (4.0 unset); ours (as diffusers' pipelines) reads --l as the release's
    guidance, on above 0. Copied as they were, its recommended Krea 2 Turbo line (--l 1) ran CFG 2 here, its --l 5.5
    6.5, a line without --l and --n CFG 5.5 where it ran none. Now each line's --l is the scale it rendered with."""
    _, ours = converted_prompts(tmp_path, module, "\n".join(lines) + "\n")
    assert ours == str(tmp_path / "c_converted_prompts.txt")
    assert open(ours).read().splitlines() == list(lines.values())


def test_sample_prompts_of_a_model_whose_samples_read_l_as_ours_are_used_as_they_are(tmp_path):
    theirs, ours = converted_prompts(tmp_path, "networks.lora_qwen_image", "A fox. --l 4 --n blurry\nA cat.\n")
    assert ours == theirs


def test_sample_prompts_lose_the_flags_ours_does_not_read(tmp_path):
    from library.data.prompts import read_prompt_file

    _, ours = converted_prompts(tmp_path, "networks.lora_zimage",
                                "# cats\nA cat on the grass. --w 640 --h 480 --f 1 --d 1 --s 20 --fs 3.0\n")
    assert ours == str(tmp_path / "c_converted_prompts.txt")
    prompt, = read_prompt_file(ours, decode=False)
    assert (prompt.prompt, prompt.width, prompt.height, prompt.seed, prompt.steps) == ("A cat on the grass.", 640, 480, 1, 20)
    assert prompt.flow_shift == 3.0  # its samples read --fs, as ours do (dropped until ours read it, 2026-11-30)


def test_our_dataset_loader_names_the_command_for_a_musubi_dataset(tmp_path):
    path = musubi_dataset(tmp_path / "musubi.toml", tmp_path, tmp_path / "cache")
    with pytest.raises(ValueError) as e:
        load_dataset_config(path)
    assert str(e.value).endswith(f"; {path} is a musubi-tuner dataset TOML: `python tools/convert_config.py <its "
                                 f"training config> --dataset_config {path}` writes it as ours and says what "
                                 f"becomes of each key")
    assert "unknown key 'image_directory'" in str(e.value)


def test_our_config_loader_names_musubi_tuner_for_its_keys(tmp_path):
    from library.errors import ConfigError

    config = tmp_path / "musubi.toml"
    config.write_text('dit = "d"\nvae = "v"\n')
    with pytest.raises(ConfigError, match=re.escape("(musubi-tuner keys: `python tools/convert_config.py")):
        load_config(["--config_file", str(config)])


def test_a_dataset_ours_cannot_read_is_not_carried_with_why():
    dataset = {"datasets": [{"image_jsonl_file": "meta.jsonl", "cache_directory": "c"},
                            {"video_directory": "v", "target_frames": [1, 25]}]}
    t = musubi_tuner.translate({"network_module": "networks.lora_zimage", "dataset_config": "d.toml"}, "c.toml",
                               dataset=dataset, dataset_source="d.toml")
    assert t.dataset is None
    assert [verdict_of(t, k)[0] for k in ("datasets[0].image_jsonl_file", "datasets[1].video_directory",
                                          "dataset_config")] == [NOT_CARRIED] * 3


@pytest.mark.skipif(not os.path.isdir(MUSUBI), reason="no musubi-tuner checkout in .peers/")
def test_every_argument_of_the_image_scripts_has_a_rule():
    files = ["training/parser_common.py", "hv_train_network.py", "qwen_image/qwen_image_utils.py",
             "flux_2/flux2_utils.py", *musubi_tuner.SCRIPTS]
    arguments = set()
    for name in files:
        with open(os.path.join(MUSUBI, name), encoding="utf-8") as f:
            text = f.read()
        if name == "hv_train_network.py":  # its own parser only (the rest is HunyuanVideo's trainer)
            text = text[text.index("def hv_setup_parser"):text.index("def main")]
        text = "\n".join(line for line in text.splitlines() if not line.strip().startswith("#"))
        arguments |= set(re.findall(r'add_argument\(\s*"--(\w+)"', text))
    assert sorted(arguments - set(musubi_tuner.RULES)) == []
    assert sorted(set(musubi_tuner.RULES) - arguments) == []


def test_the_data_layers_musubi_keys_are_the_peer_modules():
    from library.data.peer_keys import MUSUBI_DATASET_KEYS
    from library.training.peers.musubi_dataset import dataset_keys

    assert set(MUSUBI_DATASET_KEYS) == dataset_keys()


@pytest.mark.parametrize("config, message", [
    ({"num_timestep_buckets": "x"}, "c.toml: num_timestep_buckets = 'x': "),
    ({"sample_prompts": ["a.txt"]}, "c.toml: sample_prompts = ['a.txt']: "),
    ({"blocks_to_swap": "x"}, "c.toml: blocks_to_swap = 'x': invalid literal"),
])
def test_a_value_of_another_type_is_one_line_naming_its_key(config, message):
    """The first two were tracebacks (TypeError), the third a ValueError naming neither the file nor the key."""
    with pytest.raises(ValueError) as e:
        musubi_tuner.translate({"network_module": "networks.lora_zimage", **config}, "c.toml")
    assert str(e.value).startswith(message)


def test_a_resolution_too_small_for_its_buckets_is_one_line():
    """bucket_sides divided by a shortest side of 0 (ZeroDivisionError) below 32 px."""
    dataset = {"datasets": [{"image_directory": "/i", "resolution": 8, "enable_bucket": True}]}
    with pytest.raises(ValueError, match=r"^d.toml: resolution: 8 is too small for its buckets"):
        musubi_tuner.translate({"network_module": "networks.lora_zimage"}, "c.toml", dataset=dataset, dataset_source="d.toml")


def test_a_command_lines_words_become_numbers_only_where_they_read_back_as_written():
    """`--output_name 001` became 1 (the LoRA named 1.safetensors); numbers and flags as before."""
    assert argv_to_dict(["--output_name", "001", "--network_dim", "16", "--learning_rate", "1e-4", "--w", "-0.5",
                         "--sdpa", "--seed", "+3", "--name", "nan"]) == {
        "output_name": "001", "network_dim": 16, "learning_rate": 1e-4, "w": -0.5, "sdpa": True, "seed": "+3",
        "name": "nan"}


def test_a_word_no_flag_takes_is_refused_not_taken_as_a_second_value():
    """musubi-tuner's docs end a command with `--model_version edit-2511 \\` and a `...` line: the `...` became a second
    value ['edit-2511', '...'], read as off, and the edit command converted to text-to-image qwen_image without a
    word; `(... other args ...)` after --dataset_config wrote a list there. Its argparse refuses such a word; so does
    ours, naming it; several words stay a list where its argparse takes them (network_args, base_weights ...)."""
    with pytest.raises(ValueError, match=r"^command line: '\.\.\.' after --model_version 'edit-2511': no argument"):
        argv_to_dict(["--network_module", "networks.lora_qwen_image", "--model_version", "edit-2511", "..."])
    with pytest.raises(ValueError, match=r"^command line: 'x' before the first flag"):
        argv_to_dict(["x", "--sdpa"])
    assert argv_to_dict(["--network_args", "a=1", "b=2", "--base_weights", "p.safetensors", "q.safetensors",
                         "--flag", "--dim", "4"]) == {
        "network_args": ["a=1", "b=2"], "base_weights": ["p.safetensors", "q.safetensors"], "flag": True, "dim": 4}


@pytest.mark.parametrize("script, given, read", [
    ("src/musubi_tuner/zimage_train_network.py", (), "bf16"),
    ("src/musubi_tuner/zimage_train_network.py", ("--mixed_precision", "fp16"), "fp16"),
    ("flux_train_network.py", (), None)])  # sd-scripts: its parser's default "no" wins over accelerate's flag
def test_accelerates_launch_flag_is_musubi_tuners_mixed_precision_where_the_script_gives_none(script, given, read):
    """`accelerate launch --mixed_precision bf16 <script>` without the script's own flag: musubi-tuner's parser
    default None leaves accelerate's bf16 in force; the converter wrote "no" (Z-Image's DiT then float32)."""
    from argparse import Namespace

    from tools.convert_config import read_peer_config

    command = " ".join(["accelerate launch --num_cpu_threads_per_process 1 --mixed_precision bf16", script,
                        "--network_dim 8", *given])
    flat, _, _ = read_peer_config(Namespace(config=None, command=command))
    assert flat.get("mixed_precision") == read


def test_the_peer_reads_a_familys_musubi_names_from_its_spec_only(monkeypatch):
    """musubi_tuner.py names no model: the spec's peer_models["musubi-tuner"] is what it maps. A spec whose script,
    LoRA module, version and draw are renamed is read by the new names, and the old script is then refused."""
    from dataclasses import replace

    from library.models.registry import arch_specs, spec_of
    from library.models.spec import MusubiModels, PeerDraw
    from library.training.peers import musubi_models

    renamed = MusubiModels("zeta_train_network.py", "networks.lora_zeta", "zimage", versions={"turbo": {"model_type": "zimage"}},
                           versions_unread="read from the checkpoint", draws={"zeta_shift": PeerDraw("shift")}, swap_scale=3)
    specs = {arch: replace(spec, peer_models={**spec.peer_models, "musubi-tuner": renamed}) if arch == "zimage" else spec
             for arch, spec in arch_specs().items()}
    monkeypatch.setattr(musubi_models, "arch_specs", lambda: specs)
    monkeypatch.setattr(musubi_models, "spec_of", lambda model_type: specs[spec_of(model_type).arch])
    t = musubi_tuner.translate({"network_module": "networks.lora_zeta", "model_version": "turbo",
                                "timestep_sampling": "zeta_shift", "blocks_to_swap": 4}, "c.toml", script="zeta_train_network.py")
    assert {k: t.config[k] for k in ("model_type", "network_module", "timestep_sampling", "blocks_to_swap")} == {
        "model_type": "zimage", "network_module": "networks.lora", "timestep_sampling": "shift", "blocks_to_swap": 12}
    assert verdict_of(t, "model_version") == (DROPPED, "read from the checkpoint")
    with pytest.raises(ValueError, match="zimage_train_network.py: not one of musubi-tuner's image LoRA scripts"):
        musubi_tuner.translate({}, "c.toml", script="zimage_train_network.py")


@pytest.mark.parametrize("args, carried", [
    (None, False),  # relative_step: musubi-tuner's default (trainer_base.get_optimizer), its own lr
    (["relative_step=False", "warmup_init=True"], False),  # warmup_init turns relative_step back on there
    (["relative_step=False", "scale_parameter=False", "warmup_init=False"], True),
])
def test_adafactor_with_relative_step_is_not_carried(args, carried):
    """Old: optimizer_type Adafactor was "kept" at musubi-tuner's relative_step, which sets its own lr; the written
    config then failed our check (sd-scripts' converter refused it already)."""
    config = {"network_module": "networks.lora_qwen_image", "optimizer_type": "Adafactor",
              **({"optimizer_args": args} if args else {})}
    t = musubi_tuner.translate(config, "c.toml")
    assert verdict_of(t, "optimizer_type")[0] == (KEPT if carried else NOT_CARRIED)
    assert ("optimizer_type" in t.config) == carried and ("optimizer_args" in t.config) == carried
    if not carried:
        assert "relative_step (musubi-tuner's default) sets its own lr" in verdict_of(t, "optimizer_type")[1]


def test_a_kontext_prompts_fs_0_is_its_own_schedule_not_a_refused_line(tmp_path):
    """musubi-tuner's docs: `--fs 0` samples FLUX.1 Kontext on its flux_shift (its sampler: no shift given); the line
    was copied as written and our reader refused the file when training started ("--fs must be a number > 0")."""
    from library.data.prompts import read_prompt_file

    _, ours = converted_prompts(tmp_path, "networks.lora_flux", "a cat --fs 0 --d 1\na dog --fs 3\n")
    assert open(ours).read().splitlines() == ["a cat --d 1", "a dog --fs 3"]
    assert [p.flow_shift for p in read_prompt_file(ours, guidance_is_cfg=False)] == [None, 3.0]


def test_a_toml_prompt_file_of_its_objects_becomes_our_prompt_lines(tmp_path):
    """musubi-tuner's .toml prompts ([prompt] with [[prompt.subset]], its keys cfg_scale, discrete_flow_shift,
    control_image_path ...) were passed on as they were; our reader refused them at training start ("key 'cfg_scale'
    is not read"). Now they are written as its prompt lines, which the line rules carry."""
    from library.data.prompts import read_prompt_file

    prompts = tmp_path / "prompts.toml"
    prompts.write_text('[prompt]\nwidth = 512\nheight = 512\nsample_steps = 20\n'
                       '[[prompt.subset]]\nprompt = "a cat"\nseed = 1\ndiscrete_flow_shift = 3.0\n'
                       '[[prompt.subset]]\nprompt = "a dog"\nseed = 2\nframe_count = 1\nnegative_prompt = "blurry"\n')
    config = tmp_path / "c.toml"
    config.write_text(f'dit = "d"\nnetwork_module = "networks.lora_flux"\nsample_prompts = "{prompts}"\n')
    assert convert_config.main([str(config)]) == 0
    ours = toml.load(tmp_path / "c_converted.toml")["sample_prompts"]
    assert open(ours).read().splitlines() == ["a cat --w 512 --h 512 --s 20 --d 1 --fs 3.0",
                                              "a dog --w 512 --h 512 --s 20 --d 2 --n blurry"]
    read = read_prompt_file(ours, guidance_is_cfg=False)
    assert [(p.prompt, p.width, p.seed, p.flow_shift, p.negative) for p in read] == [
        ("a cat", 512, 1, 3.0, ""), ("a dog", 512, 2, None, "blurry")]


@pytest.mark.parametrize("bounds", [{"min_timestep": 100, "max_timestep": 600}, {"min_timestep": 300},
                                    {"max_timestep": 800}])
def test_its_sigma_draws_range_is_mirrored_into_ours(bounds):
    """Its default sigma draw (trainer_base, restated: u of weighting_scheme's density, indices u (max - min) + min,
    its FlowMatchDiscreteScheduler's timesteps linspace(1, 0, 1001)[:-1] x 1000 at them, sigma = timestep / 1000)
    trains sigmas from 1 - max / 1000 to 1 - min / 1000: the converter's min_timestep / max_timestep hold that range
    (they were copied as they are: min_timestep 300 trained sigma <= 0.7 there and >= 0.3 here). KS of 200 000
    draws < 0.006 (its grid's steps 0.001); preserve_distribution_shape, unread by that draw, is dropped."""
    from types import SimpleNamespace

    import torch

    from library.models import flow_matching as fm

    lo, hi = bounds.get("min_timestep", 0), bounds.get("max_timestep", 1000)
    u = torch.rand(200_000, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    timesteps = torch.linspace(1, 0, 1001, dtype=torch.float64)[:-1] * 1000
    theirs = timesteps[(u * (hi - lo) + lo).long()] / 1000
    t = musubi_tuner.translate({**bounds, "preserve_distribution_shape": True,
                                "network_module": "networks.lora_qwen_image"}, "c.toml")
    ours_lo, ours_hi = fm.timestep_range(SimpleNamespace(min_timestep=t.config.get("min_timestep"),
                                                         max_timestep=t.config.get("max_timestep")))
    assert t.config["timestep_sampling"] == "uniform" and "preserve_distribution_shape" not in t.config
    ours = fm.sigmas_in_range(lambda n: fm.sample_sigmas(n, "uniform", generator=torch.Generator().manual_seed(3)),
                              200_000, ours_lo, ours_hi, False).double()
    grid = torch.linspace(0, 1, 2001, dtype=torch.float64)
    cdfs = [torch.searchsorted(d.sort().values, grid, right=True).double() / len(d) for d in (ours, theirs)]
    assert (cdfs[0] - cdfs[1]).abs().max().item() < 0.006
