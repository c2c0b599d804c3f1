"""What Validate / Create refuse before a job is queued (library/ui/config_check.py, called in this
process): the files train_lora.py opens first, the optimizer class, and the dataset's folders outside
the UI's roots; each refusal is one line under its field."""

from __future__ import annotations

import os

import pytest
import toml

from library.ui.config_check import check
from tests.ui_support import tiny_job_settings


@pytest.fixture()
def checked(tiny_set, tmp_path):
    roots = [os.path.realpath(tiny_set["root"]), os.path.realpath(str(tmp_path))]

    def run(**changes) -> dict:
        settings = tiny_job_settings(tiny_set, steps=2)
        settings.update(changes)
        return check(toml.dumps(settings), str(tmp_path / "out"), roots)

    return run


def test_a_config_whose_first_files_are_missing_is_refused_at_its_field(checked, tiny_set, tmp_path):
    missing = str(tmp_path / "nope.toml")
    cases = {"dataset_config": (missing, "must be a file; found nothing"),
             "sample_prompts": (missing, "must be a file; found nothing"),
             "resume": (str(tmp_path / "no-state"), "must be a state folder; found nothing")}
    for key, (path, expected) in cases.items():
        answer = checked(**{key: path})
        assert answer == {"ok": False, "key": key, "error": f"config: key '{key}': {path!r} {expected} there"}, answer
    weights = str(tmp_path / "w.safetensors")  # the config check itself refuses this one (train_lora.py too)
    assert checked(network_weights=weights) == {"ok": False, "key": "network_weights", "error": (
        f"config: key 'network_weights' = {weights}: no such file or folder (expected a LoRA file or PEFT adapter folder)")}
    answer = checked(dataset_config=str(tmp_path))
    assert answer["key"] == "dataset_config" and "found a folder there" in answer["error"]
    assert checked()["ok"] is True


def test_an_optimizer_type_that_is_not_an_optimizer_class_is_refused(checked):
    answer = checked(optimizer_type="os.system")
    assert answer == {"ok": False, "key": "optimizer_type", "error": "config: key 'optimizer_type': 'os.system' is "
                                                                     "not an optimizer class (a torch.optim.Optimizer subclass)"}
    assert checked(optimizer_type="torch.optim.SGD", optimizer_args=[])["ok"] is True
    answer = checked(optimizer_type="torch.optim.SGD")  # Prodigy's d0 and d_coef: SGD's constructor refuses them
    assert answer["ok"] is False and "do not fit torch.optim.SGD" in answer["error"], answer


def test_an_unknown_optimizer_type_is_refused_under_its_field(checked):
    """Old: shown under the TOML editor (the error line says "optimizer_type 'x'", not "key 'optimizer_type'")."""
    from library.ui.config_check import error_key

    for name in ("NoSuchOpt", "torch.optim.NoSuchOpt"):
        answer = checked(optimizer_type=name)
        assert answer["ok"] is False and answer["key"] == "optimizer_type", answer
        assert answer["error"].startswith(f"config: optimizer_type '{name}'"), answer
    assert error_key("config: image 'a.png' is not a key") is None  # a word before a quote that names no key


def test_a_dataset_reading_outside_the_roots_is_refused(checked, tiny_set, tmp_path):
    dataset = toml.load(tiny_set["dataset_config"])
    for key, value in (("image_dir", "/etc"), ("control_directory", "/etc"), ("mask_dir", "/usr")):
        changed = toml.load(tiny_set["dataset_config"])
        changed["datasets"][0]["subsets"][0][key] = value
        path = tmp_path / f"dataset_{key}.toml"
        path.write_text(toml.dumps(changed))
        answer = checked(dataset_config=str(path))
        assert answer["ok"] is False and answer["key"] == "dataset_config", answer
        assert f"{key} {value!r} is outside the folders" in answer["error"] and "\n" not in answer["error"]
    dataset["datasets"][0]["cache_dir"] = "/var/tmp/caches"  # written to by the trainer
    path = tmp_path / "dataset_cache.toml"
    path.write_text(toml.dumps(dataset))
    assert "cache_dir '/var/tmp/caches' is outside" in checked(dataset_config=str(path))["error"]


def test_the_forms_base_precision_reads_and_writes_the_base_precision_key(checked, tiny_set):
    from library.ui.handlers import BASE_PRECISIONS, apply_form, form_values

    assert {"nf4", "nf4_dq", "int8"} <= set(BASE_PRECISIONS)  # the dropdown's choices
    assert form_values({"base_precision": "int8"})["base_precision"] == "int8"
    assert form_values({"fp8_base": True, "fp8_scaled": False})["base_precision"] == "fp8"  # the older keys
    # fp8_scaled picked over a config saying base_precision = "fp8" (and the older keys): one key, no conflict
    written = apply_form({"base_precision": "fp8", "fp8_base": True, "fp8_scaled": False},
                         {"base_precision": "fp8_scaled"})
    assert written == {"base_precision": "fp8_scaled"}
    assert checked(**written)["ok"] is True


