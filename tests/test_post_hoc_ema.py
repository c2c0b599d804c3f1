"""tools/post_hoc_ema.py: a run's saves averaged after training. The oracle: a run that saved every step and kept
an EMA (ema_decay, started at the first save's step) wrote the same average itself, bit for bit."""

import json
import math

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import train_lora
from tests.test_ema import ADAMW
from tests.test_train_lora import flux_args
from tools import post_hoc_ema
from tools.post_hoc_ema import SIGMA_REL_MAX, gamma_of

NAME = "tiny_flux_lora"


@pytest.fixture(scope="module")
def run(tiny_set, tmp_path_factory):
    """4 steps, a save every step, EMA 0.7 from step 1: the saves 1-4 (4: the final) and the run's own EMA."""
    out = tmp_path_factory.mktemp("phema")
    assert train_lora.main(flux_args(tiny_set, out, *ADAMW, "--max_train_steps", "4", "--save_every_n_steps", "1",
                                     "--ema_decay", "0.7", "--ema_start_step", "1")) == 0
    return out


def saves(out) -> list[str]:
    return [str(out / f"{NAME}-step{s:06d}.safetensors") for s in (1, 2, 3)] + [str(out / f"{NAME}.safetensors")]


def test_decay_per_step_over_every_steps_save_is_the_runs_own_ema_bit_for_bit(run, tmp_path, capsys):
    """Given out of order, with the run's EMA saves among them (left out) and the step-3 save twice over."""
    ema_files = sorted(str(p) for p in run.glob("*_ema.safetensors"))
    given = [saves(run)[3], saves(run)[1], *ema_files, saves(run)[0], saves(run)[2]]
    out = tmp_path / "phema.safetensors"
    assert post_hoc_ema.main([*given, "--save_to", str(out), "--decay_per_step", "0.7"]) == 0
    ours, theirs = load_file(str(out)), load_file(str(run / f"{NAME}_ema.safetensors"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    raw = load_file(saves(run)[3])
    assert max((ours[k] - raw[k]).abs().max().item() for k in ours) > 1e-4  # not the last save
    printed = capsys.readouterr().out
    assert printed.count("an EMA save") == len(ema_files) and "4 saves ->" in printed
    with safe_open(str(out), "pt") as f:
        meta = f.metadata()
    assert meta["ss_output_name"] == "phema" and meta["ss_steps"] == "4"
    record = json.loads(meta["ss_post_hoc_ema"])
    assert [s["step"] for s in record["saves"]] == [1, 2, 3, 4] and record["decay_per_step"] == 0.7


def test_beta_and_sigma_rel_weigh_the_saves_as_written(run, tmp_path):
    """--beta 0.5 --beta_end 0.9 over 4 saves: decays 0.5, 0.7, 0.9 (musubi-tuner's schedule); --sigma_rel: EDM2's
    power-function decays (s_(i-1) / s_i) ** (gamma + 1); alpha kept as saved."""
    w = [load_file(p) for p in saves(run)]
    key = next(k for k in w[0] if k.endswith("lora_down.weight"))
    gamma = gamma_of(0.1)
    for flags, b in ((["--beta", "0.5", "--beta_end", "0.9"], [0.5, 0.7, 0.9]),
                     (["--sigma_rel", "0.1"], [(s / (s + 1)) ** (gamma + 1) for s in (1, 2, 3)])):
        out = tmp_path / "x.safetensors"
        assert post_hoc_ema.main([*saves(run), "--save_to", str(out), *flags]) == 0
        expected = w[0][key].double()
        for wi, bi in zip(w[1:], b):
            expected = bi * expected + (1 - bi) * wi[key].double()
        got = load_file(str(out))
        torch.testing.assert_close(got[key].double(), expected, rtol=1e-6, atol=1e-9)
        alpha = next(k for k in got if k.endswith(".alpha"))
        assert torch.equal(got[alpha], w[3][alpha])


def test_gamma_of_sigma_rel_is_edm2s_relation():
    for sigma_rel in (0.05, 0.1, 0.2, 0.28):
        g = gamma_of(sigma_rel)
        assert math.isclose(((g + 1) / ((g + 2) ** 2 * (g + 3))) ** 0.5, sigma_rel, rel_tol=1e-9)
    assert (round(gamma_of(0.05), 2), round(gamma_of(0.10), 2)) == (16.97, 6.94)  # the figures EDM2 quotes


@pytest.mark.parametrize("flags, message", [
    (["--sigma_rel", str(SIGMA_REL_MAX)], "expected 0 < r < 0.2887"),
    (["--decay_per_step", "1"], "expected 0 <= d < 1"),
    (["--beta_end", "0.9"], "--beta_end goes with --beta"),
    (["--beta2", "0.9"], "--beta2 -> --beta_end"),
])
def test_bad_flags_are_one_line(run, tmp_path, capsys, flags, message):
    out = tmp_path / "x.safetensors"
    assert post_hoc_ema.main([*saves(run), "--save_to", str(out), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and message in err and err.count("\n") == 1 and not out.exists()


def test_saves_of_two_runs_are_refused(run, tmp_path, capsys):
    """Another run's save (another rank, or another step-2 save): one line, nothing written."""
    tensors = load_file(saves(run)[1])
    with safe_open(saves(run)[1], "pt") as f:
        meta = f.metadata()
    other = tmp_path / "other.safetensors"
    save_file({k: v + 1 for k, v in tensors.items()}, str(other), meta)
    out = tmp_path / "x.safetensors"
    assert post_hoc_ema.main([*saves(run), str(other), "--save_to", str(out)]) == 2
    assert "two different saves of step 2" in capsys.readouterr().err and not out.exists()
    key = next(k for k in tensors if k.endswith("lora_down.weight"))
    save_file({**tensors, key: tensors[key][:2]}, str(other), {**meta, "ss_steps": "9"})
    assert post_hoc_ema.main([*saves(run), str(other), "--save_to", str(out)]) == 2
    assert f"'{key}' has shape" in capsys.readouterr().err and not out.exists()
    final = load_file(saves(run)[3])  # the output must be none of the saves
    assert post_hoc_ema.main([*saves(run), "--save_to", saves(run)[3]]) == 2
    assert "is one of the inputs" in capsys.readouterr().err
    assert all(torch.equal(v, load_file(saves(run)[3])[k]) for k, v in final.items())


def test_peft_adapter_folders_give_a_folder(tmp_path):
    """An LLM run's saves are PEFT folders: the average is one too, with the last save's adapter_config.json."""
    for step, value in ((10, 1.0), (20, 3.0)):
        folder = tmp_path / f"lora-step{step:06d}"
        folder.mkdir()
        (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 2,
                                                                "target_modules": ["q_proj"]}))
        save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.full((2, 4), value)},
                  str(folder / "adapter_model.safetensors"), {"ss_steps": str(step)})
    out = tmp_path / "avg"
    assert post_hoc_ema.main([str(tmp_path / "lora-step000020"), str(tmp_path / "lora-step000010"), "--save_to",
                              str(out), "--decay_per_step", "0.9"]) == 0
    got = load_file(str(out / "adapter_model.safetensors"))
    torch.testing.assert_close(next(iter(got.values())), torch.full((2, 4), 0.9 ** 10 + (1 - 0.9 ** 10) * 3.0))
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 2
    saves = [str(tmp_path / "lora-step000010"), str(tmp_path / "lora-step000020")]
    assert post_hoc_ema.main([*saves, "--save_to", str(tmp_path / "avg.safetensors")]) == 2  # a folder's average is one
    mine = tmp_path / "mine"  # a folder of the user's: the average would have replaced it whole
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    for target in (mine, tmp_path):  # (tmp_path holds the saves)
        assert post_hoc_ema.main([*saves, "--save_to", str(target)]) == 2
    assert (mine / "notes.txt").read_text() == "keep" and (tmp_path / "lora-step000010").is_dir()


