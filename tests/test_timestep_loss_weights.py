"""timestep_loss_weights: a table of loss weights over sigma, as ai-toolkit weighs each timestep's loss with its
timestep_type "weighted" (its table of 1000, read from the user's checkout) and with train.linear_timesteps /
linear_timesteps2 (its bell curve, restated); the converter carries both (not carried, or silently unweighted,
before)."""

import json
import math
import os
import re

import pytest
import torch
import yaml
from safetensors import safe_open

import train_lora
from library.models import flow_matching as fm
from library.text_files import read_number_list
from library.training.config import ConfigError, load_config
from library.training.peers.ai_toolkit import translate
from library.training.peers.ai_toolkit_train import WEIGHTED_TABLE, bell_weights
from library.training.peers.rules import NOT_CARRIED, RENAMED
from tests.test_convert_config_ai_toolkit import job, verdict
from tests.test_reliability import ROOT, flux_args
from tests.test_timestep_range import FLUX

# a stand-in for ai-toolkit's table (not its numbers): 1000 weights, falling from 1.5 at sigma 1 to 0.5 at 0.001
TABLE = [1.5 - i / 999 for i in range(1000)]


def fake_checkout(root) -> str:
    """An ai-toolkit checkout holding the weighted table where its code keeps it, as a Python list literal."""
    path = root / WEIGHTED_TABLE
    path.parent.mkdir(parents=True)
    path.write_text("# these weights were calculated using ...\n\ndefault_weighing_scheme = [\n"
                    + "".join(f"    {w!r},\n" for w in TABLE) + "]\n")
    return str(path)


@pytest.mark.parametrize("name, text, expected", [
    ("w.json", "[1, 2.5, 3e-1]", [1.0, 2.5, 0.3]),
    ("w.csv", "1,2\n3 4\n", [1.0, 2.0, 3.0, 4.0]),
    ("w.py", "x = 3\nweights = [0.5, 1.5]\n", [0.5, 1.5]),
])
def test_the_table_is_read_from_json_numbers_or_one_python_list(tmp_path, name, text, expected):
    (tmp_path / name).write_text(text)
    assert read_number_list(str(tmp_path / name)) == expected


@pytest.mark.parametrize("name, text, message", [
    ("w.py", "a = [1]\nb = [2]\n", "expected one top-level `name = [numbers]`, found 2"),
    ("w.py", "a = [1, f(2)]\n", "its list holds more than number literals"),
    ("w.json", '{"a": 1}', "expected a list of numbers"),
    ("w.txt", "1 2 x", "neither a JSON list nor numbers"),
    ("w.json", "[1, NaN]", "each finite"),
])
def test_a_bad_table_is_one_line_naming_the_file_before_caching(tmp_path, name, text, message):
    (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError, match=re.escape(f"key 'timestep_loss_weights': {tmp_path / name}: ") + ".*"
                       + re.escape(message)):
        load_config(FLUX + ["--timestep_loss_weights", str(tmp_path / name)])


def test_each_sigma_takes_its_nearest_entry_from_sigma_1_down():
    """Weight i at sigma (N - i) / N, as ai-toolkit indexes its linspace(1000, 1, 1000) timesteps."""
    table = torch.tensor(TABLE)
    grid = (1000 - torch.arange(1000, dtype=torch.float64)) / 1000
    assert torch.equal(fm.table_weights(grid.float(), table), table)
    assert torch.equal(fm.table_weights(torch.tensor([1.0, 0.00049, 0.5004]), table), table[[0, 999, 500]])


def test_the_step_loss_is_weighted_by_its_sigmas_entry(tiny_set, tmp_path):
    """One sample: the loss with the table is the loss without it times the table's weight at its sigma (the same
    draw); with a sample weight the two multiply."""
    from library.models.flux1.family import FluxFamily

    (tmp_path / "w.json").write_text(json.dumps(TABLE))
    family = FluxFamily(tiny_set["flux_bfl"])
    model = family.load_transformer(torch.float32)
    latents, text = torch.randn(1, 16, 8, 16), {"t5": torch.randn(1, 7, 32), "clip_pooled": torch.randn(1, 32)}
    plain = load_config(FLUX + ["--timestep_sampling", "uniform"])
    weighted = load_config(FLUX + ["--timestep_sampling", "uniform",
                                   "--timestep_loss_weights", str(tmp_path / "w.json")])
    losses = {}
    for name, args in (("plain", plain), ("weighted", weighted)):
        losses[name], sigmas = family.training_loss(model, latents, text, args, [torch.Generator().manual_seed(4)],
                                                    sample_weights=torch.tensor([2.0]))
    weight = TABLE[min(999, round(1000 * (1 - sigmas.item())))]
    assert weight != 1.0 and math.isclose(losses["weighted"].item(), weight * losses["plain"].item(), rel_tol=1e-6)


