"""A run's lifecycle on disk: sample names that a later (or resumed) run does not overwrite, seeds
that agree between training samples and generate.py, schedule checks before caching, saves, resume."""

import json
import os
import re
import time

import pytest
from PIL import Image

import train_lora
from library.ui import run_files
from tests.test_reliability import files_under, flux_args
from tools import generate

STAMPED = re.compile(r"tiny_flux_lora_final_(\d\d)_(\d{14})_(\d+)\.png")


def cache_files(folder) -> list[str]:
    """What a run wrote beside the images, the dataset TOML and the captions: its caches."""
    return [f for f in files_under(folder) if not f.endswith((".png", ".txt", ".toml"))]


def test_a_second_run_keeps_the_first_runs_samples_and_an_unset_seed_is_random(tiny_set, tmp_path):
    """Samples were <name>_<tag>_<NN>.png: a second run into the same folder replaced the first's
    (1 file, not 2). Now sd-scripts' <name>_<tag>_<NN>_<YYYYmmddHHMMSS>_<seed>.png; a prompt without
    --d renders with a random seed as sd-scripts' does (it rendered with the training seed, 42)."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("a red circle --w 32 --h 32 --s 1\na blue square --w 32 --h 32 --s 1 --d 7\n")
    out = tmp_path / "run"
    for _ in range(2):
        assert train_lora.main(flux_args(tiny_set, out, "--sample_prompts", str(prompts),
                                         "--sample_bf16_reference", "false")) == 0
        time.sleep(1.0)  # the stamp has whole seconds: two runs sampling in one second name --d 7's sample alike
    finals = sorted(STAMPED.fullmatch(p.name).groups() for p in out.glob("tiny_flux_lora_final_*.png"))
    assert len(finals) == 4, finals  # two prompts, two runs
    seeds = {index: {seed for i, _, seed in finals if i == index} for index in ("00", "01")}
    assert len(seeds["00"]) == 2 and "42" not in seeds["00"] and seeds["01"] == {"7"}
    shown = run_files.samples(str(out), "tiny_flux_lora")  # the web UI reads both runs' samples, in order
    assert [(s.tag, s.index) for s in shown] == [("final", 0), ("final", 1)] * 2
    assert shown[0].stamp <= shown[2].stamp


def test_generate_without_seed_draws_one_per_image_as_sd_scripts(tiny_set, tmp_path):
    """generate.py's --seed defaulted to 0 (training samples: 42); now unset means a random seed per
    image, recorded in the file name and the PNG's info, as sd-scripts' and musubi-tuner's samples."""
    from tests.test_generate import generate_args

    out = tmp_path / "out"
    for _ in range(2):
        assert generate.main(generate_args(tiny_set, out, "--width", "32", "--height", "32")) == 0
    names = sorted(p.name for p in out.iterdir())
    seeds = [re.fullmatch(r"00[01]_(\d+)\.png", n).group(1) for n in names]
    assert len(set(seeds)) == 2 and "0" not in seeds, names
    with Image.open(out / names[0]) as png:
        assert png.text["seed"] == seeds[0]


def test_an_epochs_run_whose_warmup_covers_it_is_refused_before_caching(tiny_set, tmp_path, capsys):
    """With max_train_epochs the steps come from the dataset: lr_warmup_steps 100 over a 1-epoch run
    (2 steps) was taken and the lr never left the warmup. Now one line after the scan, before caching, naming
    where the keys were set (it blamed the config file for the command line's values)."""
    code = train_lora.main(flux_args(tiny_set, tmp_path / "run", "--max_train_epochs", "1", "--lr_scheduler",
                                     "linear", "--lr_warmup_steps", "100"))
    out, err = capsys.readouterr()
    assert code == 2 and err == ("error: command line: lr_warmup_steps = 100 is not below max_train_epochs = 1 "
                                 "(4 steps): the lr would never reach learning_rate; shorten the warmup or train "
                                 "longer\n"), err
    assert err.count("\n") == 1 and "captions:" not in out  # one line; nothing was cached


def test_save_last_n_saves_deletes_no_save_this_run_did_not_write(tiny_set, tmp_path):
    """A fresh run pruned every <name>-stepNNNNNN file in output_dir up to its step: saving every 2
    steps with the newest 1 kept, it deleted an earlier run's step-1 save (and its _ema, folders
    alike). Now it prunes the saves it wrote (and, resumed, those its state lists). sd-scripts' save of a step this
    run prunes (8 digits: step00000002) went with ours of that step."""
    out = tmp_path / "run"
    out.mkdir()
    earlier = [out / "tiny_flux_lora-step000001.safetensors", out / "tiny_flux_lora-step000003.safetensors",
               out / "tiny_flux_lora-step00000002.safetensors"]
    for path in earlier:
        path.write_bytes(b"another run's LoRA")
    assert train_lora.main(flux_args(tiny_set, out, "--max_train_steps", "5", "--save_every_n_steps", "2",
                                     "--save_last_n_saves", "1")) == 0
    assert sorted(p.name for p in out.glob("*.safetensors")) == sorted([
        "tiny_flux_lora-step000001.safetensors", "tiny_flux_lora-step00000002.safetensors",
        "tiny_flux_lora-step000003.safetensors", "tiny_flux_lora-step000004.safetensors",
        "tiny_flux_lora.safetensors"])  # its step 2 pruned, the final kept
    assert all(path.read_bytes() == b"another run's LoRA" for path in earlier)


