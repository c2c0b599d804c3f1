"""Validation loss and EMA on the tiny FLUX / Qwen-Image: val_loss falls while training, is the
same number on a second run and across a resume, never trains on the held-out images, reaches the
CSV, TensorBoard and the plot."""

import csv
import os

import pytest
import torch

import train_lora
from library.data.dataset import ImageDataset
from library.data.image_folders import scan_images, split_validation
from library.data.dataset_config import load_dataset_config
from tests.test_train_lora import flux_args

ADAMW = ["--optimizer_type", "AdamW", "--optimizer_args", "--learning_rate", "3e-3", "--sample_prompts", ""]


def dataset_toml(tiny_set, folder, **keys) -> str:
    """The tiny set (8 images, 2 buckets) with extra [general] keys."""
    image_dir = load_dataset_config(tiny_set["dataset_config"]).datasets[0].subsets[0].image_dir
    extra = "".join(f"{k} = {v}\n" for k, v in keys.items())
    path = os.path.join(folder, "ds.toml")
    os.makedirs(folder, exist_ok=True)
    with open(path, "w") as f:
        f.write(f'[general]\nresolution = 64\nbatch_size = 2\nenable_bucket = true\nmin_bucket_reso = 32\n'
                f'max_bucket_reso = 128\nbucket_reso_steps = 16\n{extra}[[datasets]]\n[[datasets.subsets]]\n'
                f'image_dir = "{image_dir}"\n')
    return path


def read_log(out, name="tiny_flux_lora") -> list[dict]:
    with open(os.path.join(out, f"{name}_log.csv")) as f:
        return list(csv.DictReader(f))


def val_losses(out, name="tiny_flux_lora") -> dict[int, float]:
    """step -> val_loss, for the steps that validated."""
    return {int(r["step"]): float(r["val_loss"]) for r in read_log(out, name) if r["val_loss"]}


def validating_run(tiny_set, out, *extra) -> list[str]:
    ds = dataset_toml(tiny_set, str(out) + "_data", validation_split=0.25)
    return flux_args(tiny_set, out, "--dataset_config", ds, "--validate_every_n_steps", "2", *ADAMW, *extra)


@pytest.fixture(scope="module")
def straight_run(tiny_set, tmp_path_factory):
    """8 steps validating every 2, logged to TensorBoard too."""
    out = tmp_path_factory.mktemp("straight") / "run"
    logs = str(out) + "_tb"
    assert train_lora.main(validating_run(tiny_set, out, "--max_train_steps", "8", "--logging_dir", logs)) == 0
    return out, logs


# ----------------------------------------------------------------------------------------------
# Validation loss


def test_val_loss_falls_on_held_out_images(tiny_set, tmp_path):
    out = tmp_path / "run"
    assert train_lora.main(validating_run(tiny_set, out, "--max_train_steps", "20", "--validate_every_n_steps", "5")) == 0
    val = val_losses(out)
    assert sorted(val) == [5, 10, 15, 20]
    assert val[20] < 0.95 * val[5], val


def test_validate_every_n_epochs_validates_at_those_epochs_ends(tiny_set, tmp_path):
    """sd-scripts' validate_every_n_epochs (its default every epoch, which convert_config writes as 1): val_loss at the
    last step of every second epoch here, and at the run's end; none between."""
    out = tmp_path / "run"
    assert train_lora.main(validating_run(tiny_set, out, "--max_train_steps", "12", "--validate_every_n_steps", "0",
                                          "--validate_every_n_epochs", "2")) == 0
    rows = read_log(out)
    ends = [int(r["step"]) for r, after in zip(rows, rows[1:]) if after["epoch"] != r["epoch"]]
    assert ends == [4, 8], rows  # (the tiny set: 6 images trained, batch 2, two buckets: 4 steps an epoch)
    assert sorted(val_losses(out)) == [8, 12]


