"""train_lora.py with model_type = "llm": a LoRA on the tiny Qwen2-style LM, and pretraining from
a config.json alone whose saved folder loads in transformers; plus tools/generate.py."""

import csv
import json
import os
import re
import shutil

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

import train_lora
from tools import convert_lora, generate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def llm_args(tiny_set, out, *extra):
    return ["--model_type", "llm", "--train_data", tiny_set["corpus"], "--output_dir", str(out),
            "--mixed_precision", "no", "--max_length", "32", "--stride", "32", "--batch_size", "8",
            "--eval_every_n_steps", "10", "--sample_max_new_tokens", "8", *extra]


def column(path, name):
    with open(path) as f:
        return [float(r[name]) for r in csv.DictReader(f)]


def test_llm_lora_trains_only_lora_and_loss_falls(tiny_set, tmp_path):
    out = tmp_path / "lora"
    code = train_lora.main(llm_args(tiny_set, out, "--pretrained_model_name_or_path", tiny_set["llm"],
                                    "--output_name", "lm", "--max_train_steps", "30", "--optimizer_type", "AdamW",
                                    "--learning_rate", "1e-2", "--network_dim", "8", "--save_format", "peft+kohya",
                                    "--save_every_n_steps", "10", "--save_last_n_saves", "1"))
    assert code == 0
    losses = column(out / "lm_log.csv", "loss")
    # The tiny base is random and frozen, so a rank-8 LoRA moves the loss by a few hundredths of a
    # nat in 30 steps (6.11 -> 6.06 measured); the bar sits below that and well above noise.
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.03
    keys = load_file(out / "lm.safetensors")
    assert keys and all(k.startswith("lora_te_model_layers_") for k in keys)
    peft_keys = load_file(out / "lm" / "adapter_model.safetensors")
    assert len(peft_keys) == 2 * len(keys) / 3 and all(k.startswith("base_model.model.model.layers.") for k in peft_keys)
    config = json.loads((out / "lm" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (8, 16, tiny_set["llm"])
    # keep-last-1 pruned the step-10 folder and file, kept step 20's
    assert sorted(os.listdir(out)).count("lm-step000020") == 1 and not (out / "lm-step000010").exists()
    assert not (out / "lm-step000010.safetensors").exists() and (out / "lm-step000020.safetensors").exists()
    assert column(out / "lm_eval.csv", "val_loss")[-1] < column(out / "lm_eval.csv", "val_loss")[0]
    # network_weights reads the folder: the same LoRA as the kohya file
    from library.models.llm import load_llm
    from networks.lora import LoRANetwork

    model = load_llm(tiny_set["llm"])
    a, b = (LoRANetwork.from_weights(model, "llm", str(p)).lora_weights() for p in (out / "lm", out / "lm.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k].up, b[k].up) and a[k].alpha == b[k].alpha for k in a)


@pytest.mark.parametrize("relative", [True, False])
def test_a_base_given_as_its_safetensors_file_gives_peft_its_folder(tiny_set, tmp_path, monkeypatch, relative):
    """base_model_name_or_path is what AutoPeftModelForCausalLM.from_pretrained(adapter) hands to
    AutoModelForCausalLM.from_pretrained: the model's folder, absolute. A base given as its .safetensors file wrote
    the file ("llm/model.safetensors"), which transformers reads as a malformed hub repo id (OSError); then the
    folder's basename ("llm") or the relative path as given, which loaded only from the folder above the base."""
    from peft import AutoPeftModelForCausalLM

    folder = tiny_set["llm"]
    if relative:
        monkeypatch.chdir(os.path.dirname(folder))
    base = os.path.join(os.path.basename(folder) if relative else folder, "model.safetensors")
    out = tmp_path / "lora"
    assert train_lora.main(llm_args(tiny_set, out, "--pretrained_model_name_or_path", base, "--output_name", "lm",
                                    "--max_train_steps", "1", "--network_dim", "4", "--eval_every_n_steps", "0")) == 0
    config = json.loads((out / "lm" / "adapter_config.json").read_text())
    written = config["base_model_name_or_path"]
    assert os.path.isabs(written) and os.path.samefile(written, folder)
    monkeypatch.chdir(tmp_path)  # another working directory: the adapter still finds its base
    assert AutoPeftModelForCausalLM.from_pretrained(str(out / "lm")).peft_config["default"].r == 4


@pytest.mark.parametrize("dropout", [("--network_dropout", "0.1"), ("--network_args", "dropout=0.1")])
def test_the_peft_adapter_config_says_the_lora_dropout_it_trained_with(tiny_set, tmp_path, dropout):
    """network_dropout (sd-scripts' key, network_args' `dropout` alike) is the LoRA's dropout in training:
    adapter_config.json said lora_dropout 0.0 whatever the run trained with."""
    out = tmp_path / "lora"
    assert train_lora.main(llm_args(tiny_set, out, "--pretrained_model_name_or_path", tiny_set["llm"], "--output_name",
                                    "lm", "--max_train_steps", "1", "--network_dim", "4", "--eval_every_n_steps", "0",
                                    *dropout)) == 0
    assert json.loads((out / "lm" / "adapter_config.json").read_text())["lora_dropout"] == 0.1


def test_a_held_out_split_shorter_than_a_window_is_counted_as_the_window_its_val_loss_is_over(tiny_set, tmp_path,
                                                                                             capsys):
    """held_out_loss scores the whole held-out split, its last window the shorter rest; the count said only the full
    windows, so a split of fewer than max_length + 1 tokens printed (and wrote in ss_datasets) "0 val windows"
    beside a val loss. Both say the windows scored now, with the tokens held out."""
    from safetensors import safe_open

    words = "the quick brown fox jumps over the lazy dog".split()
    (tmp_path / "short.txt").write_text(" ".join(words[i % len(words)] for i in range(240)))
    out = tmp_path / "lora"
    argv = llm_args(tiny_set, out, "--pretrained_model_name_or_path", tiny_set["llm"], "--output_name", "lm",
                    "--max_train_steps", "2", "--eval_every_n_steps", "2", "--network_dim", "4")
    argv[argv.index("--train_data") + 1] = str(tmp_path / "short.txt")
    assert train_lora.main(argv) == 0
    printed = capsys.readouterr().out
    said = re.search(r"(\d+) val windows \((\d+) tokens held out\)", printed)
    assert said and said[1] == "1" and 1 < int(said[2]) < 32 + 1, printed
    assert len(column(out / "lm_eval.csv", "val_loss")) == 2
    with safe_open(out / "lm" / "adapter_model.safetensors", "pt") as f:
        assert json.loads(f.metadata()["ss_datasets"])["val_windows"] == 1


def test_an_llm_loras_header_has_no_diffusion_guidance_scale(tiny_set, tmp_path):
    """guidance_scale is a diffusion key (an LLM run refuses it): its default 1.0 was written into every LLM
    LoRA's header as ss_guidance_scale. The diffusion task's facts carry it now; the LLM task's do not."""
    from safetensors import safe_open

    from library.training.saves import lora_metadata

    out = tmp_path / "lora"
    assert train_lora.main(llm_args(tiny_set, out, "--pretrained_model_name_or_path", tiny_set["llm"], "--output_name",
                                    "lm", "--max_train_steps", "1", "--network_dim", "4",
                                    "--eval_every_n_steps", "0")) == 0
    with safe_open(out / "lm" / "adapter_model.safetensors", "pt") as f:
        header = f.metadata()
    assert "ss_guidance_scale" not in header and header["ss_seed"] == "42"
    args = train_lora.load_config(llm_args(tiny_set, out, "--pretrained_model_name_or_path", tiny_set["llm"]))
    facts = {"base_model_version": "x", "base_precision": "bf16", "resolution": "64x64", "batch_size": 1,
             "timestep_sampling": "shift", "dataset": [], "guidance": 3.5}
    task = type("Task", (), {"metadata": lambda self: facts, "batches_per_epoch": lambda self: 1})()
    assert lora_metadata(args, task, 1, 1, 1, 1, 0.0)["ss_guidance_scale"] == "3.5"


@pytest.mark.parametrize("extra, message", [
    (("--pretrain",), "save_format 'peft' is for LLM LoRAs (model_type llm without pretrain)"),
    (("--network_module", "lycoris.kohya"), "save_format 'peft' needs network_module networks.lora"),
])
def test_save_format_peft_where_it_cannot_apply_is_a_config_error(tiny_set, tmp_path, capsys, extra, message):
    code = train_lora.main(llm_args(tiny_set, tmp_path, "--pretrained_model_name_or_path", tiny_set["llm"],
                                    "--save_format", "peft", *extra))
    assert code == 2 and message in capsys.readouterr().err


def test_the_output_check_refuses_a_file_where_a_peft_folder_goes_only_when_one_is_written(tiny_set, tmp_path):
    """save_format auto writes a PEFT folder for an LLM's LoRA and the kohya file for a LyCORIS one
    (config.lora_formats, which the task's save reads too). The output check guessed 'auto + llm =
    PEFT' and refused a LyCORIS run over a file named <output_name>, which that run never writes."""
    from library.training.config import ConfigError, load_config, lora_formats

    (tmp_path / "lm").write_text("notes")
    argv = llm_args(tiny_set, tmp_path, "--pretrained_model_name_or_path", tiny_set["llm"], "--output_name", "lm")
    with pytest.raises(ConfigError, match="holds a file 'lm' where the PEFT adapter folder goes"):
        load_config(argv)
    args = load_config([*argv, "--network_module", "lycoris.kohya", "--network_args", "algo=lokr"])
    assert lora_formats(args) == ["kohya"]


def test_the_output_check_covers_the_pretrained_models_folder(tiny_set, tmp_path):
    """Pretraining writes <output_dir>/<output_name>/, which the output check left out: a file named
    <output_name> failed only at the final save, after every step; output_dir + output_name naming
    the base's folder (llm_scratch) wrote model.safetensors into it, and the next run from it started
    from those weights, not from scratch. Both are one line now, before the model loads."""
    from library.training.config import ConfigError, load_config

    (tmp_path / "scratch").write_text("notes")
    pretrain = ("--pretrained_model_name_or_path", tiny_set["llm_scratch"], "--pretrain")
    with pytest.raises(ConfigError, match="holds a file 'scratch' where the pretrained model's folder goes"):
        load_config(llm_args(tiny_set, tmp_path, *pretrain, "--output_name", "scratch"))
    base = os.path.realpath(tiny_set["llm_scratch"])
    with pytest.raises(ConfigError, match="is the base's folder .*: pretraining would write the model over the one"):
        load_config(llm_args(tiny_set, os.path.dirname(base), *pretrain, "--output_name", os.path.basename(base)))
    assert load_config(llm_args(tiny_set, tmp_path, *pretrain, "--output_name", "other")).pretrain


def test_llm_pretraining_from_config_saves_a_folder_transformers_loads(tiny_set, tmp_path):
    from transformers import Qwen2ForCausalLM

    from library.models.llm import load_llm

    out = tmp_path / "pre"
    code = train_lora.main(llm_args(tiny_set, out, "--pretrained_model_name_or_path", tiny_set["llm_scratch"], "--pretrain",
                                    "--output_name", "scratch", "--max_train_steps", "30", "--learning_rate", "1e-2",
                                    "--sample_at_first"))
    assert code == 0
    val = column(out / "scratch_eval.csv", "val_loss")  # start (random init, ~ln 1024 = 6.93) ... final
    # Over the whole held-out split, token-weighted: 6.95 -> 6.57 measured in 30 steps (scaled residual init).
    assert val[0] > 6.5 and val[-1] < val[0] - 0.3, val
    folder = out / "scratch"
    ours = load_llm(str(folder))
    assert ours.config.vocab_size % 64 == 0
    ref = Qwen2ForCausalLM.from_pretrained(folder).eval()
    ids = torch.randint(0, 500, (1, 12))
    with torch.no_grad():
        assert (ours(ids) - ref(ids).logits).abs().max().item() <= 1e-4


def test_max_length_beyond_context_window_is_refused(tiny_set, tmp_path, capsys):
    code = train_lora.main(llm_args(tiny_set, tmp_path, "--pretrained_model_name_or_path", tiny_set["llm_scratch"],
                                    "--pretrain", "--max_length", "4096"))
    assert code == 2
    assert "max_length 4096 is longer than the model's context window (max_position_embeddings = 256)" in capsys.readouterr().err


def test_max_length_beyond_the_context_window_is_refused_before_the_weights_load(tiny_set, tmp_path, capsys, monkeypatch):
    """The old line loaded the base first (Llama-3-8B: 16 GB read, minutes) and then refused max_length."""
    from library.training import llm_task

    def load_llm(*args, **kwargs):
        raise AssertionError("the weights were read")

    monkeypatch.setattr(llm_task, "load_llm", load_llm)
    code = train_lora.main(llm_args(tiny_set, tmp_path, "--pretrained_model_name_or_path", tiny_set["llm"], "--max_length", "4096"))
    assert code == 2
    assert "max_length 4096 is longer than the model's context window (max_position_embeddings = 2048)" in capsys.readouterr().err


def peft_folder(base: str, folder: str, rank_pattern: dict) -> None:
    """A PEFT adapter folder PEFT itself writes on `base`: rank 4, alpha 8, q / v / down_proj, lora_B random."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False,
                        rank_pattern=rank_pattern, task_type="CAUSAL_LM")
    get_peft_model(AutoModelForCausalLM.from_pretrained(base), config).save_pretrained(folder)


def test_network_weights_of_other_ranks_is_refused_before_tokenizing_and_the_networks_ranks_train(tiny_set, tmp_path,
                                                                                                 capsys, monkeypatch):
    """network_weights keeps the network's ranks (as for a diffusion model, and sd-scripts without dim_from_weights).
    A PEFT folder whose rank_pattern puts one down_proj at 2 beside a rank-4 network: the old line tokenized the
    corpus and loaded the model, then refused ("LoRA module 'model.layers.1.mlp.down_proj' has down (2, 64) ...").
    Now one line naming the key, from the folder and the config alone. A rank_pattern the *_dim network_args give
    (every down_proj at 2: mlp_dim=2) trains on and saves back its rank_pattern."""
    from library.training import llm_task

    peft_folder(tiny_set["llm"], str(tmp_path / "one"), {"layers.1.mlp.down_proj": 2})
    peft_folder(tiny_set["llm"], str(tmp_path / "mlp"), {"down_proj": 2})
    run = ["--pretrained_model_name_or_path", tiny_set["llm"], "--output_name", "lm", "--max_train_steps", "1",
           "--network_dim", "4", "--network_alpha", "8"]
    with monkeypatch.context() as patched:
        for name in ("tokenize_corpus", "load_llm"):
            patched.setattr(llm_task, name, lambda *a, **k: pytest.fail("the corpus was tokenized or the model loaded"))
        code = train_lora.main(llm_args(tiny_set, tmp_path / "out", *run, "--network_weights", str(tmp_path / "one")))
    assert code == 2
    assert (f"error: command line: key 'network_weights': {tmp_path / 'one'}: LoRA module 'model.layers.1.mlp.down_proj' "
            f"has down (2, 64) / up (32, 2), the network expects (4, 64) / (32, 4) (rank 2, not 4: the network keeps the "
            f"ranks network_dim and the *_dim network_args give it; dim_from_weights = true takes the file's)") in capsys.readouterr().err
    assert train_lora.main(llm_args(tiny_set, tmp_path / "out", *run, "--network_weights", str(tmp_path / "mlp"),
                                    "--network_args", "mlp_dim=2")) == 0
    config = json.loads((tmp_path / "out" / "lm" / "adapter_config.json").read_text())
    assert config["r"] == 4 and set(config["rank_pattern"].values()) == {2} and len(config["rank_pattern"]) == 6


def test_a_stride_past_max_length_is_refused_before_tokenizing(tiny_set, tmp_path, capsys, monkeypatch):
    """stride 48 with max_length 32 stepped over the 16 tokens after each window: a third of the text never
    trained on or evaluated, without a word. One line naming the key, before the corpus is read."""
    from library.training import llm_task

    for name in ("tokenize_corpus", "load_llm"):
        monkeypatch.setattr(llm_task, name, lambda *a, **k: pytest.fail("the corpus was tokenized or the model loaded"))
    assert train_lora.main(llm_args(tiny_set, tmp_path / "out", "--pretrained_model_name_or_path", tiny_set["llm"],
                                    "--stride", "48")) == 2
    assert ("error: command line: key 'stride' (48) must be <= max_length (32): each window would skip the 16 tokens "
            "after it, never trained on or evaluated; for longer windows raise max_length") in capsys.readouterr().err
    config = tmp_path / "lm.toml"  # each key named where it was set: stride in the file, max_length on the command line
    config.write_text("stride = 48\n")
    run = llm_args(tiny_set, tmp_path / "out", "--pretrained_model_name_or_path", tiny_set["llm"], "--config_file",
                   str(config))
    del run[run.index("--stride"):run.index("--stride") + 2]  # the file's stride, not llm_args' 32
    assert train_lora.main(run) == 2
    assert f"error: {config} and command line: key 'stride' (48) must be <= max_length (32)" in capsys.readouterr().err


def test_dim_from_weights_continues_a_peft_folder_at_its_rank_pattern(tiny_set, tmp_path):
    """dim_from_weights (sd-scripts' key): the network is the folder's modules (q / v / down_proj, PEFT's
    targets, not our defaults) at the folder's ranks: one down_proj at 2 beside rank 4, refused above without
    the key. network_dim 8 is unused; the saved folder holds the same modules, ranks and alphas."""
    peft_folder(tiny_set["llm"], str(tmp_path / "one"), {"layers.1.mlp.down_proj": 2})
    assert train_lora.main(llm_args(tiny_set, tmp_path / "out", "--pretrained_model_name_or_path", tiny_set["llm"],
                                    "--output_name", "lm", "--max_train_steps", "1", "--network_dim", "8",
                                    "--dim_from_weights", "true", "--network_weights", str(tmp_path / "one"))) == 0
    source = load_file(str(tmp_path / "one" / "adapter_model.safetensors"))
    saved = load_file(str(tmp_path / "out" / "lm" / "adapter_model.safetensors"))
    assert {k: v.shape for k, v in saved.items()} == {k: v.shape for k, v in source.items()}
    config = json.loads((tmp_path / "out" / "lm" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["rank_pattern"] == {"layers.1.mlp.down_proj": 2}
    assert set(config["target_modules"]) == {"q_proj", "v_proj", "down_proj"}


def test_generate_writes_png_with_settings_on_fp8_base_with_lora(tiny_set, tmp_path):
    from library.models.flux1.family import FluxFamily
    from networks.lora import LoRANetwork

    model = FluxFamily(tiny_set["flux_bfl"]).load_transformer(torch.float32)
    network = LoRANetwork(model, "flux", 4, 4.0)
    for name, p in network.named_parameters():
        if "lora_up" in name:
            torch.nn.init.normal_(p, std=0.5)
    lora = tmp_path / "l.safetensors"
    network.save(str(lora))
    common = ["--model_type", "flux", "--model", tiny_set["flux_bfl"], "--ae", tiny_set["flux_vae_single"],
              "--clip_l", tiny_set["clip_l"], "--t5xxl", tiny_set["t5xxl"], "--t5xxl_max_token_length", "32",
              "--prompt", "a red circle --w 64 --h 48 --d 7", "--steps", "4", "--dtype", "fp32", "--base_precision", "fp8_scaled"]
    assert generate.main([*common, "--out", str(tmp_path / "a")]) == 0
    assert generate.main([*common, "--lora", f"{lora}:1.0", "--out", str(tmp_path / "b")]) == 0
    a, b = Image.open(tmp_path / "a" / "000_7.png"), Image.open(tmp_path / "b" / "000_7.png")
    assert a.size == (64, 48) and b.info["loras"] == "l.safetensors:1.0" and b.info["base_precision"] == "fp8_scaled"
    assert a.tobytes() != b.tobytes()  # the LoRA changes the image


def test_generate_bad_lora_ratio_is_one_line(capsys):
    assert generate.main(["--model_type", "flux", "--model", "m", "--ae", "a", "--prompt", "x", "--lora", "f.safetensors:abc"]) == 2
    assert capsys.readouterr().err.strip() == ("error: --lora 'f.safetensors:abc': ratio 'abc' is not a number "
                                               "(expected path[:ratio], e.g. a.safetensors:0.8)")


def test_held_out_loss_is_token_weighted_over_the_whole_split():
    """70 held-out tokens, max_length 16: 4 full windows (64 targets) and a rest of 5 targets, all
    69 scored once; the oracle averages per-window mean losses weighted by their target counts."""
    from types import SimpleNamespace

    from library.models.llm import LLM, LLMConfig, cross_entropy_loss
    from library.training.llm_task import LLMTask

    torch.manual_seed(0)
    model = LLM(LLMConfig(vocab_size=40, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32,
                          qkv_bias=False, max_position_embeddings=32)).eval()
    ids = torch.randint(0, 40, (70,))
    task = SimpleNamespace(val_ids=ids, val_trained=None, val_starts=None, val_packed=None,  # stream windows
                           args=SimpleNamespace(max_length=16, batch_size=3), model=model, device="cpu")
    weighted, count = 0.0, 0
    for s in range(0, 69, 16):
        window = ids[s : s + 17][None]
        with torch.no_grad():
            weighted += cross_entropy_loss(model(window[:, :-1]), window[:, 1:]).item() * (window.shape[1] - 1)
        count += window.shape[1] - 1
    assert count == 69
    assert abs(LLMTask.held_out_loss(task) - weighted / count) <= 1e-5
    task.val_ids = ids[:1]
    assert LLMTask.held_out_loss(task) != LLMTask.held_out_loss(task)  # nan: nothing to score


def scratch_pretraining(tiny_set, out, *extra):
    """The parsed config of a 1-step pretraining run from the tiny scratch config (no eval)."""
    from library.training.config import load_config

    return load_config(llm_args(tiny_set, out, "--pretrained_model_name_or_path", tiny_set["llm_scratch"], "--pretrain",
                                "--max_train_steps", "1", "--eval_every_n_steps", "0", *extra))


def test_bf16_pretraining_keeps_fp32_master_weights_so_no_update_rounds_away(tiny_set, tmp_path, monkeypatch):
    """AdamW's first step moves every weight with a gradient by the full lr, which bf16 still
    resolves; later steps are smaller: the second is counted."""
    trainer = train_lora.Trainer(scratch_pretraining(tiny_set, tmp_path, "--mixed_precision", "bf16",
                                                     "--learning_rate", "6e-4", "--max_train_steps", "2"))
    model, before = trainer.task.model, []
    matrices = lambda: {name: p.detach().clone() for name, p in model.named_parameters() if p.dim() == 2}  # noqa: E731
    step = trainer.optimizer.step
    monkeypatch.setattr(trainer.optimizer, "step", lambda *a, **k: (before.append(matrices()), step(*a, **k))[1])
    assert trainer.run() == 0 and len(before) == 2
    changed = sum(int((p != before[-1][name]).sum()) for name, p in matrices().items())
    # bf16 weights: 878,689 of 917,504 changed in step 2 (the rest rounded away); fp32: all but a few
    assert changed / sum(t.numel() for t in before[-1].values()) > 0.999, changed
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_fp16_pretraining_gradients_are_fp32_so_a_grad_scaler_unscales_them(tiny_set, tmp_path):
    """accelerate applies a GradScaler only off CPU (fp16 on CUDA); here one is applied by hand,
    as on CUDA. fp16 weights fail with 'Attempting to unscale FP16 gradients.'"""
    trainer = train_lora.Trainer(scratch_pretraining(tiny_set, tmp_path, "--mixed_precision", "fp16"))
    task, scaler = trainer.task, torch.amp.GradScaler("cpu")
    loss = trainer.module(*task.batch_inputs(next(task.epoch_batches(0)), 0))
    scaler.scale(loss).backward()
    scaler.unscale_(trainer.optimizer.optimizer)
    assert {p.dtype for p in task.model.parameters()} == {torch.float32}
    assert all(torch.isfinite(p.grad).all() for p in task.model.parameters()) and 6.5 < loss.item() < 7.5


def test_llm_eval_leaves_every_random_generator_as_it_found_it(tiny_set, tmp_path, monkeypatch):
    """CPU, CUDA (faked here: a CPU machine has no CUDA generator), Python and numpy generators are
    the same after an eval as before; an eval that reseeds CUDA repeats dropout masks after each."""
    import random

    import numpy as np

    from library.training.llm_task import LLMTask

    args = scratch_pretraining(tiny_set, tmp_path, "--temperature", "1.0", "--val_fraction", "0.01")
    task = LLMTask(args, train_lora.make_accelerator(args))
    cuda = {"state": torch.tensor([7])}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": cuda["state"].clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device="cuda": cuda.update(state=state.clone()))
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: cuda.update(state=torch.tensor([seed])))
    monkeypatch.setattr(torch.cuda, "manual_seed", lambda seed: cuda.update(state=torch.tensor([seed])))
    states = lambda: (torch.get_rng_state(), cuda["state"].clone(), random.getstate(), np.random.get_state()[1].copy())  # noqa: E731
    before = states()
    first = task.evaluate()
    after = states()
    assert torch.equal(after[0], before[0]) and torch.equal(after[1], before[1]), (before[1], after[1])
    assert after[2] == before[2] and (after[3] == before[3]).all()
    assert task.evaluate()["sample"] == first["sample"]  # the same sample draw at each eval


@pytest.mark.parametrize("extra, scaled", [((), True), (("--scaled_residual_init", "false"), False)])
def test_pretraining_init_scales_residual_projections_by_depth(tiny_set, tmp_path, extra, scaled):
    """GPT-2 / nanoGPT: o_proj and down_proj (what each layer adds to the residual stream) start
    at 0.02 / sqrt(2 * num_layers), every other matrix at 0.02; option off: 0.02 everywhere."""
    from library.training.llm_task import LLMTask

    args = scratch_pretraining(tiny_set, tmp_path, *extra)
    model = LLMTask(args, train_lora.make_accelerator(args)).model
    residual = 0.02 / (2 * model.config.num_layers) ** 0.5 if scaled else 0.02
    for name, p in model.named_parameters():
        if p.dim() == 2:  # 8,192+ samples each: the std is within ~1% of the target
            expected = residual if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
            assert abs(p.std().item() / expected - 1) < 0.05, (name, p.std().item(), expected)


def test_a_new_run_starts_its_own_eval_csv(tiny_set, tmp_path):
    """The old line appended a second run's evals to the first's (its log CSV starts over)."""
    args = llm_args(tiny_set, tmp_path, "--pretrained_model_name_or_path", tiny_set["llm"], "--output_name", "lm",
                    "--max_train_steps", "2", "--eval_every_n_steps", "1", "--sample_max_new_tokens", "1")
    for _ in range(2):
        assert train_lora.main(args) == 0
    with open(tmp_path / "lm_eval.csv") as f:
        assert [row["step"] for row in csv.DictReader(f)] == ["1", "2", "final"]


def test_a_corpus_too_short_for_one_window_names_the_files_and_the_split(tiny_set, tmp_path, capsys):
    """The old line: 'text has 5 tokens, fewer than max_length + 1 = 33', naming neither file nor key. That is the
    stream's windows; best-fit packing (the default) trains it as one padded window (it refused it too)."""
    short = tmp_path / "short.txt"
    short.write_text("two words")
    args = llm_args(tiny_set, tmp_path, "--pretrained_model_name_or_path", tiny_set["llm"], "--train_data", str(short),
                    "--val_fraction", "0", "--max_train_steps", "1", "--eval_every_n_steps", "1",
                    "--sample_max_new_tokens", "1")
    assert train_lora.main([*args, "--packing", "stream"]) == 2
    err = capsys.readouterr().err
    assert f"train_data {short}: " in err and "fewer than max_length + 1 = 33" in err, err
    assert train_lora.main(args) == 0
    assert "1 train windows of whole documents" in capsys.readouterr().out


def test_val_fraction_0_logs_no_val_loss(tiny_set, tmp_path, capsys):
    """The old line printed 'val loss nan, perplexity nan' and wrote nan to both CSV columns."""
    code = train_lora.main(llm_args(tiny_set, tmp_path, "--pretrained_model_name_or_path", tiny_set["llm"], "--output_name",
                                    "lm", "--val_fraction", "0", "--max_train_steps", "1", "--eval_every_n_steps", "1",
                                    "--sample_max_new_tokens", "1"))
    assert code == 0
    with open(tmp_path / "lm_eval.csv") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == ["step", "sample"] and [row["step"] for row in reader] == ["1", "final"]
    out = capsys.readouterr().out
    assert "step 1: no val loss (nothing held out)" in out and "nan" not in out


def test_a_train_data_folder_without_text_is_one_line_naming_it(tiny_set, tmp_path, capsys):
    """The old line: "error: ['<folder>']: no .txt files found" (a list, no key), after loading the model."""
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.md").write_text("markdown is not read")
    args = llm_args(tiny_set, tmp_path, "--pretrained_model_name_or_path", tiny_set["llm"], "--train_data", str(tmp_path / "notes"))
    assert train_lora.main(args) == 2
    assert capsys.readouterr().err == f"error: train_data {tmp_path / 'notes'}: no .txt or .jsonl file in this folder or its subfolders\n"


def test_documents_and_the_prompt_get_the_tokenizers_bos_as_users_encode_them(tiny_set, tmp_path):
    """A Llama-style tokenizer (its post-processor puts BOS first): each document is BOS text EOS and
    the sample prompt starts with BOS, as transformers / PEFT / vLLM encode at inference. The old line
    encoded with add_special_tokens=False: no BOS anywhere in the stream (0 of 2 documents)."""
    task, bos = llama_style_task(tiny_set, tmp_path)
    ids, eos = task.train_set.ids.tolist(), task.tokenizer.eos_token_id
    assert ids[0] == bos and ids.count(bos) == 2 and ids.count(eos) == 2 and ids[ids.index(eos) + 1] == bos
    assert task.encode("The")[0] == bos and task.encode("The")[-1] != eos


def llama_style_task(tiny_set, tmp_path, *extra):
    """(LLMTask on the tiny LM whose tokenizer puts BOS <|im_start|> first, as Llama's does, BOS id)."""
    import shutil

    from library.training.config import load_config
    from library.training.llm_task import LLMTask

    folder = tmp_path / "llama_style"
    shutil.copytree(tiny_set["llm"], folder)
    tok = json.loads((folder / "tokenizer.json").read_text())
    bos = next(t["id"] for t in tok["added_tokens"] if t["content"] == "<|im_start|>")
    tok["post_processor"] = {"type": "TemplateProcessing", "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [bos],
                             "tokens": ["<|im_start|>"]}}, "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}},
                             {"Sequence": {"id": "A", "type_id": 0}}], "pair": [{"Sequence": {"id": "A", "type_id": 0}}]}
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    for name, text in (("a.txt", "one two three " * 20), ("b.txt", "four five six " * 20)):
        (tmp_path / name).write_text(text)
    args = load_config(llm_args(tiny_set, tmp_path / "out", "--pretrained_model_name_or_path", str(folder), "--train_data",
                                str(tmp_path / "a.txt"), str(tmp_path / "b.txt"), "--val_fraction", "0", "--max_length", "8",
                                "--stride", "8", "--max_train_steps", "1", *extra))
    return LLMTask(args, train_lora.make_accelerator(args)), bos


def test_a_sample_is_shown_without_the_bos_token(tiny_set, tmp_path):
    """The old line decoded every id: the sample began '<|im_start|>The' (the prompt's BOS, shown as text)."""
    task, bos = llama_style_task(tiny_set, tmp_path, "--sample_prompt", "one two", "--sample_max_new_tokens", "4")
    sample = task.evaluate()["sample"]
    assert task.encode("one two")[0] == bos
    assert sample.startswith("one two") and "<|im_start|>" not in sample


def test_a_tokenizer_without_eos_warns_that_documents_run_together(tiny_set, tmp_path):
    """The old line joined the documents with nothing between them, without a word."""
    import shutil

    from library.training.config import load_config
    from library.training.llm_task import LLMTask

    shutil.copytree(tiny_set["llm"], tmp_path / "no_eos")
    config = json.loads((tmp_path / "no_eos" / "tokenizer_config.json").read_text())
    (tmp_path / "no_eos" / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "eos_token"}))
    args = load_config(llm_args(tiny_set, tmp_path / "out", "--pretrained_model_name_or_path", str(tmp_path / "no_eos"),
                                "--train_data", tiny_set["corpus"], tiny_set["corpus"], "--max_train_steps", "1"))
    with pytest.warns(UserWarning, match="the tokenizer names no eos_token, so the 2 documents of train_data .* run together"):
        LLMTask(args, train_lora.make_accelerator(args))


