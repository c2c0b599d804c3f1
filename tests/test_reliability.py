"""Bad input, end to end: every case is one `error: ...` line on stderr that names the file, key or
value and what was expected, exit status 2, and nothing (no LoRA, no half-written or temporary
file) left in the output folder. Whole runs' reliability (caches redone for exactly the edited entries, two runs
into one output, the umask): tests/test_reliability_runs.py.

Covered elsewhere, not repeated here: a diverged run stops without saving broken weights as good
(tests/test_train_lora.py::test_a_diverged_run_never_saves_broken_weights_as_good); the merge tool's own
error table on toy models (tests/test_merge_convert.py); crash safety of saves
(tests/test_crash_safety.py).
"""

import argparse
import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import train_lora
from library.models.qwen_image.model import load_qwen_image
from networks import lora_files
from networks.lora import LoRANetwork
from tools import merge_lora

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------------------------
# Helpers


def flux_args(tiny_set, out, *extra):
    """The quickstart on the tiny FLUX for one step, no samples; `extra` overrides."""
    return [
        "--config_file", os.path.join(ROOT, "configs", "quickstart.toml"),
        "--pretrained_model_name_or_path", tiny_set["flux_bfl"], "--ae", tiny_set["flux_vae_single"],
        "--clip_l", tiny_set["clip_l"], "--t5xxl", tiny_set["t5xxl"], "--dataset_config", tiny_set["dataset_config"],
        "--sample_prompts", "", "--sample_at_first", "false", "--save_every_n_steps", "0",
        "--max_train_steps", "1", "--output_dir", str(out), *extra,
    ]  # fmt: skip


def files_under(folder) -> list[str]:
    """Every file (hidden ones too) below `folder`; [] when it does not exist."""
    return sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs)


def copy_dataset(tiny_set, dest, mutate=None, subset="", steps=16, resolution=64) -> str:
    """The tiny images and captions (no caches) in `dest`/images, `mutate(images_dir)` applied,
    and a dataset TOML with extra [[datasets.subsets]] lines. Returns the TOML path."""
    images = dest / "images"
    images.mkdir(parents=True)
    for name in os.listdir(tiny_set["image_dir"]):
        if name.endswith((".png", ".txt")):
            shutil.copy(os.path.join(tiny_set["image_dir"], name), images / name)
    if mutate:
        mutate(images)
    toml = dest / "dataset.toml"
    toml.write_text(
        f"[general]\nresolution = {resolution}\nbatch_size = 2\nenable_bucket = true\nmin_bucket_reso = 16\n"
        f"max_bucket_reso = 128\nbucket_reso_steps = {steps}\n"
        f'[[datasets]]\n[[datasets.subsets]]\nimage_dir = "{images}"\n{subset}\n'
    )
    return str(toml)


