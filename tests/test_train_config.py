"""The training config schema: keys, types, ranges, where a value was set, idle and foreign keys, resume
checks (the optimizer's config and LR tracking: test_optimizer_config.py)."""

import os
import re

import pytest
import torch

from library.io import CheckpointError
from library.training import optim
from library.training.config import ConfigError, load_config, lora_network_args, parse_kv_literals


def write(tmp_path, text, name="train.toml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


BASE = 'model_type = "llm"\npretrained_model_name_or_path = "m"\ntrain_data = ["a.txt"]\n'


def test_cli_overrides_file_and_groups_are_flattened(tmp_path):
    cfg = write(tmp_path, BASE + "[network]\nnetwork_dim = 8\nnetwork_alpha = 4\n")
    args = load_config(["--config_file", cfg, "--network_dim", "32", "--gradient_checkpointing", "--output_dir", str(tmp_path)])
    assert args.network_dim == 32 and args.network_alpha == 4.0 and args.gradient_checkpointing is True


def test_unknown_key_names_key_and_file(tmp_path):
    cfg = write(tmp_path, BASE + "netwrok_dim = 8\n")
    with pytest.raises(ConfigError, match=r"train\.toml: unknown key 'netwrok_dim'"):
        load_config(["--config_file", cfg])


def test_every_unknown_key_of_a_file_is_named_in_one_line(tmp_path):
    """An sd-scripts config brings several; the old line named one a run, the first to be refused."""
    cfg = write(tmp_path, BASE + "cache_latents = true\n[extra]\nnetwork_train_unet_only = true\nsdpa = true\n")
    with pytest.raises(ConfigError) as raised:
        load_config(["--config_file", cfg])
    # then the peers that document them (peer_key_hint: sdpa is musubi-tuner's too)
    assert str(raised.value).startswith(f"{cfg}: unknown keys 'cache_latents', 'network_train_unet_only', 'sdpa' (")


def test_an_unknown_key_a_peer_documents_names_the_peer_and_the_converter(tmp_path):
    """A musubi-tuner config's keys name musubi-tuner and `tools/convert_config.py <file>`; a key no peer's TOML
    documents (ai-toolkit's process-level `device` is a YAML path's) names none."""
    cfg = write(tmp_path, BASE + 'dit = "qwen_image_bf16.safetensors"\n')
    with pytest.raises(ConfigError, match=r"'dit' \(musubi-tuner key: `python tools/convert_config.py .*` writes the "
                                          r"config as ours"):
        load_config(["--config_file", cfg])
    cfg = write(tmp_path, BASE + 'device = "cuda:0"\n')
    with pytest.raises(ConfigError) as raised:
        load_config(["--config_file", cfg])
    assert str(raised.value) == f"{cfg}: unknown key 'device'"


def test_a_config_file_without_its_suffix_is_found_with_toml_appended(tmp_path):
    """sd-scripts appends .toml; the old line said 'config file not found'."""
    cfg = write(tmp_path, BASE + f'output_dir = "{tmp_path}"\nnetwork_dim = 8\n')
    args = load_config(["--config_file", cfg[:-len(".toml")]])
    assert args.network_dim == 8 and args.config_file == cfg
    dotted = tmp_path / "flux_v1.5.toml"  # old: a dot in the name read as a suffix: "config file not found"
    os.rename(cfg, dotted)
    assert load_config(["--config_file", str(dotted)[:-len(".toml")]]).config_file == str(dotted)


def test_a_leading_tilde_in_a_path_key_is_the_home_folder_in_the_toml_and_on_the_command_line(tmp_path, monkeypatch):
    """A TOML has no shell: output_dir = "~/loras" made a folder named '~' in the working folder, and
    --output_dir=~/x (one word) the same; dataset TOML folders too."""
    home = tmp_path / "home"
    (home / "imgs").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    (home / "run.toml").write_text('model_type = "llm"\npretrained_model_name_or_path = "~/model"\n'
                                   'train_data = ["~/a.txt", "b.txt"]\noutput_dir = "~/loras"\n')
    args = load_config(["--config_file=~/run", "--logging_dir=~/logs", "--output_name", "~x"])
    assert args.config_file == str(home / "run.toml")
    assert (args.pretrained_model_name_or_path, args.output_dir, args.logging_dir) == (
        str(home / "model"), str(home / "loras"), str(home / "logs"))
    assert args.train_data == [str(home / "a.txt"), "b.txt"]
    assert args.output_name == "~x"  # a name, not a path
    (home / "fast.safetensors").write_bytes(b"")
    args = load_config(["--model_type", "flux", "--pretrained_model_name_or_path", "~/flux.safetensors", "--ae=~/ae",
                        "--clip_l=~/clip_l", "--t5xxl=~/t5xxl",
                        "--dataset_config=~/ds.toml", "--base_loras=~/fast.safetensors:0.5"])
    assert args.base_loras == [f"{home}/fast.safetensors:0.5"]
    assert (args.dataset_config, args.t5xxl) == (str(home / "ds.toml"), str(home / "t5xxl"))
    (home / "ds.toml").write_text('[[datasets]]\nresolution = 64\ncache_dir = "~/cache"\n'
                                  '[[datasets.subsets]]\nimage_dir = "~/imgs"\nmask_dir = "~/imgs/../imgs"\n')
    from library.data.dataset_config import load_dataset_config
    dataset = load_dataset_config("~/ds.toml").datasets[0]
    assert (dataset.cache_dir, dataset.subsets[0].image_dir) == (str(home / "cache"), str(home / "imgs"))
    assert dataset.subsets[0].mask_dir == str(home / "imgs/../imgs")


def test_none_on_the_command_line_clears_the_files_epochs_and_steps_alone_under_them_are_refused(tmp_path):
    """The file's max_train_epochs overrides max_train_steps: --max_train_steps 1 trained the file's epochs
    without a word, and nothing on the command line could clear them (0 is < 1, 'none' not an int)."""
    cfg = write(tmp_path, BASE + f'output_dir = "{tmp_path}"\nmax_train_epochs = 2\n')
    with pytest.raises(ConfigError) as raised:
        load_config(["--config_file", cfg, "--max_train_steps", "5"])
    assert str(raised.value) == (f"{cfg} and command line: --max_train_steps 5 would be ignored: max_train_epochs = 2 "
                                 f"in {cfg} overrides it; add --max_train_epochs none to train 5 steps")
    args = load_config(["--config_file", cfg, "--max_train_steps", "5", "--max_train_epochs", "none"])
    assert (args.max_train_steps, args.max_train_epochs) == (5, None)
    assert load_config(["--config_file", cfg, "--max_train_steps", "5", "--max_train_epochs", "3"]).max_train_epochs == 3
    with pytest.raises(ConfigError, match="--max_train_steps must be int, got 'none'"):  # its default is a number
        load_config(["--config_file", cfg, "--max_train_steps", "none"])


@pytest.mark.parametrize(
    "line, message",
    [
        ('network_dim = "8"', "key 'network_dim' must be an integer"),
        ('gradient_checkpointing = "True"', "key 'gradient_checkpointing' must be a boolean"),
        ('mixed_precision = "fp64"', "key 'mixed_precision' must be one of"),
    ],
)
def test_wrong_types_are_errors(tmp_path, line, message):
    cfg = write(tmp_path, BASE + line + "\n")
    with pytest.raises(ConfigError, match=message):
        load_config(["--config_file", cfg])


@pytest.mark.parametrize("key, value, problem", [
    ("learning_rate", "-1", "must be > 0"),
    ("network_dim", "0", "must be >= 1"),
    ("max_train_steps", "0", "must be >= 1"),
    ("blocks_to_swap", "-1", "must be >= 0"),
    ("validate_every_n_steps", "-1", "must be >= 0"),
])
def test_a_bad_value_is_blamed_on_where_it_was_set(tmp_path, key, value, problem):
    base = BASE + f'output_dir = "{tmp_path}"\n'
    cfg = write(tmp_path, base, name="base.toml")
    with pytest.raises(ConfigError, match=rf"^command line: key '{key}' {problem}"):
        load_config(["--config_file", cfg, f"--{key}", value])
    cfg = write(tmp_path, base + f"{key} = {value}\n", name="base.toml")
    with pytest.raises(ConfigError, match=rf"base\.toml: key '{key}' {problem}"):
        load_config(["--config_file", cfg])


def test_a_combination_set_in_two_places_names_both(tmp_path):
    cfg = write(tmp_path, BASE + f'output_dir = "{tmp_path}"\npretrain = true\n', name="base.toml")
    with pytest.raises(ConfigError, match=r"base\.toml and command line: 'pretrain' .*'fp8_base'"):
        load_config(["--config_file", cfg, "--fp8_base"])


@pytest.mark.parametrize("value, shown", [("-8", "-8"), ("nan", "nan"), ("-inf", "-inf")])
def test_network_alpha_must_be_positive_or_zero(tmp_path, value, shown):
    cfg = write(tmp_path, BASE + f"[network]\nnetwork_alpha = {value}\n")
    with pytest.raises(ConfigError) as raised:
        load_config(["--config_file", cfg])
    assert f"train.toml: key 'network_alpha' must be > 0 (or 0 for alpha = rank), got {shown}" in str(raised.value)
    assert load_config(["--config_file", cfg, "--network_alpha", "0"]).network_alpha == 0.0  # sd-scripts: alpha = rank


def test_impossible_combination_is_named(tmp_path):
    cfg = write(tmp_path, BASE + "pretrain = true\nfp8_base = true\n")
    with pytest.raises(ConfigError, match="'pretrain'.*fp8"):
        load_config(["--config_file", cfg])


_CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


@pytest.mark.parametrize("name", sorted(f[:-5] for f in os.listdir(_CONFIGS)
                                        if f.endswith(".toml") and not f.startswith("dataset_")))
def test_example_configs_pass_the_schema(name):
    """Every training config in configs/ (the dataset_*.toml files are the datasets they name)."""
    from library.models.registry import FAMILIES

    args = load_config(["--config_file", os.path.join(_CONFIGS, f"{name}.toml")])
    assert args.model_type in (*FAMILIES, "llm")
    dataset = args.model_type != "llm" and args.dataset_config
    if dataset and dataset.startswith("configs/") and args.validate_every_n_steps:
        # ten configs asked for val_loss of a shipped dataset TOML that holds no image out: refused at start
        import toml

        data = toml.load(os.path.join(os.path.dirname(_CONFIGS), dataset))
        tables = [data.get("general", {}), *data.get("datasets", []),
                  *(s for d in data.get("datasets", []) for s in d.get("subsets", []))]
        assert data.get("validation_datasets") or any(t.get("validation_split") for t in tables), \
            f"{name}.toml: validate_every_n_steps, but {dataset} holds no image out"


def test_dataset_example_config_parses():
    import os

    from library.data.dataset_config import load_dataset_config

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    blueprint = load_dataset_config(os.path.join(root, "configs", "dataset_example.toml"))
    assert blueprint.datasets and blueprint.datasets[0].subsets


def test_scaled_residual_init_outside_pretraining_is_named(tmp_path):
    cfg = write(tmp_path, BASE + "scaled_residual_init = false\n")
    with pytest.raises(ConfigError, match=r"train\.toml: key 'scaled_residual_init' is for llm pretraining"):
        load_config(["--config_file", cfg])


FLUX = ('model_type = "flux"\npretrained_model_name_or_path = "m"\nae = "a"\nclip_l = "c"\nt5xxl = "t"\n'
        'dataset_config = "d.toml"\n')


QWEN = ('model_type = "qwen_image"\npretrained_model_name_or_path = "m"\nae = "a"\ntext_encoder = "t"\n'
        'dataset_config = "d.toml"\n')


def test_network_args_take_sd_scripts_block_ranges_and_bare_regexes(tmp_path):
    """'train_double_block_indices=0-5,10' (sd-scripts' syntax, and our LoRA's) was refused as 'not a
    Python literal' before the network saw it."""
    cfg = write(tmp_path, FLUX + "network_args = ['train_double_block_indices=0-2,5', 'exclude_patterns=.*_mod\\..*']\n")
    args = load_config(["--config_file", cfg, "--output_dir", str(tmp_path)])
    assert lora_network_args(args) == {"train_double_block_indices": "0-2,5", "exclude_patterns": r".*_mod\..*"}
    with pytest.raises(ConfigError, match="not a Python literal"):  # optimizer_args stay literals
        parse_kv_literals(["betas=0.9,0.99x"], "optimizer_args", "x")


@pytest.mark.parametrize("network_arg, message", [
    ("train_double_block_indices=10-", "network_args 'train_double_block_indices': bad range '10-' in '10-'"),
    ("loraplus_lr_ratio=inf", "network_args 'loraplus_lr_ratio': expected a finite number > 0, got inf"),
    ('exclude_patterns=[".*img_mod.*", 1]', "network_args 'exclude_patterns': item 1 is not a regex string"),
])
def test_network_args_the_network_check_refuses_name_the_config(tmp_path, network_arg, message):
    """As train_lora.py gives them to the check before caching; before, block 10 alone was trained, the loss was
    NaN at step 2, and a raw TypeError ended the run."""
    from library.training.lora_inputs import check_network_settings

    cfg = write(tmp_path, FLUX + f"network_args = [{network_arg!r}]\n")
    args = load_config(["--config_file", cfg, "--output_dir", str(tmp_path)])
    with pytest.raises(ConfigError, match=re.escape(f"train.toml: {message}")):
        check_network_settings(args, "flux")


def test_a_key_in_two_tables_is_refused_naming_both(tmp_path):
    """The old line let the later table win without a word (TOML refuses a repeat only within one table)."""
    cfg = write(tmp_path, BASE + "[network]\nnetwork_dim = 4\n[output]\nnetwork_dim = 8\n")
    with pytest.raises(ConfigError, match=r"train\.toml: key 'network_dim' given twice \(in \[network\] and in \[output\]\)"):
        load_config(["--config_file", cfg])
    cfg = write(tmp_path, "learning_rate = 1e-3\n" + BASE + "[optimizer]\nlearning_rate = 5e-2\n")
    with pytest.raises(ConfigError, match=r"'learning_rate' given twice \(in the top level and in \[optimizer\]\)"):
        load_config(["--config_file", cfg])


@pytest.mark.parametrize("key, value, problem", [
    ("max_grad_norm", "-1.0", "must be >= 0, got -1"),  # clip_grad_norm_ would flip the gradient
    ("save_last_n_saves", "-1", "must be >= 0, got -1"),  # [:-keep] would delete each save as written
    ("max_train_epochs", "0", "must be >= 1, got 0"),  # silently fell back to max_train_steps
    ("save_every_n_steps", "-2", "must be >= 0"),
    ("learning_rate", "inf", "must be > 0 and finite, got inf"),
    ("learning_rate", "nan", "must be > 0 and finite, got nan"),
    ("network_dropout", "1.5", r"must be in \[0, 1\), got 1.5"),
    ("lr_scheduler_num_cycles", "0", "must be >= 1"),
    ("discrete_flow_shift", "-1", "must be > 0"),
    ("max_data_loader_n_workers", "-1", "must be >= 0"),
    ("guidance_scale", "nan", "must be >= 0 and finite, got nan"),
    ("ema_inv_gamma", "inf", "must be a finite number, got inf"),
])
def test_numbers_out_of_range_are_refused(tmp_path, key, value, problem):
    cfg = write(tmp_path, FLUX + f"{key} = {value}\n")
    with pytest.raises(ConfigError, match=rf"train\.toml: key '{key}' {problem}"):
        load_config(["--config_file", cfg, "--output_dir", str(tmp_path)])


@pytest.mark.parametrize("config, line, message", [
    (FLUX, "batch_size = 4", "key 'batch_size' is read by model_type llm, not by model_type flux "
                             r"\(the batch size of images is the dataset TOML's batch_size\)"),
    (FLUX, "batch_size = 8", "key 'batch_size' is read by model_type llm"),  # the llm's default: was let through
    (BASE, "torch_compile = true", "key 'torch_compile' is read by the diffusion models, not by model_type llm"),
    (BASE, "max_data_loader_n_workers = 2", "key 'max_data_loader_n_workers' is read by the diffusion models"),
    (FLUX, 'train_data = ["x.txt"]', "key 'train_data' is read by model_type llm"),
    (FLUX, 'text_encoder = "q"', "key 'text_encoder' is read by model_type .*qwen_image.*, not by model_type flux"),
    (BASE, 'timestep_sampling = "shift"', "key 'timestep_sampling' is read by the diffusion models, not by model_type llm"),
    (BASE, 'clip_l = "c"', "key 'clip_l' is read by the diffusion models"),
    # a key of one model_type of a family folder (the old line took every key of the folder)
    (QWEN, "layers = 3", "key 'layers' is read by model_type qwen_image_layered, not by model_type qwen_image"),
    (QWEN.replace('"qwen_image"', '"qwen_image_layered"'), 'model_version = "qwen-image-edit-2511"',
     "key 'model_version' is read by model_type .*qwen_image_edit.*, not by model_type qwen_image_layered"),
])
def test_a_key_the_model_type_never_reads_is_refused(tmp_path, config, line, message):
    """The old line ignored them: batch_size = 8 on a FLUX run trained the dataset's batch size."""
    cfg = write(tmp_path, config + line + "\n")
    with pytest.raises(ConfigError, match=rf"train\.toml: {message}"):
        load_config(["--config_file", cfg, "--output_dir", str(tmp_path)])


def test_a_foreign_key_is_refused_at_its_default_too(tmp_path):
    """batch_size = 8 (the llm's default) on a FLUX run was let through, and the dataset's batch trained;
    4 or 16 were refused."""
    cfg = write(tmp_path, FLUX + "blocks_to_swap = 0\n")
    with pytest.raises(ConfigError, match=r"^command line: key 'batch_size' is read by model_type llm"):
        load_config(["--config_file", cfg, "--output_dir", str(tmp_path), "--batch_size", "8"])
    cfg = write(tmp_path, BASE + "blocks_to_swap = 0\n")
    with pytest.raises(ConfigError, match=r"train\.toml: key 'blocks_to_swap' is read by the diffusion models"):
        load_config(["--config_file", cfg, "--output_dir", str(tmp_path)])


@pytest.mark.parametrize("lines, message", [
    ("lr_warmup_steps = 2", "key 'lr_warmup_steps' does nothing with lr_scheduler = \"constant\""),
    ("sample_every_n_steps = 10", "key 'sample_every_n_steps' renders the prompts of sample_prompts, which is not set"),
    ("sample_at_first = true", "key 'sample_at_first' renders the prompts of sample_prompts"),
    ('network_weights = "/nonexistent/lora.safetensors"', "key 'network_weights' = /nonexistent/lora.safetensors: no such file or folder"),
])
def test_keys_that_would_do_nothing_or_fail_after_caching_are_refused_first(tmp_path, lines, message):
    cfg = write(tmp_path, FLUX + lines + "\n")
    with pytest.raises(ConfigError, match=message):
        load_config(["--config_file", cfg, "--output_dir", str(tmp_path)])


@pytest.mark.parametrize("lines, message", [
    ('lr_scheduler = "cosine"\nlr_scheduler_num_cycles = 3',
     "key 'lr_scheduler_num_cycles' does nothing with lr_scheduler = \"cosine\"; it needs lr_scheduler = \"cosine_with_restarts\""),
    ('lr_scheduler = "linear"\nlr_scheduler_power = 2.0', "key 'lr_scheduler_power' does nothing with lr_scheduler = \"linear\""),
    ("discrete_flow_shift = 3.1582", "key 'discrete_flow_shift' does nothing with timestep_sampling unset"),
    ('timestep_sampling = "flux_shift"\ndiscrete_flow_shift = 2.0', 'key \'discrete_flow_shift\' does nothing with timestep_sampling = "flux_shift"; it needs timestep_sampling = "shift"'),
    ('timestep_sampling = "uniform"\nsigmoid_scale = 2.0', "key 'sigmoid_scale' does nothing with timestep_sampling = \"uniform\""),
    ("huber_c = 0.5", "key 'huber_c' does nothing with loss_type = \"l2\""),
    ("block_swap_prefetch = 2", "key 'block_swap_prefetch' does nothing with blocks_to_swap = 0"),
    # fp8_scaled = false (sd-scripts' plain cast) without fp8_base trained a bf16 base without a word
    ("fp8_scaled = false", "key 'fp8_scaled' does nothing with fp8_base = false"),
    ('base_precision = "nf4"\nfp8_scaled = false', "key 'fp8_scaled' does nothing with fp8_base = false"),
])
def test_a_scheduler_or_loss_key_that_its_choice_never_reads_is_refused(tmp_path, lines, message):
    """The old line trained without them: diffusers' get_scheduler passes num_cycles only to
    cosine_with_restarts and power only to polynomial; the shift, scale and huber_c only act in their mode."""
    cfg = write(tmp_path, FLUX + lines + "\n")
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(["--config_file", cfg, "--output_dir", str(tmp_path)])
    used = {"lr_scheduler_num_cycles": 'lr_scheduler = "cosine_with_restarts"', "lr_scheduler_power": 'lr_scheduler = "polynomial"',
            "discrete_flow_shift": 'timestep_sampling = "shift"', "sigmoid_scale": 'timestep_sampling = "sigmoid"',
            "huber_c": 'loss_type = "huber"', "block_swap_prefetch": "blocks_to_swap = 2", "fp8_scaled": "fp8_base = true"}
    key = re.search(r"key '(\w+)'", message).group(1)
    line = next(v for v in lines.split("\n") if v.startswith(key))  # the key alone, where its mode reads it
    load_config(["--config_file", write(tmp_path, FLUX + used[key] + "\n" + line + "\n"), "--output_dir", str(tmp_path)])


@pytest.mark.parametrize("line, message, used", [
    ("persistent_data_loader_workers = true", "does nothing with max_data_loader_n_workers = 0",
     "max_data_loader_n_workers = 2"),
    ('ema_device = "cpu"', "does nothing with ema_decay = 0.0; it needs ema_decay > 0", "ema_decay = 0.9"),
    ('log_prefix = "a_"', "does nothing with log_with unset and logging_dir unset; it needs a tracker", 'logging_dir = "logs"'),
    ("save_last_n_saves = 2", "does nothing with save_every_n_steps = 0 and save_every_n_epochs = 0",
     "save_every_n_epochs = 1"),
])
def test_a_key_whose_feature_is_off_is_refused(tmp_path, line, message, used):
    """The old line took them and did nothing: no worker to keep alive, no EMA, no tracker run to name,
    no intermediate save to prune."""
    cfg = write(tmp_path, FLUX + line + "\n")
    key = line.split(" =")[0]
    with pytest.raises(ConfigError, match=rf"train\.toml: key '{key}' {re.escape(message)}"):
        load_config(["--config_file", cfg, "--output_dir", str(tmp_path)])
    load_config(["--config_file", write(tmp_path, FLUX + line + "\n" + used + "\n"), "--output_dir", str(tmp_path)])


def test_sampling_keys_with_prompts_blanked_are_an_explicit_no(tmp_path):
    cfg = write(tmp_path, FLUX + 'sample_at_first = true\nsample_prompts = ""\nlr_scheduler = "constant_with_warmup"\n'
                                 "lr_warmup_steps = 2\n")
    load_config(["--config_file", cfg, "--output_dir", str(tmp_path)])


@pytest.mark.parametrize("config, lines, margin", [
    (FLUX, "", 37),  # .<name>-step001600.safetensors.xxxxxxxx.tmp: a step save's temporary
    (FLUX, "ema_decay = 0.999\n", 41),  # its EMA's: -step001600_ema.safetensors
    (FLUX, 'sample_prompts = "p.txt"\nsample_every_n_steps = 100\n', 58),  # _step001600_00_<time>_<seed>.png
    (BASE, "", 25),  # an LLM's PEFT adapter folder: .<name>-step001600.xxxxxxxx.tmp
])
def test_an_output_name_too_long_for_the_names_the_run_writes_is_refused_at_load(tmp_path, config, lines, margin):
    """The old line took it, trained every step, and lost the LoRA at its save (or failed at the first sample):
    'File name too long' for the save's temporary, the name itself under the limit."""
    cfg, limit = write(tmp_path, config + lines), os.pathconf(tmp_path, "PC_NAME_MAX")
    load_config(["--config_file", cfg, "--output_dir", str(tmp_path), "--output_name", "x" * (limit - margin)])
    refused = rf"'output_name' is {limit - margin + 1} bytes \(UTF-8\): .* is {limit + 1} bytes, over .* of {limit}"
    with pytest.raises(ConfigError, match=refused):
        load_config(["--config_file", cfg, "--output_dir", str(tmp_path), "--output_name", "x" * (limit - margin + 1)])


def test_an_output_name_is_measured_in_utf8_bytes(tmp_path):
    """80 CJK characters are 240 bytes: under 255 as a name, over it in the save's temporary."""
    cfg, limit = write(tmp_path, FLUX), os.pathconf(tmp_path, "PC_NAME_MAX")
    with pytest.raises(ConfigError) as raised:
        load_config(["--config_file", cfg, "--output_dir", str(tmp_path), "--output_name", "\u5b57" * 80])
    assert str(raised.value) == (
        f"command line: key 'output_name' is 240 bytes (UTF-8): the longest file name the run writes from it, "
        f"'.<output_name>-step001600.safetensors.xxxxxxxx.tmp', is 277 bytes, over the file system's limit of {limit} "
        f"in output_dir '{tmp_path}'; use at most {limit - 37} bytes")


def test_a_folder_given_as_the_config_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"is a folder; expected a training config \(\.toml\) file"):
        load_config(["--config_file", str(tmp_path)])