def test_a_token_id_beyond_the_models_vocab_is_refused_before_training(tiny_set, tmp_path, capsys):
    """The old line trained until a batch held the token, then died in the embedding ('IndexError: index
    out of range in self'); 30 added tokens put '<|x29|>' at id 480 of the tiny model's 464."""
    import shutil

    from transformers import PreTrainedTokenizerFast

    shutil.copytree(tiny_set["llm"], tmp_path / "added")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tmp_path / "added")
    tokenizer.add_tokens([f"<|x{i}|>" for i in range(30)])
    tokenizer.save_pretrained(tmp_path / "added")
    (tmp_path / "text.txt").write_text("<|x29|> " + open(tiny_set["corpus"]).read())
    args = llm_args(tiny_set, tmp_path, "--pretrained_model_name_or_path", str(tmp_path / "added"), "--train_data",
                    str(tmp_path / "text.txt"), "--max_train_steps", "1", "--eval_every_n_steps", "0")
    assert train_lora.main(args) == 2
    assert ("the tokenizer gives train_data token id 480 ('<|x29|>'), beyond the model's vocab_size 464"
            in capsys.readouterr().err)


def test_an_unset_stride_follows_max_length(tiny_set, tmp_path):
    """The old default stride 256 with max_length 32 read 32 tokens of every 256 (7/8 of the text never
    trained: 519 windows of the tiny corpus instead of 4147); with max_length 1024 each token 4 times."""
    from library.training.config import load_config
    from library.training.llm_task import LLMTask

    argv = llm_args(tiny_set, tmp_path, "--pretrained_model_name_or_path", tiny_set["llm"], "--max_train_steps", "1",
                    "--packing", "stream")  # the stream's windows (best_fit, the default, has no stride)
    del argv[argv.index("--stride") : argv.index("--stride") + 2]
    args = load_config(argv)
    task = LLMTask(args, train_lora.make_accelerator(args))
    tokens = len(task.train_set.ids)
    assert task.train_set.stride == 32 and len(task.train_set) == (tokens - 33) // 32 + 1