def one_error_line(capsys, code: int) -> str:
    """The run's stderr must be exactly one `error: ` line, with exit status 2."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


@pytest.fixture(scope="module")
def trained(tiny_set, tmp_path_factory):
    """One finished 1-step run (rank 8, with its training state): a real LoRA and a real state."""
    out = tmp_path_factory.mktemp("trained")
    assert train_lora.main(flux_args(tiny_set, out, "--save_state", "true", "--network_dim", "8")) == 0
    return out


# ----------------------------------------------------------------------------------------------
# Bad input to train_lora.py: (argv extras, fragments the one error line must hold)


def corrupt_image(ts, tmp):
    cfg = copy_dataset(ts, tmp, lambda d: (d / "003.png").write_bytes(b"\x89PNG\r\n\x1a\nnot an image"))
    return ["--dataset_config", cfg], ["images/003.png: cannot be read as an image"]


def image_without_caption(ts, tmp):
    cfg = copy_dataset(ts, tmp, lambda d: (d / "003.txt").unlink())
    return ["--dataset_config", cfg], ["images/003.png: no caption file '003.txt' and no class_tokens for its subset"]


def empty_caption_file(ts, tmp):
    cfg = copy_dataset(ts, tmp, lambda d: (d / "003.txt").write_text(" \n"))
    return ["--dataset_config", cfg], ["images/003.txt: caption file is empty"]


def dataset_unknown_key(ts, tmp):
    cfg = copy_dataset(ts, tmp, subset="num_repeat = 2")
    return ["--dataset_config", cfg], ["dataset.toml: [datasets.subsets] unknown key 'num_repeat' (allowed: image_dir, num_repeats"]


def dataset_wrong_type(ts, tmp):
    cfg = copy_dataset(ts, tmp, subset='num_repeats = "2"')
    return ["--dataset_config", cfg], ["dataset.toml: [datasets.subsets] key 'num_repeats' must be an integer, got '2'"]


def bucket_steps_not_multiple_of_16(ts, tmp):
    cfg = copy_dataset(ts, tmp, steps=24)
    return ["--dataset_config", cfg], ["dataset.toml: [datasets] key 'bucket_reso_steps' must be a positive multiple of 16", "got 24"]


def resolution_below_one_patch(ts, tmp):
    cfg = copy_dataset(ts, tmp, resolution=8)
    return ["--dataset_config", cfg], ["dataset.toml: [datasets] key 'resolution' must be at least 16 pixels per side", "got [8, 8]"]


def dataset_config_missing(ts, tmp):
    return ["--dataset_config", str(tmp / "nope.toml")], ["nope.toml: no such dataset config file"]


def config_unknown_key_in_table(ts, tmp):
    (tmp / "train.toml").write_text('[network]\nnetwork_dimm = 4\n')
    return ["--config_file", str(tmp / "train.toml")], ["train.toml: unknown key 'network_dimm'"]


def config_wrong_type(ts, tmp):
    (tmp / "train.toml").write_text('[network]\nnetwork_dim = "16"\n')
    return ["--config_file", str(tmp / "train.toml")], ["train.toml: key 'network_dim' must be an integer, got '16'"]


def config_not_toml(ts, tmp):
    (tmp / "train.toml").write_text('[network]\nnetwork_dim 16\n')
    return ["--config_file", str(tmp / "train.toml")], ["train.toml: not valid TOML"]


def cli_bool_not_a_bool(ts, tmp):
    return ["--fp8_base", "yes"], ["command line: --fp8_base takes true or false, got 'yes'"]


def optimizer_unknown(ts, tmp):
    return ["--optimizer_type", "AdamQ"], ["command line: optimizer_type 'AdamQ' is unknown (AdamW, AdamW8bit, Prodigy"]


def optimizer_not_an_optimizer(ts, tmp):  # was refused after caching and loading, blaming the empty optimizer_args
    return ["--optimizer_type", "torch.nn.Linear"], ["optimizer_type torch.nn.Linear: a class, but no torch.optim.Optimizer"]


def optimizer_args_not_literals(ts, tmp):
    return (["--optimizer_type", "AdamW", "--optimizer_args", "betas=__import__('os').getcwd()"],
            ["command line: optimizer_args value \"betas=__import__('os').getcwd()\" is not a Python literal"])


def optimizer_args_wrong_value(ts, tmp):
    return (["--optimizer_type", "AdamW", "--optimizer_args", "weight_decay=-1.0"],
            ["optimizer_args (weight_decay=-1.0) do not fit AdamW: Invalid weight_decay value: -1.0"])


def output_dir_cannot_be_created(ts, tmp):
    # Below a regular file: cannot be created even by root (who ignores chmod).
    (tmp / "a_file").write_text("x")
    return (["--output_dir", str(tmp / "a_file" / "out")],
            [f"command line: output_dir '{tmp / 'a_file' / 'out'}' cannot be created: '{tmp / 'a_file'}' is a file, not a folder"])


def output_dir_a_dangling_link(ts, tmp):  # makedirs failed after the checks: "[Errno 17] File exists" (2026-11-29)
    os.symlink(tmp / "unmounted" / "disk", tmp / "out")
    return (["--output_dir", str(tmp / "out" / "run")],
            [f"command line: output_dir '{tmp / 'out' / 'run'}' cannot be created: '{tmp / 'out'}' is a link to "
             f"'{tmp / 'unmounted' / 'disk'}', which does not exist"])


def logging_dir_is_a_file(ts, tmp):  # failed after caching with "[Errno 20] Not a directory" (2026-11-27)
    (tmp / "tb").write_text("x")
    return (["--logging_dir", str(tmp / "tb")],
            [f"command line: logging_dir '{tmp / 'tb'}' cannot be created: '{tmp / 'tb'}' is a file, not a folder"])


def log_prefix_a_path(ts, tmp):  # TensorBoard wrote wherever it pointed, out of a web UI's roots too (2026-11-27)
    return (["--logging_dir", str(tmp / "tb"), "--log_prefix", "../../elsewhere_"],
            ["command line: key 'log_prefix' must be a plain name (no path separator, not '.' or '..'), got '../../elsewhere_'"])


def sample_prompt_bad_flag(ts, tmp):
    (tmp / "prompts.txt").write_text("# samples\na red circle --w 64 --x 3\n")
    return ["--sample_prompts", str(tmp / "prompts.txt")], ["prompts.txt:2: unknown flag '--x' (allowed: --w, --h, --s, --d, --g, --n, --l, --fs, --ci)"]


def checkpoint_missing(ts, tmp):
    return ["--pretrained_model_name_or_path", str(tmp / "flux1-dev.safetensors")], ["flux1-dev.safetensors: no such file or folder"]


def checkpoint_not_safetensors(ts, tmp):
    (tmp / "flux1-dev.ckpt").write_bytes(b"PK\x03\x04")
    return ["--pretrained_model_name_or_path", str(tmp / "flux1-dev.ckpt")], ["flux1-dev.ckpt: expected a .safetensors or .gguf file"]


def qwen_image_folder_as_flux(ts, tmp):
    return (["--pretrained_model_name_or_path", ts["qwen_image"]],
            ["transformer/config.json: _class_name is 'QwenImageTransformer2DModel', expected 'FluxTransformer2DModel'"])


def qwen_image_file_as_flux(ts, tmp):
    shutil.copy(os.path.join(ts["qwen_image"], "diffusion_pytorch_model.safetensors"), tmp / "qwen.safetensors")
    return (["--pretrained_model_name_or_path", str(tmp / "qwen.safetensors")],
            ["qwen.safetensors: key 'txt_norm.weight' belongs to a Qwen-Image transformer, not FLUX.1"])


def llm_as_flux(ts, tmp):
    return ["--pretrained_model_name_or_path", ts["llm"]], ["llm: not a FLUX.1 transformer"]


def fp8_checkpoint(ts, tmp, fp8_base):
    """A plain-e4m3 file (flux1-dev-fp8 style): trained on as it is, so the config must say fp8, plain."""
    sd = load_file(ts["flux_bfl"])
    sd = {k: v.to(torch.float8_e4m3fn) if v.dim() == 2 and "blocks." in k else v for k, v in sd.items()}
    save_file(sd, str(tmp / "flux1-fp8.safetensors"))
    wanted = "bf16" if fp8_base == "false" else "fp8_scaled"
    return (["--pretrained_model_name_or_path", str(tmp / "flux1-fp8.safetensors"), "--fp8_base", fp8_base],
            [f"flux1-fp8.safetensors: the checkpoint stores a pre-quantized fp8 base (used as it is), but the config asks "
             f"for {wanted}", "fp8_scaled = false"])


def network_weights_missing(ts, tmp):
    return ["--network_weights", str(tmp / "init.safetensors")], ["init.safetensors: no such file or folder"]


def network_weights_of_qwen_image(ts, tmp):
    net = LoRANetwork(load_qwen_image(ts["qwen_image"]), "qwen_image", 4, 4.0)
    net.save(str(tmp / "qwen_lora.safetensors"))
    return (["--network_weights", str(tmp / "qwen_lora.safetensors")],  # from its header, before caching
            ["key 'network_weights': ", "qwen_lora.safetensors: a LoRA for Qwen-Image (tools/lora_info.py: arch qwen_image, "
             "diffusers names), not for this FLUX.1 model"])


def empty_paths(ts, tmp):  # "error: : no such file or folder", naming no key
    return ["--pretrained_model_name_or_path", ""], ["command line: key 'pretrained_model_name_or_path' is empty; expected a path"]


def dataset_config_a_folder(ts, tmp):  # "error: [Errno 21] Is a directory: ..."
    return ["--dataset_config", str(tmp)], [f"{tmp}: a folder; expected a dataset config file"]


def t5_tokens_negative(ts, tmp):  # an OverflowError traceback from the tokenizer after the latents were cached
    return ["--t5xxl_max_token_length", "-1"], ["command line: key 't5xxl_max_token_length' must be >= 1, got -1"]


def base_loras_a_vae(ts, tmp):  # its header passed: the run cached every image, then failed naming no key
    return (["--base_loras", ts["flux_vae_single"]],
            ["key 'base_loras': ", "ae.safetensors: LoRA key 'decoder.", "(is it a LoRA file?)"])


def dim_from_weights_without_network_weights(ts, tmp):
    return ["--dim_from_weights", "true"], ["key 'dim_from_weights' needs network_weights"]


def dim_from_weights_with_a_selection(ts, tmp):  # sd-scripts ignores them: the file's modules are the network's
    (tmp / "init.safetensors").write_bytes(b"")  # refused from the config, before the file is read
    return (["--dim_from_weights", "true", "--network_weights", str(tmp / "init.safetensors"), "--network_args",
             "train_blocks=single"], ["network_args 'train_blocks' selects modules or ranks; with dim_from_weights the "
                                      "network holds network_weights' modules at their ranks"])


def seed_beyond_torch(ts, tmp):  # was "error: Overflow when unpacking long long", naming nothing
    return ["--seed", str(2**64)], [f"command line: key 'seed' must be 0 to 2^64 - 1, got {2**64}"]


def ema_start_after_the_epochs_steps(ts, tmp):  # trained and saved an _ema file equal to the raw LoRA (2026-11-27)
    return (["--max_train_epochs", "1", "--ema_decay", "0.9", "--ema_start_step", "100"],
            ["key 'ema_start_step' = 100 is not before max_train_epochs = 1 (", "steps): the EMA would equal the raw weights"])


CASES = {
    "corrupt_image": corrupt_image,
    "image_without_caption_or_class_tokens": image_without_caption,
    "empty_caption_file": empty_caption_file,
    "dataset_unknown_key": dataset_unknown_key,
    "dataset_wrong_type": dataset_wrong_type,
    "bucket_reso_steps_not_multiple_of_16": bucket_steps_not_multiple_of_16,
    "resolution_below_one_patch": resolution_below_one_patch,
    "dataset_config_missing": dataset_config_missing,
    "config_unknown_key_in_table": config_unknown_key_in_table,
    "config_wrong_type": config_wrong_type,
    "config_not_toml": config_not_toml,
    "cli_bool_not_a_bool": cli_bool_not_a_bool,
    "optimizer_unknown": optimizer_unknown,
    "optimizer_args_not_literals": optimizer_args_not_literals,
    "optimizer_not_an_optimizer": optimizer_not_an_optimizer,
    "optimizer_args_wrong_value": optimizer_args_wrong_value,
    "output_dir_cannot_be_created": output_dir_cannot_be_created,
    "output_dir_a_dangling_link": output_dir_a_dangling_link,
    "logging_dir_is_a_file": logging_dir_is_a_file,
    "log_prefix_a_path": log_prefix_a_path,
    "sample_prompt_bad_flag": sample_prompt_bad_flag,
    "checkpoint_missing": checkpoint_missing,
    "checkpoint_not_safetensors": checkpoint_not_safetensors,
    "qwen_image_folder_as_flux": qwen_image_folder_as_flux,
    "qwen_image_file_as_flux": qwen_image_file_as_flux,
    "llm_as_flux": llm_as_flux,
    "fp8_checkpoint_for_bf16_base": lambda ts, tmp: fp8_checkpoint(ts, tmp, "false"),
    "fp8_checkpoint_for_fp8_base": lambda ts, tmp: fp8_checkpoint(ts, tmp, "true"),
    "network_weights_missing": network_weights_missing,
    "network_weights_of_qwen_image": network_weights_of_qwen_image,
    "base_loras_a_vae": base_loras_a_vae,
    "t5_tokens_negative": t5_tokens_negative,
    "empty_paths": empty_paths,
    "dataset_config_a_folder": dataset_config_a_folder,
    "seed_beyond_torch": seed_beyond_torch,
    "dim_from_weights_without_network_weights": dim_from_weights_without_network_weights,
    "dim_from_weights_with_a_selection": dim_from_weights_with_a_selection,
    "ema_start_after_the_epochs_steps": ema_start_after_the_epochs_steps,
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_error_line_exit_2_and_no_output(tiny_set, tmp_path, capsys, case):
    extra, fragments = CASES[case](tiny_set, tmp_path)
    out = tmp_path / "out"
    capsys.readouterr()
    line = one_error_line(capsys, train_lora.main(flux_args(tiny_set, out, *extra)))
    for fragment in fragments:
        assert fragment in line, (fragment, line)
    assert files_under(out) == []


def test_missing_caption_trains_on_the_class_tokens(tiny_set, tmp_path, monkeypatch):
    from library.models.flux1.family import FluxFamily

    cfg = copy_dataset(tiny_set, tmp_path, lambda d: (d / "003.txt").unlink(), subset='class_tokens = "sks shape"')
    encoded: list[str] = []
    real = FluxFamily.load_text_encoder

    def recording(self, *args, **kwargs):
        encode = real(self, *args, **kwargs)
        return lambda captions: (encoded.extend(captions), encode(captions))[1]

    monkeypatch.setattr(FluxFamily, "load_text_encoder", recording)
    out = tmp_path / "out"
    assert train_lora.main(flux_args(tiny_set, out, "--dataset_config", cfg)) == 0
    assert encoded.count("sks shape") == 1 and len(encoded) == 8  # the other 7 keep their files
    assert (out / "tiny_flux_lora.safetensors").stat().st_size > 0


def test_network_weights_of_another_rank_is_refused(trained, tiny_set, tmp_path, capsys, monkeypatch):
    """Refused from the file and the transformer's header (the network on meta), before caching, naming the key.
    The old line refused once the model had loaded, after caching."""
    from library.training import diffusion_task

    for name in ("cache_latents", "cache_text"):
        monkeypatch.setattr(diffusion_task, name, lambda *a, **k: pytest.fail("cached before the refusal"))
    out = tmp_path / "out"
    capsys.readouterr()
    code = train_lora.main(flux_args(tiny_set, out, "--network_dim", "4",
                                     "--network_weights", str(trained / "tiny_flux_lora.safetensors")))
    line = one_error_line(capsys, code)
    assert "key 'network_weights': " in line, line
    assert ("tiny_flux_lora.safetensors: LoRA module 'double_blocks.0.img_attn.proj' has down (8, 64) / up (64, 8), "
            "the network expects (4, 64) / (64, 4) (rank 8, not 4: the network keeps the ranks network_dim and the "
            "*_dim network_args give it; dim_from_weights = true takes the file's)") in line, line
    assert files_under(out) == []


def lora_past_the_blocks(tmp) -> str:
    """A rank-4 LoRA of double blocks 0 and 18: one of FLUX.1 (19 double blocks) on the tiny FLUX.1's 2."""
    path = str(tmp / "more_blocks.safetensors")
    lora_files.write_kohya({f"double_blocks.{i}.img_attn.proj": lora_files.LoRAWeights(torch.ones(4, 64), torch.ones(64, 4), 4.0)
                            for i in (0, 18)}, path)
    return path


