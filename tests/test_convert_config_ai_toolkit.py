"""tools/convert_config.py on ai-toolkit's (ostris) LoRA YAML: its own examples convert into a config, dataset
TOML and prompt file our loaders read, each key's verdict is the one library/training/peers/ai_toolkit*.py
gives it, an arch we do not train is one line, and a list of resolutions becomes one [[datasets]] per size."""

import math
import os

import pytest
import torch
import yaml

from library.data.dataset_config import load_dataset_config, parse_dataset_config
from library.data.prompts import read_prompt_file
from library.models import flow_matching as fm
from library.models.registry import FAMILIES, arch_specs
from library.training.config import load_config
from library.training.config_schema import SCHEMA
from library.training.peers.ai_toolkit import translate
from library.training.peers.ai_toolkit_model import ENTRY_ARGS
from library.training.peers.rules import DROPPED, NOT_CARRIED, RENAMED, UNKNOWN
from tools.convert_config import main

# ai-toolkit's config/examples/train_lora_flux_24gb.yaml (ostris/ai-toolkit 27a03a9), as it ships.
FLUX_EXAMPLE = r"""---
job: extension
config:
  # this name will be the folder and filename name
  name: "my_first_flux_lora_v1"
  process:
    - type: 'sd_trainer'
      # root folder to save training sessions/samples/weights
      training_folder: "output"
      # uncomment to see performance stats in the terminal every N steps
#      performance_log_every: 1000
      device: cuda:0
      # if a trigger word is specified, it will be added to captions of training data if it does not already exist
      # alternatively, in your captions you can add [trigger] and it will be replaced with the trigger word
#      trigger_word: "p3r5on"
      network:
        type: "lora"
        linear: 16
        linear_alpha: 16
      save:
        dtype: float16 # precision to save
        save_every: 250 # save every this many steps
        max_step_saves_to_keep: 4 # how many intermittent saves to keep
        push_to_hub: false #change this to True to push your trained model to Hugging Face.
        # You can either set up a HF_TOKEN env variable or you'll be prompted to log-in
#       hf_repo_id: your-username/your-model-slug
#       hf_private: true #whether the repo is private or public
      datasets:
        # datasets are a folder of images. captions need to be txt files with the same name as the image
        # for instance image2.jpg and image2.txt. Only jpg, jpeg, and png are supported currently
        # images will automatically be resized and bucketed into the resolution specified
        # on windows, escape back slashes with another backslash so
        # "C:\\path\\to\\images\\folder"
        - folder_path: "/path/to/images/folder"
          caption_ext: "txt"
          caption_dropout_rate: 0.05  # will drop out the caption 5% of time
          shuffle_tokens: false  # shuffle caption order, split by commas
          cache_latents_to_disk: true  # leave this true unless you know what you're doing
          resolution: [ 512, 768, 1024 ]  # flux enjoys multiple resolutions
      train:
        batch_size: 1
        steps: 2000  # total number of steps to train 500 - 4000 is a good range
        gradient_accumulation_steps: 1
        train_unet: true
        train_text_encoder: false  # probably won't work with flux
        gradient_checkpointing: true  # need the on unless you have a ton of vram
        noise_scheduler: "flowmatch" # for training only
        optimizer: "adamw8bit"
        lr: 1e-4
        # uncomment this to skip the pre training sample
#        skip_first_sample: true
        # uncomment to completely disable sampling
#        disable_sampling: true
        # uncomment to use new vell curved weighting. Experimental but may produce better results
#        linear_timesteps: true

        # ema will smooth out learning, but could slow it down. Recommended to leave on.
        ema_config:
          use_ema: true
          ema_decay: 0.99

        # will probably need this if gpu supports it for flux, other dtypes may not work correctly
        dtype: bf16
      model:
        # huggingface model name or path
        name_or_path: "black-forest-labs/FLUX.1-dev"
        is_flux: true
        quantize: true  # run 8bit mixed precision
#        low_vram: true  # uncomment this if the GPU is connected to your monitors. It will use less vram to quantize, but is slower.
      sample:
        sampler: "flowmatch" # must match train.noise_scheduler
        sample_every: 250 # sample every this many steps
        sample_start_step: 0 # start sampling at this step
        width: 1024
        height: 1024
        prompts:
          # you can add [trigger] to the prompts here and it will be replaced with the trigger word
#          - "[trigger] holding a sign that says 'I LOVE PROMPTS!'"\
          - "woman with red hair, playing chess at the park, bomb going off in the background"
          - "a woman holding a coffee cup, in a beanie, sitting at a cafe"
          - "a horse is a DJ at a night club, fish eye lens, smoke machine, lazer lights, holding a martini"
          - "a man showing off his cool new t shirt at the beach, a shark is jumping out of the water in the background"
          - "a bear building a log cabin in the snow covered mountains"
          - "woman playing the guitar, on stage, singing a song, laser lights, punk rocker"
          - "hipster man with a beard, building a chair, in a wood shop"
          - "photo of a man, white background, medium shot, modeling clothing, studio lighting, white backdrop"
          - "a man holding a sign that says, 'this is a sign'"
          - "a bulldog, in a post apocalyptic world, with a shotgun, in a leather jacket, in a desert, with a motorcycle"
        neg: ""  # not used on flux
        seed: 42
        walk_seed: true
        guidance_scale: 4
        sample_steps: 20
# you can add any additional meta info here. [name] is replaced with config name at top
meta:
  name: "[name]"
  version: '1.0'
"""