def test_val_loss_is_identical_on_a_second_run_and_logged_everywhere(tiny_set, tmp_path, straight_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, logs = straight_run
    rows = read_log(out)
    assert [r["val_loss"] != "" for r in rows] == [False, True] * 4  # empty cells between validations
    again = tmp_path / "again"
    assert train_lora.main(validating_run(tiny_set, again, "--max_train_steps", "8")) == 0
    assert val_losses(again) == val_losses(out)
    events = [os.path.join(d, f) for d, _, fs in os.walk(logs) for f in fs if f.startswith("events.out")]
    acc = EventAccumulator(os.path.dirname(events[0]))
    acc.Reload()
    tb = {e.step: e.value for e in acc.Scalars("val_loss")}
    assert tb == pytest.approx(val_losses(out), rel=1e-6)


def test_val_loss_is_bit_identical_across_a_resume(tiny_set, tmp_path, straight_run):
    out = tmp_path / "resumed"
    assert train_lora.main(validating_run(tiny_set, out, "--max_train_steps", "4", "--save_state", "true")) == 0
    state = out / "tiny_flux_lora-state"
    assert train_lora.main(validating_run(tiny_set, out, "--max_train_steps", "8", "--resume", str(state))) == 0
    assert val_losses(out) == val_losses(straight_run[0])


def test_validation_images_are_never_trained_on(tiny_set, tmp_path, monkeypatch):
    from library.training.diffusion_task import DiffusionTask

    trained, held_out = set(), set()
    real = DiffusionTask.batch_inputs

    def recording(self, batch, step):
        trained.update(batch["image_paths"])
        held_out.update(item.image_path for item in self.validation_set.items)
        return real(self, batch, step)

    monkeypatch.setattr(DiffusionTask, "batch_inputs", recording)
    assert train_lora.main(validating_run(tiny_set, tmp_path / "run", "--max_train_steps", "9")) == 0
    assert len(held_out) == 2 and len(trained) == 6 and not trained & held_out  # floor(8 x 0.25) held out


def test_split_depends_on_validation_seed_only(tiny_set, tmp_path):
    def held_out(seed=0, validation_seed=0):
        bp = load_dataset_config(dataset_toml(tiny_set, str(tmp_path), validation_split=0.5, validation_seed=validation_seed))
        train, val = split_validation(scan_images(bp), bp)
        assert {i.image_path for i in ImageDataset(bp, seed=seed).items} == {i.image_path for i in train}
        return sorted(os.path.basename(i.image_path) for i in val)

    assert len(held_out()) == 4
    assert held_out(seed=1) == held_out(seed=2)  # the training seed does not move it
    assert held_out(validation_seed=1) != held_out(validation_seed=0)


def test_validation_datasets_section_is_held_out_whole(tiny_set, tmp_path):
    path = dataset_toml(tiny_set, str(tmp_path))
    image_dir = load_dataset_config(path).datasets[0].subsets[0].image_dir
    with open(path, "a") as f:
        f.write(f'[[validation_datasets]]\nbatch_size = 1\n[[validation_datasets.subsets]]\nimage_dir = "{image_dir}"\n')
    bp = load_dataset_config(path)
    held = scan_images(bp, held_out_sets=True)
    assert len(held) == 8 and {i.dataset_index for i in held} == {1}
    out = tmp_path / "run"
    assert train_lora.main(flux_args(tiny_set, out, "--dataset_config", path, "--max_train_steps", "2", *ADAMW)) == 0
    assert list(val_losses(out)) == [2]  # validate_every_n_steps = 0: at the end only


def test_validation_split_errors_name_the_key(tiny_set, tmp_path):
    with pytest.raises(ValueError, match="'validation_split' must be in \\[0, 1\\)"):
        load_dataset_config(dataset_toml(tiny_set, str(tmp_path), validation_split=1.0))
    bp = load_dataset_config(dataset_toml(tiny_set, str(tmp_path), validation_split=0.1))  # floor(8 x 0.1) = 0
    with pytest.raises(ValueError, match="holds out no image"):
        split_validation(scan_images(bp), bp)
    no_split = flux_args(tiny_set, tmp_path / "run", "--validate_every_n_steps", "2", "--max_train_steps", "2", *ADAMW)
    assert train_lora.main(no_split) == 2


def test_qwen_image_validates(tiny_set, tmp_path):
    out = tmp_path / "qwen"
    code = train_lora.main([
        "--model_type", "qwen_image", "--pretrained_model_name_or_path", tiny_set["qwen_image"],
        "--ae", tiny_set["qwen_image_vae"], "--text_encoder", tiny_set["qwen_image_text_encoder"],
        "--dataset_config", dataset_toml(tiny_set, str(tmp_path), validation_split=0.25), "--output_dir", str(out),
        "--output_name", "qwen", "--max_train_steps", "4", "--validate_every_n_steps", "2", "--mixed_precision", "no",
        "--network_dim", "4", "--optimizer_type", "AdamW", "--learning_rate", "1e-3",
    ])
    assert code == 0
    val = val_losses(out, "qwen")
    assert sorted(val) == [2, 4] and all(v == v and v > 0 for v in val.values())


def test_plot_lr_draws_val_loss(straight_run, tmp_path):
    from library.training.lr_plot import find_logs, plot, read_log as read_csv, summarize

    (path,) = find_logs(str(straight_run[0]))
    log = read_csv(path)
    drawn = plot({"run": log}, str(tmp_path / "plot.png"), log_scale=False, beta=0.9)
    assert drawn["run val_loss"] == list(val_losses(straight_run[0]).values())
    assert any(line.startswith("run: val_loss first") and "4 validations" in line for line in summarize("run", log))
    assert (tmp_path / "plot.png").stat().st_size > 0


def test_val_loss_of_unchanged_weights_is_the_same_number(tiny_set, tmp_path, monkeypatch):
    """Fixed noise (not drawn from the global RNG) and eval mode (LoRA dropout off): validating
    twice in a row gives one number, with a network_dropout that would change it in train mode."""
    from library.training.diffusion_task import DiffusionTask

    pairs = []
    real = DiffusionTask.validation_loss

    def twice(self):
        pairs.append((real(self), real(self)))
        return pairs[-1][0]

    monkeypatch.setattr(DiffusionTask, "validation_loss", twice)
    out = tmp_path / "run"
    assert train_lora.main(validating_run(tiny_set, out, "--max_train_steps", "4", "--network_dropout", "0.5")) == 0
    assert len(pairs) == 2 and all(a == b for a, b in pairs), pairs
    assert pairs[0][0] != pairs[1][0]  # the weights did change between the validations


@pytest.mark.parametrize("key", ["validate_every_n_steps", "validate_every_n_epochs"])
def test_validate_every_n_steps_without_held_out_images_stops_before_caching(tiny_set, tmp_path, monkeypatch, capsys,
                                                                              key):
    """The old line found it after the latents and captions were cached (minutes on a real set)."""
    from library.training.diffusion_task import DiffusionTask

    def no_caching(self):
        raise AssertionError("cached before the refusal")

    monkeypatch.setattr(DiffusionTask, "_fill_caches", no_caching)
    assert train_lora.main(flux_args(tiny_set, tmp_path / "out", f"--{key}", "2")) == 2
    assert f"{key} is set but no image is held out" in capsys.readouterr().err


def test_an_output_dir_that_is_an_image_dir_stops_before_caching(tiny_set, tmp_path, monkeypatch, capsys):
    """Old: the run wrote its samples and loss plot into the image folder, and the next run trained on them (with
    class_tokens, without a word) or stopped on them (no caption file)."""
    from library.training.diffusion_task import DiffusionTask
    from tests.test_reliability import copy_dataset

    def no_caching(self):
        raise AssertionError("cached before the refusal")

    monkeypatch.setattr(DiffusionTask, "_fill_caches", no_caching)
    toml = copy_dataset(tiny_set, tmp_path / "data")
    args = flux_args(tiny_set, tmp_path / "unused", "--dataset_config", toml,
                     "--output_dir", str(tmp_path / "data" / "images" / "."))
    assert train_lora.main(args) == 2
    assert f"image_dir '{tmp_path / 'data' / 'images'}' is the output_dir" in capsys.readouterr().err


def test_prior_loss_weight_without_regularization_images_stops_before_caching(tiny_set, tmp_path, monkeypatch, capsys):
    """Old: prior_loss_weight = 0.05 on a dataset without is_reg subsets trained exactly the run without it,
    exit 0 and no word (it only weights regularization images)."""
    from library.training.diffusion_task import DiffusionTask

    def no_caching(self):
        raise AssertionError("cached before the refusal")

    monkeypatch.setattr(DiffusionTask, "_fill_caches", no_caching)
    assert train_lora.main(flux_args(tiny_set, tmp_path / "out", "--prior_loss_weight", "0.05")) == 2
    # where it was set: the command line, not the config file beside it (old)
    assert (f"error: command line and {tiny_set['dataset_config']}: key 'prior_loss_weight' = 0.05 does nothing: no "
            f"subset has is_reg = true") in capsys.readouterr().err


@pytest.mark.parametrize("extra, message", [
    (["--network_args", "bogus=3"], "network_args: unknown key 'bogus' for family 'flux'"),
    (["--network_module", "lycoris.kohya", "--network_args", "algo=bogus"], "network_args 'algo': 'bogus' is not a LyCORIS algo"),
])
def test_bad_network_args_stop_before_caching(tiny_set, tmp_path, monkeypatch, capsys, extra, message):
    """The old line built the network after the caches: minutes on a real set before the one line. The line names
    where network_args was set: the command line here, not the config file (configs/quickstart.toml) beside it."""
    from library.training.diffusion_task import DiffusionTask

    def no_caching(self):
        raise AssertionError("cached before the refusal")

    monkeypatch.setattr(DiffusionTask, "_fill_caches", no_caching)
    assert train_lora.main(flux_args(tiny_set, tmp_path / "out", *extra)) == 2
    assert f"error: command line: {message}" in capsys.readouterr().err


def test_validation_noise_does_not_move_with_the_datasets_listed_before_it(tmp_path):
    """The noise of a held-out image was seeded by 'dataset:subset:path': a second [[datasets]] or a reg subset
    listed before it gave the same images, at unchanged weights, another val_loss (+1.06% on the tiny FLUX), so
    the runs the number is meant to compare did not compare. Its path in its folder alone seeds it now."""
    from library.data.dataset_config import parse_dataset_config
    from library.training.validation import noise_seed
    from tests.test_dataset import make_image

    for i in range(4):
        make_image(str(tmp_path / "cats" / f"{i}.png"), 32, 32, (40 * i, 90, 90))
        make_image(str(tmp_path / "dogs" / f"{i}.png"), 32, 32, (90, 40 * i, 90))
    cats, dogs = {"image_dir": str(tmp_path / "cats"), "class_tokens": "cat"}, {"image_dir": str(tmp_path / "dogs"), "class_tokens": "dog"}

    def seeds(*datasets, split=0.0, held_out=()):
        blueprint = parse_dataset_config({"general": {"resolution": 32, "validation_split": split},
                                          "datasets": [{"subsets": list(d)} for d in datasets],
                                          "validation_datasets": [{"subsets": [s]} for s in held_out]}, source="d.toml")
        items = split_validation(scan_images(blueprint), blueprint)[1] + scan_images(blueprint, held_out_sets=True)
        val = ImageDataset(blueprint, items=items, validation=True)
        return sorted((os.path.basename(val[i]["image_path"]), noise_seed(val[i]["key"], 0)) for i in range(len(val)))

    held = seeds([cats], held_out=[dogs])
    assert len(held) == 4 and held == seeds([cats], [cats], held_out=[dogs])  # a second training dataset
    split = seeds([cats], split=0.5)
    assert len(split) == 2 and split == seeds([{**dogs, "is_reg": True}, cats], split=0.5)  # a reg subset before it


@pytest.mark.parametrize("grid", [1, 2])  # 2: a mask on the 8-pixel grid of a 16x VAE's latents, area-averaged
def test_val_loss_applies_a_held_out_images_loss_mask_as_training_does(tiny_set, grid):
    """validation_loss called loss_at without the mask the dataset serves (alpha_mask, mask_dir): with the
    left half of every image transparent the training loss halved and val_loss did not move. It is now
    loss_at's masked loss at the image's fixed noise and sigmas, the mask on the latent grid as training puts it."""
    from contextlib import nullcontext
    from types import SimpleNamespace

    import torch.nn.functional as F
    from accelerate.utils import DistributedType

    from library.models.flux1.family import FluxFamily
    from library.training.validation import VALIDATION_SIGMAS, noise_seed, validation_loss

    family = FluxFamily(tiny_set["flux_bfl"])
    model = family.load_transformer(torch.float32)
    torch.manual_seed(0)
    sample = {"key": "0.png", "latents": torch.randn(16, 8, 8),
              "text": {"t5": torch.randn(7, 32), "clip_pooled": torch.randn(32)}}
    mask = torch.ones(1, 8 * grid, 8 * grid)
    mask[:, :, : 4 * grid] = 0.0  # the left half
    accelerator = SimpleNamespace(device=torch.device("cpu"), num_processes=1, process_index=0,
                                  distributed_type=DistributedType.NO, autocast=nullcontext)
    plain = validation_loss(family, model, [sample], 1.0, accelerator)
    masked = validation_loss(family, model, [{**sample, "mask": mask}], 1.0, accelerator)
    on_grid = F.avg_pool2d(mask[None], grid)  # [1, 1, 8, 8]
    by_hand = []
    with torch.no_grad():
        for j, sigma in enumerate(VALIDATION_SIGMAS):
            noise = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(noise_seed("0.png", j)))
            text = {k: v[None] for k, v in sample["text"].items()}
            by_hand.append(family.loss_at(model, sample["latents"][None], text, noise, torch.tensor([sigma]), 1.0,
                                          mask=on_grid).item())
    assert masked != pytest.approx(plain, rel=0.05)
    assert masked == pytest.approx(sum(by_hand) / len(by_hand), rel=1e-6)