def test_base_loras_naming_blocks_the_model_lacks_are_refused_before_caching(tiny_set, tmp_path, capsys, monkeypatch):
    """Read onto the meta model as the merge reads it; the old line refused it at the merge, after caching and
    loading the transformer."""
    from library.training import diffusion_task

    for name in ("cache_latents", "cache_text"):
        monkeypatch.setattr(diffusion_task, name, lambda *a, **k: pytest.fail("cached before the refusal"))
    path, out = lora_past_the_blocks(tmp_path), tmp_path / "out"
    capsys.readouterr()
    line = one_error_line(capsys, train_lora.main(flux_args(tiny_set, out, "--base_loras", f"{path}:0.5")))
    assert line == (f"error: command line: key 'base_loras': {path}: LoRA module 'double_blocks.18.img_attn.proj' "
                    f"is not a Linear of this flux model"), line  # where it was set (old: the config file beside it)
    assert files_under(out) == []


def lora_with_a_nan(tmp) -> str:
    """A rank-4 LoRA of the tiny FLUX.1's double block 0 whose up holds one NaN (a diverged training's file)."""
    up = torch.ones(64, 4)
    up[3, 1] = float("nan")
    path = str(tmp / "diverged.safetensors")
    lora_files.write_kohya({"double_blocks.0.img_attn.proj": lora_files.LoRAWeights(torch.ones(4, 64), up, 4.0)}, path)
    return path