def test_a_resumed_llm_run_logs_each_eval_once(tiny_set, tmp_path, monkeypatch):
    """Killed after its step-2 eval, resumed from its step-1 state: the eval CSV had step 2 twice
    (the killed run's and the resumed run's), where the loss CSV drops the killed run's rows."""
    from library.training.llm_task import LLMTask

    class Killed(Exception):
        pass

    evaluate = LLMTask.after_step

    def killed_after_step_3(self, step, output_dir):
        evaluate(self, step, output_dir)
        if step == 2 and not self.args.resume:
            raise Killed

    monkeypatch.setattr(LLMTask, "after_step", killed_after_step_3)
    out = tmp_path / "lm"
    args = llm_args(tiny_set, out, "--pretrained_model_name_or_path", tiny_set["llm"], "--output_name", "lm",
                    "--max_train_steps", "2", "--eval_every_n_steps", "1", "--save_every_n_steps", "1", "--save_state",
                    "true", "--network_dim", "4")
    with pytest.raises(Killed):
        train_lora.main(args)
    assert train_lora.main(args + ["--resume", str(out / "lm-state")]) == 0
    with open(out / "lm_eval.csv") as f:
        assert [row["step"] for row in csv.DictReader(f)] == ["1", "2", "final"]


def test_an_eval_and_a_sample_meeting_at_a_step_are_one_eval(tiny_set, tmp_path):
    """eval_every_n_steps 2 and sample_every_n_steps 1: step 2's eval and its sample (an LLM's sample is an eval)
    each ran the whole held-out split and wrote a row of the same weights ('2' and 'step000002')."""
    out = tmp_path / "lm"
    assert train_lora.main(llm_args(tiny_set, out, "--pretrained_model_name_or_path", tiny_set["llm"], "--output_name",
                                    "lm", "--max_train_steps", "3", "--eval_every_n_steps", "2",
                                    "--sample_every_n_steps", "1", "--network_dim", "4")) == 0
    with open(out / "lm_eval.csv") as f:
        assert [row["step"] for row in csv.DictReader(f)] == ["step000001", "2", "final"]