def test_sample_prompts_with_a_reference_outside_the_roots_are_refused(checked, tmp_path_factory, tmp_path):
    """A prompt file's --ci (an edit model's reference image) was read from anywhere: the sample drew it
    where the pages show it, past the roots every other path is held to."""
    from PIL import Image

    outside = tmp_path_factory.mktemp("outside") / "secret.png"
    Image.new("RGB", (16, 16)).save(outside)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"a cat --ci {outside}\n")
    answer = checked(sample_prompts=str(prompts))
    assert answer["ok"] is False and answer["key"] == "sample_prompts", answer
    assert f"--ci {str(outside)!r} is outside the folders" in answer["error"] and "\n" not in answer["error"]
    inside = tmp_path / "ref.png"
    Image.new("RGB", (16, 16)).save(inside)
    prompts.write_text(f"a cat --ci {inside}\n")
    # past the roots check, the references are the model's to take: FLUX.1 takes none (train_lora.py's line)
    assert checked(sample_prompts=str(prompts))["error"].endswith("model_type flux takes no reference images")
    # Old: the references were decoded before the roots check: an outside file that is no image answered
    # with its decode error (the check had opened it), not the roots refusal.
    not_an_image = outside.parent / "notes.png"
    not_an_image.write_text("not an image")
    prompts.write_text(f"a cat --ci {not_an_image}\n")
    assert "is outside the folders" in checked(sample_prompts=str(prompts))["error"]
    broken = tmp_path / "broken.png"
    broken.write_text("not an image")
    prompts.write_text(f"a cat --ci {broken}\n")  # inside: decoded, its error named
    answer = checked(sample_prompts=str(prompts))
    assert answer["ok"] is False and answer["key"] == "sample_prompts" and str(broken) in answer["error"], answer


def test_zimage_omnis_siglip_folder_outside_the_roots_is_refused(tmp_path):
    """siglip (optional: the Omni repo's own by default) was in no list of path keys the UI checks (2026-11-27)."""
    from types import SimpleNamespace

    from library.ui.config_check import outside_roots

    args = SimpleNamespace(model_type="zimage_omni", pretrained_model_name_or_path=str(tmp_path), siglip="/etc",
                           base_loras=[], train_data=[])
    answer = outside_roots(args, [str(tmp_path)])
    assert answer["key"] == "siglip" and "'/etc' is outside the folders" in answer["error"], answer
    assert outside_roots(SimpleNamespace(**{**vars(args), "siglip": None}), [str(tmp_path)]) is None


def test_a_loss_weight_table_outside_the_roots_is_refused(tmp_path):
    """timestep_loss_weights (2026-12-05) is a file the run reads: the UI's roots hold it too."""
    from types import SimpleNamespace

    from library.ui.config_check import outside_roots

    args = SimpleNamespace(model_type="llm", timestep_loss_weights="/etc/hostname", base_loras=[], train_data=[])
    answer = outside_roots(args, [str(tmp_path)])
    assert answer["key"] == "timestep_loss_weights" and "'/etc/hostname' is outside the folders" in answer["error"]


def test_a_base_lora_under_a_folder_with_a_colon_is_checked_as_the_trainer_reads_it(tmp_path):
    """Old: the check cut each base_loras entry at its last colon, where the trainer reads the whole
    entry as the path when it exists: 'root/run 12:30/../../outside/x' was checked as 'root/run 12' (inside)."""
    from types import SimpleNamespace

    from library.ui.config_check import outside_roots

    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "run 12:30").mkdir(parents=True)
    outside.mkdir()
    (outside / "x.safetensors").write_bytes(b"")
    entry = f"{root}/run 12:30/../../outside/x.safetensors"
    args = SimpleNamespace(model_type="llm", base_loras=[entry], train_data=[])
    answer = outside_roots(args, [str(root)])
    assert answer is not None and answer["key"] == "base_loras" and "is outside the folders" in answer["error"], answer
    (root / "x.safetensors").write_bytes(b"")
    assert outside_roots(SimpleNamespace(**{**vars(args), "base_loras": [f"{root}/x.safetensors:0.5"]}), [str(root)]) is None


def test_a_dataset_whose_image_dir_is_not_a_folder_is_refused_with_the_trainers_line(checked, tiny_set, tmp_path):
    """Old: Validate answered ok and the job was queued, to fail after launch with this line; now it is
    refused before, under the dataset field. A folder with no image too (it passed Validate)."""
    (tmp_path / "a_file").write_text("")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("a caption without its image")
    for image_dir, why in ((str(tmp_path / "nope"), "image_dir does not exist or is not a folder"),
                           (str(tmp_path / "a_file"), "image_dir does not exist or is not a folder"),
                           (str(tmp_path / "empty"), "image_dir holds no images (")):
        changed = toml.load(tiny_set["dataset_config"])
        changed["datasets"][0]["subsets"][0]["image_dir"] = image_dir
        path = tmp_path / "dataset.toml"
        path.write_text(toml.dumps(changed))
        answer = checked(dataset_config=str(path))
        assert answer["ok"] is False and answer["key"] == "dataset_config", answer
        assert answer["error"].startswith(f"{path}: {image_dir}: {why}"), answer