@pytest.mark.parametrize("key", ["base_loras", "network_weights"])
def test_a_lora_holding_a_nan_is_refused_before_caching_naming_the_module(tiny_set, tmp_path, capsys, monkeypatch, key):
    """Old: base_loras merged the NaN into the base and network_weights loaded it, and the run stopped at its first
    step with "loss is nan" (blaming the training) after caching; now one line names the file and module first."""
    from library.training import diffusion_task

    for name in ("cache_latents", "cache_text"):
        monkeypatch.setattr(diffusion_task, name, lambda *a, **k: pytest.fail("cached before the refusal"))
    path, out = lora_with_a_nan(tmp_path), tmp_path / "out"
    capsys.readouterr()
    line = one_error_line(capsys, train_lora.main(flux_args(tiny_set, out, f"--{key}", path, "--network_dim", "4")))
    assert line.endswith(f"key '{key}': {path}: module 'double_blocks.0.img_attn.proj' up holds 1 non-finite value "
                         f"(NaN / inf) of 256: a broken LoRA (a diverged training's?), which would make the outputs "
                         f"of the layers it adapts NaN"), line
    assert files_under(out) == []


LYCORIS = ("--network_module", "lycoris.kohya", "--network_args", "algo=lokr")


@pytest.mark.parametrize("extra, fragment", [
    (("--network_args", "train_single_block_indices=0-37"),
     "network_args 'train_single_block_indices': index 2 is out of range, the model has 2 such blocks"),
    (("--network_args", "exclude_patterns=['.*img_atn.*']"),
     "network_args pattern '.*img_atn.*' matches no LoRA target module"),
    ((*LYCORIS, "train_single_block_indices=0-37"),
     "network_args 'train_single_block_indices': index 2 is out of range, the model has 2 such blocks"),
    ((*LYCORIS, "exclude_patterns=['.*img_atn.*']"), "network_args pattern '.*img_atn.*' matches no LoRA target module"),
    ((*LYCORIS, "preset=full", "exclude_patterns=['.*img_mod.*']"),
     "network_args 'exclude_patterns' selects our targets; with a LyCORIS 'preset' the preset selects them"),
])
def test_network_args_the_model_judges_are_refused_before_caching(tiny_set, tmp_path, capsys, monkeypatch, extra,
                                                                  fragment):
    """FLUX.1's block indices copied to a model of fewer blocks, a pattern matching no module: judged on the meta
    model before caching (the old line encoded every latent and caption first: 1 min 50 s on 210 images). With
    lycoris.kohya too, whose targets are our selection (the old line judged it, and a preset given beside it, only
    as LyCORIS built its modules: after caching and loading the transformer)."""
    from library.training import diffusion_task

    for name in ("cache_latents", "cache_text"):
        monkeypatch.setattr(diffusion_task, name, lambda *a, **k: pytest.fail("cached before the refusal"))
    out = tmp_path / "out"
    capsys.readouterr()
    line = one_error_line(capsys, train_lora.main(flux_args(tiny_set, out, *extra)))
    # where network_args was set: the command line (old: the config file beside it, quickstart.toml)
    assert line.startswith(f"error: command line: {fragment}"), line
    assert files_under(out) == []