@pytest.mark.parametrize("pretrain", [False, True])
def test_a_resume_whose_data_does_not_fit_its_state_is_refused_before_the_model_loads(tiny_set, tmp_path, monkeypatch,
                                                                                       pretrain):
    """A state written 3 batches into an epoch of 99 against this run's data (fewer batches): refused by
    check_resumed_fit before the weights are read (a LoRA's base: load_llm) or built (pretraining from a
    config.json: LLM). The old line loaded the model first (minutes for an 8B base), then refused."""
    from library.training import llm_task
    from library.training.config import load_config
    from library.training.state import SavedState

    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded")

    def built(*args, **kwargs):
        if torch.empty(0).device.type == "meta":  # the network check's model on meta: no weights, seconds
            return real_llm(*args, **kwargs)
        raise AssertionError("the model was built")

    real_llm = llm_task.LLM
    monkeypatch.setattr(llm_task, "load_llm", loaded)
    monkeypatch.setattr(llm_task, "LLM", built)
    base = ["--pretrain", "--pretrained_model_name_or_path", tiny_set["llm_scratch"]] if pretrain else \
        ["--pretrained_model_name_or_path", tiny_set["llm"]]
    args = load_config(llm_args(tiny_set, tmp_path, *base, "--max_train_steps", "4"))
    args.resume = str(tmp_path / "lm-state")
    state = SavedState({}, {}, {"step": 3, "epoch": 0, "batches_done": 3, "batches_per_epoch": 99, "scheduler": {}}, {},
                       None)
    with pytest.raises(ValueError, match=r"lm-state: state was written 3 of 99 batches into epoch 0, this run has \d+ "
                                         r"batches per epoch"):
        llm_task.LLMTask(args, train_lora.make_accelerator(args), state)