def test_a_folder_where_the_lora_goes_or_a_file_where_the_state_goes_is_refused_before_training(tiny_set, tmp_path):
    """Both trained every step and then failed at the save ('[Errno 21] Is a directory: ... ->
    run/tiny_flux_lora.safetensors'; 'tiny_flux_lora-state: a file is there'), exit 2 without the LoRA."""
    import pytest

    from library.training.config import ConfigError, load_config

    out = tmp_path / "run"
    (out / "tiny_flux_lora.safetensors").mkdir(parents=True)
    with pytest.raises(ConfigError) as e:
        load_config(flux_args(tiny_set, out))
    assert str(e.value) == (f"command line: output_dir '{out}' holds a folder 'tiny_flux_lora.safetensors' where the "
                            f"LoRA file goes; move it, or choose another output_name")
    (out / "tiny_flux_lora.safetensors").rmdir()
    (out / "tiny_flux_lora-state").write_text("notes")
    load_config(flux_args(tiny_set, out))  # no state written: the file is no matter
    with pytest.raises(ConfigError, match="holds a file 'tiny_flux_lora-state' where the training state folder goes"):
        load_config(flux_args(tiny_set, out, "--save_state", "true"))
    # A folder where the log CSV goes failed at the first step, after caching ("[Errno 21] Is a directory"); one
    # where the lr plot goes, after the LoRA was saved (exit 2, naming a temporary file).
    for entry, what in (("tiny_flux_lora_log.csv", "log CSV"), ("tiny_flux_lora_lr.png", "learning-rate plot")):
        (out / entry).mkdir()
        with pytest.raises(ConfigError, match=f"holds a folder '{entry}' where the {what} goes; move it"):
            load_config(flux_args(tiny_set, out))
        (out / entry).rmdir()


def resume_mid_epoch(tiny_set, out, capsys, dataset_config: str, *first_args):
    """A state written 2 of 4 batches into epoch 0 (its run given `first_args`), resumed on `dataset_config`:
    (the state folder, the resume's exit code, its stderr)."""
    assert train_lora.main(flux_args(tiny_set, out, "--max_train_steps", "2", "--save_state", "true", *first_args)) == 0
    state = out / "tiny_flux_lora-state"
    capsys.readouterr()
    code = train_lora.main(flux_args(tiny_set, out, "--max_train_steps", "4", "--dataset_config", dataset_config,
                                     "--resume", str(state)))
    return state, code, capsys.readouterr().err


def test_a_run_that_does_not_resume_an_unfinished_state_in_its_output_dir_is_refused(tiny_set, tmp_path, capsys):
    """The state is one folder, replaced at every save: a run started without --resume over a stopped run's state
    replaced it at its first save without a word (a forgotten --resume lost the only point to continue from). Now
    one line before caching; --resume continues it (the line counts epochs from 1, as ss_epoch: "(epoch 0)" was
    said 2 batches into the first epoch); --resume at the output folder names the state inside it."""
    import json

    from tests.test_reliability import copy_dataset

    out = tmp_path / "run"
    assert train_lora.main(flux_args(tiny_set, out, "--max_train_steps", "2", "--save_state", "true")) == 0
    state = out / "tiny_flux_lora-state"
    written = json.loads((state / "train_state.json").read_text())
    (state / "train_state.json").write_text(json.dumps({**written, "max_steps": 4}))  # as a run of 4 stopped at 2
    before = (state / "trainable.safetensors").read_bytes()
    capsys.readouterr()
    data = copy_dataset(tiny_set, tmp_path / "data")
    fresh = flux_args(tiny_set, out, "--max_train_steps", "4", "--dataset_config", data)
    assert train_lora.main(fresh) == 2
    assert capsys.readouterr().err == (f"error: {state}: the state of an unfinished run (step 2 of 4); this run does "
                                       f"not resume it and would replace it at its first save: continue it with "
                                       f"--resume {state}, or remove it (or set another output_name) to start over\n")
    assert cache_files(tmp_path / "data") == [] and (state / "trainable.safetensors").read_bytes() == before
    assert train_lora.main([*fresh, "--resume", str(out)]) == 2
    assert capsys.readouterr().err.endswith(f"{out}: not a training state (no train_state.json); it holds {state}\n")
    assert train_lora.main([*fresh, "--resume", str(state)]) == 0
    assert f"resumed from {state} at step 2 (epoch 1, 2 of its batches done)" in capsys.readouterr().out