def test_dim_from_weights_trains_exactly_the_files_modules_at_their_ranks(trained, tiny_set, tmp_path, capsys):
    """sd-scripts' dim_from_weights: the network is the file's modules (a rank-8 file cut to its attention
    projections) at the file's ranks and alphas, not network_dim's 4 (refused without the key, above); the
    header says the file's rank."""
    tensors = load_file(str(trained / "tiny_flux_lora.safetensors"))
    kept = {k: v for k, v in tensors.items() if "_attn_proj." in k}
    assert kept and len(kept) < len(tensors)
    save_file(kept, str(tmp_path / "proj.safetensors"))
    out = tmp_path / "out"
    assert train_lora.main(flux_args(tiny_set, out, "--network_dim", "4", "--network_alpha", "2", "--max_train_steps", "1",
                                     "--dim_from_weights", "true", "--network_weights",
                                     str(tmp_path / "proj.safetensors"))) == 0
    saved = load_file(str(out / "tiny_flux_lora.safetensors"))
    assert {k: v.shape for k, v in saved.items()} == {k: v.shape for k, v in kept.items()}
    assert {float(v) for k, v in saved.items() if k.endswith(".alpha")} == {8.0}
    with safe_open(str(out / "tiny_flux_lora.safetensors"), "pt") as f:
        assert (f.metadata()["ss_network_dim"], f.metadata()["ss_network_alpha"]) == ("8", "8")


def test_network_weights_alpha_is_kept_and_the_header_says_so(trained, tiny_set, tmp_path, capsys):
    """The file's alpha wins (sd-scripts too); the old line still wrote the config's network_alpha
    into ss_network_alpha, a header that contradicts its .alpha tensors."""
    out = tmp_path / "out"
    capsys.readouterr()
    assert train_lora.main(flux_args(tiny_set, out, "--network_dim", "8", "--network_alpha", "2", "--max_train_steps", "1",
                                     "--network_weights", str(trained / "tiny_flux_lora.safetensors"))) == 0
    assert "network_weights: its alpha (8) is kept" in capsys.readouterr().out
    with safe_open(str(out / "tiny_flux_lora.safetensors"), "pt") as f:
        assert f.metadata()["ss_network_alpha"] == "8"
        assert {float(f.get_tensor(k)) for k in f.keys() if k.endswith(".alpha")} == {8.0}