def test_the_saves_alpha_headers_stay_with_the_average(tmp_path):
    """The header is the last save's: a diffusers-layout file's adapter config (its lora_alpha) and the PEFT fold
    mark describe the average as well. Old: both were dropped as for a tool that rewrites the layout, so diffusers
    loaded the average at alpha = rank (another strength than the saves')."""
    from networks.lora_files import ADAPTER_METADATA_KEY, FOLDED_MARK

    header = {ADAPTER_METADATA_KEY: json.dumps({"r": 2, "lora_alpha": 1}), FOLDED_MARK: "false"}
    paths = []
    for step, value in ((1, 1.0), (2, 3.0)):
        paths.append(str(tmp_path / f"lora-step{step:06d}.safetensors"))
        tensors = {"transformer.x.lora_A.weight": torch.full((2, 4), value),
                   "transformer.x.lora_B.weight": torch.full((4, 2), value)}
        save_file(tensors, paths[-1], {**header, "ss_steps": str(step)})
    out = tmp_path / "avg.safetensors"
    assert post_hoc_ema.main([*paths, "--save_to", str(out), "--decay_per_step", "0.5"]) == 0
    with safe_open(str(out), "pt") as f:
        meta = f.metadata()
    assert {k: meta.get(k) for k in header} == header and "sshs_model_hash" in meta