# ai-toolkit's config/examples/train_lora_qwen_image_24gb.yaml, its comments and sample prompts left out.
QWEN_EXAMPLE = """
job: extension
config:
  name: "my_first_qwen_image_lora_v1"
  process:
    - type: 'sd_trainer'
      training_folder: "output"
      device: cuda:0
      network: {type: "lora", linear: 16, linear_alpha: 16}
      save: {dtype: float16, save_every: 250, max_step_saves_to_keep: 4}
      datasets:
        - folder_path: "/path/to/images/folder"
          caption_ext: "txt"
          caption_dropout_rate: 0.05
          shuffle_tokens: false
          cache_latents_to_disk: true
          resolution: [ 512, 768, 1024 ]
      train:
        batch_size: 1
        cache_text_embeddings: true
        steps: 2000
        gradient_accumulation: 1
        train_unet: true
        train_text_encoder: false
        gradient_checkpointing: true
        noise_scheduler: "flowmatch"
        optimizer: "adamw8bit"
        lr: 1e-4
        dtype: bf16
      model:
        name_or_path: "Qwen/Qwen-Image"
        arch: "qwen_image"
        quantize: true
        qtype: "uint3|ostris/accuracy_recovery_adapters/qwen_image_torchao_uint3.safetensors"
        quantize_te: true
        qtype_te: "qfloat8"
        low_vram: true
      sample:
        sampler: "flowmatch"
        sample_every: 250
        sample_start_step: 0
        width: 1024
        height: 1024
        prompts:
          - "a bear building a log cabin in the snow covered mountains"
          - "a man holding a sign that says, 'this is a sign'"
        neg: ""
        seed: 42
        walk_seed: true
        guidance_scale: 3
        sample_steps: 25
meta:
  name: "[name]"
  version: '1.0'
"""


def flux_pipeline_folder(tiny_set, root) -> str:
    """The tiny FLUX.1 files laid out as a diffusers pipeline folder, as `hf download` writes FLUX.1-dev."""
    folder = root / "FLUX.1-dev"
    folder.mkdir()
    for name, key in (("transformer", "flux_diffusers"), ("vae", "flux_vae"), ("text_encoder", "clip_l"),
                      ("text_encoder_2", "t5xxl")):
        os.symlink(tiny_set[key], folder / name)
    return str(folder)