def test_a_resume_inside_an_epoch_checks_the_files_of_a_train_data_folder(tiny_set, tmp_path):
    """A file of a train_data folder changed since the state was written: refused as when the files are
    listed. The old record was the folder's name and 0 (os.path.getsize of files only), so the rest of
    the epoch trained other windows without a word."""
    from library.training.config import load_config
    from library.training.llm_task import LLMTask
    from library.training.state import SavedState, item_digests

    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_text(open(tiny_set["corpus"], encoding="utf-8").read()[:20_000])
    (data / "b.txt").write_text("the cat sat on the mat")
    args = load_config(llm_args(tiny_set, tmp_path, "--pretrained_model_name_or_path", tiny_set["llm"],
                                "--train_data", str(data), "--max_train_steps", "4"))
    written = LLMTask(args, train_lora.make_accelerator(args))
    progress = {"step": 3, "epoch": 0, "batches_done": 3, "batches_per_epoch": written.batches_per_epoch(),
                "data_items": item_digests(written.data_items()), "scheduler": {}}
    (data / "b.txt").write_text("the cats sat on the mat")
    args.resume = str(tmp_path / "lm-state")
    with pytest.raises(ValueError, match="lm-state: state was written 3 batches into epoch 0; since then 1 of its "
                                         "training files are gone and 1 are new"):
        LLMTask(args, train_lora.make_accelerator(args), SavedState({}, {}, progress, {}, None))