def test_resume_from_a_state_of_another_run_config_is_refused(trained, tiny_set, tmp_path, capsys):
    state = trained / "tiny_flux_lora-state"
    before = {f: (state / f).read_bytes() for f in files_under(state)}
    out = tmp_path / "out"
    capsys.readouterr()
    code = train_lora.main(flux_args(tiny_set, out, "--network_dim", "8", "--learning_rate", "0.5", "--resume", str(state)))
    line = one_error_line(capsys, code)
    assert f"{state}: state was written with learning_rate = 1.0, this run has 0.5; resume needs the same settings" in line
    assert files_under(out) == []
    assert {f: (state / f).read_bytes() for f in files_under(state)} == before  # the state is untouched

    code = train_lora.main(flux_args(tiny_set, out, "--network_dim", "8", "--resume", str(trained)))
    assert f"{trained}: not a training state (no train_state.json)" in one_error_line(capsys, code)
    # network_dropout was not compared (its network_args form was): resumed, and the header said 0.3 for the run
    code = train_lora.main(flux_args(tiny_set, out, "--network_dim", "8", "--network_dropout", "0.3", "--resume", str(state)))
    assert "state was written with network_dropout = 0.0, this run has 0.3" in one_error_line(capsys, code)
    # base_loras (LoRAs merged into the frozen base) were not compared: a resume without them trained on another
    # base without a word, and the final header said no base_loras though half its steps had them
    merged = tmp_path / "merged"
    assert train_lora.main(flux_args(tiny_set, merged, "--save_state", "true", "--network_dim", "8",
                                     "--base_loras", str(trained / "tiny_flux_lora.safetensors"))) == 0
    capsys.readouterr()
    code = train_lora.main(flux_args(tiny_set, out, "--network_dim", "8", "--resume", str(merged / "tiny_flux_lora-state")))
    assert ("state was written with base_loras = [{'file': 'tiny_flux_lora.safetensors', 'ratio': 1.0}], this run "
            "has None") in one_error_line(capsys, code)


def test_a_state_a_killed_save_left_moved_aside_is_put_back_and_resumes(trained, tiny_set, tmp_path, capsys):
    """SIGKILL between atomic_folder's two renames left the previous state under a hidden `.<name>-state.<x>.old`
    and no `<name>-state`: --resume found no state (and the half-written `.tmp` stayed, GBs at full size)."""
    out = tmp_path / "out"
    hidden = out / ".tiny_flux_lora-state.k3j_x9ab.old"
    shutil.copytree(trained / "tiny_flux_lora-state", hidden / "folder")
    (out / ".tiny_flux_lora-state.q1w2e3r4.tmp").mkdir()
    (out / ".tiny_flux_lora-state.q1w2e3r4.tmp" / "optimizer.pt").write_bytes(b"half")
    (out / ".other-state.a1b2c3d4.tmp").mkdir()  # another output_name's (its run may be writing it): left alone
    (out / ".tiny_flux_lora.safetensors._4zf69x5.tmp").write_bytes(b"half a LoRA")  # a final save killed mid-write
    capsys.readouterr()
    state = out / "tiny_flux_lora-state"
    assert train_lora.main(flux_args(tiny_set, out, "--save_state", "true", "--network_dim", "8", "--max_train_steps", "2",
                                     "--resume", str(state))) == 0
    printed = capsys.readouterr().out
    assert f"{state}: put back from {hidden}" in printed
    assert f"removed what a killed save left in {out}: .tiny_flux_lora.safetensors._4zf69x5.tmp\n" in printed, printed
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == [".other-state.a1b2c3d4.tmp"]
    with open(state / "train_state.json") as f:
        assert json.load(f)["step"] == 2


def test_a_folder_save_is_on_the_disk_before_it_replaces_the_old_one(tmp_path, monkeypatch):
    """atomic_folder renamed the new state over the old and removed the old with the writers' plain open() files
    (optimizer.pt, train_state.json) still in the page cache: a power cut then could leave the only state with
    empty files. Every file and folder of the new one is fsynced before the renames, the parent after them."""
    from library import atomic_files

    events = []
    fsync, replace, rmtree = os.fsync, os.replace, atomic_files.shutil.rmtree
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", str(b))), replace(a, b))[1])
    monkeypatch.setattr(atomic_files.shutil, "rmtree", lambda p: (events.append(("rmtree", str(p))), rmtree(p))[1])
    state = tmp_path / "x-state"
    state.mkdir()
    (state / "old.json").write_text("{}")
    with atomic_files.atomic_folder(str(state)) as tmp:
        with open(os.path.join(tmp, "optimizer.pt"), "wb") as f:
            f.write(b"state")
        os.mkdir(os.path.join(tmp, "sub"))
        with open(os.path.join(tmp, "sub", "train_state.json"), "w") as f:
            f.write("{}")
    kinds = [kind for kind, _ in events]
    first_replace, removed = kinds.index("replace"), kinds.index("rmtree")
    synced_before = {os.path.relpath(p, tmp) for kind, p in events[:first_replace] if kind == "fsync"}
    assert {"optimizer.pt", os.path.join("sub", "train_state.json"), "sub", "."} <= synced_before, events
    assert ("fsync", str(tmp_path)) in events[kinds.index("replace", first_replace + 1):removed], events
    assert sorted(os.listdir(state)) == ["optimizer.pt", "sub"]