def written(tmp_path, name: str, text: str, capsys, *args) -> tuple[int, str, str]:
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    code = main([str(path), *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_ai_toolkits_flux_example_converts_into_files_our_loaders_read(tiny_set, tmp_path, capsys):
    from library.models.family import family_class

    text = (FLUX_EXAMPLE.replace("/path/to/images/folder", tiny_set["image_dir"])
            .replace("black-forest-labs/FLUX.1-dev", flux_pipeline_folder(tiny_set, tmp_path))
            .replace('training_folder: "output"', f'training_folder: "{tmp_path / "output"}"'))
    code, out, err = written(tmp_path, "train_lora_flux_24gb", text, capsys, "--strict")
    assert code == 0, out + err  # --strict: every key carried over (or dropped as ours already)
    assert "check: train_lora.py reads it as written" in out
    assert "0 not carried, 0 unknown" in out

    args = load_config(["--config_file", str(tmp_path / "train_lora_flux_24gb_converted.toml")])
    assert (args.model_type, args.base_precision, args.text_encoder_precision) == ("flux", "fp8_scaled", "fp8_scaled")
    assert (args.network_module, args.network_dim, args.network_alpha) == ("networks.lora", 16, 16.0)
    assert (args.optimizer_type, args.optimizer_args, args.learning_rate) == ("AdamW8bit", ["eps=1e-06"], 1e-4)
    assert (args.max_train_steps, args.mixed_precision, args.gradient_checkpointing) == (2000, "bf16", True)
    assert (args.save_every_n_steps, args.save_last_n_saves, args.save_precision) == (250, 4, "fp16")
    assert (args.ema_decay, args.sample_with_ema, args.timestep_sampling) == (0.99, True, "sigmoid")
    assert (args.sample_every_n_steps, args.sample_at_first) == (250, True)
    assert args.output_dir == str(tmp_path / "output" / "my_first_flux_lora_v1")
    family_class("flux").from_args(args).check_model_files()  # every file key found in the pipeline folder

    blueprint = load_dataset_config(args.dataset_config)
    assert [d.resolution for d in blueprint.datasets] == [(512, 512), (768, 768), (1024, 1024)]
    for d in blueprint.datasets:
        # ai-toolkit's loader buckets FLUX.1 at its get_bucket_divisibility, 16 (64, its bucket_tolerance, before)
        assert (d.enable_bucket, d.bucket_no_upscale, d.bucket_reso_steps, d.batch_size) == (True, True, 16, 1)
        (subset,) = d.subsets
        assert (subset.image_dir, subset.caption_extension, subset.caption_dropout_rate) == (tiny_set["image_dir"], ".txt", 0.05)

    prompts = read_prompt_file(args.sample_prompts)
    assert len(prompts) == 10
    assert [p.seed for p in prompts] == list(range(42, 52))  # walk_seed
    assert {(p.width, p.height, p.steps, p.guidance, p.negative) for p in prompts} == {(1024, 1024, 20, 4.0, "")}
    assert prompts[0].prompt == "woman with red hair, playing chess at the park, bomb going off in the background"


def test_a_qwen_image_example_converts_and_says_its_3_bit_base_is_not_ours(tiny_set, tmp_path, capsys):
    from library.models.family import family_class

    folder = os.path.dirname(tiny_set["qwen_image"])  # transformer/, vae/, text_encoder/, tokenizer/
    text = QWEN_EXAMPLE.replace("/path/to/images/folder", tiny_set["image_dir"]).replace("Qwen/Qwen-Image", folder)
    code, out, err = written(tmp_path, "qwen", text, capsys, "--strict")
    assert code == 1 and "1 key(s) not carried over" in err  # --strict: the 3-bit base
    assert "not carried model.quantize = True" in out and 'base_precision = "nf4"' in out
    assert "check: train_lora.py reads it as written" in out
    args = load_config(["--config_file", str(tmp_path / "qwen_converted.toml")])
    assert (args.model_type, args.base_precision, args.text_encoder_precision) == ("qwen_image", None, "fp8_scaled")
    assert (args.pretrained_model_name_or_path, args.ae, args.text_encoder) == (folder, folder, folder)
    family_class("qwen_image").from_args(args).check_model_files()
    assert len(load_dataset_config(args.dataset_config).datasets) == 3
    prompts = read_prompt_file(args.sample_prompts)
    assert [(p.seed, p.steps, p.guidance) for p in prompts] == [(42, 25, 3.0), (43, 25, 3.0)]


def job(**sections) -> dict:
    """A minimal ai-toolkit job: a LoRA on a Hub model, one dataset, the given sections merged in."""
    process = {"type": "sd_trainer", "network": {"type": "lora", "linear": 8, "linear_alpha": 8},
               "datasets": [{"folder_path": "/data/images"}],
               "model": {"name_or_path": "black-forest-labs/FLUX.1-dev", "arch": "flux"}}
    for name, keys in sections.items():
        process[name] = {**process.get(name, {}), **keys} if isinstance(keys, dict) else keys
    return {"job": "extension", "config": {"name": "run", "process": [process]}}


def verdict(t, key: str):
    return next((line.verdict, line.text) for line in t.lines if line.key == key)


@pytest.mark.parametrize("section, key, value, expected, ours", [
    ("train", "noise_offset", 0.1, NOT_CARRIED, {}),
    ("train", "noise_offset", 0.0, DROPPED, {}),
    ("train", "timestep_type", "linear", RENAMED, {"timestep_sampling": "uniform"}),
    ("train", "timestep_type", "weighted", NOT_CARRIED, {}),
    ("train", "timestep_type", "shift", RENAMED, {"timestep_sampling": "flux_shift", "shifted_draw": "uniform"}),
    ("train", "content_or_style", "style", RENAMED, {"timestep_bias": "low_noise"}),  # carried since 2026-12-01
    ("train", "content_or_style", "content", RENAMED, {"timestep_bias": "high_noise"}),
    ("train", "loss_type", "mse", RENAMED, {"loss_type": "l2"}),
    ("train", "optimizer", "automagic", NOT_CARRIED, {}),
    ("train", "optimizer", "adafactor", RENAMED, {"optimizer_type": "Adafactor", "max_grad_norm": 0.0}),
    ("train", "optimizer", "adamw8bit", RENAMED, {"optimizer_type": "AdamW8bit", "max_grad_norm": None}),
    ("train", "lr_scheduler", "linear", NOT_CARRIED, {}),
    ("train", "lr_scheduler", "cosine", RENAMED, {"lr_scheduler": "cosine"}),
    ("train", "gradient_accumulation", 4, RENAMED, {"gradient_accumulation_steps": 4, "max_train_steps": 1000,
                                                    "max_grad_norm": 0.25}),
    ("train", "gradient_accumulation_steps", 4, RENAMED, {"gradient_accumulation_steps": None, "max_train_steps": 250,
                                                          "max_grad_norm": None}),
    ("train", "unload_text_encoder", True, NOT_CARRIED, {}),
    ("train", "diff_output_preservation", True, "kept", {"diff_output_preservation": True, "trigger_word": "zxq"}),
    ("train", "reg_weight", 0.5, RENAMED, {"prior_loss_weight": 0.5}),
    ("model", "quantize", True, RENAMED, {"base_precision": "fp8_scaled", "text_encoder_precision": "fp8_scaled"}),
    ("model", "vae_path", "/models/ae.safetensors", RENAMED, {"ae": "/models/ae.safetensors"}),
    ("model", "assistant_lora_path", "/models/adapter.safetensors", RENAMED, {"base_loras": ["/models/adapter.safetensors:1.0"]}),
    ("network", "type", "lokr", RENAMED, {"network_module": "lycoris.kohya",
                                          "network_args": ["algo=lokr", "factor=-1", "full_matrix=True"]}),
    ("network", "dropout", 0.1, RENAMED, {"network_dropout": 0.1}),
    ("network", "rank", 32, RENAMED, {"network_dim": 32}),  # over the job's linear 8: NetworkConfig reads rank first
    ("save", "dtype", "bf16", RENAMED, {"save_precision": "bf16"}),
    ("save", "push_to_hub", True, DROPPED, {}),
    ("train", "a_key_of_a_newer_version", 1, UNKNOWN, {}),
])
def test_each_key_gets_its_verdict_and_our_value(section, key, value, expected, ours):
    t = translate(job(trigger_word="zxq", **{section: {key: value}}), "run.yaml")
    assert verdict(t, f"{section}.{key}")[0] == expected
    assert {k: t.config.get(k) for k in ours} == ours


def test_the_gradient_clip_and_accumulation_are_ai_toolkits():
    """SDTrainer.hook_train_loop: no clip for `adafactor`; gradient_accumulation's micro-batches summed, then clipped
    (ours averages them: the clip / N is the same step); the older gradient_accumulation_steps zeroes the gradients
    as each micro-batch begins and counts its steps, saves, samples and warmup in micro-batches."""
    t = translate(job(train={"gradient_accumulation": 2, "max_grad_norm": 0.5}), "run.yaml")
    assert (t.config["gradient_accumulation_steps"], t.config["max_grad_norm"]) == (2, 0.25)
    t = translate(job(train={"gradient_accumulation": 2, "optimizer": "adafactor", "max_grad_norm": 0.5}), "run.yaml")
    assert t.config["max_grad_norm"] == 0.0 and verdict(t, "train.optimizer")[0] == RENAMED
    assert translate(job(train={"optimizer": "Adafactor"}), "run.yaml").config.get("max_grad_norm") is None
    older = translate(job(train={"gradient_accumulation_steps": 4, "steps": 2000,
                                 "lr_scheduler": "constant_with_warmup",
                                 "lr_scheduler_params": {"num_warmup_steps": 200}},
                          save={"save_every": 400}), "run.yaml")
    assert "gradient_accumulation_steps" not in older.config
    assert {k: older.config[k] for k in ("max_train_steps", "lr_warmup_steps", "save_every_n_steps")} == {
        "max_train_steps": 500, "lr_warmup_steps": 50, "save_every_n_steps": 100}


def test_keys_left_out_are_read_at_ai_toolkits_defaults_and_a_hub_id_is_a_folder_to_download():
    t = translate(job(), "run.yaml")
    assert verdict(t, "train.lr (ai-toolkit's default)") == (RENAMED, "learning_rate")
    assert (t.config["learning_rate"], t.config["max_train_steps"], t.config["network_alpha"]) == (1e-6, 1000, 8.0)
    assert (t.config["save_precision"], t.config["save_every_n_steps"], t.config["mixed_precision"]) == ("fp16", 1000, "no")
    assert t.config["optimizer_type"] == "AdamW" and t.config["timestep_sampling"] == "sigmoid"
    assert {t.config[k] for k in ("pretrained_model_name_or_path", "ae", "clip_l", "t5xxl")} == {"models/FLUX.1-dev"}
    assert "hf download black-forest-labs/FLUX.1-dev --local-dir models/FLUX.1-dev" in verdict(t, "model.name_or_path")[1]


def test_chromas_vae_and_t5_are_ai_toolkits_own_from_flex_whatever_name_or_path_names():
    """ai-toolkit's Chroma reads one transformer file from name_or_path and its VAE and T5 from ostris/Flex.1-alpha:
    ours wrote ae and t5xxl as lodestones/Chroma's folder (which holds neither) and called it a diffusers folder."""
    t = translate(job(model={"name_or_path": "lodestones/Chroma", "arch": "chroma"}), "run.yaml")
    assert (t.config["ae"], t.config["t5xxl"]) == ("models/Flex.1-alpha", "models/Flex.1-alpha")
    assert t.config["pretrained_model_name_or_path"] == "models/Chroma"
    assert "hf download ostris/Flex.1-alpha --local-dir models/Flex.1-alpha" in verdict(t, "model.arch")[1]
    assert "newest chroma-unlocked-vNN.safetensors" in verdict(t, "model.name_or_path")[1]
    hidream = translate(job(model={"name_or_path": "HiDream-ai/HiDream-I1-Full", "arch": "hidream"}), "run.yaml")
    assert hidream.config["llama"] == "models/Meta-Llama-3.1-8B-Instruct"  # its default Llama, said with its Hub id
    assert "hf download unsloth/Meta-Llama-3.1-8B-Instruct" in verdict(hidream, "model.arch")[1]


def test_the_lora_trains_at_train_lr_whatever_train_unet_lr_says():
    """ai-toolkit's LoRA trainer gives the network train.lr (BaseSDTrainProcess); unet_lr is unread. It was read as the
    LoRA's lr and train.lr dropped: 5e-5 where ai-toolkit trains at 1e-4 (and with unet_lr alone, at its 1e-6)."""
    t = translate(job(train={"lr": 1e-4, "unet_lr": 5e-5}), "run.yaml")
    assert t.config["learning_rate"] == 1e-4
    assert verdict(t, "train.unet_lr")[0] == DROPPED
    assert translate(job(train={"unet_lr": 5e-5}), "run.yaml").config["learning_rate"] == 1e-6


def tiny_model(arch: str):
    if arch == "qwen_image":
        from library.models.qwen_image.model import QwenImage
        from tests.lora_layouts import QWEN_CFG

        return QwenImage(QWEN_CFG)
    if arch == "zimage":
        from library.models.zimage.model import ZImage
        from library.models.zimage.tiny import tiny_config

        return ZImage(tiny_config())
    if arch == "ernie_image":
        from library.models.ernie_image.model import ErnieImage
        from library.models.ernie_image.tiny import tiny_config

        return ErnieImage(tiny_config())
    if arch == "anima":
        from library.models.anima.model import Anima
        from library.models.anima.tiny import tiny_config

        return Anima(tiny_config())
    if arch == "nucleus_image":
        from library.models.nucleus_image.model import NucleusImage
        from library.models.nucleus_image.tiny import tiny_config

        return NucleusImage(tiny_config())
    from library.models.ideogram4.model import Ideogram4
    from library.models.ideogram4.tiny import tiny_config

    return Ideogram4(tiny_config())


# ai-toolkit's get_transformer_block_names: its LoRA wraps every Linear whose name holds one (transformer_only)
@pytest.mark.parametrize("arch, blocks", [("qwen_image", "transformer_blocks"), ("zimage", "layers"),
                                          ("ideogram4", "layers"), ("ernie_image", "layers"),
                                          ("nucleus_image", "transformer_blocks"), ("anima", "blocks")])
def test_the_network_trains_every_linear_of_the_blocks_as_ai_toolkits_lora(arch, blocks):
    """The blocks' modulation Linears (img_mod / txt_mod, adaLN) are among them: ours leaves them out by default,
    so the translation trained fewer modules than ai-toolkit; it adds train_modulation=true."""
    import torch.nn as nn
    from types import SimpleNamespace

    from library.training.config import lora_network_args
    from networks.lora import LoRANetwork

    t = translate(job(model={"arch": arch, "name_or_path": "/models/base"}), "run.yaml")
    args = lora_network_args(SimpleNamespace(network_args=t.config.get("network_args", []), network_dropout=0.0,
                                             config_file="run.toml"))
    model = tiny_model(arch)
    ours = {lora.name for lora in LoRANetwork(model, arch, rank=4, network_args=args).lora_modules()}
    # (the model's top-level blocks: Anima's LLM adapter has blocks too, which ai-toolkit trains only when asked)
    assert ours == {name for name, m in model.named_modules() if isinstance(m, nn.Linear)
                    and name.startswith(blocks + ".")}


def test_hidreams_ignore_if_contains_carries_as_a_pattern_over_the_same_module_names():
    """ai-toolkit's HiDream example leaves the routed experts out (ignore_if_contains ff_i.experts, ff_i.gate): ours
    (the same diffusers module names) did not carry it and trained every expert, a LoRA many times the size."""
    from types import SimpleNamespace

    from library.models.hidream.model import HiDream
    from library.models.hidream.tiny import tiny_config
    from library.training.config import lora_network_args
    from networks.lora import LoRANetwork

    t = translate(job(model={"arch": "hidream", "name_or_path": "/models/base"},
                      network={"network_kwargs": {"ignore_if_contains": ["ff_i.experts", "ff_i.gate"]}}), "run.yaml")
    assert verdict(t, "network.network_kwargs.ignore_if_contains")[0] == RENAMED
    args = lora_network_args(SimpleNamespace(network_args=t.config["network_args"], network_dropout=0.0,
                                             config_file="run.toml"))
    model = HiDream(tiny_config())
    names = {lora.name for lora in LoRANetwork(model, "hidream", rank=4, network_args=args).lora_modules()}
    every = {lora.name for lora in LoRANetwork(model, "hidream", rank=4).lora_modules()}
    assert names and not any("ff_i.experts" in n for n in names) and any("ff_i.experts" in n for n in every)
    assert any("ff_i.shared_experts" in n for n in names)  # the shared experts stay, as there


def test_an_adapter_job_and_a_job_of_other_processes_are_refused_for_what_they_are():
    """Its Redux example (no network, an adapter) was refused as "trains the whole model (a fine-tune)", and its
    extraction job (5 locon processes) as "5 processes; ... a file per process", as if splitting it would do."""
    redux = job(adapter={"type": "redux"})
    del redux["config"]["process"][0]["network"]
    with pytest.raises(ValueError, match=r"no network: ai-toolkit then trains its redux adapter; ours trains LoRAs"):
        translate(redux, "run.yaml")
    extract = {"job": "extract", "config": {"name": "x", "process": [{"type": "locon"}, {"type": "locon"}]}}
    with pytest.raises(ValueError, match=r"process type 'locon': ours translates ai-toolkit's LoRA trainers"):
        translate(extract, "run.yaml")


def test_an_arch_we_do_not_train_is_one_line_exit_2_and_nothing_written(tmp_path, capsys):
    code, out, err = written(tmp_path, "sdxl", yaml.safe_dump(job(model={"arch": "sdxl"})), capsys)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "model.arch 'sdxl': not a model we train" in err
    assert sorted(os.listdir(tmp_path)) == ["sdxl.yaml"]


def test_a_list_of_resolutions_becomes_one_datasets_table_per_size_with_the_regularization_images_beside():
    datasets = [{"folder_path": "/data/images", "resolution": [512, 768, 1024], "num_repeats": 2},
                {"folder_path": "/data/reg", "resolution": 512, "is_reg": True},
                {"folder_path": "/data/reg_wide", "resolution": 1536, "is_reg": True}]
    t = translate(job(datasets=datasets, train={"batch_size": 2}), "run.yaml")
    sizes = [(d["resolution"], [s["image_dir"] for s in d["subsets"]]) for d in t.dataset["datasets"]]
    assert sizes == [(512, ["/data/images", "/data/reg"]), (768, ["/data/images"]), (1024, ["/data/images"])]
    assert verdict(t, "datasets")[0] == NOT_CARRIED  # 1536 px regularization images with no training images there
    blueprint = parse_dataset_config(t.dataset, "run_dataset.toml")
    assert [(d.batch_size, [(s.num_repeats, s.is_reg) for s in d.subsets]) for d in blueprint.datasets] == [
        (2, [(2, False), (1, True)]), (2, [(2, False)]), (2, [(2, False)])]


@pytest.mark.parametrize("arch, step", [("flux2", 16), ("qwen_image", 32), ("chroma", 32), ("zimage", 16),
                                        ("ernie_image", 32), ("nucleus_image", 32), ("anima", 32)])
def test_buckets_step_as_ai_toolkits_model_whatever_bucket_tolerance_says(arch, step):
    """ai-toolkit's loader writes its model's get_bucket_divisibility over every dataset's bucket_tolerance; ours
    carried bucket_tolerance (64 where unset): FLUX.2 images bucketed at 64 px steps where ai-toolkit's take 16."""
    datasets = [{"folder_path": "/data/a"}, {"folder_path": "/data/b", "bucket_tolerance": 64}]
    t = translate(job(datasets=datasets, model={"arch": arch}), "run.yaml")
    assert [d["bucket_reso_steps"] for d in t.dataset["datasets"]] == [step]  # one [[datasets]]: one step
    said = f"ai-toolkit replaces it by the model's bucket divisibility, {step} px: bucket_reso_steps = {step}"
    assert verdict(t, "datasets[1].bucket_tolerance") == (DROPPED, said)


def test_the_trigger_word_becomes_a_caption_prefix_only_where_the_captions_lack_it(tmp_path):
    for folder, captions in (("without", ["a star", "a cube"]), ("with", ["zxq star", "a zxq cube"]),
                             ("placeholder", ["[trigger] star", "a cube"])):
        (tmp_path / folder).mkdir()
        for i, caption in enumerate(captions):
            (tmp_path / folder / f"{i}.txt").write_text(caption)
    datasets = [{"folder_path": str(tmp_path / f), "resolution": 512} for f in ("without", "with", "placeholder")]
    t = translate(job(trigger_word="zxq", datasets=datasets, sample={"prompts": ["[trigger] on a table --m 0.5"]}),
                  "run.yaml")
    subsets = t.dataset["datasets"][0]["subsets"]
    assert [s.get("caption_prefix") for s in subsets] == ["zxq", None, None]
    assert [line.verdict for line in t.lines if line.key == "trigger_word"] == [RENAMED, DROPPED, NOT_CARRIED]
    assert t.files["sample_prompts"][1].splitlines()[1] == "zxq on a table --w 512 --h 512 --s 20 --d 0 --g 7"
    assert verdict(t, "sample.prompts[0] --m")[0] == NOT_CARRIED  # the LoRA's strength in samples


def test_a_dropped_caption_is_the_trigger_word_and_the_mask_line_says_how_it_weighs():
    """ai-toolkit puts the trigger word back into a dropped caption (BaseSDTrainProcess), not into a regularization
    one: caption_dropout_text (ours trained the empty caption). It scales the batch's masks to mean 1 (SDTrainer);
    ours weighs each pixel by its mask as it is: the line says so."""
    datasets = [{"folder_path": "/data/a", "caption_dropout_rate": 0.05, "mask_path": "/data/masks"},
                {"folder_path": "/data/reg", "caption_dropout_rate": 0.05, "is_reg": True}]
    t = translate(job(trigger_word="zxq", datasets=datasets), "run.yaml")
    subsets = t.dataset["datasets"][0]["subsets"]
    assert [s.get("caption_dropout_text") for s in subsets] == ["zxq", None]
    assert "caption_dropout_text = 'zxq'" in verdict(t, "datasets[0].caption_dropout_rate")[1]
    assert "mean 1" in next(line.note for line in t.lines if line.key == "datasets[0].mask_path")
    without = translate(job(datasets=datasets[:1]), "run.yaml")  # no trigger word: the empty caption there too
    assert verdict(without, "datasets[0].caption_dropout_rate") == (RENAMED, "caption_dropout_rate")
    assert "caption_dropout_text" not in without.dataset["datasets"][0]["subsets"][0]


@pytest.mark.parametrize("where", ["train", "dataset"])
def test_cached_text_embeddings_shuffle_once_and_drop_no_tokens(where):
    """ai-toolkit's cache_text_embeddings (train's is every dataset's) skips token_dropout_rate and bakes the one
    shuffle it drew into the cached embedding: one fixed order per image, the caption as written here, no tag
    dropout (it was 8 variants with tag dropout: a new order every step)."""
    tags = {"folder_path": "/data/a", "shuffle_tokens": True, "token_dropout_rate": 0.1}
    cached = {"cache_text_embeddings": True}
    t = translate(job(train=cached if where == "train" else {}, datasets=[{**tags, **({} if where == "train" else
                                                                                      cached)}]), "run.yaml")
    subset = t.dataset["datasets"][0]["subsets"][0]
    assert not {"shuffle_caption", "caption_tag_dropout_rate"} & set(subset)
    assert {verdict(t, f"datasets[0].{key}")[0] for key in ("token_dropout_rate", "shuffle_tokens")} == {DROPPED}
    every_step = translate(job(datasets=[tags]), "run.yaml").dataset["datasets"][0]["subsets"][0]
    assert every_step["shuffle_caption"] and every_step["caption_tag_dropout_rate"] == 0.1


def test_every_peer_model_a_family_lists_is_a_model_type_with_keys_of_our_schema():
    listed = {name: keys for spec in arch_specs().values() for name, keys in spec.peer_models.get("ai-toolkit", {}).items()}
    assert {"flux", "flux_kontext", "qwen_image", "qwen_image_edit_plus", "zimage", "chroma"} <= set(listed)
    for name, keys in listed.items():
        assert keys["model_type"] in FAMILIES and set(keys) - set(ENTRY_ARGS) <= set(SCHEMA), name


def test_the_check_names_the_paths_this_machine_lacks(tmp_path, capsys):
    """The example as it ships names a Hub model and /path/to/images/folder: the written config parses, and the check
    line lists what the run would not find (it said "reads it as written", as if the run could start)."""
    (tmp_path / "flux.yaml").write_text(FLUX_EXAMPLE)
    assert main([str(tmp_path / "flux.yaml")]) == 0
    check = [line for line in capsys.readouterr().out.splitlines() if line.startswith("check: ")]
    assert check == ["check: train_lora.py reads it as written; not on this machine: pretrained_model_name_or_path = "
                     "models/FLUX.1-dev, ae = models/FLUX.1-dev, clip_l = models/FLUX.1-dev, t5xxl = models/FLUX.1-dev, "
                     "image_dir = /path/to/images/folder"]


def test_skip_first_sample_wins_over_force_first_sample():
    """BaseSDTrainProcess tests skip_first_sample first; both on rendered the first samples here."""
    t = translate(job(train={"skip_first_sample": True, "force_first_sample": True}, sample={"prompts": ["a"]}),
                  "run.yaml")
    assert t.config["sample_at_first"] is False


def test_a_bad_train_batch_size_is_named_as_the_trains():
    with pytest.raises(ValueError, match=r"run.yaml: train.batch_size must be a whole number >= 1, got '2'"):
        translate(job(train={"batch_size": "2"}), "run.yaml")


# ai-toolkit's UI writes these into every job (ui/src/app/jobs/new/jobConfig.ts), whatever the model
UI_KEYS = {"sqlite_db_path": "./aitk_db.db", "network": {"conv": 16, "conv_alpha": 16}, "save": {"save_format": "diffusers"},
           "datasets": [{"folder_path": "/data/images", "mask_path": None, "mask_min_value": 0.1,
                         "shrink_video_to_frames": True}]}


def test_what_the_ui_writes_into_every_job_is_no_key_not_carried():
    """conv (these transformers have no Conv2d), save_format (a full model's), mask_min_value without a mask and
    shrink_video_to_frames on images change nothing there: each was 'not carried', sqlite_db_path 'unknown'."""
    t = translate(job(**UI_KEYS), "run.yaml")
    assert [(line.key, line.verdict) for line in t.not_carried] == []
    masked = [{"folder_path": "/data/images", "mask_path": "/data/masks", "mask_min_value": 0.1}]
    assert verdict(translate(job(datasets=masked), "run.yaml"), "datasets[0].mask_min_value")[0] == NOT_CARRIED


def test_an_assistant_lora_on_the_hub_is_a_file_to_download_into_base_loras():
    """The UI's training adapters name a Hub repository and its file: it was written as a local path."""
    t = translate(job(model={"assistant_lora_path": "ostris/zimage_turbo_training_adapter/adapter_v2.safetensors"}),
                  "run.yaml")
    assert t.config["base_loras"] == ["models/zimage_turbo_training_adapter/adapter_v2.safetensors:1.0"]
    assert ("`hf download ostris/zimage_turbo_training_adapter adapter_v2.safetensors --local-dir "
            "models/zimage_turbo_training_adapter`") in verdict(t, "model.assistant_lora_path")[1]


def test_flux1s_assistant_lora_repository_or_folder_is_its_pytorch_lora_weights(tmp_path):
    """ai-toolkit's FLUX.1 reads pytorch_lora_weights.safetensors from an assistant_lora_path naming a Hub
    repository (its schnell examples: ostris/FLUX.1-schnell-training-adapter) or a folder: the repository was not
    carried, the folder written as the LoRA file. Another model's (Z-Image: repo/file only) stays refused."""
    flux = translate(job(model={"name_or_path": "black-forest-labs/FLUX.1-schnell", "arch": "flux",
                                "assistant_lora_path": "ostris/FLUX.1-schnell-training-adapter"}), "run.yaml")
    assert flux.config["base_loras"] == ["models/FLUX.1-schnell-training-adapter/pytorch_lora_weights.safetensors:1.0"]
    assert ("`hf download ostris/FLUX.1-schnell-training-adapter pytorch_lora_weights.safetensors --local-dir "
            "models/FLUX.1-schnell-training-adapter`") in verdict(flux, "model.assistant_lora_path")[1]
    (tmp_path / "adapter").mkdir()
    folder = translate(job(model={"name_or_path": "black-forest-labs/FLUX.1-schnell", "arch": "flux",
                                  "assistant_lora_path": str(tmp_path / "adapter")}), "run.yaml")
    assert folder.config["base_loras"] == [f"{tmp_path / 'adapter' / 'pytorch_lora_weights.safetensors'}:1.0"]
    zimage = translate(job(model={"name_or_path": "Tongyi-MAI/Z-Image-Turbo", "arch": "zimage",
                                  "assistant_lora_path": "ostris/zimage_turbo_training_adapter"}), "run.yaml")
    assert verdict(zimage, "model.assistant_lora_path")[0] == NOT_CARRIED


@pytest.mark.parametrize("sections, message", [
    ({"trigger_word": 1990}, 'run.yaml: trigger_word must be text (quote it: "1990"), got 1990'),
    ({"network": {"linear_alpha": "x"}}, "run.yaml: network.linear_alpha = 'x': could not convert string to float"),
    ({"train": {"loss_type": ["mse"]}}, "run.yaml: train.loss_type = ['mse']: "),
])
def test_a_value_of_another_type_is_one_line_naming_its_key(sections, message):
    """Each was a traceback (TypeError), or a ValueError naming neither the file nor the key."""
    with pytest.raises(ValueError) as e:
        translate(job(**sections), "run.yaml")
    assert str(e.value).startswith(message)


def test_a_null_sample_seed_writes_no_seed():
    """seed: null is a random seed there; it was written as '--d None', which our prompt reader refuses."""
    t = translate(job(sample={"prompts": ["a cat"], "seed": None, "walk_seed": True}), "run.yaml")
    assert t.files["sample_prompts"][1].splitlines()[1] == "a cat --w 512 --h 512 --s 20 --g 7"


@pytest.mark.parametrize("walk, seeds", [(False, ["0", "5", "5", "7"]), (True, ["0", "5", "2", "7"])])
def test_a_samples_seed_stays_for_the_samples_after_it(walk, seeds):
    """ai-toolkit's current_seed: a sample's seed stays for the later samples, unless walk_seed sets start + i for
    each (BaseSDTrainProcess.sample). The later samples were written at the section's seed."""
    samples = [{"prompt": "a"}, {"prompt": "b", "seed": 5}, {"prompt": "c"}, {"prompt": "d", "seed": 7}]
    t = translate(job(sample={"samples": samples, "seed": 0, "walk_seed": walk}), "run.yaml")
    lines = t.files["sample_prompts"][1].splitlines()[1:]
    assert [line.split("--d ")[1].split()[0] for line in lines] == seeds


@pytest.mark.parametrize("network, arch, alpha", [
    ({"linear": 32, "linear_alpha": 16}, "flux", 32.0),  # forced to the rank there: scale 1, not 0.5
    ({"linear": 16, "linear_alpha": None}, "qwen_image", 16.0),  # no alpha: ai-toolkit's 1.0 is unread there too
    ({"rank": 32}, "sd3", 32.0),  # the rank NetworkConfig reads first
    ({"type": "lokr", "lokr_full_rank": False, "linear": 16, "linear_alpha": 4}, "flux", 16.0),
    ({"type": "lokr", "lokr_full_rank": False, "linear": 16, "linear_alpha": 4, "old_lokr_format": True}, "flux", 4.0),
    ({"type": "lokr", "lokr_full_rank": False, "linear": 16, "linear_alpha": 4, "old_lokr_format": True},
     "flux2_klein_4b", 16.0),  # [klein]'s model writes the PEFT format whatever old_lokr_format says
])
def test_the_network_trains_at_the_alpha_ai_toolkit_gives_it(network, arch, alpha):
    """ai-toolkit's LoRASpecialNetwork sets alpha = rank for every transformer it trains (its PEFT format), unless a
    LoKr is asked for in the old format on a model that keeps it: a converted linear_alpha would train at another
    scale (toolkit/lora_special.py)."""
    given = job(network=network, model={"arch": arch})
    section = given["config"]["process"][0]["network"]
    for key in [k for k, v in section.items() if v is None]:
        del section[key]
    t = translate(given, "run.yaml")
    assert t.config["network_alpha"] == alpha
    shown = next(line for line in t.lines if line.key.startswith("network.linear_alpha"))
    assert ("alpha = rank" in shown.note) == (alpha != float(network.get("linear_alpha") or 1.0))


@pytest.mark.parametrize("arch, hub, k", [("hidream", "HiDream-ai/HiDream-I1-Full", 3.0),
                                          ("lumina2", "Alpha-VLLM/Lumina-Image-2.0", 6.0),
                                          ("sd3", "stabilityai/stable-diffusion-3.5-large", 3.0),
                                          ("zimage", "Tongyi-MAI/Z-Image-Turbo", 3.0),  # (its UI's zimage:turbo too)
                                          ("ernie_image", "baidu/ERNIE-Image", 3.0),
                                          ("anima", "circlestone-labs/Anima", 3.0),
                                          ("ideogram4", "ideogram/ideogram-4", 1.0),
                                          ("nucleus_image", "NucleusAI/Nucleus-Image", 1.0)])
def test_a_fixed_shift_models_shift_types_are_ours_shift_of_a_uniform_draw(arch, hub, k):
    """HiDream's training scheduler there shifts by 3, not by the image size: its shift / flux_shift types pick one of
    999 evenly spaced sigmas (1 down to its scheduler's sigma_min, 0.003) shifted by 3, uniformly: ours' shift of a
    uniform draw at 3, continuous, within 0.005 in CDF of its grid at every sigma (its grid's floor, 0.009, holds
    ours' lowest 0.003; at Lumina 2's 6, 0.035 holds 0.006). Z-Image's, ERNIE-Image's and Anima's shift by 3 too
    (their get_train_scheduler's CustomFlowMatchEulerDiscreteScheduler, use_dynamic_shifting off), SD3's (its
    sd_flow_config) and Lumina 2's (its lumina2_config, 6) are fixed, Ideogram 4's and Nucleus-Image's shift by 1:
    ours' uniform draw there. FLUX.1's shifts by the image size: below."""
    sigma_min = k * 0.001 / (1 + (k - 1) * 0.001)
    unshifted = torch.linspace(1.0, sigma_min, 1000, dtype=torch.float64)[:999]  # randint(0, 999): not the last
    grid = (k * unshifted / (1 + (k - 1) * unshifted)).sort().values
    x = torch.linspace(1e-4, 1 - 1e-4, 20_001, dtype=torch.float64)
    ours_cdf = x / (k - (k - 1) * x)  # P(k s / (1 + (k - 1) s) <= x), s uniform
    floor = grid[0] / (k - (k - 1) * grid[0])  # ours' mass below its least sigma (its sigma_min shifted twice)
    assert (torch.searchsorted(grid, x, right=True).double() / 999 - ours_cdf).abs().max().item() < floor + 0.002
    for kind in ("shift", "flux_shift"):
        t = translate(job(model={"name_or_path": hub, "arch": arch}, train={"timestep_type": kind}), "run.yaml")
        assert verdict(t, "train.timestep_type")[0] == RENAMED
        keys = {key: t.config.get(key) for key in ("timestep_sampling", "shifted_draw", "discrete_flow_shift")}
        assert keys == ({"timestep_sampling": "shift", "shifted_draw": "uniform", "discrete_flow_shift": k} if k != 1
                        else {"timestep_sampling": "uniform", "shifted_draw": None, "discrete_flow_shift": None})


def test_flux1s_shift_types_are_ours_flux_shift_of_a_uniform_draw():
    """ai-toolkit trains FLUX.1 with toolkit/sampler.py's flux_config: dynamic, mu on the line 256 / 4096 tokens at
    0.5 / 1.15 at (h / 2)(w / 2) tokens of the latent (its patch_size 2), applied to 999 of linspace(1, 0.001, 1000)
    picked uniformly: ours' flux_shift of a uniform draw at our token count, within 0.005 in CDF at 1024 and 512 px.
    Kontext's model counts h w tokens (its transformer's patch_size 1), 4x ours: not carried."""
    for tokens in (4096, 1024):
        mu = 0.5 + (1.15 - 0.5) / (4096 - 256) * (tokens - 256)
        unshifted = torch.linspace(1.0, 0.001, 1000, dtype=torch.float64)[:999]
        grid = (math.exp(mu) / (math.exp(mu) + 1 / unshifted - 1)).sort().values
        quantiles = (torch.arange(20_000, dtype=torch.float64) + 0.5) / 20_000
        ours = fm.sample_sigmas(20_000, "flux_shift", generator=None, image_seq_len=tokens, shifted="uniform",
                                quantiles=quantiles).double().sort().values
        x = torch.linspace(1e-4, 1 - 1e-4, 20_001, dtype=torch.float64)
        cdf = [torch.searchsorted(d, x, right=True).double() / len(d) for d in (grid, ours)]
        assert (cdf[0] - cdf[1]).abs().max().item() < 0.005
    t = translate(job(train={"timestep_type": "flux_shift"}), "run.yaml")
    assert (t.config["timestep_sampling"], t.config["shifted_draw"]) == ("flux_shift", "uniform")
    kontext = translate(job(model={"name_or_path": "black-forest-labs/FLUX.1-Kontext-dev", "arch": "flux_kontext"},
                            train={"timestep_type": "shift"}), "run.yaml")
    assert verdict(kontext, "train.timestep_type")[0] == NOT_CARRIED
