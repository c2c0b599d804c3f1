"""tools/convert_config.py on the peers' HiDream-O1-Image configs. musubi-tuner's hidream_o1_train_network.py: its
documented command line becomes a config train_lora.py reads and trains (the release from its --model_type, its x0
loss as ours' sigma_sq, its noise settings ours' keys of the same names, buckets on its 32 px),
and every argument of its own parser has a line. ai-toolkit's hidream_o1 job as its UI writes it, and one at its
defaults: the network ours builds on the tiny model trains the Linears ai-toolkit's LoRA wraps; its noise_scale
trains as ours' noise keys (unclipped, Dev's too)."""

from types import SimpleNamespace

import pytest
import torch.nn as nn

from library.data.dataset_config import load_dataset_config
from library.models.hidream_o1.family import NOISE, NOISE_KEYS, HiDreamO1Family
from library.models.hidream_o1.spec import DEV, FULL
from library.training.config import load_config, lora_network_args
from library.training.peers import ai_toolkit, musubi_tuner
from library.training.peers.musubi_dataset import bucket_sides, peer_buckets
from library.training.peers.ai_toolkit_model import release_of
from library.training.peers.rules import DROPPED, KEPT, NOT_CARRIED, RENAMED, argv_to_dict
from networks.lora import LoRANetwork
from tests.test_convert_config_musubi import musubi_dataset, verdict_of
from tools import convert_config

# docs/hidream_o1.md's LoRA training command (kohya-ss/musubi-tuner 30c658c), the paths ours (DIT, DATASET, OUT)
DOCUMENTED = """accelerate launch --num_cpu_threads_per_process 1 --mixed_precision bf16 src/musubi_tuner/hidream_o1_train_network.py \\
    --dit {dit} \\
    --dataset_config {dataset} \\
    --model_type full --task t2i \\
    --mixed_precision bf16 \\
    --timestep_sampling uniform --weighting_scheme none \\
    --noise_scale_start 8.0 --noise_scale_end 8.0 --noise_clip_std 0.0 \\
    --optimizer_type adamw8bit --learning_rate 4e-5 \\
    --gradient_checkpointing \\
    --network_module networks.lora_hidream_o1 --network_dim 32 \\
    --max_train_epochs 16 --save_every_n_epochs 1 --seed 42 \\
    --output_dir {out} --output_name hidream_o1_lora"""

# hidream_o1_setup_parser's arguments (hidream_o1_train_network.py), each with the verdict a typical value gets
THEIR_OWN = {"model_type": ("dev", RENAMED), "task": ("i2i", NOT_CARRIED), "noise_scale_start": (7.5, KEPT),
             "noise_scale_end": (7.5, KEPT), "noise_clip_std": (2.5, KEPT), "fp8_scaled": (True, KEPT),
             "skip_t2i_visual_dummy": (True, DROPPED), "dino_loss_weight": (0.05, NOT_CARRIED),
             **{name: (value, DROPPED) for name, value in (
                 ("dino_loss_backend", "vit"), ("dino_loss_model_type", "small"), ("dino_loss_layer", -4),
                 ("dino_loss_feature_mode", "patch"), ("dino_loss_resize", 224), ("dino_loss_use_gram", True),
                 ("dino_loss_no_norm", True), ("dino_loss_every_n_steps", 2))}}


@pytest.fixture(scope="module")
def documented(tiny_set, tmp_path_factory):
    """The documented command converted: (our config, our dataset TOML, the translation)."""
    root = tmp_path_factory.mktemp("musubi_o1")
    dataset = musubi_dataset(root / "musubi_dataset.toml", tiny_set["image_dir"], root / "cache")
    command = DOCUMENTED.format(dit=tiny_set["hidream_o1"], dataset=dataset, out=root / "out")
    out = str(root / "ours.toml")
    assert convert_config.main(["--command", command, "--out", out]) == 0
    words = convert_config.command_words(command)
    script = next(w for w in words if w.endswith(".py"))
    t = musubi_tuner.translate(argv_to_dict(words[words.index(script) + 1:]), "command line", script=script)
    return out, out[:-len(".toml")] + "_dataset.toml", t


