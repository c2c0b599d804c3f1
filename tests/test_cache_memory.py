"""In-memory caches (cache_latents_to_disk and cache_text_encoder_outputs_to_disk false, the defaults) that
would not fit the memory available: one error from the first batch's size, naming the key that keeps them on
disk, instead of the kernel's out-of-memory kill after minutes of encoding (a FLUX.1 caption is 4 MiB of T5
output: 1000 images with shuffle_caption's 8 variants are 35 GiB)."""

import os

import pytest

from library.data import caches
from tests.test_captions import TextIdEncoder, dataset
from tests.test_dataset import CountingEncoder

TEXT_BYTES = 3 * 2 * 2 + 3  # TextIdEncoder's output per text: a [3, 2] bf16 hidden state and a [3] bool mask
LATENT_BYTES = 3 * 4 * 4 * 2  # CountingEncoder's latents of a 32 x 32 image, bf16


def available(monkeypatch, nbytes: int):
    monkeypatch.setattr(caches, "memory_available", lambda: nbytes)


def test_text_outputs_over_the_memory_available_stop_at_the_first_batch_naming_the_key(tmp_path, monkeypatch):
    ds = dataset(tmp_path, images=8, shuffle_caption=True, caption_variants=4)
    needed = 8 * (1 + 4) * TEXT_BYTES  # each image's caption and its 4 variants
    available(monkeypatch, int(needed / caches.MEMORY_SHARE) - 1)
    enc = TextIdEncoder()
    with pytest.raises(ValueError) as e:
        caches.cache_text(ds.items, enc, "flux", batch_size=8, to_disk=False)
    assert len(enc.calls) == 8  # one batch of the 40 texts
    msg = str(e.value)
    assert "the text encoder outputs of 40 texts (8 images, 32 of them augmented caption_variants)" in msg
    assert msg.endswith("set cache_text_encoder_outputs_to_disk = true to keep them on disk (or set fewer caption_variants)")
    available(monkeypatch, int(needed / caches.MEMORY_SHARE) + 1)
    assert caches.cache_text(ds.items, TextIdEncoder(), "flux", batch_size=8, to_disk=False) == 8


def test_latents_over_the_memory_available_stop_at_the_first_batch_and_files_are_not_held(tmp_path, monkeypatch):
    ds = dataset(tmp_path, images=4)
    needed = 4 * LATENT_BYTES
    available(monkeypatch, int(needed / caches.MEMORY_SHARE) - 1)
    enc = CountingEncoder()
    with pytest.raises(ValueError, match=r"the latents of 4 images would take 0\.0 GiB, over 90% of the 0\.0 GiB of "
                                         r"memory available; set cache_latents_to_disk = true to keep them on disk"):
        caches.cache_latents(ds.items, enc.latents, "vae", batch_size=2, to_disk=False, load_workers=0)
    assert enc.images == 2
    assert caches.cache_latents(ds.items, enc.latents, "vae", batch_size=2, to_disk=True) == 4  # files: no check
    assert caches.cache_text(ds.items, TextIdEncoder(), "te", to_disk=True) == 4
    available(monkeypatch, int(needed / caches.MEMORY_SHARE) + 1)
    assert caches.cache_latents(dataset(tmp_path, images=4).items, enc.latents, "vae", to_disk=False) == 4


def test_each_process_of_a_run_holds_its_own_in_memory_caches(tmp_path, monkeypatch):
    ds = dataset(tmp_path, images=2)
    available(monkeypatch, int(2 * TEXT_BYTES / caches.MEMORY_SHARE) + 1)  # one process's, not two
    assert caches.cache_text(ds.items, TextIdEncoder(), "te", to_disk=False, share=(0, 1)) == 2
    with pytest.raises(ValueError, match="in each of 2 processes"):
        caches.cache_text(dataset(tmp_path, images=2).items, TextIdEncoder(), "te", to_disk=False, share=(1, 2))


def test_the_memory_available_is_read_from_the_kernel():
    assert caches.memory_available() > 2**20  # Linux: /proc/meminfo's MemAvailable


def test_the_trainer_stops_in_one_line_and_exit_2_before_the_model_loads(tiny_set, tmp_path, monkeypatch, capsys):
    """The quickstart with its caches in memory on a machine without room for them: the run ends at the
    latents' first batch (before any text encoder or the transformer loads), one line, status 2."""
    import train_lora
    from library.training.diffusion_task import DiffusionTask
    from tests.test_train_lora import flux_args

    available(monkeypatch, 1024)
    monkeypatch.setattr(DiffusionTask, "_load_base", lambda self: pytest.fail("the transformer loaded"))
    assert train_lora.main(flux_args(tiny_set, tmp_path / "out", "--cache_latents_to_disk", "false",
                                     "--cache_text_encoder_outputs_to_disk", "false")) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: in-memory caches: the latents of ") and line.endswith(
        "set cache_latents_to_disk = true to keep them on disk")


