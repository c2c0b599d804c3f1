"""tools/convert_config.py on sd-scripts' flux_train_network.py and anima_train_network.py configs
(library/training/peers/sd_scripts.py, sd_scripts_script.py): its documented command lines on the tiny FLUX.1 and
Anima sets become configs train_lora.py reads (and trains 2 steps from), TOML configs with their dataset TOML, its
DreamBooth folders, a Chroma config; each key's verdict is the one its code gives it (kept, renamed, dropped, not
carried, unknown); bad input is one line, exit 2."""

import ast
import os

import pytest

from library.data.dataset_config import load_dataset_config
from library.text_files import toml_loads
from library.training.config import load_config
from library.training.peers import sd_scripts
from tools import convert_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# sd-scripts' checkout (the parser's arguments): the repository's .peers/, or SD_SCRIPTS_CHECKOUT
CHECKOUT = os.environ.get("SD_SCRIPTS_CHECKOUT", os.path.join(ROOT, ".peers", "sd-scripts"))


def report_rows(text: str) -> dict[str, tuple[str, str]]:
    """The report's rows: the peer's key -> (verdict, what it says after the value: a renamed key's ours)."""
    rows = {}
    for line in text.splitlines()[1:]:
        if not line.startswith("  "):
            break
        verdict, rest = line[2:13].strip(), line[14:]
        key = rest.split(" = ", 1)[0]
        rows[key] = (verdict, rest.split("  (", 1)[1][:-1].removeprefix("-> ") if "  (" in rest else "")
    return rows


def their_dataset(tmp_path, image_dir, **extra) -> str:
    """An sd-scripts dataset TOML (its docs' layout) over the tiny images."""
    path = tmp_path / "my_flux_dataset_config.toml"
    lines = ["[general]", "shuffle_caption = false", 'caption_extension = ".txt"', "keep_tokens = 1", "",
             "[[datasets]]", "resolution = 64", "batch_size = 2", "enable_bucket = true", "min_bucket_reso = 32",
             "max_bucket_reso = 128", "bucket_reso_steps = 16", *(f"{k} = {v}" for k, v in extra.items()), "",
             "  [[datasets.subsets]]", f"  image_dir = {image_dir!r}".replace("'", '"'), "  num_repeats = 2"]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def documented_command(tiny_set, dataset: str, out: str, *extra: str) -> str:
    """sd-scripts' docs/flux_train_network.md command line (section 4), its paths on the tiny set."""
    return " ".join([
        "accelerate launch --num_cpu_threads_per_process 1 flux_train_network.py",
        f'--pretrained_model_name_or_path="{tiny_set["flux_bfl"]}"', f'--clip_l="{tiny_set["clip_l"]}"',
        f'--t5xxl="{tiny_set["t5xxl"]}"', f'--ae="{tiny_set["flux_vae_single"]}"', f'--dataset_config="{dataset}"',
        f'--output_dir="{out}"', '--output_name="my_flux_lora"', "--save_model_as=safetensors",
        "--network_module=networks.lora_flux", "--network_dim=16", "--network_alpha=1", "--learning_rate=1e-4",
        '--optimizer_type="AdamW8bit"', '--lr_scheduler="constant"', "--sdpa", "--max_train_epochs=10",
        "--save_every_n_epochs=1", '--mixed_precision="fp16"', "--gradient_checkpointing", "--guidance_scale=1.0",
        '--timestep_sampling="flux_shift"', '--model_prediction_type="raw"', "--blocks_to_swap=18",
        "--cache_text_encoder_outputs", "--cache_latents", *extra,
    ])


def convert(argv: list[str], capsys) -> tuple[int, dict, str]:
    code = convert_config.main(argv)
    captured = capsys.readouterr()
    return code, report_rows(captured.out), captured.out + captured.err


def test_documented_command_converts_and_train_lora_reads_it(tiny_set, tmp_path, capsys):
    dataset = their_dataset(tmp_path, tiny_set["image_dir"], color_aug="true")
    out = tmp_path / "ours.toml"
    command = documented_command(tiny_set, dataset, str(tmp_path / "run"), "--noise_offset 0.1",
                                 "--ip_noise_gamma 0.1 --ip_noise_gamma_random_strength",
                                 "--network_args split_qkv=True img_attn_dim=8 ggpo_beta=0.01 dropout=0.1 "
                                 "network_reg_dims=double_blocks=16,single_blocks_0_=4")
    code, rows, text = convert(["--command", command, "--out", str(out)], capsys)
    assert code == 0, text
    assert rows["network_dim"] == ("kept", "") and rows["mixed_precision"] == ("kept", "")
    assert rows["network_module"][0] == "renamed" and 'network_module = "networks.lora"' in rows["network_module"][1]
    assert rows["blocks_to_swap"][1].startswith("blocks_to_swap = 27: sd-scripts' 18 swaps 9 double and 18 single")
    for dropped in ("sdpa", "cache_latents", "model_prediction_type", "save_model_as", "noise_offset",
                    "network_args dropout"):  # networks.lora_flux reads network_dropout, not a dropout argument
        assert rows[dropped][0] == "dropped", dropped
    assert rows["noise_offset"][1].startswith("sd-scripts' FLUX.1 / Chroma training does not read it either")
    for refused in ("network_args split_qkv", "network_args ggpo_beta", "datasets[0].color_aug",
                    "network_train_unet_only (default)"):  # the docs' command trains a CLIP-L LoRA too
        assert rows[refused][0] == "not carried", refused
    assert "check: train_lora.py reads it as written" in text
    ours = toml_loads(out.read_text())
    assert ours["network_module"] == "networks.lora" and ours["network_args"] == [
        "img_attn_dim=8", "network_reg_dims=double_blocks=16,single_blocks_0_=4"]  # carried since 2026-12-01
    assert (ours["timestep_sampling"], ours["guidance_scale"], ours["blocks_to_swap"]) == ("flux_shift", 1.0, 27)
    assert (ours["ip_noise_gamma"], ours["ip_noise_gamma_random_strength"]) == (0.1, True)  # carried since 2026-12-01
    assert ours["dataset_config"] == str(tmp_path / "ours_dataset.toml")
    args = load_config(["--config_file", str(out)])
    assert (args.model_type, args.optimizer_type, args.max_train_epochs, args.network_alpha) == ("flux", "AdamW8bit", 10, 1.0)
    data = load_dataset_config(args.dataset_config)
    subset = data.datasets[0].subsets[0]
    assert (data.datasets[0].resolution, subset.num_repeats, subset.keep_tokens) == ((64, 64), 2, 1)
    assert "# not carried: network_args split_qkv = 'True'" in out.read_text()