def test_the_documented_command_converts_to_files_our_loaders_read(documented, tiny_set):
    config, dataset, t = documented
    args = load_config(["--config_file", config])
    assert (args.model_type, args.model_version, args.pretrained_model_name_or_path) == (
        "hidream_o1", FULL, tiny_set["hidream_o1"])
    # its loss is the MSE of the predicted x0 (weighting_scheme none, the only one its script takes): ours' sigma_sq
    assert (args.timestep_sampling, args.weighting_scheme) == ("uniform", "sigma_sq")
    assert (args.network_module, args.network_dim, args.network_alpha) == ("networks.lora", 32, 1.0)  # its alpha 1
    assert args.network_args in (None, [])  # its text-to-image targets are ours' default
    assert (args.learning_rate, args.optimizer_type, args.max_train_epochs) == (4e-5, "adamw8bit", 16)
    ours = load_dataset_config(dataset).datasets[0]
    assert (ours.min_bucket_reso, ours.max_bucket_reso, ours.bucket_reso_steps) == (32, 128, 32)  # its 32 px grid
    assert verdict_of(t, "task")[0] == DROPPED  # t2i: ours' as it is
    assert (args.noise_scale_start, args.noise_scale_end, args.noise_clip_std) == (8.0, 8.0, 0.0)  # ours' keys
    assert verdict_of(t, "model_type") == (RENAMED, "model_version")
    assert not t.not_carried


def test_a_converted_config_trains_two_steps(documented, tmp_path):
    import train_lora
    from safetensors.torch import load_file

    config, _, _ = documented
    code = train_lora.main(["--config_file", config, "--output_dir", str(tmp_path), "--max_train_epochs", "none",
                            "--max_train_steps", "2", "--mixed_precision", "no", "--optimizer_type", "AdamW",
                            "--save_every_n_epochs", "0", "--gradient_checkpointing", "false"])
    assert code == 0
    tensors = load_file(tmp_path / "hidream_o1_lora.safetensors")
    assert tensors["lora_unet_model_language_model_layers_0_self_attn_q_proj.lora_down.weight"].shape[0] == 32
    assert tensors["lora_unet_model_x_embedder_proj1.alpha"].item() == 1.0  # musubi-tuner's targets, its alpha


@pytest.mark.parametrize("name", list(THEIR_OWN))
def test_every_argument_of_its_own_parser_has_a_line(name):
    value, verdict = THEIR_OWN[name]
    t = musubi_tuner.translate({"network_module": "networks.lora_hidream_o1", "model_type": "dev", name: value},
                               "c.toml")
    assert verdict_of(t, name)[0] == verdict, verdict_of(t, name)


@pytest.mark.parametrize("release, given", [
    ("full", {"noise_scale_start": 8.0, "noise_clip_std": 0}),
    ("dev", {"noise_scale_start": 8.0}), ("full", {"noise_clip_std": 2.5}), ("full", {"noise_scale_end": 6.0})])
def test_its_noise_settings_are_ours_of_the_same_names(release, given):
    """hidream_o1_train_network.py's noise options, each left out the release's (the end: the start's), as ours."""
    t = musubi_tuner.translate({"network_module": "networks.lora_hidream_o1", "model_type": release, **given}, "c.toml")
    assert t.config["model_version"] == {"full": FULL, "dev": DEV}[release]
    assert {key: t.config[key] for key in given} == given and {verdict_of(t, key)[0] for key in given} == {KEPT}


def test_the_releases_noise_is_musubi_tuners_default():
    """hidream_o1_train_network.py: start 7.5 for dev, else 8.0; end the start's; clip 2.5 for dev, else 0."""
    assert NOISE == {FULL: (8.0, 8.0, 0.0), DEV: (7.5, 7.5, 2.5)}


def test_its_defaults_are_written_full_x0_loss_and_the_sigma_draw():
    """A config that leaves model_type, weighting_scheme and timestep_sampling out trains Full (its --model_type
    default; ours would read the release from a file name), the x0 loss and its unshifted sigma draw."""
    t = musubi_tuner.translate({"network_module": "networks.lora_hidream_o1",
                                "dit": "hidream_o1_image_dev_bf16.safetensors"}, "c.toml")
    assert {k: t.config[k] for k in ("model_type", "model_version", "weighting_scheme", "timestep_sampling")} == {
        "model_type": "hidream_o1", "model_version": FULL, "weighting_scheme": "sigma_sq",
        "timestep_sampling": "uniform"}
    assert verdict_of(t, "model_type (unset)")[0] == RENAMED