@pytest.mark.parametrize("peer_json", [{"current_epoch": 1, "current_step": 5}, None], ids=["sd-scripts", "musubi"])
def test_a_peers_state_named_as_ours_is_neither_replaced_nor_called_damaged(tiny_set, tmp_path, capsys, peer_json):
    """sd-scripts and musubi-tuner name their final accelerate state <output_name>-state, as ours: a run into their
    output_dir took it for no state (musubi-tuner's, no train_state.json) or a damaged one (sd-scripts' has its own)
    and replaced it at its first save; --resume at it said "no 'step' ... the state is damaged" or "not a training
    state". Now one line each, before caching, the folder untouched; a --resume path that is not there says so."""
    out = tmp_path / "run"
    peer = out / "tiny_flux_lora-state"
    peer.mkdir(parents=True)
    for name in ("optimizer.bin", "scheduler.bin", "random_states_0.pkl", "model.safetensors"):
        (peer / name).write_bytes(b"accelerate")
    if peer_json:
        (peer / "train_state.json").write_text(json.dumps(peer_json))
    before = sorted(os.listdir(peer))
    capsys.readouterr()
    assert train_lora.main(flux_args(tiny_set, out, "--max_train_steps", "1")) == 2
    said = f"error: {peer}: an accelerate state (sd-scripts' or musubi-tuner's save_state); "
    assert capsys.readouterr().err == (f"{said}this run would replace it at its first save: move it, or set another "
                                       f"output_name\n")
    assert train_lora.main(flux_args(tiny_set, out, "--max_train_steps", "1", "--resume", str(peer))) == 2
    assert capsys.readouterr().err == (f"{said}ours resumes only its own: start from the peer's LoRA with "
                                       f"network_weights\n")
    assert sorted(os.listdir(peer)) == before and not [p for p in os.listdir(out) if p.endswith(".safetensors")]
    missing = tmp_path / "nowhere-state"
    assert train_lora.main(flux_args(tiny_set, out, "--max_train_steps", "1", "--resume", str(missing))) == 2
    assert capsys.readouterr().err == (f"error: {missing}: no such folder; --resume takes the <output_name>-state "
                                       f"folder a run saved\n")


def test_resume_inside_an_epoch_with_other_data_is_refused(tiny_set, tmp_path, capsys):
    """A state written 2 of 4 batches into epoch 0 resumed on the set repeated twice (8 batches per
    epoch) skipped 2 batches of the new set's order and trained the rest: other images than the
    epoch had left, without a word. Refused now, naming both counts."""
    from tests.test_reliability import copy_dataset

    repeated = copy_dataset(tiny_set, tmp_path / "data", subset="num_repeats = 2")
    state, code, err = resume_mid_epoch(tiny_set, tmp_path / "run", capsys, repeated)
    assert code == 2 and err == (f"error: {state}: state was written 2 of 4 batches into epoch 0, this run has 8 batches "
                                 f"per epoch (the dataset, its batch_size or num_repeats, or the processes changed): "
                                 f"the rest of that epoch would be other images; resume with the same data\n"), err
    assert cache_files(tmp_path / "data") == []  # refused before caching (it cached 8 latents and 8 texts first)


def test_resume_inside_an_epoch_with_as_many_batches_of_other_images_is_refused(tiny_set, tmp_path, capsys):
    """The same 8 images, one renamed (4 batches per epoch as before): the state written 2 of 4
    batches into epoch 0 resumed and trained the saved order's rest over the changed list. Now
    refused, counting the files gone and new. (Names and sizes, not paths: the state was written on
    another copy of the same files, and the rename is all the check sees.)"""
    from tests.test_reliability import copy_dataset

    def rename(images):
        (images / "003.png").rename(images / "103.png")
        (images / "003.txt").rename(images / "103.txt")

    first, renamed = copy_dataset(tiny_set, tmp_path / "a"), copy_dataset(tiny_set, tmp_path / "b", rename)
    state, code, err = resume_mid_epoch(tiny_set, tmp_path / "run", capsys, renamed, "--dataset_config", first)
    assert code == 2 and err == (f"error: {state}: state was written 2 batches into epoch 0; since then 1 of its "
                                 f"training files are gone and 1 are new (a renamed or resized file counts in both): "
                                 f"the rest of that epoch would be other images; resume with the same data, or from a "
                                 f"state saved at an epoch's end\n"), err
    assert cache_files(tmp_path / "b") == []


def test_resume_inside_an_epoch_with_batch_size_and_num_repeats_both_changed_is_refused(tiny_set, tmp_path, capsys):
    """batch_size 2 -> 4 with num_repeats 1 -> 2: 4 batches per epoch as before, of the same files, so the
    state written 2 of 4 batches into epoch 0 resumed over another order without a word. Refused now."""
    from tests.test_reliability import copy_dataset

    toml = copy_dataset(tiny_set, tmp_path / "data", subset="num_repeats = 2")
    with open(toml) as f:
        doubled = f.read().replace("batch_size = 2", "batch_size = 4")
    with open(toml, "w") as f:
        f.write(doubled)
    state, code, err = resume_mid_epoch(tiny_set, tmp_path / "run", capsys, toml)
    assert code == 2 and err == (f"error: {state}: state was written 2 of 4 batches into epoch 0, this run has as "
                                 f"many, but another batch_size or num_repeats: the rest of that epoch would be other "
                                 f"images; resume with the same data\n"), err