def test_toml_config_with_defaults_and_an_unknown_key(tiny_set, tmp_path, capsys):
    """sd-scripts' TOML (tables for people, as its --output_config writes); a key it leaves out is translated at
    its default where that trains otherwise than ours; a typo is unknown."""
    dataset = their_dataset(tmp_path, tiny_set["image_dir"])
    config = tmp_path / "flux_lora.toml"
    config.write_text("\n".join([
        "[model]", f'pretrained_model_name_or_path = "{tiny_set["flux_bfl"]}"', f'clip_l = "{tiny_set["clip_l"]}"',
        f't5xxl = "{tiny_set["t5xxl"]}"', f'ae = "{tiny_set["flux_vae_single"]}"', "",
        "[training]", f'dataset_config = "{dataset}"', f'output_dir = "{tmp_path / "run"}"',
        'network_module = "networks.lora_flux"', "network_train_unet_only = true", 'timestep_sampling = "sigma"',
        'weighting_scheme = "logit_normal"', "logit_std = 1.2", "discrete_flow_shift = 3.1582",
        'loss_type = "huber"', 'huber_schedule = "constant"', "huber_c = 0.2", "huber_scale = 0.5",
        "min_snr_gamma = 5", "learnig_rate = 1e-4", ""]))
    code, rows, text = convert([str(config)], capsys)
    assert code == 0, text
    assert rows["learnig_rate"][0] == "unknown"
    assert rows["min_snr_gamma"][0] == "dropped"  # flux_train_network's post_process_loss returns the loss as it is
    assert rows["timestep_sampling"] == ("renamed", 'timestep_sampling = "shift" with sigmoid_scale = 1.2, '
                                                    "discrete_flow_shift = 3.1582 (the same draw, continuous)")
    assert rows["network_alpha (default)"] == ("kept", "") and rows["learning_rate (default)"] == ("kept", "")
    assert rows["model_prediction_type (default)"][0] == "not carried"  # sigma_scaled
    ours = toml_loads((tmp_path / "flux_lora_converted.toml").read_text())
    assert (ours["network_dim"], ours["network_alpha"], ours["learning_rate"], ours["mixed_precision"]) == (4, 1.0, 2e-6, "no")
    assert (ours["output_name"], ours["guidance_scale"]) == ("last", 3.5)
    assert (ours["timestep_sampling"], ours["sigmoid_scale"], ours["discrete_flow_shift"]) == ("shift", 1.2, 3.1582)
    assert (ours["loss_type"], ours["huber_c"]) == ("huber", 0.1)
    assert "check: train_lora.py reads it as written" in text


@pytest.mark.parametrize("keys, verdicts", [
    ({}, {"timestep_sampling (default)": "renamed"}),  # a uniform draw shifted by 3: shift, shifted_draw uniform
    ({"timestep_sampling": "sigma", "discrete_flow_shift": 1}, {"timestep_sampling": "renamed"}),  # -> uniform
    ({"weighting_scheme": "sigma_sqrt", "model_prediction_type": "raw"}, {"weighting_scheme": "dropped"}),
    ({"weighting_scheme": "cosmap"}, {"weighting_scheme": "not carried"}),  # weighs the sigma_scaled loss
    ({"timestep_sampling": "uniform", "sigmoid_scale": 2.0}, {"timestep_sampling": "kept", "sigmoid_scale": "dropped"}),
    ({"loss_type": "huber"}, {"loss_type": "not carried"}),  # huber_schedule snr: sd-scripts' FLUX stops
    ({"optimizer_type": "AdamWScheduleFree"}, {"optimizer_type": "kept"}),  # not carried before 2026-11-29
    ({"optimizer_type": "AdamWScheduleFree", "optimizer_args": ["warmup_steps=100"], "lr_scheduler": "cosine"},
     {"optimizer_type": "kept", "optimizer_args": "kept", "lr_scheduler": "dropped"}),  # sd-scripts' dummy scheduler
    ({"optimizer_type": "Adafactor", "optimizer_args": ["scale_parameter=False"]},  # relative_step: its own lr
     {"optimizer_type": "not carried", "optimizer_args": "not carried"}),
    ({"optimizer_type": "Adafactor", "optimizer_args": ["relative_step=False", "scale_parameter=False", "warmup_init=False"]},
     {"optimizer_type": "kept", "optimizer_args": "kept"}),  # sd-scripts' docs' low-VRAM Adafactor
    ({"use_8bit_adam": True}, {"use_8bit_adam": "renamed"}),
    ({"lr_scheduler": "cosine", "lr_scheduler_num_cycles": 3}, {"lr_scheduler_num_cycles": "dropped"}),
    ({"unet_lr": 5e-4, "learning_rate": 1e-4}, {"unet_lr": "renamed", "learning_rate": "dropped"}),
    ({"base_weights": ["a.safetensors", "b.safetensors"], "base_weights_multiplier": [0.5]},
     {"base_weights": "renamed", "base_weights_multiplier": "dropped"}),
    ({"resume": "out/last-state"}, {"resume": "not carried"}),
    ({"network_train_unet_only": False, "text_encoder_lr": 0},  # lora_flux skips a parameter group at lr 0: no
     {"network_train_unet_only": "dropped", "text_encoder_lr": "dropped"}),  # CLIP-L LoRA trained, as ours
    ({"network_train_unet_only": False, "text_encoder_lr": [1e-5, 1e-5]},  # the kohya_ss GUI's list
     {"network_train_unet_only": "not carried", "text_encoder_lr": "not carried"}),
    ({"apply_t5_attn_mask": True}, {"apply_t5_attn_mask": "not carried"}),  # ours' FLUX.1 runs T5 unmasked
    ({"timestep_sampling": "sigma", "weighting_scheme": "logit_normal", "logit_mean": 0.4},  # not carried before
     {"timestep_sampling": "renamed", "logit_mean": "renamed"}),  # 2026-12-05 (ours' sigmoid draw had no mean)
    ({"timestep_sampling": "sigma", "weighting_scheme": "mode", "mode_scale": 1.0},  # nor the mode law
     {"timestep_sampling": "renamed", "mode_scale": "kept"}),
    ({"timestep_sampling": "sigma", "weighting_scheme": "mode", "mode_scale": 2.5},  # outside (-1, 1.75]
     {"timestep_sampling": "not carried", "mode_scale": "dropped"}),
])
def test_verdicts_follow_sd_scripts_code(keys, verdicts):
    t = sd_scripts.translate({"network_train_unet_only": True, **keys}, "x.toml")
    got = {line.key: line.verdict for line in t.lines}
    assert {k: got.get(k) for k in verdicts} == verdicts
    if "unet_lr" in keys:
        assert t.config["learning_rate"] == 5e-4
    if "base_weights" in keys:
        assert t.config["base_loras"] == ["a.safetensors:0.5", "b.safetensors:1"]
    if "use_8bit_adam" in keys:
        assert t.config["optimizer_type"] == "AdamW8bit"
    if "logit_mean" in keys:  # its sigma is the shift of 1 - u: the mean negated
        assert (t.config["timestep_sampling"], t.config["sigmoid_mean"]) == ("shift", -0.4)
    if keys.get("mode_scale") == 1.0:
        assert {k: t.config[k] for k in ("timestep_sampling", "shifted_draw", "mode_scale")} == {
            "timestep_sampling": "shift", "shifted_draw": "mode", "mode_scale": 1.0}  # (its shift 3: ours' default)