@pytest.mark.parametrize("config, key, why", [
    ({"timestep_sampling": "flux_shift"}, "timestep_sampling", "pixel-patch cache"),
    ({"timestep_sampling": "qwen_shift"}, "timestep_sampling", "pixel-patch cache"),
    ({"weighting_scheme": "logit_normal"}, "weighting_scheme", "hidream_o1_train_network.py refuses it"),
    ({"model_type": "turbo"}, None, r"model_type 'turbo': not one of musubi-tuner's \(HiDream-O1-Image: full, dev\)"),
])
def test_what_it_does_on_this_model_that_ours_does_not_is_refused(config, key, why):
    """Its resolution shifts read the cache [B, H/32, W/32, 3072] as latents of height W/32 and width 3072 (a shift
    of ~e^4.6 at 1024 px for flux_shift); its script takes weighting_scheme none only."""
    if key is None:
        with pytest.raises(ValueError, match=why):
            musubi_tuner.translate({"network_module": "networks.lora_hidream_o1", **config}, "c.toml")
        return
    t = musubi_tuner.translate({"network_module": "networks.lora_hidream_o1", **config}, "c.toml")
    assert verdict_of(t, key)[0] == NOT_CARRIED and why in verdict_of(t, key)[1]


def test_its_version_key_does_not_meet_another_models_version_values():
    """Its --model_type dev and FLUX.2's model_version dev are two keys: each says its own model."""
    assert musubi_tuner.translate({"model_type": "dev"}, "c.toml").config["model_type"] == "hidream_o1"
    assert musubi_tuner.translate({"model_version": "dev"}, "c.toml").config["model_type"] == "flux2"
    with pytest.raises(ValueError, match="disagree"):
        musubi_tuner.translate({"model_type": "dev", "network_module": "networks.lora_flux_2"}, "c.toml")


def test_its_buckets_step_32_and_reference_images_are_not_carried():
    """BucketSelector's RESOLUTION_STEPS_HIDREAM_O1 (ours refuses a 16 px step on this model's 32 px patches)."""
    assert bucket_sides(1024, 32) == (512, 2048)
    theirs = peer_buckets(1024, 32)
    assert all(w % 32 == h % 32 == 0 for w, h in theirs) and (528, 1984) in peer_buckets(1024) - theirs
    dataset = {"general": {"resolution": [1024, 1024], "enable_bucket": True},
               "datasets": [{"image_directory": "i", "control_directory": "c"}]}
    t = musubi_tuner.translate({"network_module": "networks.lora_hidream_o1"}, "c.toml", dataset=dataset,
                               dataset_source="d.toml")
    assert t.dataset["datasets"][0]["bucket_reso_steps"] == 32
    assert verdict_of(t, "datasets[0].control_directory")[0] == NOT_CARRIED


# ai-toolkit's UI job for HiDream-O1 (ui/src/app/jobs/new/options.tsx, its defaults for the model)
UI_JOB = {"job": "extension", "config": {"name": "o1", "process": [{
    "type": "diffusion_trainer", "training_folder": "output",
    "network": {"type": "lora", "linear": 8, "linear_alpha": 8, "transformer_only": False,
                "network_kwargs": {"ignore_if_contains": ["lm_head", "patch_embed", "visual"]}},
    "train": {"steps": 100, "lr": 1e-4, "timestep_type": "linear", "optimizer": "adamw8bit", "dtype": "bf16"},
    "model": {"arch": "hidream_o1", "name_or_path": "HiDream-ai/HiDream-O1-Image", "quantize": True,
              "qtype": "qfloat8", "model_kwargs": {"noise_scale_inference": 8.0, "noise_scale": 8.0}},
    "datasets": [{"folder_path": "/data/images", "resolution": [1024]}]}]}}


def ui_job(network=None, model=None) -> dict:
    process = UI_JOB["config"]["process"][0]
    given = {**process, "network": network or process["network"], "model": {**process["model"], **(model or {})}}
    return {**UI_JOB, "config": {"name": "o1", "process": [given]}}


def network_of(tiny_set, t) -> tuple[set[str], nn.Module]:
    """(the modules ours trains for the translation, the tiny model they are in)."""
    from library.models.hidream_o1.checkpoint import load_hidream_o1

    args = lora_network_args(SimpleNamespace(network_args=t.config.get("network_args", []), network_dropout=0.0,
                                             config_file="run.toml"))
    model = load_hidream_o1(tiny_set["hidream_o1"], read_weights=False)
    return {lora.name for lora in LoRANetwork(model, "hidream_o1", rank=4, network_args=args).lora_modules()}, model


def test_ai_toolkits_ui_job_trains_its_linears(tiny_set):
    """transformer_only off: every Linear of Qwen3VLForConditionalGeneration but those the UI leaves out by name (the
    vision tower's, lm_head: no text-to-image step runs them), so the timestep MLP too (t_embedder_dim)."""
    t = ai_toolkit.translate(ui_job(), "o1.yaml")
    assert t.config["network_args"] == ["t_embedder_dim=8"]
    assert verdict_of(t, "network.transformer_only")[0] == RENAMED
    assert verdict_of(t, "network.network_kwargs.ignore_if_contains")[0] == DROPPED
    for key in ("model.model_kwargs.noise_scale", "model.model_kwargs.noise_scale_inference"):
        assert verdict_of(t, key)[0] == DROPPED
    assert (t.config["timestep_sampling"], t.config["base_precision"]) == ("uniform", "fp8_scaled")
    assert "weighting_scheme" not in t.config  # its velocity loss: ours' default "none"
    ours, model = network_of(tiny_set, t)
    assert ours == {name for name, m in model.named_modules() if isinstance(m, nn.Linear)}