def test_a_state_whose_network_took_modules_from_network_weights_resumes_only_with_that_file(tiny_set, tmp_path,
                                                                                             capsys):
    """A state trained on double block 1 with network_weights of a block-0 LoRA (the network adds the file's
    modules), resumed without network_weights: 'RuntimeError: Error(s) in loading state_dict for LoRANetwork:
    Unexpected key(s)' after caching and the model load. Now refused before caching, naming the key; a state
    written before the key was kept gets one line naming its first foreign key, and resumes with the file; the
    same file in another folder is the same setting."""
    import json
    import shutil

    from library.training.config import load_config
    from library.training.state import load_state
    from tests.test_reliability import copy_dataset

    first, out = tmp_path / "first", tmp_path / "run"
    assert train_lora.main(flux_args(tiny_set, first, "--network_args", "train_double_block_indices=0")) == 0
    block1 = ("--network_args", "train_double_block_indices=1", "--max_train_steps", "2")
    assert train_lora.main(flux_args(tiny_set, out, *block1[:2], "--save_state", "true", "--network_weights",
                                     str(first / "tiny_flux_lora.safetensors"))) == 0
    state = out / "tiny_flux_lora-state"
    capsys.readouterr()
    data = copy_dataset(tiny_set, tmp_path / "data")
    assert train_lora.main(flux_args(tiny_set, out, *block1, "--dataset_config", data, "--resume", str(state))) == 2
    assert capsys.readouterr().err == (f"error: {state}: state was written with network_weights = "
                                       f"'tiny_flux_lora.safetensors', this run has None; resume needs the same "
                                       f"settings\n")
    assert cache_files(tmp_path / "data") == []  # refused before caching

    written = json.loads((state / "train_state.json").read_text())
    older = {**written, "run": {k: v for k, v in written["run"].items()
                                if k not in ("network_weights", "dim_from_weights")}}
    (state / "train_state.json").write_text(json.dumps(older))  # a state from before the keys were kept
    assert train_lora.main(flux_args(tiny_set, out, *block1, "--resume", str(state))) == 2
    assert capsys.readouterr().err == (f"error: {state / 'trainable.safetensors'}: holds tensors this run's network "
                                       f"has no module for: 30 (first "
                                       f"'lora_unet_double_blocks_0_img_attn_proj.alpha'); resume with the network "
                                       f"settings the state was written with (network_args, network_weights, "
                                       f"dim_from_weights)\n")

    moved = tmp_path / "moved" / "tiny_flux_lora.safetensors"
    moved.parent.mkdir()
    shutil.copy(first / "tiny_flux_lora.safetensors", moved)
    with_file = flux_args(tiny_set, out, *block1, "--network_weights", str(moved), "--resume", str(state))
    assert train_lora.main(with_file) == 0  # the older state resumes with the file
    assert f"resumed from {state} at step 1" in capsys.readouterr().out
    (state / "train_state.json").write_text(json.dumps(written))
    assert load_state(str(state), load_config(with_file)).progress["step"] == 1  # the same file in another folder


def test_a_diverged_run_names_its_own_last_save_not_another_runs(tiny_set, tmp_path, monkeypatch, capsys):
    """A NaN loss at step 3 of a run without saves said 'the last save before it: step 1,
    .../tiny_flux_lora-step000001.safetensors': an earlier run's file in the same output_dir."""
    from library.models.family import DiffusionFamily

    real, calls = DiffusionFamily.training_loss, []

    def poisoned(self, *a, **k):
        loss, sigmas = real(self, *a, **k)
        calls.append(1)
        return (loss * float("nan") if len(calls) == 3 else loss), sigmas

    monkeypatch.setattr(DiffusionFamily, "training_loss", poisoned)
    out = tmp_path / "run"
    out.mkdir()
    (out / "tiny_flux_lora-step000001.safetensors").write_bytes(b"another run's LoRA")
    assert train_lora.main(flux_args(tiny_set, out, "--max_train_steps", "4")) == 3
    err = capsys.readouterr().err
    assert "no save before it (save_every_n_steps keeps some)" in err and "step000001" not in err, err


def test_ctrl_c_during_the_last_step_still_writes_the_final_lora(tiny_set, tmp_path, monkeypatch, capsys):
    """A Ctrl-C during step 2 of 2 saved tiny_flux_lora-step000002 and a state at step 2 and exited
    130 without tiny_flux_lora.safetensors; --resume then said 'nothing to train' (0) and never wrote
    it. Now the run ends as it would: the final LoRA and its state, the final samples skipped, and 130
    as any Ctrl-C (it exited 0, as if the samples had been rendered)."""
    import os
    import signal

    from library.training.diffusion_task import DiffusionTask

    def after_step(self, step, output_dir):
        if step == 2:
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(DiffusionTask, "after_step", after_step)
    out = tmp_path / "run"
    assert train_lora.main(flux_args(tiny_set, out, "--max_train_steps", "2")) == 130
    assert "SIGINT after the last step: final samples skipped; the LoRA is final" in capsys.readouterr().out
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["tiny_flux_lora.safetensors"]