def test_a_run_removes_the_temporaries_killed_saves_left_for_its_output_name_only(tmp_path):
    """A save killed mid-write (SIGKILL) left its hidden temporary (half the LoRA) that no later run removed.
    Under its output lock a run removes those of its own saves (LoRA files, step saves, EMAs, PEFT / model
    folders, log, lr plot) and puts back a folder save moved aside; another output_name's, or one another
    output_name's running save may own (output_name 'x_ema' writes x_ema.safetensors), and any other name stay."""
    out = tmp_path / "out"
    out.mkdir()
    ours = [".x.safetensors._4zf69x5.tmp", ".x-step000004_ema.safetensors.ab_12cd3.tmp", ".x_log.csv.q1w2e3r4.tmp",
            ".x_lr.png.zz9yy8xx.tmp"]
    for name in ours + [".y.safetensors._4zf69x5.tmp", ".x-step000004_ema.safetensors.k9k9k9k9.part",
                        ".x.safetensors.tmp", "x.safetensors", ".y_ema.safetensors.a1b2c3d4.tmp", ".x2_ema.lock"]:
        (out / name).write_bytes(b"half")
    (out / ".x2_ema.safetensors.a1b2c3d4.tmp").write_bytes(b"half")  # output_name x2_ema's save, its lock held
    (out / ".x-step000002.r5t6y7u8.tmp").mkdir()  # a PEFT adapter folder being written
    (out / ".x.m1n2b3v4.old" / "folder").mkdir(parents=True)  # the adapter folder, moved aside, never replaced
    (out / ".x.m1n2b3v4.old" / "folder" / "adapter_config.json").write_text("{}")
    args = argparse.Namespace(output_dir=str(out), output_name="x")
    from library.training import run_locks

    lines = run_locks.recover_saves(args)
    assert sorted(os.listdir(out)) == sorted([".y.safetensors._4zf69x5.tmp", ".x-step000004_ema.safetensors.k9k9k9k9.part",
                                              ".x.safetensors.tmp", "x.safetensors", ".y_ema.safetensors.a1b2c3d4.tmp",
                                              ".x2_ema.lock", ".x2_ema.safetensors.a1b2c3d4.tmp", "x"])
    assert (out / "x" / "adapter_config.json").read_text() == "{}"
    assert lines[0] == f"{out / 'x'}: put back from {out / '.x.m1n2b3v4.old'} (a save was killed while it replaced this folder)"
    assert lines[1].startswith(f"removed what a killed save left in {out}: ") and len(lines) == 2, lines
    assert sorted(lines[1].split(": ")[1].split(", ")) == sorted(ours + [".x-step000002.r5t6y7u8.tmp", ".x.m1n2b3v4.old"])