def test_dreambooth_folders_become_subsets(tiny_set, tmp_path, capsys):
    """No dataset_config: train_data_dir's `<repeats>_<class tokens>` folders (and reg_data_dir's) are the
    subsets, the dataset arguments our [general]; a folder without the number is skipped, as sd-scripts does."""
    images = sorted(f for f in os.listdir(tiny_set["image_dir"]) if f.endswith(".png"))
    train, reg = tmp_path / "img" / "10_ohwx shape", tmp_path / "reg" / "1_shape"
    for folder, names in ((train, images[:4]), (reg, images[4:])):
        folder.mkdir(parents=True)
        for name in names:
            (folder / name).write_bytes(open(os.path.join(tiny_set["image_dir"], name), "rb").read())
    (tmp_path / "img" / "notes").mkdir()
    command = (f"flux_train_network.py --pretrained_model_name_or_path {tiny_set['flux_bfl']} --clip_l {tiny_set['clip_l']} "
               f"--t5xxl {tiny_set['t5xxl']} --ae {tiny_set['flux_vae_single']} --train_data_dir {tmp_path / 'img'} "
               f"--reg_data_dir {tmp_path / 'reg'} --resolution 64,64 --train_batch_size 2 --enable_bucket "
               f"--min_bucket_reso 32 --max_bucket_reso 128 --bucket_reso_steps 16 --flip_aug --color_aug "
               f"--network_module networks.lora_flux --network_train_unet_only --output_dir {tmp_path / 'run'}")
    code, rows, text = convert(["--command", command, "--out", str(tmp_path / "db.toml")], capsys)
    assert code == 0, text
    assert rows["train_data_dir"] == ("renamed", "dataset subsets 10_ohwx shape (10 repeats)")
    assert rows["train_data_dir notes/"][0] == "dropped" and rows["color_aug"][0] == "not carried"
    assert rows["caption_extension (default)"][0] == "renamed"  # sd-scripts' .caption, ours .txt
    written = toml_loads((tmp_path / "db_dataset.toml").read_text())
    assert written["general"] == {"resolution": 64, "batch_size": 2, "enable_bucket": True, "min_bucket_reso": 32,
                                  "max_bucket_reso": 128, "bucket_reso_steps": 16, "flip_aug": True,
                                  "caption_extension": ".caption"}
    assert written["datasets"][0]["subsets"] == [
        {"image_dir": str(train), "num_repeats": 10, "class_tokens": "ohwx shape"},
        {"image_dir": str(reg), "num_repeats": 1, "class_tokens": "shape", "is_reg": True}]
    assert "check: train_lora.py reads it as written" in text


def test_chroma_config(tiny_set, tmp_path, capsys):
    """sd-scripts' Chroma command (its docs): guidance 0 and the T5 mask are what ours always does; a CLIP-L
    given anyway is dropped (Chroma has none), and the rest reads as train_lora.py reads it."""
    dataset = their_dataset(tmp_path, tiny_set["image_dir"])
    command = (f"flux_train_network.py --pretrained_model_name_or_path={tiny_set['chroma_bfl']} --model_type=chroma "
               f"--t5xxl={tiny_set['chroma_t5xxl']} --ae={tiny_set['flux_vae_single']} --clip_l={tiny_set['clip_l']} "
               f"--dataset_config={dataset} --output_dir={tmp_path / 'run'} --output_name=my_chroma_lora "
               f"--guidance_scale=0.0 --timestep_sampling=sigmoid --apply_t5_attn_mask --model_prediction_type=raw "
               f"--network_module=networks.lora_flux --network_args img_mod_dim=2 train_blocks=single")
    code, rows, text = convert(["--command", command, "--out", str(tmp_path / "chroma.toml")], capsys)
    assert code == 0, text
    assert {k: rows[k][0] for k in ("guidance_scale", "apply_t5_attn_mask", "clip_l", "network_args img_mod_dim")} == {
        "guidance_scale": "dropped", "apply_t5_attn_mask": "dropped", "clip_l": "dropped",
        "network_args img_mod_dim": "not carried"}
    assert "network_train_unet_only (default)" not in rows  # no CLIP-L to train
    args = load_config(["--config_file", str(tmp_path / "chroma.toml")])
    assert (args.model_type, args.timestep_sampling, args.network_args) == ("chroma", "sigmoid", ["train_blocks=single"])
    assert "check: train_lora.py reads it as written" in text


def anima_command(tiny_set, dataset: str, out: str, *extra: str) -> str:
    """sd-scripts' docs/anima_train_network.md command line (section 4), its paths on the tiny set."""
    return " ".join([
        "accelerate launch --num_cpu_threads_per_process 1 anima_train_network.py",
        f'--pretrained_model_name_or_path="{tiny_set["anima"]}"', f'--qwen3="{tiny_set["anima_text_encoder"]}"',
        f'--vae="{tiny_set["qwen_image_vae"]}"', f'--dataset_config="{dataset}"', f'--output_dir="{out}"',
        '--output_name="my_anima_lora"', "--save_model_as=safetensors", "--network_module=networks.lora_anima",
        "--network_dim=8", "--learning_rate=1e-4", '--optimizer_type="AdamW8bit"', '--lr_scheduler="constant"',
        '--timestep_sampling="sigmoid"', "--discrete_flow_shift=1.0", "--max_train_epochs=10",
        "--save_every_n_epochs=1",
        '--mixed_precision="bf16"', "--gradient_checkpointing", "--cache_latents", "--cache_text_encoder_outputs",
        "--vae_chunk_size=64", "--vae_disable_cache", *extra,
    ])


def test_anima_documented_command_converts_and_train_lora_reads_it(tiny_set, tmp_path, capsys):
    """anima_train_network.py: its model files as ours (qwen3 -> text_encoder, vae -> ae), its sigmoid draw kept (ours'
    Anima default is anima_shift k = 3), its LLM-adapter switch as adapter_dim at network_dim, its memory switches
    dropped, a separate adapter file and another Qwen3 length not carried; the FLUX.1 script's keys are unknown."""
    dataset = their_dataset(tmp_path, tiny_set["image_dir"])
    command = anima_command(tiny_set, dataset, str(tmp_path / "run"), "--blocks_to_swap=10", "--fp8_base",
                            "--llm_adapter_path=adapter.safetensors", "--qwen3_max_token_length=256",
                            "--t5_max_token_length=512", "--llm_adapter_lr=5e-5", "--guidance_scale=1.0",
                            "--network_args train_llm_adapter=True \"exclude_patterns=['.*mlp.*']\" "
                            "\"include_patterns=['.*final_layer.*']\" verbose=True rank_dropout=0.1 split_qkv=True")
    out = tmp_path / "ours.toml"
    code, rows, text = convert(["--command", command, "--out", str(out)], capsys)
    assert code == 0, text
    assert (rows["qwen3"], rows["vae"]) == (("renamed", "text_encoder"), ("renamed", "ae"))
    assert rows["blocks_to_swap"] == ("kept", "")  # its 10 of 28 blocks of one kind, as ours
    for dropped in ("fp8_base", "vae_chunk_size", "vae_disable_cache", "t5_max_token_length", "llm_adapter_lr",
                    "discrete_flow_shift", "network_args verbose", "network_args split_qkv", "cache_latents"):
        assert rows[dropped][0] == "dropped", (dropped, rows[dropped])
    assert rows["llm_adapter_lr"][1].startswith("its full fine-tuning's rates")
    for refused in ("llm_adapter_path", "qwen3_max_token_length", "network_args include_patterns"):
        assert rows[refused][0] == "not carried", refused
    assert rows["guidance_scale"][0] == "unknown"  # the FLUX.1 script's argument: not anima_train_network.py's
    assert "network_train_unet_only (default)" not in rows  # sd-scripts stops when caching without it; ours: the DiT's
    assert "check: train_lora.py reads it as written" in text
    ours = toml_loads(out.read_text())
    assert (ours["model_type"], ours["text_encoder"], ours["ae"]) == (
        "anima", tiny_set["anima_text_encoder"], tiny_set["qwen_image_vae"])
    assert (ours["timestep_sampling"], ours["blocks_to_swap"]) == ("sigmoid", 10)
    assert ours["network_module"] == "networks.lora"
    assert ours["network_args"] == ["adapter_dim=8", "exclude_patterns=['.*mlp.*']", "rank_dropout=0.1"]
    assert not {"base_precision", "discrete_flow_shift", "guidance_scale"} & set(ours)
    args = load_config(["--config_file", str(out)])
    assert (args.model_type, args.network_dim, args.optimizer_type) == ("anima", 8, "AdamW8bit")