def ctrl_c_after_the_first_sample(tmp_path, monkeypatch):
    """A prompt file of 3 samples, and a SIGINT right after the first image is saved."""
    import os
    import signal

    from library.data import images

    real = images.save_side_by_side

    def save_then_ctrl_c(*a, **k):
        real(*a, **k)
        os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(images, "save_side_by_side", save_then_ctrl_c)
    prompts = tmp_path / "p.txt"
    prompts.write_text("".join(f"prompt {i} --w 32 --h 32 --s 1 --d {i}\n" for i in range(3)))
    return prompts


def test_ctrl_c_during_the_final_samples_stops_them_at_the_next_image(tiny_set, tmp_path, monkeypatch, capsys):
    """A Ctrl-C after the first of 3 final samples went unheeded: the run rendered all 3 and exited 0.
    Now it stops before the second (the final LoRA is already written) and exits 130."""
    prompts = ctrl_c_after_the_first_sample(tmp_path, monkeypatch)
    out = tmp_path / "run"
    assert train_lora.main(flux_args(tiny_set, out, "--sample_prompts", str(prompts),
                                     "--sample_bf16_reference", "false")) == 130
    assert "SIGINT during the final samples: 1 written, the rest skipped; the LoRA is final" in capsys.readouterr().out
    assert len(list(out.glob("tiny_flux_lora_final_*.png"))) == 1 and (out / "tiny_flux_lora.safetensors").exists()


def test_ctrl_c_during_the_first_samples_stops_before_step_1(tiny_set, tmp_path, monkeypatch, capsys):
    """A Ctrl-C after the first of 3 sample_at_first samples stopped them, then trained step 1 and
    saved tiny_flux_lora-step000001 and a state before exiting 130. Now the run stops before step 1
    as a Ctrl-C while loading does: 130, no LoRA, no state, no row in the log."""
    prompts = ctrl_c_after_the_first_sample(tmp_path, monkeypatch)
    out = tmp_path / "run"
    assert train_lora.main(flux_args(tiny_set, out, "--sample_prompts", str(prompts), "--sample_at_first", "true",
                                     "--max_train_steps", "2", "--sample_bf16_reference", "false")) == 130
    assert "SIGINT during the first samples: stopped before step 1" in capsys.readouterr().err
    assert len(list(out.glob("tiny_flux_lora_start_*.png"))) == 1
    assert not list(out.glob("*.safetensors")) and not (out / "tiny_flux_lora-state").exists()
    assert run_files.last_step(str(out / "tiny_flux_lora_log.csv")) == 0


def llm_state_args(tmp_path, *extra):
    from library.training.config import load_config

    return load_config(["--model_type", "llm", "--pretrained_model_name_or_path", "fake", "--train_data", "fake",
                        "--output_dir", str(tmp_path), "--max_train_steps", "4", *extra])


def write_llm_state(state, run: dict):
    """An LLM training state folder whose train_state.json holds `run` (a run digest) and no files: a
    load that passes the settings' checks then fails on trainable.safetensors."""
    import json

    state.mkdir(exist_ok=True)
    (state / "train_state.json").write_text(json.dumps({"step": 2, "epoch": 0, "batches_done": 2,
                                                        "scheduler": {}, "run": run}, default=str))


def test_an_llm_state_resumed_with_other_windows_is_refused(tmp_path):
    """An LLM run resumed with another max_length (stride, val_fraction, batch_size) skipped the first
    batches of another set of windows without a word; a state written before these keys still resumes."""
    import json

    import pytest

    from library.training.state import LLM_DATA_IDENTITY, load_state, run_digest

    def args(*extra):
        return llm_state_args(tmp_path, *extra)

    state = tmp_path / "state"
    write_llm_state(state, run_digest(args("--max_length", "32")))
    with pytest.raises(ValueError, match="state was written with max_length = 32, this run has 64"):
        load_state(str(state), args("--max_length", "64"))
    old = {k: v for k, v in json.loads(json.dumps(run_digest(args()), default=str)).items() if k not in LLM_DATA_IDENTITY}
    write_llm_state(state, old)
    with pytest.raises(ValueError, match="trainable.safetensors"):  # past the settings: the files are read
        load_state(str(state), args("--max_length", "64"))


def test_a_state_that_attended_across_documents_resumes_only_with_that_setting(tmp_path):
    """The key changes which targets are trained: a state written with the other value (or before the key,
    which attended across) is refused, naming it."""
    import json

    import pytest

    from library.training.state import load_state, run_digest

    def args(*extra):
        return llm_state_args(tmp_path, *extra)

    state = tmp_path / "state"
    write_llm_state(state, run_digest(args("--attend_across_documents")))
    with pytest.raises(ValueError, match="written with attend_across_documents = True, this run has False"):
        load_state(str(state), args())
    before_key = json.loads(json.dumps(run_digest(args()), default=str))
    del before_key["attend_across_documents"], before_key["packing"]  # it came later
    write_llm_state(state, before_key)
    with pytest.raises(ValueError, match="written with attend_across_documents = True, this run has False"):
        load_state(str(state), args())
    with pytest.raises(ValueError, match="trainable.safetensors"):  # past the settings: the files are read
        load_state(str(state), args("--attend_across_documents"))