def test_the_planner_says_the_in_memory_caches_the_trainer_then_holds(tiny_set, tmp_path, monkeypatch, capsys):
    """tools/plan_memory.py planned device memory only: caches held in memory (the defaults) were first seen at the
    run's first batch. Its host-memory row now gives what the trainer's check then projects from the encoded
    tensors (caches.check_memory_room: one process's bytes), on a dataset with flip_aug and 2 caption_variants."""
    import toml

    import train_lora
    from library.data.dataset_config import load_dataset_config
    from library.models.flux1.family import FluxFamily
    from library.training.config import load_config
    from library.training.memory_plan import cache_entry_bytes
    from tools import plan_memory

    image_dir = load_dataset_config(tiny_set["dataset_config"]).datasets[0].subsets[0].image_dir
    (tmp_path / "ds.toml").write_text(f'[general]\nresolution = 64\nbatch_size = 2\nenable_bucket = false\n[[datasets]]\n'
                                      f'[[datasets.subsets]]\nimage_dir = "{image_dir}"\nflip_aug = true\n'
                                      f'shuffle_caption = true\ncaption_variants = 2\n')
    config = {"model_type": "flux", "pretrained_model_name_or_path": tiny_set["flux_bfl"], "ae": tiny_set["flux_vae_single"],
              "clip_l": tiny_set["clip_l"], "t5xxl": tiny_set["t5xxl"], "t5xxl_max_token_length": 32,
              "dataset_config": str(tmp_path / "ds.toml"), "output_dir": str(tmp_path / "out"), "mixed_precision": "no",
              "network_dim": 4, "optimizer_type": "AdamW", "learning_rate": 1e-3, "max_train_steps": 1,
              "cache_latents_to_disk": False, "cache_text_encoder_outputs_to_disk": False}
    (tmp_path / "run.toml").write_text(toml.dumps(config))
    run = load_config(["--config_file", str(tmp_path / "run.toml")])
    family = FluxFamily(tiny_set["flux_bfl"], tiny_set["flux_vae_single"], clip_l=tiny_set["clip_l"], t5xxl=tiny_set["t5xxl"])
    plan = caches.plan_in_memory_caches(load_dataset_config(run.dataset_config), *cache_entry_bytes(family, run))

    checked, real = {}, caches.check_memory_room
    monkeypatch.setattr(caches, "check_memory_room", lambda needed, processes, what, key, *a: (
        checked.__setitem__(key, needed), real(needed, processes, what, key, *a)))
    assert train_lora.main(["--config_file", str(tmp_path / "run.toml")]) == 0
    images = len([n for n in os.listdir(image_dir) if n.endswith(".png")])
    assert (plan.images, plan.texts, plan.variants) == (images, 3 * images, 2 * images)
    assert checked == {"cache_latents_to_disk": plan.latent_bytes, "cache_text_encoder_outputs_to_disk": plan.text_bytes}

    available(monkeypatch, plan.latent_bytes + plan.text_bytes)  # not 90% over both
    capsys.readouterr()
    assert plan_memory.main(["--config_file", str(tmp_path / "run.toml"), "--vram", "12"]) == 0
    row = capsys.readouterr().out.strip().splitlines()[-1]
    assert row.startswith(f"Host memory, each process: the in-memory caches of {images} images ({3 * images} texts, "
                          f"{2 * images} of them caption_variants): latents up to 0.00 GiB, text encoder outputs up to "
                          f"0.00 GiB; 0.0 GiB available here: over 90% of it, set cache_latents_to_disk = true or "
                          f"cache_text_encoder_outputs_to_disk = true"), row


def test_a_full_size_caption_and_latent_are_what_the_docs_say():
    """FLUX.1 [dev] at full size, on meta: a caption's cache is T5-XXL's 512 x 4096 and CLIP-L's pooled 768, bf16
    (4 MiB: docs/configuration.md's figure); a latent 16 channels at 1/8 of the side, bf16 (0.5 MiB at 1024 px)."""
    from library.training.memory_plan import cache_entry_bytes, reusing_meta_models
    from tools.plan_memory import PresetFamily, default_args

    family = PresetFamily("flux1-dev", None)
    with reusing_meta_models():
        per_pixel, per_text = cache_entry_bytes(family, default_args(family.name))
    assert (per_pixel * 1024 * 1024, per_text) == (2**19, (512 * 4096 + 768) * 2)


def test_the_heap_caching_freed_goes_back_to_the_kernel_before_the_base_loads(tiny_set, tmp_path, monkeypatch):
    """glibc kept the freed pages of the VAE's and text encoders' tensors under its grown mmap threshold: a Qwen-Image
    VAE's two 512 px encodes left 0.24-0.33 GiB in the process after it was freed (bench/bench_host_trim.py), beside the
    base that loads next. Caching now ends with malloc_trim(0), before the transformer loads."""
    from types import SimpleNamespace

    import train_lora
    from library.training.diffusion_task import DiffusionTask
    from tests.test_train_lora import flux_args

    events, load_base = [], DiffusionTask._load_base
    from library.training import host_memory

    monkeypatch.setattr(host_memory, "ctypes", SimpleNamespace(CDLL=lambda name: SimpleNamespace(
        malloc_trim=lambda pad: events.append((name, pad)))))
    monkeypatch.setattr(DiffusionTask, "_load_base", lambda self: (events.append("load"), load_base(self))[1])
    assert train_lora.main(flux_args(tiny_set, tmp_path / "out", "--max_train_steps", "1")) == 0
    assert events == [("libc.so.6", 0), "load"]
