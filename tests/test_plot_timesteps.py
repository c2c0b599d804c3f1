"""tools/plot_timesteps.py: the sigmas a config trains on, drawn as the trainer draws them (the shipped learned FLUX.1
base's quickstart config, keys over it after --)."""

import os

import pytest
import torch

from library.models import flow_matching as fm
from tools.cli import ROOT
from tools.plot_timesteps import QUANTILES, main

QUICKSTART = os.path.join(ROOT, "configs", "quickstart.toml")


def printed_quantiles(line: str) -> list[float]:
    """The 5% ... 95% values of a size's line."""
    part = line.split("sigma quantiles ")[1].split(";")[0]
    return [float(item.split()[1]) for item in part.split(", ")]


def expected(sigmas: torch.Tensor) -> list[float]:
    q = torch.quantile(sigmas.double(), torch.tensor(QUANTILES, dtype=torch.float64)).tolist()
    return [round(v, 3) for v in q]


def test_the_plot_draws_the_models_own_law_at_each_size(tmp_path, capsys):
    """FLUX.1's own draw (flux_shift: its shift grows with the token count) at 512 and 1024 px, against
    flow_matching's draw from the same seed; the PNG is written."""
    out = tmp_path / "sigmas.png"
    assert main(["--config_file", QUICKSTART, "--resolution", "512,1024", "--draws", "2000", "--out", str(out),
                 "--", "--timestep_sampling", "flux_shift"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for line, tokens in zip(lines, (32 * 32, 64 * 64)):
        ours = fm.sample_sigmas(2000, "flux_shift", generator=torch.Generator().manual_seed(0), image_seq_len=tokens)
        assert printed_quantiles(line) == pytest.approx(expected(ours), abs=1.5e-3), line
    assert printed_quantiles(lines[1])[2] > printed_quantiles(lines[0])[2] + 0.05  # more tokens, more noise
    assert out.stat().st_size > 10_000 and lines[-1] == f"wrote {out}"


@pytest.mark.parametrize("preserve", ["false", "true"])
def test_a_timestep_range_is_drawn_as_the_trainer_keeps_it(tmp_path, capsys, preserve):
    assert main(["--config_file", QUICKSTART, "--draws", "2000", "--out", str(tmp_path / "s.png"), "--",
                 "--timestep_sampling", "sigmoid", "--min_timestep", "300", "--max_timestep", "900",
                 "--preserve_distribution_shape", preserve]) == 0
    line = capsys.readouterr().out.splitlines()[0]
    plain = fm.sample_sigmas(2000, "sigmoid", generator=torch.Generator().manual_seed(0))
    if preserve == "false":  # the law scaled into the range
        assert printed_quantiles(line) == pytest.approx(expected(plain * 0.6 + 0.3), abs=1.5e-3), line
    else:  # cut to it: the in-range share's quantiles
        values = printed_quantiles(line)
        assert 0.3 <= values[0] and values[-1] <= 0.9
        assert values[2] == pytest.approx(expected(plain[(plain >= 0.3) & (plain <= 0.9)])[2], abs=0.02)


def test_stratified_draws_are_the_laws_quantiles(tmp_path, capsys):
    """num_timestep_buckets = --draws: one draw per stratum, so the printed quantiles are the sigmoid law's own,
    sigmoid(the normal's quantile), within a stratum's width (2,000 independent draws miss them by ~3e-3 each)."""
    assert main(["--config_file", QUICKSTART, "--draws", "2000", "--out", str(tmp_path / "s.png"), "--",
                 "--timestep_sampling", "sigmoid", "--num_timestep_buckets", "2000"]) == 0
    law = torch.sigmoid(torch.special.ndtri(torch.tensor(QUANTILES, dtype=torch.float64))).tolist()
    assert printed_quantiles(capsys.readouterr().out.splitlines()[0]) == pytest.approx(law, abs=1.2e-3)


@pytest.mark.parametrize("flags, message", [
    (["--out", "s.txt"], "--out s.txt: expected a .png file name"),
    (["--resolution", "1024,big"], "--resolution 'big': expected a size in pixels"),
    (["--draws", "10"], "--draws 10: expected at least 100"),
    (["--", "--min_timestep", "1000"], "key 'min_timestep' must be 0 to 999"),
])
def test_bad_input_is_one_line_and_no_plot(tmp_path, capsys, monkeypatch, flags, message):
    monkeypatch.chdir(tmp_path)
    assert main(["--config_file", QUICKSTART, *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_the_loss_weight_curve_takes_the_table_too(tmp_path):
    """timestep_loss_weights weighs the loss as weighting_scheme does: the plot's curve is their product (it drew
    weighting_scheme's alone, none at all for a table with weighting_scheme none)."""
    from tools.plot_timesteps import loss_weights

    (tmp_path / "w.json").write_text("[" + ", ".join(str(1 + i / 1000) for i in range(1000)) + "]")
    grid = torch.tensor([0.25, 0.5, 0.75])
    assert loss_weights(grid, "none", None) is None
    weights, label = loss_weights(grid, "none", str(tmp_path / "w.json"))
    assert torch.allclose(weights, torch.tensor([1.75, 1.5, 1.25])) and label == "loss weight (table w.json)"
    weights, label = loss_weights(grid, "sigma_sq", str(tmp_path / "w.json"))
    assert torch.allclose(weights, grid ** 2 * torch.tensor([1.75, 1.5, 1.25]))
    assert label == "loss weight (sigma_sq x table w.json)"