def test_anima_toml_reads_its_scripts_defaults(tiny_set, tmp_path, capsys):
    """An anima_train_network.py TOML (no script named: its LoRA module, else its qwen3 key says it; keys of both
    scripts are one line): a timestep draw left out is its
    parser's sigmoid (not ours' anima_shift), `shift` at its discrete_flow_shift 1.0; weighting_scheme weighs its raw
    loss (no model_prediction_type there); a Qwen3 LoRA it would train is not carried."""
    dataset = their_dataset(tmp_path, tiny_set["image_dir"])
    config = tmp_path / "anima_lora.toml"
    config.write_text("\n".join([
        "[model]", f'pretrained_model_name_or_path = "{tiny_set["anima"]}"',
        f'qwen3 = "{tiny_set["anima_text_encoder"]}"', f'vae = "{tiny_set["qwen_image_vae"]}"', 'llm_adapter_path = ""',
        "", "[training]", f'dataset_config = "{dataset}"', f'output_dir = "{tmp_path / "run"}"',
        'weighting_scheme = "sigma_sqrt"', "network_train_unet_only = true", 'network_module = "networks.lora_anima"',
        't5xxl = "t5.safetensors"', ""]))  # its LoRA module names the script: t5xxl is then not its parser's
    code, rows, text = convert([str(config)], capsys)
    assert code == 0, text
    assert rows["timestep_sampling (default)"] == ("kept", "") and rows["weighting_scheme"] == ("kept", "")
    assert rows["llm_adapter_path"] == ("dropped", "empty") and rows["t5xxl"][0] == "unknown"
    ours = toml_loads((tmp_path / "anima_lora_converted.toml").read_text())
    assert (ours["model_type"], ours["timestep_sampling"]) == ("anima", "sigmoid")
    assert ours["weighting_scheme"] == "sigma_sqrt"
    assert (ours["network_dim"], ours["learning_rate"]) == (4, 2e-6)  # its parser's defaults, as FLUX.1's
    assert "check: train_lora.py reads it as written" in text
    shift = sd_scripts.translate({"qwen3": "q", "timestep_sampling": "shift", "network_train_unet_only": False},
                                 "x.toml")
    verdicts = {line.key: line.verdict for line in shift.lines}
    assert (shift.config["timestep_sampling"], shift.config["discrete_flow_shift"]) == ("shift", 1.0)
    assert verdicts["discrete_flow_shift (default)"] == "kept" and verdicts["network_train_unet_only"] == "not carried"
    cached = sd_scripts.translate({"network_module": "networks.lora_anima", "cache_text_encoder_outputs_to_disk": True,
                                   "network_args": ["train_llm_adapter=false", "loraplus_text_encoder_lr_ratio=2"]},
                                  "x.toml")
    assert cached.config["model_type"] == "anima" and "network_args" not in cached.config
    assert {line.key: line.verdict for line in cached.lines}["network_args loraplus_text_encoder_lr_ratio"] == "dropped"
    # (guidance_scale: the FLUX.1 script's alone; clip_l is sd3_train_network.py's too)
    with pytest.raises(ValueError, match=r"^x\.toml: guidance_scale \(flux_train_network\.py's\), qwen3 \(anima_tr"):
        sd_scripts.translate({"qwen3": "q", "guidance_scale": 1.0}, "x.toml")
    with pytest.raises(ValueError, match="^x.toml: sd-scripts' anima_train_network.py trains model_type 'anima', but "
                                         "--model_type flux"):
        sd_scripts.translate({"qwen3": "q"}, "x.toml", model_type="flux")


def test_command_with_config_file_takes_the_command_lines_keys_over_the_files(tiny_set, tmp_path, capsys):
    dataset = their_dataset(tmp_path, tiny_set["image_dir"])
    (tmp_path / "base.toml").write_text(f'[model]\npretrained_model_name_or_path = "{tiny_set["flux_bfl"]}"\n'
                                        f'clip_l = "{tiny_set["clip_l"]}"\nt5xxl = "{tiny_set["t5xxl"]}"\n'
                                        f'ae = "{tiny_set["flux_vae_single"]}"\ndataset_config = "{dataset}"\n'
                                        "network_dim = 8\nnetwork_alpha = 4\n")
    command = f"accelerate launch flux_train_network.py --config_file {tmp_path / 'base'} --network_dim 32"
    code, rows, text = convert(["--command", command, "--out", str(tmp_path / "ours.toml")], capsys)
    assert code == 0, text
    args = load_config(["--config_file", str(tmp_path / "ours.toml")])
    assert (args.network_dim, args.network_alpha) == (32, 4.0)