def test_a_state_of_the_streams_windows_resumes_only_with_them(tmp_path):
    """packing changes which windows there are: a state written before the key (the stream's windows) is refused
    with packing unset (best_fit since 2026-12-04), naming the key, and resumes with packing = "stream"."""
    import json

    import pytest

    from library.training.state import load_state, run_digest

    def args(*extra):
        return llm_state_args(tmp_path, *extra)

    state = tmp_path / "state"
    before_key = json.loads(json.dumps(run_digest(args()), default=str))
    assert before_key.pop("packing") == "best_fit"
    write_llm_state(state, before_key)
    with pytest.raises(ValueError, match="written with packing = 'stream', this run has 'best_fit'"):
        load_state(str(state), args())
    with pytest.raises(ValueError, match="trainable.safetensors"):  # past the settings: the files are read
        load_state(str(state), args("--packing", "stream"))


def test_a_state_trained_on_replies_only_resumes_only_with_that_setting(tmp_path):
    """train_on_all_tokens changes which targets are trained (and which windows hold one): a state written
    with the other value is refused, naming it (the old line resumed it, the rest of the epoch another loss
    on other windows); a state written before the key was kept still resumes with either value."""
    import json

    import pytest

    from library.training.state import load_state, run_digest

    def args(*extra):
        return llm_state_args(tmp_path, *extra)

    state = tmp_path / "state"
    write_llm_state(state, run_digest(args()))
    with pytest.raises(ValueError, match="written with train_on_all_tokens = False, this run has True"):
        load_state(str(state), args("--train_on_all_tokens", "true"))
    before_key = json.loads(json.dumps(run_digest(args()), default=str))
    del before_key["train_on_all_tokens"]
    write_llm_state(state, before_key)
    for value in ("true", "false"):
        with pytest.raises(ValueError, match="trainable.safetensors"):  # past the settings: the files are read
            load_state(str(state), args("--train_on_all_tokens", value))


def test_an_earlier_runs_ema_goes_with_its_lora_and_a_foreign_one_is_refused(tiny_set, tmp_path, capsys):
    """A run without EMA after one with ema_decay 0.9 left tiny_flux_lora_ema.safetensors (the first
    run's) beside the new LoRA, taken for its EMA. Now the final save removes an _ema file this
    trainer wrote for the output_name (its header says so); any other file there stops the run
    before the models load, untouched (sd-scripts and musubi-tuner write no _ema file to mistake).
    The step saves' twins too: tiny_flux_lora-step000001_ema.safetensors stayed beside the second
    run's tiny_flux_lora-step000001 (3 files left, not 2)."""
    out = tmp_path / "run"
    two_steps = ("--max_train_steps", "2", "--save_every_n_steps", "1")
    assert train_lora.main(flux_args(tiny_set, out, *two_steps, "--ema_decay", "0.9")) == 0
    assert len(list(out.glob("*_ema.safetensors"))) == 2
    assert train_lora.main(flux_args(tiny_set, out, *two_steps)) == 0
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["tiny_flux_lora-step000001.safetensors",
                                                                 "tiny_flux_lora.safetensors"]
    printed = capsys.readouterr().out
    for name in ("tiny_flux_lora-step000001_ema.safetensors", "tiny_flux_lora_ema.safetensors"):
        assert f"removed {out / name}: the EMA of the earlier run" in printed, printed
    (out / "tiny_flux_lora-step000001_ema.safetensors").write_bytes(b"someone's file")
    assert train_lora.main(flux_args(tiny_set, out)) == 2
    assert "tiny_flux_lora-step000001_ema.safetensors: not an EMA this trainer wrote" in capsys.readouterr().err
    (out / "tiny_flux_lora-step000001_ema.safetensors").unlink()
    (out / "tiny_flux_lora_ema.safetensors").write_bytes(b"someone's file")
    assert train_lora.main(flux_args(tiny_set, out)) == 2
    err = capsys.readouterr().err
    assert err == (f"error: {out / 'tiny_flux_lora_ema.safetensors'}: not an EMA this trainer wrote for output_name "
                   f"'tiny_flux_lora' (no ss_ema / ss_output_name in its header); this run has no ema_decay and would "
                   f"leave it beside its LoRA as if it were its EMA: move it, or choose another output_name\n"), err
    assert (out / "tiny_flux_lora_ema.safetensors").read_bytes() == b"someone's file"