def truncate_optimizer(state) -> str:
    data = (state / "optimizer.pt").read_bytes()
    (state / "optimizer.pt").write_bytes(data[: len(data) // 2])
    return f"{state / 'optimizer.pt'}: cannot be read (truncated or not a torch file"


def empty_optimizer(state) -> str:  # old: an IndexError's traceback (torch's EOFError has no message)
    (state / "optimizer.pt").write_bytes(b"")
    return f"{state / 'optimizer.pt'}: cannot be read (truncated or not a torch file: EOFError)"


def break_train_state(state) -> str:
    (state / "train_state.json").write_text('{"step": 1, "epoch": ')
    return f"{state / 'train_state.json'}: not valid JSON"


def mistype_the_step(state) -> str:  # old: a TypeError traceback at the resume's first subtraction, exit 1
    progress = json.loads((state / "train_state.json").read_text())
    (state / "train_state.json").write_text(json.dumps({**progress, "step": "two"}))
    return f"{state / 'train_state.json'}: 'step' is 'two', expected a whole number >= 0; the state is damaged"


@pytest.mark.parametrize("damage", [truncate_optimizer, empty_optimizer, break_train_state, mistype_the_step])
def test_resume_from_a_damaged_state_is_one_error_line_before_the_models_load(trained, tiny_set, tmp_path, capsys,
                                                                              monkeypatch, damage):
    state = tmp_path / "state"
    shutil.copytree(trained / "tiny_flux_lora-state", state)
    expected = damage(state)
    built = []
    monkeypatch.setattr(train_lora, "build_task", lambda *a, real=train_lora.build_task: built.append(1) or real(*a))
    out = tmp_path / "out"
    capsys.readouterr()
    line = one_error_line(capsys, train_lora.main(flux_args(tiny_set, out, "--network_dim", "8", "--resume", str(state))))
    assert expected in line, line
    assert built == [] and files_under(out) == []


@pytest.mark.parametrize("epochs", [False, True])
def test_resume_at_the_final_step_into_a_new_folder_has_nothing_to_train(trained, tiny_set, tmp_path, capsys,
                                                                         monkeypatch, epochs):
    """Said after the models had loaded and the caches filled (minutes at full size, for one line): now as soon as
    the run's length is known, from the config (max_train_steps) or the dataset's batches (max_train_epochs)."""
    from library.training.diffusion_task import DiffusionTask

    state, out, length = trained / "tiny_flux_lora-state", tmp_path / "out", ()
    if epochs:  # a run of one epoch (one step: all its batches in one accumulation), finished with its state
        length = ("--max_train_epochs", "1", "--gradient_accumulation_steps", "64", "--sample_prompts", "")
        assert train_lora.main(flux_args(tiny_set, tmp_path / "epoch", "--save_state", "true", "--network_dim", "8",
                                         *length)) == 0
        state = tmp_path / "epoch" / "tiny_flux_lora-state"
    monkeypatch.setattr(DiffusionTask, "_fill_caches", lambda self: pytest.fail("caching a run with nothing to train"))
    capsys.readouterr()
    assert train_lora.main(flux_args(tiny_set, out, "--network_dim", "8", "--resume", str(state), *length)) == 0
    captured = capsys.readouterr()
    planned = "the run is 1 step (max_train_epochs = 1)" if epochs else "max_train_steps is 1"
    assert f"nothing to train: {state} is at step 1, {planned}" in captured.out, captured.out
    assert captured.err == "" and files_under(out) == []


def test_llm_max_length_beyond_the_context_window_is_refused(tiny_set, tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("a photo of a cat sitting on a red chair. " * 50)
    out = tmp_path / "out"
    capsys.readouterr()
    code = train_lora.main([
        "--model_type", "llm", "--pretrained_model_name_or_path", tiny_set["llm"], "--train_data", str(corpus),
        "--output_dir", str(out), "--max_train_steps", "1", "--mixed_precision", "no", "--max_length", "4096",
    ])  # fmt: skip
    line = one_error_line(capsys, code)
    assert "max_length 4096 is longer than the model's context window (max_position_embeddings = 2048)" in line, line
    assert files_under(out) == []


# ----------------------------------------------------------------------------------------------
# Bad input to tools/merge_lora.py (its toy-model error table is in tests/test_merge_convert.py)


def merge_error(capsys, *argv) -> str:
    capsys.readouterr()
    return one_error_line(capsys, merge_lora.main([str(a) for a in argv]))


def test_merge_of_a_flux_lora_into_qwen_image_is_refused(trained, tiny_set, tmp_path, capsys):
    lora = trained / "tiny_flux_lora.safetensors"
    line = merge_error(capsys, "--model", tiny_set["qwen_image"], "--lora", lora, "--save_to", tmp_path / "merged")
    assert line == f"error: {lora}: a LoRA for FLUX.1 (tools/lora_info.py: arch flux, bfl names), not for this Qwen-Image model"
    assert files_under(tmp_path) == []


def test_merge_of_a_lora_for_a_wider_flux_is_refused(tiny_set, tmp_path, capsys):
    # The tiny FLUX's proj is [64, 64]; this LoRA was made for a FLUX of width 96.
    wide = lora_files.LoRAWeights(torch.randn(4, 96), torch.randn(96, 4), 4.0)
    lora_files.write_kohya({"double_blocks.0.img_attn.proj": wide}, str(tmp_path / "wide.safetensors"))
    line = merge_error(capsys, "--model", tiny_set["flux_bfl"], "--lora", tmp_path / "wide.safetensors",
                       "--save_to", tmp_path / "merged.safetensors")
    assert ("wide.safetensors: LoRA for 'double_blocks.0.img_attn.proj.weight' gives a delta of shape (96, 96), "
            "the checkpoint weight is (64, 64)") in line, line
    assert files_under(tmp_path) == ["wide.safetensors"]


def test_merge_ratio_that_is_not_a_number_is_refused(trained, tiny_set, tmp_path, capsys):
    lora = trained / "tiny_flux_lora.safetensors"
    line = merge_error(capsys, "--model", tiny_set["flux_bfl"], "--lora", f"{lora}:0,8", "--save_to", tmp_path / "m.safetensors")
    assert f"--lora '{lora}:0,8': ratio '0,8' is not a number (expected path[:ratio]" in line, line
    assert files_under(tmp_path) == []


def test_merge_save_to_below_a_file_is_refused(trained, tiny_set, tmp_path, capsys):
    (tmp_path / "a_file").write_text("x")
    target = tmp_path / "a_file" / "merged.safetensors"
    line = merge_error(capsys, "--model", tiny_set["flux_bfl"], "--lora", trained / "tiny_flux_lora.safetensors", "--save_to", target)
    assert f"{target}: cannot be written, '{tmp_path / 'a_file'}' is a file, not a folder" in line, line
    assert files_under(tmp_path) == ["a_file"]


def test_merge_folder_save_to_below_a_file_is_refused(tiny_set, tmp_path, capsys):
    net = LoRANetwork(load_qwen_image(tiny_set["qwen_image"]), "qwen_image", 4, 4.0)
    net.save(str(tmp_path / "qwen_lora.safetensors"))
    (tmp_path / "a_file").write_text("x")
    target = tmp_path / "a_file" / "merged"
    line = merge_error(capsys, "--model", tiny_set["qwen_image"], "--lora", tmp_path / "qwen_lora.safetensors", "--save_to", target)
    assert f"'{tmp_path / 'a_file'}' is a file, not a folder" in line, line
    assert files_under(tmp_path) == ["a_file", "qwen_lora.safetensors"]