@pytest.mark.parametrize("command, expected", [
    ("flux_train_network.py --model_type sd3", "command line: model_type 'sd3': expected one of sd-scripts' flux, chroma"),
    ("sdxl_train_network.py --network_dim 4", "sdxl_train_network.py: sd-scripts' sdxl_train_network.py trains sdxl, "
                                              "which we do not train here"),
    ("train_network.py --network_dim 4", "train_network.py: sd-scripts' train_network.py trains Stable Diffusion 1.x"),
    ("flux_train_network.py --network_args rank_dropout", "command line: network_args entry 'rank_dropout': expected key=value"),
    ("flux_train_network.py --train_data_dir /nonexistent/img", "command line: train_data_dir '/nonexistent/img': no such folder"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, command, expected):
    code = convert_config.main(["--command", command, "--out", str(tmp_path / "x.toml")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"error: {expected}") and len(err.strip().splitlines()) == 1, err
    assert not os.listdir(tmp_path)


def test_two_steps_train_from_a_converted_config(tiny_set, tmp_path, capsys):
    import train_lora

    dataset = their_dataset(tmp_path, tiny_set["image_dir"])
    command = documented_command(tiny_set, dataset, str(tmp_path / "run"), "--network_train_unet_only",
                                 "--t5xxl_max_token_length 32", "--max_train_steps 2", "--network_dim 4")
    command = command.replace("--blocks_to_swap=18", "").replace('--mixed_precision="fp16"', "--mixed_precision=no")
    command = command.replace("--max_train_epochs=10 --save_every_n_epochs=1", "").replace("AdamW8bit", "AdamW")
    assert convert_config.main(["--command", command, "--out", str(tmp_path / "ours.toml")]) == 0
    capsys.readouterr()
    assert train_lora.main(["--config_file", str(tmp_path / "ours.toml")]) == 0
    assert os.path.isfile(tmp_path / "run" / "my_flux_lora.safetensors")


def own_parsers(checkout: str, script: str) -> dict[str, tuple[str, ...]]:
    """Each script's own part of its parser (beside train_network's): the `<module>.add_*(parser)` calls of its
    setup_parser, as {library/<module>.py: (function, ...)}."""
    tree = ast.parse(open(os.path.join(checkout, script), encoding="utf-8").read())
    setup = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "setup_parser")
    found: dict[str, tuple[str, ...]] = {}
    for call in ast.walk(setup):
        func = getattr(call, "func", None)
        if (isinstance(call, ast.Call) and isinstance(func, ast.Attribute) and func.attr.startswith("add_")
                and isinstance(func.value, ast.Name) and func.value.id != "parser"):
            path = f"library/{func.value.id}.py"
            found[path] = (*found.get(path, ()), func.attr)
    return found


def parser_arguments(checkout: str, script: str = "flux_train_network.py") -> set[str]:
    """The --names the script's parser takes: the add_argument calls of setup_parser (its and
    train_network's) and of the add_* functions they call, read from the source (nothing of theirs imported)."""
    functions = {
        "library/train_util.py": ("add_sd_models_arguments", "add_dataset_arguments", "add_training_arguments",
                                  "add_masked_loss_arguments", "add_optimizer_arguments", "add_dit_training_arguments"),
        "library/utils.py": ("add_logging_arguments",), "library/sai_model_spec.py": ("add_model_spec_arguments",),
        "library/deepspeed_utils.py": ("add_deepspeed_arguments",), "library/config_util.py": ("add_config_arguments",),
        "library/custom_train_functions.py": ("add_custom_train_arguments",),
        "train_network.py": ("setup_parser",), script: ("setup_parser",),
    }
    for path, names in own_parsers(checkout, script).items():
        functions[path] = (*functions.get(path, ()), *names)
    found = set()
    for path, names in functions.items():
        tree = ast.parse(open(os.path.join(checkout, path), encoding="utf-8").read())
        for node in (n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names):
            for call in ast.walk(node):
                if (isinstance(call, ast.Call) and getattr(call.func, "attr", "") == "add_argument" and call.args
                        and isinstance(call.args[0], ast.Constant) and str(call.args[0].value).startswith("--")):
                    found.add(call.args[0].value[2:])
    return found


# (bench/gpu_prepare.sh's .peers/sd-scripts holds its library and networks alone: no parser to read)
@pytest.mark.skipif(not os.path.isfile(os.path.join(CHECKOUT, "train_network.py")),
                    reason="no sd-scripts checkout (.peers/sd-scripts or SD_SCRIPTS_CHECKOUT)")
def test_every_argument_of_the_parser_has_a_rule():
    arguments = parser_arguments(CHECKOUT)
    assert len(arguments) > 200
    assert sorted(arguments - set(sd_scripts.RULES)) == [] and sorted(set(sd_scripts.RULES) - arguments) == []
    for script, rules in sd_scripts.SCRIPT_RULES.items():  # each script's own (48d368f: 215 and 220 arguments)
        arguments = parser_arguments(CHECKOUT, script)
        assert sorted(arguments - set(rules)) == [] and sorted(set(rules) - arguments) == [], script


def test_every_rule_says_why():
    for key, rule in sd_scripts.RULES.items():
        assert rule.kind in ("same", "custom") or rule.why, key


def test_the_docs_name_every_key_that_is_never_carried():
    """docs/moving_from_peers.md's sd-scripts section names each key whose rule never carries it."""
    from library.training.peers.sd_scripts_dataset import DATASET_RULES

    text = open(os.path.join(ROOT, "docs", "moving_from_peers.md"), encoding="utf-8").read()
    section = text.split("## sd-scripts", 1)[1].split("\n## ", 1)[0]
    keys = [k for rules in (sd_scripts.RULES, DATASET_RULES) for k, r in rules.items() if r.kind in ("unsupported", "implied")]
    assert [k for k in keys if f"`{k}`" not in section] == []


# The kohya_ss GUI's TOML (kohya_gui/lora_gui.py writes one per run and starts flux_train_network.py --config_file
# with it): every field, the empty ones as "", 0, [] or false, and keys of its own that sd-scripts' parser lacks.
KOHYA_SS_GUI_TOML = """
adaptive_noise_scale = 0
ae = "ae.safetensors"
apply_t5_attn_mask = false
bucket_no_upscale = true
bucket_reso_steps = 64
cache_latents = true
cache_latents_to_disk = true
cache_text_encoder_outputs = true
caption_dropout_every_n_epochs = 0
caption_dropout_rate = 0
caption_extension = ".txt"
clip_l = "clip_l.safetensors"
dataset_config = ""
discrete_flow_shift = 3.1582
enable_bucket = true
epoch = 10
fp8_base = true
gradient_checkpointing = true
guidance_scale = 1.0
huber_c = 0.1
huber_scale = 1
huber_schedule = "snr"
ip_noise_gamma = 0
learning_rate = 0.0003
log_with = ""
logging_dir = ""
loss_type = "l2"
lr_scheduler = "cosine_with_restarts"
lr_scheduler_args = []
lr_scheduler_num_cycles = 3
lr_warmup_steps = 0
max_data_loader_n_workers = 2
max_grad_norm = 1
max_train_epochs = 0
max_train_steps = 1600
mem_eff_save = false
min_snr_gamma = 0
mixed_precision = "bf16"
model_prediction_type = "raw"
network_alpha = 16
network_args = []
network_dim = 16
network_module = "networks.lora_flux"
network_train_unet_only = true
network_weights = ""
noise_offset = 0
noise_offset_type = "Original"
optimizer_args = ["weight_decay=0.01", "betas=0.9,0.99"]
optimizer_type = "AdamW"
output_name = "ohwx_flux"
persistent_data_loader_workers = 1
pretrained_model_name_or_path = "flux1-dev.safetensors"
reg_data_dir = ""
resolution = "512,512"
resume = ""
sample_every_n_steps = 0
sample_prompts = ""
save_every_n_steps = 0
save_precision = "bf16"
scale_weight_norms = 0
single_blocks_to_swap = 0
t5xxl = "t5xxl_fp16.safetensors"
timestep_sampling = "shift"
train_batch_size = 1
unet_lr = 0.0003
vae = ""
vae_batch_size = 0
wandb_api_key = ""
"""


def test_kohya_ss_gui_toml_converts_with_nothing_not_carried(tmp_path, capsys):
    """Its fields at their off values mean what sd-scripts reads them as (`if args.key:`): nothing; its `vae = ""`
    does not make it musubi-tuner's; its own keys are dropped; train_lora.py reads the written config."""
    images = tmp_path / "img" / "10_ohwx person"
    images.mkdir(parents=True)
    (images / "a.png").write_bytes(b"")
    config = tmp_path / "config_lora-20250101-120000.toml"
    config.write_text(KOHYA_SS_GUI_TOML + f'output_dir = "{tmp_path / "run"}"\ntrain_data_dir = "{tmp_path / "img"}"\n')
    code, rows, text = convert([str(config)], capsys)
    assert code == 0, text
    assert text.startswith("sd-scripts -> ours:") and ", 0 not carried, 0 unknown" in text.splitlines()[0], text
    for key in ("log_with", "logging_dir", "network_weights", "sample_prompts", "scale_weight_norms", "vae_batch_size",
                "max_train_epochs", "dataset_config", "reg_data_dir", "epoch", "noise_offset_type", "mem_eff_save",
                "single_blocks_to_swap"):
        assert rows[key][0] == "dropped", (key, rows[key])
    assert rows["network_args"] == ("dropped", "empty") and rows["reg_data_dir"] == ("dropped", "empty: no folder")
    assert "check: train_lora.py reads it as written" in text
    ours = toml_loads((tmp_path / "config_lora-20250101-120000_converted.toml").read_text())
    assert ours["persistent_data_loader_workers"] is True  # its 1
    assert not {"log_with", "logging_dir", "network_weights", "scale_weight_norms", "vae_batch_size",
                "max_train_epochs"} & set(ours)


def test_tell_peer_takes_an_empty_or_sd_scripts_vae_for_sd_scripts():
    args = convert_config.build_parser().parse_args(["x.toml"])
    assert convert_config.tell_peer(args, {"pretrained_model_name_or_path": "m", "vae": ""}, "x.toml", None) == "sd-scripts"
    assert convert_config.tell_peer(args, {"pretrained_model_name_or_path": "m", "vae": "sd_vae.pt"}, "x.toml",
                                    None) == "sd-scripts"
    assert convert_config.tell_peer(args, {"vae": "vae.safetensors", "network_dim": 4}, "x.toml", None) == "musubi-tuner"
    assert convert_config.tell_peer(args, {"dit": "d", "vae": ""}, "x.toml", None) == "musubi-tuner"


@pytest.mark.parametrize("keys, verdicts, config", [
    ({"persistent_data_loader_workers": 1, "max_data_loader_n_workers": 2}, {"persistent_data_loader_workers": "kept"},
     {"persistent_data_loader_workers": True, "max_data_loader_n_workers": 2}),  # the kohya_ss GUI writes 0 / 1; sd-scripts takes 1 as on
    ({"log_with": "", "logging_dir": "", "network_weights": "", "sample_prompts": "", "save_precision": "",
      "scale_weight_norms": 0, "vae_batch_size": 0, "max_train_epochs": 0},  # ours refused "" / 0 or read "" as a path
     dict.fromkeys(("log_with", "logging_dir", "network_weights", "sample_prompts", "save_precision",
                    "scale_weight_norms", "vae_batch_size", "max_train_epochs"), "dropped"), {}),
    ({"base_weights": [], "base_weights_multiplier": []}, {"base_weights": "dropped"}, {}),
    ({"network_args": "", "blocks_to_swap": ""}, {"network_args": "dropped", "blocks_to_swap": "dropped"}, {}),  # was a
    # "network_args entry ''" error and an int('') one: sd-scripts' `if args.network_args` reads "" as none
    ({"log_prefix": "", "logging_dir": "logs"}, {"log_prefix": "dropped"}, {"logging_dir": "logs"}),
    ({"vae_batch_size": 2, "scale_weight_norms": 1.0}, {"vae_batch_size": "kept", "scale_weight_norms": "kept"},
     {"vae_batch_size": 2, "scale_weight_norms": 1.0}),
])
def test_off_values_are_dropped_and_the_rest_kept(keys, verdicts, config):
    t = sd_scripts.translate({"network_train_unet_only": True, **keys}, "x.toml")
    assert {line.key: line.verdict for line in t.lines if line.key in verdicts} == verdicts
    assert {k: t.config[k] for k in config if k in t.config} == config
    assert not {k for k in keys if k not in config} & set(t.config)


def config_with_prompts(tmp_path, text: str) -> str:
    """An sd-scripts FLUX config rendering samples from a prompt file holding `text`: its path."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(text)
    (tmp_path / "ds.toml").write_text(f'[[datasets]]\nresolution = 64\n[[datasets.subsets]]\n'
                                      f'image_dir = "{tmp_path}"\n')
    config = tmp_path / "c.toml"
    config.write_text(f'pretrained_model_name_or_path = "m"\nae = "a"\nclip_l = "c"\nt5xxl = "t"\n'
                      f'dataset_config = "{tmp_path / "ds.toml"}"\nnetwork_train_unet_only = true\n'
                      f'sample_prompts = "{prompts}"\nsample_every_n_steps = 100\n')
    return str(config)


def test_sample_prompts_with_flags_sd_scripts_skips_are_copied_without_them(tmp_path, capsys):
    """sd-scripts' FLUX samples skip --ss (and any flag or value its patterns do not match, --d -1); ours refuses
    them: the written config names a copy without them, which our prompt reader reads."""
    from library.data.prompts import read_prompt_file

    config = config_with_prompts(tmp_path, "# samples\nohwx person --w 512 --h 512 --d 42 --s 20 --g 3.5 --ss euler_a\n"
                                           "ohwx person at night --d -1 --n blurry\n")
    code, rows, text = convert([config], capsys)
    assert code == 0, text
    assert rows["sample_prompts"][0] == "renamed" and "a copy without --d, --ss" in rows["sample_prompts"][1]
    ours = toml_loads((tmp_path / "c_converted.toml").read_text())
    assert ours["sample_prompts"] == str(tmp_path / "c_converted_prompts.txt")
    assert (tmp_path / "c_converted_prompts.txt").read_text() == (
        "# samples\nohwx person --w 512 --h 512 --d 42 --s 20 --g 3.5\nohwx person at night --n blurry\n")
    first, second = read_prompt_file(ours["sample_prompts"], guidance_is_cfg=False)
    assert (first.width, first.seed, second.seed, second.negative) == (512, 42, None, "blurry")


def test_sample_prompt_values_are_copied_as_sd_scripts_reads_them(tmp_path, capsys):
    """sd-scripts reads a flag's value by its pattern's prefix (--w 1024.0 and 1024px: 1024; --g 1e1: 1.0; --s 0:
    1) and the copy kept them as written: ours refused the converted file at the run's start (needs int, got
    '1024.0'; steps must be >= 1) or read another value (1e1: 10). A value ours reads alike stays as written."""
    from library.data.prompts import read_prompt_file

    config = config_with_prompts(tmp_path, "a cat --W 1024.0 --h 768px --s 0 --g 1e1 --d 42.5 --l 3.50\n"
                                           "a dog --w 512 --s 5000 --d 123456789.0\n")
    code, rows, text = convert([config], capsys)
    assert code == 0, text
    assert "with each value as sd-scripts reads it" in rows["sample_prompts"][1], rows["sample_prompts"]
    copy = tmp_path / "c_converted_prompts.txt"
    assert copy.read_text() == ("a cat --W 1024 --h 768 --s 1 --g 1 --d 42 --l 3.50\n"
                                "a dog --w 512 --s 1000 --d 123456789\n")
    first, second = read_prompt_file(str(copy), guidance_is_cfg=False)
    assert (first.width, first.height, first.steps, first.guidance, first.seed) == (1024, 768, 1, 1.0, 42)
    assert second.steps == 1000


def test_out_never_writes_over_a_file_the_conversion_reads(tmp_path, capsys):
    """Old: `--out sd.toml` replaced sd-scripts' config with ours, `--out ds.toml` the dataset TOML the peer's
    config names (now our training config), `--out prompts.toml` its prompt objects, exit 0 and no word."""
    (tmp_path / "ds.toml").write_text(  # a folder of another machine (one here holding no image is skipped)
        f'[[datasets]]\nresolution = 64\n[[datasets.subsets]]\nimage_dir = "{tmp_path / "images"}"\n')
    (tmp_path / "prompts.toml").write_text('[[prompt]]\nprompt = "a cat"\n')
    config = tmp_path / "sd.toml"
    config.write_text('pretrained_model_name_or_path = "m"\nae = "a"\nclip_l = "c"\nt5xxl = "t"\n'
                      'dataset_config = "ds.toml"\nnetwork_train_unet_only = true\nsample_prompts = "prompts.toml"\n'
                      'sample_every_n_steps = 100\n')
    files = {name: (tmp_path / name).read_text() for name in os.listdir(tmp_path)}
    for out, what in (("sd.toml", "the config being converted"), ("ds.toml", "the dataset config it names"),
                      ("prompts.toml", "the prompt file it names"), ("ds", "the dataset config it names")):
        if out == "ds":  # its dataset TOML beside it: ds_dataset.toml, over a dataset config of that name
            (tmp_path / "ds_dataset.toml").write_text((tmp_path / "ds.toml").read_text())
            config.write_text(config.read_text().replace('"ds.toml"', '"ds_dataset.toml"'))
            files = {name: (tmp_path / name).read_text() for name in os.listdir(tmp_path)}
            out = "ds.toml"
        code = convert_config.main([str(config), "--out", str(tmp_path / out)])
        err = capsys.readouterr().err.strip()
        assert code == 2 and err.startswith("error: --out: ") and f"written over {what}" in err, err
        assert {name: (tmp_path / name).read_text() for name in os.listdir(tmp_path)} == files, out


@pytest.mark.parametrize("text, keys, ours", [
    ("a photo --w 512\n", {}, None),  # the kohya_ss GUI writes its prompt box into every config: sd-scripts renders none
    ("", {"sample_every_n_steps": 100}, ""),  # an empty file: sd-scripts renders nothing, ours refused the file
    ("# none yet\n", {"sample_at_first": True}, ""),
])
def test_sample_prompts_sd_scripts_does_not_render(tmp_path, text, keys, ours):
    prompts = tmp_path / "prompt.txt"
    prompts.write_text(text)
    t = sd_scripts.translate({"network_train_unet_only": True, "sample_prompts": str(prompts), **keys}, "x.toml")
    assert t.config.get("sample_prompts") == ours and not t.files


def test_a_value_of_another_type_is_one_line_naming_the_key():
    with pytest.raises(ValueError, match=r"^x\.toml: guidance_scale = '': could not convert"):
        sd_scripts.translate({"guidance_scale": ""}, "x.toml")  # was float()'s line alone, naming no key
    with pytest.raises(ValueError, match=r"^x\.toml: learning_rate = \[\]: float\(\) argument"):
        sd_scripts.translate({"learning_rate": []}, "x.toml")  # was a TypeError: a traceback



@pytest.mark.parametrize("value, steps, verdict, ours", [
    (100, 1000, "kept", 100), (0.05, None, "kept", 0.05),
    ("10%", None, "renamed", 0.1),  # sd-scripts' int_or_float: was kept as the text '10%', which ours refused
    (1.0, 600, "renamed", 600),  # a TOML float: 1.0 x the run's steps there, 1 step here
    ("100%", None, "not carried", None),  # no max_train_steps to count it in
])
def test_lr_warmup_steps_is_read_as_the_peers_read_it(value, steps, verdict, ours):
    """sd-scripts and musubi-tuner read lr_warmup_steps with int_or_float: "10%" and any float are a fraction of
    the run's steps; ours reads a number under 1 as the fraction and one of 1 or more as steps."""
    from library.training.peers import musubi_tuner

    given = {"lr_warmup_steps": value, **({"max_train_steps": steps} if steps else {})}
    for t in (sd_scripts.translate({"network_train_unet_only": True, **given}, "x.toml"),
              musubi_tuner.translate({"network_module": "networks.lora_zimage", **given}, "x.toml")):
        assert {line.key: line.verdict for line in t.lines}["lr_warmup_steps"] == verdict
        assert t.config.get("lr_warmup_steps") == ours


def test_a_lora_to_start_from_says_sd_scripts_trains_it_at_the_configs_alpha():
    """train_network.py builds the network at network_alpha / network_dim, then loads the file ("FIXME consider alpha
    of weights"): its alpha unread, unless dim_from_weights builds the network from it. Ours reads the file's."""
    base = {"network_train_unet_only": True, "network_weights": "start.safetensors", "network_alpha": 8}
    line = next(line for line in sd_scripts.translate(base, "x.toml").lines if line.key == "network_weights")
    assert line.verdict == "kept" and "network_alpha / network_dim (8 / 4)" in line.note
    built = sd_scripts.translate({**base, "dim_from_weights": True}, "x.toml")
    assert next(line.note for line in built.lines if line.key == "network_weights") == ""
    assert [line.verdict for line in sd_scripts.translate({**base, "network_weights": ""}, "x.toml").lines
            if line.key == "network_weights"] == ["dropped"]


@pytest.mark.parametrize("word, musubi, sd", [("1.0", 1, None), ("100.0", 100, None), ("0.5", 0.5, 0.5),
                                             ("1.5", 900, None), ("100", 100, 100)])
def test_a_command_lines_warmup_goes_through_the_peers_argparse_type(word, musubi, sd):
    """On a command line the word goes through the peer's type: musubi-tuner's _int_or_float makes a whole decimal of
    1 or more an int (steps: "1.0" is 1 step), sd-scripts' int_or_float refuses it (int("1.0")). Both were read as a
    TOML float is, a fraction of the run: "100.0" 100 x its 600 steps, a warmup the run never ends."""
    from library.training.peers import musubi_tuner
    from library.training.peers.rules import argv_to_dict

    given = argv_to_dict(["--lr_warmup_steps", word, "--max_train_steps", "600"])
    musubi_run = musubi_tuner.translate({"network_module": "networks.lora_zimage", **given}, "command line")
    sd_run = sd_scripts.translate({"network_train_unet_only": True, **given}, "command line")
    assert (musubi_run.config.get("lr_warmup_steps"), sd_run.config.get("lr_warmup_steps")) == (musubi, sd)


def test_the_peer_reads_a_familys_sd_scripts_names_from_its_spec_only(monkeypatch):
    """sd_scripts.py names no model: the specs' peer_models["sd-scripts"] give its --model_type values and default,
    and the family spec whether T5's padding is masked. A spec whose name is renamed is read by the new name, and
    the old one is then refused."""
    from dataclasses import replace

    from library.models.registry import arch_specs
    from library.models.spec import SdScriptsModels
    from library.training.peers import sd_scripts_models

    specs = dict(arch_specs())
    entry = specs["chroma"].peer_models["sd-scripts"]
    specs["chroma"] = replace(specs["chroma"], peer_models={**specs["chroma"].peer_models, "sd-scripts": SdScriptsModels(
        entry.script, entry.lora_module, {"chroma_hd": {"model_type": "chroma"}})})
    monkeypatch.setattr(sd_scripts_models, "arch_specs", lambda: specs)
    t = sd_scripts.translate({"model_type": "chroma_hd", "apply_t5_attn_mask": True, "network_train_unet_only": True},
                             "x.toml")
    assert t.config["model_type"] == "chroma"
    assert next(line.verdict for line in t.lines if line.key == "apply_t5_attn_mask") == "dropped"  # Chroma masks it
    with pytest.raises(ValueError, match="x.toml: model_type 'chroma': expected one of sd-scripts' flux, chroma_hd"):
        sd_scripts.translate({"model_type": "chroma"}, "x.toml")


def test_a_schedule_free_optimizer_is_carried_and_the_schedule_it_ignores_dropped():
    """AdamWScheduleFree was not carried (ours refused schedule-free optimizers); now ours trains it, and the schedule
    keys the peers ignore with it (a dummy scheduler at the constant lr) are dropped, not written for ours to refuse."""
    from library.training.peers import musubi_tuner

    given = {"optimizer_type": "AdamWScheduleFree", "optimizer_args": ["warmup_steps=100"], "lr_scheduler": "cosine",
             "lr_warmup_steps": 50, "lr_scheduler_num_cycles": 2}
    for t in (sd_scripts.translate({"network_train_unet_only": True, **given}, "x.toml"),
              musubi_tuner.translate({"network_module": "networks.lora_zimage", **given}, "x.toml")):
        verdicts = {line.key: line.verdict for line in t.lines}
        assert (verdicts["optimizer_type"], verdicts["optimizer_args"]) == ("kept", "kept"), t.peer
        for key in ("lr_scheduler", "lr_warmup_steps", "lr_scheduler_num_cycles"):
            assert verdicts[key] == "dropped" and key not in t.config, (t.peer, key)
        assert t.config["optimizer_args"] == ["warmup_steps=100"]


def test_our_dataset_loader_names_sd_scripts_for_its_keys_not_a_typo(tmp_path):
    """An sd-scripts dataset TOML's enable_wildcard = false (a no-op there) was "unknown key 'enable_wildcard'
    (allowed: ...)", read as a typo: nothing said it is an sd-scripts feature or that convert_config says what
    becomes of it. The data layer's list is the peer module's keys that are not ours."""
    from library.data.dataset_config import DATASET_KEYS, PIXEL_AUGMENTATIONS, SUBSET_KEYS
    from library.data.peer_keys import SD_SCRIPTS_DATASET_KEYS
    from library.training.peers.sd_scripts_dataset import DATASET_RULES

    ours = set(DATASET_KEYS) | set(SUBSET_KEYS) | set(PIXEL_AUGMENTATIONS)
    assert set(SD_SCRIPTS_DATASET_KEYS) == (set(DATASET_RULES) | {"conditioning_data_dir"}) - ours  # carry_table's
    path = tmp_path / "sd_dataset.toml"
    path.write_text(f'[general]\nenable_wildcard = false\n[[datasets]]\nresolution = 64\n'
                    f'[[datasets.subsets]]\nimage_dir = "{tmp_path}"\n')
    with pytest.raises(ValueError) as e:
        load_dataset_config(str(path))
    assert "[general] unknown key 'enable_wildcard'" in str(e.value)
    assert str(e.value).endswith(f"; {path} is an sd-scripts dataset TOML: `python tools/convert_config.py <its "
                                 f"training config> --dataset_config {path}` writes it as ours and says what "
                                 f"becomes of each key")


def test_a_dataset_sd_scripts_trains_with_warnings_converts_to_one_ours_loads(tiny_set, tmp_path, capsys):
    """sd-scripts sets bucket_no_upscale false on a dataset without enable_bucket and skips a subset of 0 repeats
    (one switched off) or of an empty folder, each with a warning; the converter carried all three, and our
    loader refused the written dataset ("does nothing without enable_bucket", "num_repeats must be >= 1")."""
    (tmp_path / "empty").mkdir()
    image_dir = tiny_set["image_dir"]
    (tmp_path / "ds.toml").write_text(
        f'[general]\nbucket_no_upscale = true\ncaption_extension = ".txt"\n'
        f'[[datasets]]\nresolution = 64\nenable_bucket = true\nmin_bucket_reso = 32\nmax_bucket_reso = 128\n'
        f'[[datasets.subsets]]\nimage_dir = "{image_dir}"\n'
        f'[[datasets]]\nresolution = 64\n'
        f'[[datasets.subsets]]\nimage_dir = "{image_dir}"\nnum_repeats = 2\n'
        f'[[datasets.subsets]]\nimage_dir = "{image_dir}"\nnum_repeats = 0\n'
        f'[[datasets.subsets]]\nimage_dir = "{tmp_path / "empty"}"\n')
    config = tmp_path / "c.toml"
    config.write_text(f'pretrained_model_name_or_path = "m"\nae = "a"\nclip_l = "c"\nt5xxl = "t"\n'
                      f'dataset_config = "{tmp_path / "ds.toml"}"\nnetwork_train_unet_only = true\n')
    code, rows, text = convert([str(config)], capsys)
    assert code == 0, text
    assert rows["datasets[1].bucket_no_upscale"] == ("dropped", "without enable_bucket: sd-scripts sets it false")
    assert rows["datasets[1].subsets[1]"] == ("dropped", "num_repeats 0: sd-scripts skips the subset")
    assert rows["datasets[1].subsets[2]"] == ("dropped", "no images in the folder: sd-scripts skips the subset")
    data = load_dataset_config(str(tmp_path / "c_converted_dataset.toml"))
    assert [d.bucket_no_upscale for d in data.datasets] == [True, False]
    assert [[s.num_repeats for s in d.subsets] for d in data.datasets] == [[1], [2]]


@pytest.mark.parametrize("script, config, lines", [
    ("sd3_train_network.py", {}, {"a cat --g 3.5 --d 1": "a cat --d 1 --l 7.5", "a cat --l 5 --g 2": "a cat --l 5"}),
    ("lumina_train_network.py", {}, {"a cat": "a cat --l 3.5"}),
    ("anima_train_network.py", {}, {"a cat --fs 5": "a cat --fs 5 --l 7.5"}),
    ("hunyuan_image_train_network.py", {}, {"a cat --fs 4 --l 6": "a cat --fs 4 --l 6"}),
    ("flux_train_network.py", {"model_type": "chroma"}, {"a cat --g 3.5": "a cat --l 1"}),
    ("flux_train_network.py", {}, {"a cat --g 3.5 --fs 2": "a cat --g 3.5"}),  # FLUX.1: --g its guidance, no --fs
])
def test_sample_lines_render_at_the_scale_and_shift_its_samples_read(tmp_path, script, config, lines):
    """sd-scripts' SD3, Lumina, Anima and HunyuanImage samples read --l alone (7.5 / 3.5 unset; Chroma's FLUX.1 ones
    --l 1.0, its --g an embedded guidance Chroma lacks), and Anima's and HunyuanImage's read --fs. Copied as they
    were, a lone --g was ours' CFG scale (3.5 where it rendered 7.5), a line without --l the family's default, and an
    Anima --fs was left out."""
    from library.training.peers import sd_scripts

    prompts = tmp_path / "p.txt"
    prompts.write_text("\n".join(lines) + "\n")
    t = sd_scripts.translate({"sample_prompts": str(prompts), "sample_every_n_steps": 100, **config},
                             str(tmp_path / "c.toml"), script=script)
    if "sample_prompts" not in t.files:  # nothing to change: the file as it is
        assert list(lines) == list(lines.values()) and t.config["sample_prompts"] == str(prompts)
    else:
        assert t.files["sample_prompts"][1].splitlines() == list(lines.values())


def test_the_headers_note_and_modelspec_text_are_carried():
    """training_comment and metadata_title / _author / ... (the LoRA's header text) were dropped ("ours writes none");
    ours writes them now, by the same keys. A thumbnail (a data URL of an image) is still not written."""
    from library.training.config_schema import SCHEMA
    from library.training.peers import sd_scripts

    given = {"training_comment": "v2", "metadata_title": "Zxq", "metadata_trigger_phrase": "zxq",
             "metadata_thumbnail": "t.png"}
    t = sd_scripts.translate(given, "x.toml")
    assert {k: t.config.get(k) for k in given} == {**given, "metadata_thumbnail": None}
    assert set(given) - {"metadata_thumbnail"} <= set(SCHEMA)


def test_networks_lora_on_a_dit_script_is_said_to_wrap_none_of_its_transformer():
    """sd-scripts' SD3 doc passes networks.lora, its SD / SDXL LoRA, which finds no Transformer2DModel in a DiT: the
    run wraps none of the transformer. The refusal read as if ours took it ("ours trains ... (networks.lora)")."""
    t = sd_scripts.translate({"network_module": "networks.lora", "network_train_unet_only": True}, "x.toml")
    verdict, text = next((line.verdict, line.text) for line in t.lines if line.key == "network_module")
    assert verdict == "not carried" and text.startswith("sd-scripts' SD / SDXL LoRA, which finds no layer"), text


@pytest.mark.parametrize("keys, ours", [
    ({"validation_split": 0.1}, 1),  # its default: every epoch where it holds images out
    ({"validation_split": 0.1, "validate_every_n_epochs": 3}, 3),
    ({"validate_every_n_epochs": 3}, None),  # nothing held out: it validates nothing
])
def test_its_epoch_validation_is_ours(keys, ours):
    t = sd_scripts.translate({"network_train_unet_only": True, **keys}, "x.toml")
    assert t.config.get("validate_every_n_epochs") == ours