def test_an_earlier_runs_peft_ema_folders_go_with_their_adapters_and_a_foreign_one_is_refused(tiny_set, tmp_path,
                                                                                              capsys):
    """An LLM LoRA is saved as PEFT adapter folders: a run without EMA after one with ema_decay 0.9 left
    the first run's lm_ema/ and lm-step000001_ema/ beside its own lm/ and lm-step000001/, taken for
    their EMAs (2 stale folders; the removal read _ema.safetensors files only). Now they go as the
    files do; a folder there whose weights this trainer did not write stops the run, untouched."""
    from tests.test_train_llm import llm_args

    out = tmp_path / "run"
    args = llm_args(tiny_set, out, "--pretrained_model_name_or_path", tiny_set["llm"], "--output_name", "lm",
                    "--max_train_steps", "2", "--save_every_n_steps", "1", "--eval_every_n_steps", "0")
    assert train_lora.main(args + ["--ema_decay", "0.9"]) == 0
    assert sorted(p.name for p in out.glob("*_ema")) == ["lm-step000001_ema", "lm_ema"]
    assert train_lora.main(args) == 0
    assert list(out.glob("*_ema")) == [] and (out / "lm").is_dir() and (out / "lm-step000001").is_dir()
    printed = capsys.readouterr().out
    for name in ("lm-step000001_ema", "lm_ema"):
        assert f"removed {out / name}: the EMA of the earlier run" in printed, printed
    (out / "lm_ema").mkdir()
    (out / "lm_ema" / "notes.txt").write_text("someone's folder")
    assert train_lora.main(args) == 2
    assert capsys.readouterr().err.startswith(f"error: {out / 'lm_ema'}: not an EMA this trainer wrote for output_name")
    assert (out / "lm_ema" / "notes.txt").read_text() == "someone's folder"


def test_save_state_on_train_end_saves_the_state_with_the_final_lora_only(tiny_set, tmp_path, monkeypatch):
    """sd-scripts' save_state_on_train_end was an unknown key (exit 2): a migrated config could not
    keep a state to extend the run from. Now the final save writes one (at step 2), the step-1 save none."""
    import json

    real, saved = train_lora.Saver.state, []
    monkeypatch.setattr(train_lora.Saver, "state", lambda self, *a: saved.append(a[-1]["step"]) or real(self, *a))
    out = tmp_path / "run"
    assert train_lora.main(flux_args(tiny_set, out, "--max_train_steps", "2", "--save_every_n_steps", "1",
                                     "--save_state_on_train_end", "true")) == 0
    assert saved == [2] and json.loads((out / "tiny_flux_lora-state" / "train_state.json").read_text())["step"] == 2


def test_epochs_with_accumulation_samples_and_an_unusual_output_dir(tiny_set, tmp_path):
    """max_train_epochs 2 with gradient_accumulation_steps 3 over 4 batches an epoch: sd-scripts'
    2 x ceil(4 / 3) = 4 optimizer steps; sample_at_first and sample_every_n_epochs 1 render at the
    start and after epoch 1 (epoch 2's are the final ones), sample_every_n_steps 3 after step 3 (both
    intervals fire, as in musubi-tuner; the pair was refused); an output_dir with a space and non-ASCII
    letters takes every file."""
    from safetensors import safe_open

    prompts = tmp_path / "p.txt"
    prompts.write_text("a red circle --w 32 --h 32 --s 1 --d 1\n")
    out = tmp_path / "my runs ü"
    assert train_lora.main(flux_args(tiny_set, out, "--max_train_epochs", "2", "--gradient_accumulation_steps", "3",
                                     "--sample_prompts", str(prompts), "--sample_bf16_reference", "false",
                                     "--sample_at_first", "true", "--sample_every_n_epochs", "1",
                                     "--sample_every_n_steps", "3", "--save_every_n_epochs", "1")) == 0
    tags = sorted(p.name.split("_")[3] for p in out.glob("tiny_flux_lora_*_00_*.png"))
    assert tags == ["epoch0001", "final", "start", "step000003"], tags
    with safe_open(str(out / "tiny_flux_lora.safetensors"), "pt") as f:
        assert f.metadata()["ss_steps"] == "4" and f.metadata()["ss_num_epochs"] == "2", f.metadata()
    with safe_open(str(out / "tiny_flux_lora-step000002.safetensors"), "pt") as f:  # save_every_n_epochs' save
        # sd-scripts' meaning: the epochs planned, and the epoch the save falls in (ss_num_epochs was the ones done)
        assert (f.metadata()["ss_num_epochs"], f.metadata()["ss_epoch"]) == ("2", "1"), f.metadata()