@pytest.mark.parametrize("lines, message", [
    ('pretrain = true\nnetwork_weights = "x"', "key 'network_weights' is read by LoRA training (pretrain = false)"),
    ("pretrain = true\nnetwork_dim = 32", "key 'network_dim' is read by LoRA training"),
    ('pretrain = true\nsave_format = "kohya"', "save_format 'kohya' is for LLM LoRAs (model_type llm without pretrain)"),
    ('sample_prompt = ""', "key 'sample_prompt' must not be empty"),  # crashed at the first eval
])
def test_llm_keys_that_pretraining_or_sampling_would_ignore_or_crash_on_are_refused(tmp_path, lines, message):
    """The old line trained from scratch with the LoRA keys ignored, and crashed on an empty prompt."""
    cfg = write(tmp_path, BASE + lines + "\n")
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(["--config_file", cfg, "--output_dir", str(tmp_path)])


def test_a_peers_lora_module_names_the_command_that_converts_the_config(tmp_path):
    """network_module = "networks.lora_flux" (sd-scripts' / musubi-tuner's) was "not supported" alone."""
    cfg = write(tmp_path, BASE + 'network_module = "networks.lora_flux"\n')
    with pytest.raises(ConfigError) as e:
        load_config(["--config_file", cfg, "--output_dir", str(tmp_path)])
    assert str(e.value).endswith("(supported: networks.lora, lycoris.kohya): sd-scripts / musubi-tuner's LoRA "
                                 f"module, ours networks.lora; `python tools/convert_config.py {cfg}` writes that "
                                 f"config as ours")