def test_ai_toolkits_default_lora_trains_the_decoder_layers_only(tiny_set):
    t = ai_toolkit.translate(ui_job(network={"type": "lora", "linear": 8}), "o1.yaml")
    assert t.config["network_args"] == ["embedders_dim=0"]
    ours, model = network_of(tiny_set, t)
    assert ours == {name for name, m in model.named_modules() if isinstance(m, nn.Linear)
                    and name.startswith("model.language_model.layers.")}


def test_other_module_names_left_out_are_still_not_carried():
    network = {**UI_JOB["config"]["process"][0]["network"], "network_kwargs": {"ignore_if_contains": ["mlp"]}}
    assert verdict_of(ai_toolkit.translate(ui_job(network=network), "o1.yaml"),
                      "network.network_kwargs.ignore_if_contains")[0] == NOT_CARRIED


DEV_FILE = {"name_or_path": "/models/hidream_o1_image_dev_bf16.safetensors"}


@pytest.mark.parametrize("model, key, verdict, noise", [
    (DEV_FILE, "model.model_kwargs.noise_scale", RENAMED, (8.0, 8.0, 0.0)),  # the UI job's 8.0 on Dev: unclipped
    ({**DEV_FILE, "model_kwargs": {}}, "model.model_kwargs.noise_scale (ai-toolkit's default)", RENAMED,
     (8.0, 8.0, 0.0)),
    ({**DEV_FILE, "model_kwargs": {"noise_scale": 7.5}}, "model.model_kwargs.noise_scale", RENAMED, (7.5, 7.5, 0.0)),
    ({"model_kwargs": {"noise_scale": 6}}, "model.model_kwargs.noise_scale", RENAMED, (6.0, 6.0, 0.0)),
    ({"model_kwargs": {}}, None, None, NOISE[FULL]),  # its default is Full's: no line, no key
    ({}, "model.model_kwargs.noise_scale", DROPPED, NOISE[FULL]),  # the UI job's 8.0 on Full
])
def test_the_job_trains_at_ai_toolkits_noise(model, key, verdict, noise):
    """ai-toolkit scales either release's noise by model_kwargs.noise_scale (8.0 unset), never clipped
    (HidreamO1FlowmatchScheduler.add_noise), where Dev's release clips at 2.5 std from 7.5: the converted config's
    keys give the family ai-toolkit's noise. The release is the one the model's name says (ai-toolkit names none)."""
    t = ai_toolkit.translate(ui_job(model=model), "o1.yaml")
    lines = [(line.key, line.verdict) for line in t.lines if line.key.startswith("model.model_kwargs.noise_scale ")
             or line.key == "model.model_kwargs.noise_scale"]
    assert lines == ([(key, verdict)] if key else [])
    keys = {k: t.config[k] for k in NOISE_KEYS if k in t.config}
    assert ("noise_scale_start" in keys) == (verdict == RENAMED)
    family = HiDreamO1Family("o1.safetensors", model_version=t.config.get("model_version") or release_of(t), **keys)
    assert family.noise == noise


def test_a_noise_scale_that_is_no_number_is_not_carried():
    t = ai_toolkit.translate(ui_job(model={"model_kwargs": {"noise_scale": "high"}}), "o1.yaml")
    assert verdict_of(t, "model.model_kwargs.noise_scale")[0] == NOT_CARRIED and "noise_scale_start" not in t.config


def test_a_single_file_reads_its_tokenizer_from_extras_name_or_path():
    """ai-toolkit loads the processor from extras_name_or_path for a single file: ours' tokenizer key."""
    model = {"name_or_path": "/models/hidream_o1_image_bf16.safetensors",
             "extras_name_or_path": "/models/HiDream-O1-Image"}
    t = ai_toolkit.translate(ui_job(model=model), "o1.yaml")
    assert (t.config["pretrained_model_name_or_path"], t.config["tokenizer"]) == (
        "/models/hidream_o1_image_bf16.safetensors", "/models/HiDream-O1-Image")
    assert "tokenizer" not in ai_toolkit.translate(ui_job(), "o1.yaml").config  # the repo folder holds it