def test_a_step_ending_an_epoch_renders_once_when_both_intervals_fire_there():
    """musubi-tuner renders such a step twice (its step's check and its epoch's); here once, as the step's."""
    from library.training.output_names import sample_tag

    every_2_steps_and_epoch = [(sample_tag(2, 1, step, 10), sample_tag(2, 1, step, 10, epoch=step // 3))
                               for step in (2, 3, 6, 10)]  # 3 steps an epoch: epochs end at steps 3, 6, 9
    assert every_2_steps_and_epoch == [("step000002", None), (None, "epoch0001"), ("step000006", None), (None, None)]
    assert sample_tag(0, 2, 6, 10, epoch=2) == "epoch0002" and sample_tag(0, 2, 3, 10, epoch=1) is None


def test_a_state_resumed_on_another_diffusers_base_with_the_same_transformer_folder_name_is_refused(tmp_path):
    """Old: the state kept the base's folder name only, and every diffusers base's is `transformer`: a resume on
    another base (Qwen-Image vs Qwen-Image-2512) was accepted (its loss 54299). A state written before the
    parent's name was kept still resumes."""
    import json

    import pytest

    from library.training.state import load_state, run_digest

    def args(base):
        return llm_state_args(tmp_path, "--pretrained_model_name_or_path", str(tmp_path / base / "transformer"))

    state = tmp_path / "state"
    write_llm_state(state, run_digest(args("Qwen-Image")))
    with pytest.raises(ValueError, match="base_model = 'Qwen-Image/transformer', this run has 'Qwen-Image-2512/transformer'"):
        load_state(str(state), args("Qwen-Image-2512"))
    with pytest.raises(ValueError, match="trainable.safetensors"):  # the same base moved: past the settings
        load_state(str(state), llm_state_args(tmp_path, "--pretrained_model_name_or_path",
                                              str(tmp_path / "moved" / "Qwen-Image" / "transformer")))
    before = {**json.loads(json.dumps(run_digest(args("Qwen-Image")), default=str)), "base_model": "transformer"}
    write_llm_state(state, before)
    with pytest.raises(ValueError, match="trainable.safetensors"):
        load_state(str(state), args("Qwen-Image-2512"))


def test_a_state_resumes_with_its_network_and_optimizer_settings_in_another_order_or_spelling(tmp_path):
    """Old: network_args / optimizer_args were compared as written and optimizer_type as a string: the same run
    with its arguments in another order, `0.10` for `0.1`, or `adamw` for `AdamW` (sd-scripts' lookup, any case)
    was refused. Another value or another optimizer still is."""
    import pytest

    from library.training.state import load_state, run_digest

    def args(*extra):
        return llm_state_args(tmp_path, *extra)

    state = tmp_path / "state"
    write_llm_state(state, run_digest(args("--network_args", "mlp_dim=4", "rank_dropout=0.1", "--optimizer_type",
                                           "AdamW", "--optimizer_args", "weight_decay=0.01", "betas=(0.9,0.99)")))
    for same in (("--network_args", "rank_dropout = 0.10", "mlp_dim=4", "--optimizer_type", "adamw",
                  "--optimizer_args", "betas=(0.9, 0.99)", "weight_decay=1e-2"),
                 ("--network_args", "mlp_dim=4", "rank_dropout=0.1", "--optimizer_type", "torch.optim.AdamW",
                  "--optimizer_args", "weight_decay=0.01", "betas=(0.9,0.99)")):
        with pytest.raises(ValueError, match="trainable.safetensors"):  # past the settings
            load_state(str(state), args(*same))
    for other, key in ((("--network_args", "mlp_dim=4", "rank_dropout=0.2", "--optimizer_type", "AdamW",
                         "--optimizer_args", "weight_decay=0.01", "betas=(0.9,0.99)"), "network_args"),
                       (("--network_args", "mlp_dim=4", "rank_dropout=0.1", "--optimizer_type", "Adam",
                         "--optimizer_args", "weight_decay=0.01", "betas=(0.9,0.99)"), "optimizer_type"),
                       (("--network_args", "mlp_dim=4", "rank_dropout=0.1", "--optimizer_type", "AdamW",
                         "--optimizer_args", "weight_decay=0.01"), "optimizer_args")):
        with pytest.raises(ValueError, match=f"state was written with {key} = "):
            load_state(str(state), args(*other))


def test_samples_a_ctrl_c_cut_are_finished_when_the_run_resumes(tiny_set, tmp_path, monkeypatch, capsys):
    """A Ctrl-C after the first of step 2's 3 samples stopped them and saved the state at step 2; the resumed run
    went on to step 3 and the other two samples of step 2 were never rendered (the next ones at step 4). Now the
    state says so (samples_cut) and the resume renders prompts 2 and 3 of step 2 first, with the step-2 weights."""
    prompts = ctrl_c_after_the_first_sample(tmp_path, monkeypatch)
    out = tmp_path / "run"
    args = flux_args(tiny_set, out, "--sample_prompts", str(prompts), "--max_train_steps", "3",
                     "--sample_every_n_steps", "2", "--sample_bf16_reference", "false")
    assert train_lora.main(args) == 130
    assert [p.name.split("_")[4] for p in out.glob("tiny_flux_lora_step000002_*.png")] == ["00"]
    monkeypatch.undo()
    capsys.readouterr()
    assert train_lora.main([*args, "--resume", str(out / "tiny_flux_lora-state")]) == 0
    assert "rendering the samples step000002 of step 2 from prompt 2 on" in capsys.readouterr().out
    assert sorted(p.name.split("_")[4] for p in out.glob("tiny_flux_lora_step000002_*.png")) == ["00", "01", "02"]
    assert len(list(out.glob("tiny_flux_lora_final_*.png"))) == 3