def test_a_bad_flag_is_one_line_not_the_usage(capsys):
    """The old line printed argparse's usage (every key: ~80 lines) above the error."""
    import train_lora

    assert train_lora.main(["--bogus", "1"]) == 2
    err = capsys.readouterr().err
    assert err == "error: command line: unrecognized arguments: --bogus 1 (python train_lora.py --help lists the keys)\n"
    # a musubi-tuner command line's flags: the command that translates it (was the --help pointer alone)
    assert train_lora.main(["--dit=dit.safetensors", "--vae", "vae.safetensors", "--bogus"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: command line: unrecognized arguments: --dit=dit.safetensors --vae vae.safetensors "
                          "--bogus (musubi-tuner flags: `python tools/convert_config.py --command ")
    assert "--help" not in err


@pytest.mark.parametrize("warmup, said", [("10", "lr_warmup_steps = 10 is not below max_train_steps = 10")])
def test_a_warmup_as_long_as_the_run_is_refused_naming_both_keys(tmp_path, warmup, said):
    """lr_warmup_steps >= max_train_steps was taken: the lr never reached learning_rate (10 of 10 steps
    of warmup ended at 0.9 x lr). A ratio below 1 rounds down, below the run's steps."""
    cfg = write(tmp_path, BASE + 'lr_scheduler = "constant_with_warmup"\nmax_train_steps = 10\n')
    with pytest.raises(ConfigError) as e:
        load_config(["--config_file", cfg, "--output_dir", str(tmp_path), "--lr_warmup_steps", warmup])
    assert str(e.value) == (f"command line and {cfg}: {said}: the lr would never reach learning_rate; shorten the "
                            f"warmup or train longer")
    assert load_config(["--config_file", cfg, "--output_dir", str(tmp_path), "--lr_warmup_steps", "9"]).lr_warmup_steps == 9


def test_resume_refuses_another_schedule_shape_and_takes_older_states(tmp_path):
    """The scheduler's state holds its step, not its lambda: the old line resumed a state written with
    lr_warmup_steps = 100 under 10 (the lr jumped from the warmup's 0.3 to the full rate) without a word."""
    import json

    from library.training.state import SCHEDULE_IDENTITY, load_state, run_digest

    cfg = write(tmp_path, BASE + 'lr_scheduler = "cosine_with_restarts"\nlr_warmup_steps = 100\nlr_scheduler_num_cycles = 2\n')
    written = load_config(["--config_file", cfg, "--output_dir", str(tmp_path)])
    state = tmp_path / "state"
    state.mkdir()

    def write_state(run: dict):
        (state / "train_state.json").write_text(json.dumps(
            {"step": 30, "epoch": 0, "batches_done": 30, "scheduler": {}, "run": json.loads(json.dumps(run, default=str))}))

    write_state(run_digest(written))
    for flag, value in (("--lr_warmup_steps", "10"), ("--lr_scheduler_num_cycles", "3")):
        resumed = load_config(["--config_file", cfg, "--output_dir", str(tmp_path), flag, value])
        with pytest.raises(ValueError, match=f"state was written with {flag[2:]} = .*, this run has {value}"):
            load_state(str(state), resumed)
    old = {k: v for k, v in run_digest(written).items() if k not in SCHEDULE_IDENTITY}  # a state from before
    write_state(old)
    with pytest.raises(CheckpointError, match="trainable.safetensors"):  # past the settings check: the files
        load_state(str(state), load_config(["--config_file", cfg, "--output_dir", str(tmp_path), "--lr_warmup_steps", "10"]))


@pytest.mark.parametrize("progress, planned", [
    (None, 8),  # a fresh run: 2 epochs of 4 steps
    ({"step": 4, "epoch": 0, "batches_done": 4, "batches_per_epoch": 4}, 8),  # at epoch 0's end, the same data
    ({"step": 2, "epoch": 0, "batches_done": 2, "batches_per_epoch": 4}, 8),  # inside epoch 0
    ({"step": 4, "epoch": 1, "batches_done": 0, "batches_per_epoch": 4}, 8),  # an epoch save's state
    ({"step": 3, "epoch": 0, "batches_done": 3, "batches_per_epoch": 3}, 7),  # epoch 0 had 3 batches: 3 + 4
    ({"step": 3, "epoch": 1, "batches_done": 0, "batches_per_epoch": 3}, 7),
    ({"step": 9, "epoch": 2, "batches_done": 0, "batches_per_epoch": 3}, 9),  # both epochs done: nothing left
])
def test_max_train_epochs_counts_the_resumed_epochs_at_the_length_they_had(tmp_path, progress, planned):
    """A resume onto longer epochs planned max_train_epochs x the new length from step 0, on top of the steps the
    resumed run had trained: an extra epoch's worth."""
    from library.training.run_length import plan_steps

    args = load_config(["--config_file", write(tmp_path, BASE + "max_train_epochs = 2\n")])
    assert plan_steps(args, 4, progress) == planned
    args.gradient_accumulation_steps = 3  # epochs of 2 steps (3 batches, then 1)
    inside = {"step": 1, "epoch": 0, "batches_done": 3, "batches_per_epoch": 4}
    assert plan_steps(args, 4, None) == plan_steps(args, 4, inside) == 4


@pytest.mark.parametrize("scheduler, refused", [("cosine", True), ("constant", False)])
def test_resume_with_another_length_is_refused_where_the_schedule_follows_it(tmp_path, scheduler, refused):
    """A cosine run of 10 steps killed at 5 (lr 0.5 x) and resumed with max_train_steps = 20 went on
    from cosine-of-20's 0.85 x: the schedule is rebuilt for the new length. Refused now; a constant
    schedule may still be extended."""
    import json

    from library.training.state import load_state, run_digest

    cfg = write(tmp_path, BASE + f'lr_scheduler = "{scheduler}"\nmax_train_steps = 10\n')
    state = tmp_path / "state"
    state.mkdir()
    (state / "train_state.json").write_text(json.dumps(
        {"step": 5, "epoch": 0, "batches_done": 5, "scheduler": {}, "max_steps": 10,
         "run": json.loads(json.dumps(run_digest(load_config(["--config_file", cfg])), default=str))}))
    longer = load_config(["--config_file", cfg, "--max_train_steps", "20"])
    if refused:
        with pytest.raises(ValueError) as e:
            load_state(str(state), longer)
        assert str(e.value) == (f"{state}: state was written by a run of 10 steps, this run has 20 (max_train_steps / "
                                f"max_train_epochs): the cosine schedule's lr at step 5 would jump onto another curve; "
                                f"resume with the same length")
    with pytest.raises(CheckpointError, match="trainable.safetensors"):  # past the check: the files
        load_state(str(state), longer if not refused else load_config(["--config_file", cfg]))


def test_persistent_data_loader_workers_reaches_one_dataloader_that_serves_every_epoch(tmp_path):
    """sd-scripts' persistent_data_loader_workers was refused as an unknown key; now it is read, and
    with workers one DataLoader (persistent_workers=True) is handed each epoch's batches."""
    from types import SimpleNamespace

    from library.training.diffusion_task import DiffusionTask
    from tests.test_dataset import blueprint, make_image

    cfg = write(tmp_path, FLUX + "persistent_data_loader_workers = true\nmax_data_loader_n_workers = 2\n")
    args = load_config(["--config_file", cfg])
    assert (args.persistent_data_loader_workers, args.max_data_loader_n_workers) == (True, 2)
    for i in range(5):
        make_image(tmp_path / "img" / f"{i}.png", 64, 64)
        (tmp_path / "img" / f"{i}.txt").write_text("a photo")
    from library.data import dataset as D

    data = D.ImageDataset(blueprint(tmp_path / "img"))
    task = SimpleNamespace(args=args, dataset=data, sampler=D.BucketBatchSampler(data), _loader=None,
                           device=torch.device("cpu"), accelerator=SimpleNamespace(process_index=0, num_processes=1))
    keys = []
    for epoch in (0, 1):
        loader = DiffusionTask.epoch_batches(task, epoch)
        keys.append([key for batch in loader for key in batch["keys"]])
    assert loader is task._loader and loader.persistent_workers and loader.num_workers == 2
    expected = [[data[entry]["key"] for batch in D.EpochBatches(task.sampler, epoch) for entry in batch]
                for epoch in (0, 1)]
    assert keys == expected and keys[0] != keys[1]  # each epoch's own order, served by the same workers
    args.max_data_loader_n_workers = 0  # torch refuses persistent workers without workers: the option is moot
    task._loader = None
    loader = DiffusionTask.epoch_batches(task, 0)
    assert not loader.persistent_workers and task._loader is None


def test_a_resumed_eval_log_keeps_its_start_row(tmp_path):
    """An LLM eval log's "start" row (the baseline before step 1, sample_at_first) was dropped at a resume
    with the rows after the state's step: the CSV lost it while TensorBoard kept it at step 0."""
    path = tmp_path / "lm_eval.csv"
    path.write_text("step,val_loss\nstart,5.1\n2,4.9\n4,4.7\nfinal,4.6\n")
    optim.drop_rows_after(str(path), 2)
    assert path.read_text().splitlines() == ["step,val_loss", "start,5.1", "2,4.9"]
    # the sample tags an eval log also holds: step000002 (before the state's step 3) stays (the old line dropped it); the epoch end
    # logged after it is the resumed run's to render again
    path.write_text("step,val_loss\nstart,5.1\nstep000002,4.9\nepoch0001,4.8\nstep000004,4.7\nfinal,4.6\n")
    optim.drop_rows_after(str(path), 3)
    assert path.read_text().splitlines() == ["step,val_loss", "start,5.1", "step000002,4.9"]


def test_every_key_is_named_in_the_configuration_docs():
    """README said docs/configuration.md holds every key; 14 of the schema's were named nowhere (their defaults
    only in --help)."""
    from library.training.config_schema import SCHEMA

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    docs = ""
    for name in ("docs/configuration.md", "README.md"):
        with open(os.path.join(root, name)) as f:
            docs += f.read()
    assert [key for key in SCHEMA if f"`{key}`" not in docs and f"{key} = " not in docs] == []


def test_ip_noise_gamma_is_checked_before_training(tmp_path):
    """A negative gamma and a random strength without gamma are one line each; an LLM run refuses both keys."""
    quickstart = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "quickstart.toml")
    run = ["--config_file", quickstart, "--output_dir", str(tmp_path)]
    with pytest.raises(ConfigError, match="key 'ip_noise_gamma' must be >= 0"):
        load_config(run + ["--ip_noise_gamma", "-0.1"])
    with pytest.raises(ConfigError, match="key 'ip_noise_gamma_random_strength' does nothing with ip_noise_gamma = 0"):
        load_config(run + ["--ip_noise_gamma_random_strength", "true"])
    args = load_config(run + ["--ip_noise_gamma", "0.1", "--ip_noise_gamma_random_strength", "true"])
    assert (args.ip_noise_gamma, args.ip_noise_gamma_random_strength) == (0.1, True)
    with pytest.raises(ConfigError, match="key 'ip_noise_gamma' is read by the diffusion models"):
        load_config(["--config_file", write(tmp_path, BASE), "--ip_noise_gamma", "0.1"])
