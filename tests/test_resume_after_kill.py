"""A run killed (no handler saving anything) after step 3 and resumed from its step-2 state: save_last_n_saves
prunes the saves written before the resume, a resume into another folder prunes none there, and the log holds
each step once (moved from tests/test_train_lora.py, which was over ~800 lines)."""

import csv
import os

import pytest

import train_lora
from tests.test_train_lora import flux_args


class Killed(Exception):
    """Stands in for SIGKILL: the run ends where it is, with no handler saving anything."""


@pytest.fixture(scope="module")
def killed_and_resumed(tiny_set, tmp_path_factory):
    """A run saving every 2 steps (the newest 1 kept, with its state) killed after step 3, then
    resumed from its step-2 state to the end (step 6). -> (output folder, its files after the kill)."""
    from library.training.diffusion_task import DiffusionTask

    out = tmp_path_factory.mktemp("killed") / "run"
    args = flux_args(tiny_set, out, "--max_train_steps", "6", "--save_every_n_steps", "2", "--save_last_n_saves", "1",
                     "--save_state", "true", "--sample_prompts", "")

    def after_step(self, step, output_dir):
        if step == 3:
            raise Killed

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(DiffusionTask, "after_step", after_step)
        with pytest.raises(Killed):
            train_lora.main(args)
    after_kill = sorted(os.listdir(out))
    assert train_lora.main(args + ["--resume", str(out / "tiny_flux_lora-state")]) == 0
    return out, after_kill


def test_save_last_n_saves_prunes_the_saves_written_before_a_resume(killed_and_resumed):
    out, after_kill = killed_and_resumed
    assert "tiny_flux_lora-step000002.safetensors" in after_kill
    assert sorted(f for f in os.listdir(out) if f.endswith(".safetensors")) == [
        "tiny_flux_lora-step000004.safetensors", "tiny_flux_lora.safetensors"]


def test_a_run_resumed_into_another_folder_prunes_none_of_the_files_there(killed_and_resumed, tiny_set, tmp_path):
    """Old: the state's save steps were looked up in the new output_dir: resumed there with
    save_last_n_saves, another run's <name>-step000004 (a step the state lists) was deleted."""
    out, _ = killed_and_resumed
    other = tmp_path / "other"
    other.mkdir()
    (other / "tiny_flux_lora-step000004.safetensors").write_bytes(b"another run's LoRA")
    args = flux_args(tiny_set, other, "--max_train_steps", "10", "--save_every_n_steps", "2", "--save_last_n_saves", "1",
                     "--sample_prompts", "")
    assert train_lora.main(args + ["--resume", str(out / "tiny_flux_lora-state")]) == 0
    assert (other / "tiny_flux_lora-step000004.safetensors").read_bytes() == b"another run's LoRA"
    assert (other / "tiny_flux_lora-step000008.safetensors").exists()


def test_resume_after_a_kill_logs_each_step_once(killed_and_resumed):
    out, _ = killed_and_resumed
    with open(out / "tiny_flux_lora_log.csv") as f:
        assert [int(row["step"]) for row in csv.DictReader(f)] == [1, 2, 3, 4, 5, 6]