def test_optimizer_args_that_do_not_fit_the_optimizer_are_refused_under_the_optimizer_field(checked):
    """Old: "config: optimizer_args (d0=...) do not fit AdamW" named no key: shown under the TOML editor."""
    answer = checked(optimizer_type="AdamW")  # with quickstart's Prodigy optimizer_args
    assert answer["ok"] is False and answer["key"] == "optimizer_args", answer
    assert answer["error"].startswith("config: optimizer_args (d0=") and "do not fit AdamW" in answer["error"]


def test_what_train_lora_refuses_first_is_refused_at_its_field_with_its_line(checked, tiny_set, tmp_path, capsys):
    """Old: Validate / Create ran load_config and the model files' check only, and queued configs that train_lora.py
    refuses in its first seconds (DiffusionTask's checks before caching): blocks_to_swap past the model's blocks,
    network_args the network refuses, a key the model never reads, a pre-quantized base the config calls bf16."""
    import train_lora
    from tests.test_fp8_checkpoints import tiny_comfy_flux
    from tests.test_reliability import one_error_line
    from tools.make_tiny_models import tiny_config

    answer = checked(blocks_to_swap=100)
    assert answer == {"ok": False, "key": "blocks_to_swap", "error": (
        f"{tiny_set['flux_bfl']}: blocks_to_swap must be between 1 and 3 for this model (4 blocks), got 100")}, answer
    config = tmp_path / "swap.toml"
    config.write_text(toml.dumps(tiny_job_settings(tiny_set, blocks_to_swap=100, output_dir=str(tmp_path / "run"))))
    assert one_error_line(capsys, train_lora.main(["--config_file", str(config)])) == f"error: {answer['error']}"
    answer = checked(network_args=["conv_dim=4"])
    assert answer["key"] == "network_args", answer  # not under conv_dim, the unknown key the line names
    assert answer["error"].startswith("config: network_args: unknown key 'conv_dim' for family 'flux'"), answer
    # Old: passed Validate (check_network_fits ran in DiffusionTask only): a block index past the model's blocks
    answer = checked(network_args=["train_double_block_indices=7"])
    assert answer["key"] == "network_args" and "train_double_block_indices" in answer["error"], answer
    answer = checked(network_module="lycoris.kohya", network_args=["algo=dylora"])
    assert answer["key"] == "network_args" and "'algo=dylora' is refused" in answer["error"], answer
    zimage = tiny_config("zimage", tiny_set, guidance_scale=3.5)
    answer = check(zimage, str(tmp_path / "out"), [os.path.realpath(tiny_set["root"])])
    assert answer == {"ok": False, "key": "guidance_scale", "error": (
        "config: key 'guidance_scale' = 3.5 does nothing: model_type zimage has no guidance embedding to feed it to; "
        "remove it")}, answer
    stored = tiny_comfy_flux(tiny_set, tmp_path)
    bf16 = {k: v for k, v in tiny_job_settings(tiny_set, pretrained_model_name_or_path=stored).items()
            if k not in ("fp8_base", "fp8_scaled")}
    roots = [os.path.realpath(tiny_set["root"]), os.path.realpath(str(tmp_path))]
    answer = check(toml.dumps(bf16), str(tmp_path / "out"), roots)
    assert answer["key"] == "pretrained_model_name_or_path", answer
    assert answer["error"].startswith(f"{stored}: the checkpoint stores a pre-quantized fp8_tensor_scaled base (used as "
                                      f"it is), but the config asks for bf16"), answer
    assert checked(pretrained_model_name_or_path=stored)["ok"] is True  # the quickstart's fp8_scaled base
    assert checked(blocks_to_swap=3)["ok"] is True


def test_an_llm_config_train_lora_refuses_first_is_refused_at_its_field(tiny_set, tmp_path):
    """Old: an LLM config whose train_data is missing, or whose network_args hold a key the LLM's LoRA does not know,
    passed Validate; train_lora.py refused it at once (LLMTask's first checks)."""
    roots = [os.path.realpath(tiny_set["root"]), os.path.realpath(str(tmp_path))]

    def checked_llm(**changes) -> dict:
        settings = {"model_type": "llm", "pretrained_model_name_or_path": tiny_set["llm"], "train_data": [tiny_set["corpus"]],
                    "max_length": 32, "stride": 32, "max_train_steps": 2, "network_args": ["mlp_dim=4"], **changes}
        return check(toml.dumps(settings), str(tmp_path / "out"), roots)

    assert checked_llm()["ok"] is True
    missing = str(tmp_path / "no_corpus.txt")
    assert checked_llm(train_data=[tiny_set["corpus"], missing]) == {
        "ok": False, "key": "train_data", "error": f"train_data {missing}: no such text file or folder"}
    (tmp_path / "empty").mkdir()
    answer = checked_llm(train_data=[str(tmp_path / "empty")])  # a folder: its .txt / .jsonl files
    assert answer["key"] == "train_data" and "no .txt or .jsonl file in this folder" in answer["error"], answer
    answer = checked_llm(network_args=["bogus_dim=4"])
    assert answer["key"] == "network_args", answer
    assert answer["error"].startswith("config: network_args: unknown key 'bogus_dim' for family 'llm'"), answer