def test_ai_toolkits_weighted_type_is_carried_with_its_checkouts_table(tmp_path, monkeypatch, capsys):
    """timestep_type "weighted" (its UI's default on Qwen-Image, FLUX.1 Kontext, FLUX.2, Z-Image ...): a uniform pick of
    its 1000 timesteps, each loss weighted by its table. With the table found in the checkout above the job (its UI
    writes jobs under it) or AI_TOOLKIT_CHECKOUT: a uniform draw with the table written beside ours; without: not
    carried, naming the variable."""
    from tools import convert_config

    monkeypatch.delenv("AI_TOOLKIT_CHECKOUT", raising=False)
    assert verdict(translate(job(train={"timestep_type": "weighted"}), "run.yaml"), "train.timestep_type")[0] == \
        NOT_CARRIED
    table = fake_checkout(tmp_path / "ai-toolkit")
    job_file = tmp_path / "ai-toolkit" / "output" / "my_lora" / "config.yaml"
    job_file.parent.mkdir(parents=True)
    job_file.write_text(yaml.safe_dump({"job": "extension", "config": {"name": "my_lora", "process": [
        job(train={"timestep_type": "weighted"})["config"]["process"][0]]}}))
    out = tmp_path / "ours.toml"
    assert convert_config.main([str(job_file), "--out", str(out)]) == 0
    report = capsys.readouterr().out
    assert f"its loss weights (its table, {table})" in report
    args = load_config(["--config_file", str(out)])
    assert args.timestep_sampling == "uniform"
    assert args.timestep_loss_weights == str(tmp_path / "ours_timestep_weights.json")
    assert read_number_list(args.timestep_loss_weights) == TABLE
    monkeypatch.setenv("AI_TOOLKIT_CHECKOUT", str(tmp_path / "ai-toolkit"))
    t = translate(job(train={"timestep_type": "weighted"}), "run.yaml")
    assert verdict(t, "train.timestep_type") == (RENAMED, "timestep_sampling = uniform")
    assert json.loads(t.files["timestep_loss_weights"][1]) == TABLE


@pytest.mark.parametrize("key, half", [("linear_timesteps", False), ("linear_timesteps2", True)])
def test_linear_timesteps_weigh_by_its_bell_curve(key, half):
    """train.linear_timesteps: a uniform draw, and its SDTrainer weighs each loss by its scheduler's bell curve
    (do_weighted_timesteps): the converter wrote the uniform draw alone (a silent difference) before. The curve,
    restated in float64 here: exp(-2 ((i - 500) / 1000)^2), less its least, mean 1; linear_timesteps2 flat from 500."""
    y = [math.exp(-2 * ((i - 500) / 1000) ** 2) for i in range(1000)]
    least = min(y)
    expected = [(v - least) * 1000 / sum(v - least for v in y) for v in y]
    if half:
        expected[500:] = [max(expected[500:])] * 500
    ours = bell_weights(half)
    assert max(abs(a - b) for a, b in zip(ours, expected)) < 1e-5
    assert abs(sum(ours) / 1000 - sum(expected) / 1000) < 1e-4 and (half or abs(sum(ours) / 1000 - 1) < 1e-4)
    t = translate(job(train={key: True}), "run.yaml")
    assert t.config["timestep_sampling"] == "uniform" and json.loads(t.files["timestep_loss_weights"][1]) == ours
    assert verdict(t, f"train.{key}")[0] == "dropped" and not t.not_carried  # (its own line said not carried)


def test_a_run_records_the_table(tiny_set, tmp_path):
    (tmp_path / "w.json").write_text(json.dumps(TABLE))
    out = tmp_path / "out"
    assert train_lora.main(flux_args(tiny_set, out, "--timestep_sampling", "uniform", "--timestep_loss_weights",
                                     str(tmp_path / "w.json"))) == 0
    with safe_open(str(out / "tiny_flux_lora.safetensors"), framework="pt") as f:
        fact = json.loads(f.metadata()["ss_timestep_loss_weights"])
    assert fact == {"file": "w.json", "count": 1000, "mean": 1.0}


CHECKOUT = os.environ.get("AI_TOOLKIT_CHECKOUT", os.path.join(ROOT, ".peers", "ai-toolkit"))


@pytest.mark.skipif(not os.path.isfile(os.path.join(CHECKOUT, WEIGHTED_TABLE)), reason="no ai-toolkit checkout "
                    "(.peers/ai-toolkit or AI_TOOLKIT_CHECKOUT)")
def test_its_own_table_reads_as_1000_weights_of_mean_1():
    table = read_number_list(os.path.join(CHECKOUT, WEIGHTED_TABLE))
    assert len(table) == 1000 and abs(sum(table) / 1000 - 1) < 1e-6 and min(table) > 0.4 and max(table) < 1.6