def test_llm_evals_reach_tensorboard_at_their_step(tiny_set, tmp_path):
    """The start and final evals logged their val_loss at step 'start' / 'final': TensorBoard's int(step)
    raised, so an LLM run with logging_dir ended in 'error: invalid literal for int()' after its LoRA
    was saved (exit 2). They log at steps 0 and 2 now; the eval CSV keeps its labels."""
    import glob

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, logs = tmp_path / "lm", tmp_path / "logs"
    args = llm_args(tiny_set, out, "--pretrained_model_name_or_path", tiny_set["llm"], "--output_name", "lm",
                    "--max_train_steps", "2", "--eval_every_n_steps", "2", "--sample_at_first", "true",
                    "--network_dim", "4", "--logging_dir", str(logs))
    assert train_lora.main(args) == 0
    (events,) = glob.glob(str(logs / "*" / "lm" / "events.out.tfevents.*"))
    acc = EventAccumulator(os.path.dirname(events))
    acc.Reload()
    assert [e.step for e in acc.Scalars("val_loss")] == [0, 2, 2]
    with open(out / "lm_eval.csv") as f:
        assert [row["step"] for row in csv.DictReader(f)] == ["start", "2", "final"]


def test_an_llm_lycoris_lokr_trains_and_saves(tiny_set, tmp_path):
    """Old: the LyCORIS network of an LLM was built with no 'unet' (None), which lycoris scans always:
    every LLM run with network_module = lycoris.kohya stopped with an AttributeError as it started."""
    from safetensors import safe_open

    out = tmp_path / "lokr"
    assert train_lora.main(llm_args(tiny_set, out, "--pretrained_model_name_or_path", tiny_set["llm"], "--max_train_steps",
                                    "2", "--network_dim", "4", "--network_module", "lycoris.kohya",
                                    "--network_args", "algo=lokr")) == 0
    with safe_open(str(out / "lora.safetensors"), "pt") as f:
        assert any(k.endswith(".lokr_w1") for k in f.keys())


def test_a_peft_adapter_of_a_vision_language_base_applies_in_peft_and_reads_back(tiny_set, tmp_path):
    """A LoRA trained on a Qwen2.5-VL checkpoint (config.json with vision_config) was saved under
    base_model.model.model.layers.N; transformers 5 builds that class with its language model at
    model.language_model, so PeftModel.from_pretrained loaded none of it (logits moved by 0.0, while
    merge_lora's merge moved them by 0.65) and its bare target_modules added empty LoRAs to the vision
    tower's MLPs. Its modules are named there now, targets by full path; our tools read it back as ours."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from library.models.llm import load_llm
    from networks.lora import LoRANetwork

    base = tmp_path / "vl"
    shutil.copytree(tiny_set["qwen_image_edit_text_encoder"], base)
    for f in os.listdir(tiny_set["qwen_image_tokenizer"]):
        shutil.copy(os.path.join(tiny_set["qwen_image_tokenizer"], f), base / f)
    out = tmp_path / "out"
    # the base as its weights file (load_llm reads config.json beside it): the adapter's names did not nest then
    weights = str(base / "model.safetensors")
    assert train_lora.main(llm_args(tiny_set, out, "--pretrained_model_name_or_path", weights, "--output_name", "vl",
                                    "--max_train_steps", "3", "--optimizer_type", "AdamW", "--learning_rate", "3e-2",
                                    "--eval_every_n_steps", "0", "--save_format", "peft")) == 0
    config = json.loads((out / "vl" / "adapter_config.json").read_text())
    assert all(t.startswith("model.language_model.layers.") for t in config["target_modules"]), config["target_modules"]
    ids = torch.randint(0, 200, (1, 24))
    hf = AutoModelForImageTextToText.from_pretrained(str(base)).eval()
    with torch.no_grad():
        plain = hf(input_ids=ids).logits
        adapted = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(str(base)), str(out / "vl")).eval()
        peft_logits = adapted(input_ids=ids).logits
        model = load_llm(str(base))
        LoRANetwork.from_weights(model, "llm", str(out / "vl")).apply()
        ours = model(ids)
    moved = float((peft_logits - plain).abs().max())
    assert moved > 1e-3 and float((ours - peft_logits).abs().max()) < 1e-4 * max(1.0, moved), moved
    # a kohya file of it converted to PEFT for this base names its modules there too (convert_lora named them
    # model.layers.N: PeftModel found none, logits unmoved)
    LoRANetwork.from_weights(load_llm(str(base)), "llm", str(out / "vl")).save(str(tmp_path / "k.safetensors"))
    assert convert_lora.main([str(tmp_path / "k.safetensors"), str(tmp_path / "p"), "--to", "peft", "--model",
                              str(base)]) == 0
    with torch.no_grad():
        vl = AutoModelForImageTextToText.from_pretrained(str(base))
        converted = PeftModel.from_pretrained(vl, str(tmp_path / "p"))
        assert float((converted.eval()(input_ids=ids).logits - peft_logits).abs().max()) < 1e-5 * max(1.0, moved)


