"""The training config schema, optimizer factory and LR tracking (CSV + plot)."""

import csv
import glob
import importlib
import math
import re
import warnings

import os

import pytest
import torch

from library.io import CheckpointError
from library.training import config, optim, run_length
from library.training.config import ConfigError, load_config, lora_network_args, parse_kv_literals
from tools import plot_lr


def write(tmp_path, text, name="train.toml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


BASE = 'model_type = "llm"\npretrained_model_name_or_path = "m"\ntrain_data = ["a.txt"]\n'


def test_cli_overrides_file_and_groups_are_flattened(tmp_path):
    cfg = write(tmp_path, BASE + "[network]\nnetwork_dim = 8\nnetwork_alpha = 4\n")
    args = load_config(["--config_file", cfg, "--network_dim", "32", "--gradient_checkpointing", "--output_dir", str(tmp_path)])
    assert args.network_dim == 32 and args.network_alpha == 4.0 and args.gradient_checkpointing is True


def test_unknown_key_names_key_and_file(tmp_path):
    cfg = write(tmp_path, BASE + "netwrok_dim = 8\n")
    with pytest.raises(ConfigError, match=r"train\.toml: unknown key 'netwrok_dim'"):
        load_config(["--config_file", cfg])


def test_every_unknown_key_of_a_file_is_named_in_one_line(tmp_path):
    """An sd-scripts config brings several; the old line named one a run, the first to be refused."""
    cfg = write(tmp_path, BASE + "cache_latents = true\n[extra]\nnetwork_train_unet_only = true\nsdpa = true\n")
    with pytest.raises(ConfigError) as raised:
        load_config(["--config_file", cfg])
    assert str(raised.value) == f"{cfg}: unknown keys 'cache_latents', 'network_train_unet_only', 'sdpa'"


def test_a_config_file_without_its_suffix_is_found_with_toml_appended(tmp_path):
    """sd-scripts appends .toml; the old line said 'config file not found'."""
    cfg = write(tmp_path, BASE + f'output_dir = "{tmp_path}"\nnetwork_dim = 8\n')
    args = load_config(["--config_file", cfg[:-len(".toml")]])
    assert args.network_dim == 8 and args.config_file == cfg


def test_none_on_the_command_line_clears_the_files_epochs_and_steps_alone_under_them_are_refused(tmp_path):
    """The file's max_train_epochs overrides max_train_steps: --max_train_steps 1 trained the file's epochs
    without a word, and nothing on the command line could clear them (0 is < 1, 'none' not an int)."""
    cfg = write(tmp_path, BASE + f'output_dir = "{tmp_path}"\nmax_train_epochs = 2\n')
    with pytest.raises(ConfigError) as raised:
        load_config(["--config_file", cfg, "--max_train_steps", "5"])
    assert str(raised.value) == (f"{cfg} and command line: --max_train_steps 5 would be ignored: max_train_epochs = 2 "
                                 f"in {cfg} overrides it; add --max_train_epochs none to train 5 steps")
    args = load_config(["--config_file", cfg, "--max_train_steps", "5", "--max_train_epochs", "none"])
    assert (args.max_train_steps, args.max_train_epochs) == (5, None)
    assert load_config(["--config_file", cfg, "--max_train_steps", "5", "--max_train_epochs", "3"]).max_train_epochs == 3
    with pytest.raises(ConfigError, match="--max_train_steps must be int, got 'none'"):  # its default is a number
        load_config(["--config_file", cfg, "--max_train_steps", "none"])


@pytest.mark.parametrize(
    "line, message",
    [
        ('network_dim = "8"', "key 'network_dim' must be an integer"),
        ('gradient_checkpointing = "True"', "key 'gradient_checkpointing' must be a boolean"),
        ('mixed_precision = "fp64"', "key 'mixed_precision' must be one of"),
    ],
)
def test_wrong_types_are_errors(tmp_path, line, message):
    cfg = write(tmp_path, BASE + line + "\n")
    with pytest.raises(ConfigError, match=message):
        load_config(["--config_file", cfg])


@pytest.mark.parametrize("key, value, problem", [
    ("learning_rate", "-1", "must be > 0"),
    ("network_dim", "0", "must be >= 1"),
    ("max_train_steps", "0", "must be >= 1"),
    ("blocks_to_swap", "-1", "must be >= 0"),
    ("validate_every_n_steps", "-1", "must be >= 0"),
])
def test_a_bad_value_is_blamed_on_where_it_was_set(tmp_path, key, value, problem):
    base = BASE + f'output_dir = "{tmp_path}"\n'
    cfg = write(tmp_path, base, name="base.toml")
    with pytest.raises(ConfigError, match=rf"^command line: key '{key}' {problem}"):
        load_config(["--config_file", cfg, f"--{key}", value])
    cfg = write(tmp_path, base + f"{key} = {value}\n", name="base.toml")
    with pytest.raises(ConfigError, match=rf"base\.toml: key '{key}' {problem}"):
        load_config(["--config_file", cfg])


def test_a_combination_set_in_two_places_names_both(tmp_path):
    cfg = write(tmp_path, BASE + f'output_dir = "{tmp_path}"\npretrain = true\n', name="base.toml")
    with pytest.raises(ConfigError, match=r"base\.toml and command line: 'pretrain' .*'fp8_base'"):
        load_config(["--config_file", cfg, "--fp8_base"])


@pytest.mark.parametrize("value, shown", [("-8", "-8"), ("nan", "nan"), ("-inf", "-inf")])
def test_network_alpha_must_be_positive_or_zero(tmp_path, value, shown):
    cfg = write(tmp_path, BASE + f"[network]\nnetwork_alpha = {value}\n")
    with pytest.raises(ConfigError) as raised:
        load_config(["--config_file", cfg])
    assert f"train.toml: key 'network_alpha' must be > 0 (or 0 for alpha = rank), got {shown}" in str(raised.value)
    assert load_config(["--config_file", cfg, "--network_alpha", "0"]).network_alpha == 0.0  # sd-scripts: alpha = rank


def test_impossible_combination_is_named(tmp_path):
    cfg = write(tmp_path, BASE + "pretrain = true\nfp8_base = true\n")
    with pytest.raises(ConfigError, match="'pretrain'.*fp8"):
        load_config(["--config_file", cfg])


def test_optimizer_args_are_literals_never_evaluated():
    assert parse_kv_literals(["betas=(0.9, 0.99)", "weight_decay=0.01", "decouple=True", "mode=fast"], "optimizer_args", "x") == {
        "betas": (0.9, 0.99),
        "weight_decay": 0.01,
        "decouple": True,
        "mode": "fast",
    }
    with pytest.raises(ConfigError, match="not a Python literal"):
        parse_kv_literals(["x=__import__('os').system('true')"], "optimizer_args", "train.toml")


def test_optimizer_args_true_false_none_in_any_case_are_python_values():
    # 'safeguard_warmup=false' was the string "false", which Prodigy reads as true
    parsed = parse_kv_literals(["safeguard_warmup=false", "decouple=TRUE", "weight_decay=none", "mode=falsy"],
                               "optimizer_args", "x")
    assert parsed == {"safeguard_warmup": False, "decouple": True, "weight_decay": None, "mode": "falsy"}


def test_optimizer_args_inf_and_nan_are_floats(tmp_path):
    """'growth_rate=inf' (Prodigy's own default) stayed the string 'inf': the config check took it and the
    run died at step 1, after caching, with a TypeError."""
    parsed = parse_kv_literals(["growth_rate=inf", "low=-INF", "x=NaN"], "optimizer_args", "x")
    assert parsed["growth_rate"] == math.inf and parsed["low"] == -math.inf and math.isnan(parsed["x"])
    cfg = write(tmp_path, BASE + 'optimizer_type = "Prodigy"\nlearning_rate = 1.0\noptimizer_args = ["d0=1e-4", "growth_rate=inf"]\n')
    assert config.optimizer_kwargs(load_config(["--config_file", cfg, "--output_dir", str(tmp_path)])) == {
        "d0": 1e-4, "growth_rate": math.inf}


def test_optimizer_args_yes_no_on_off_are_booleans_as_network_args_reads_them():
    """'use_bias_correction=no' reached Prodigy as the string 'no', which it read as true."""
    parsed = parse_kv_literals(["use_bias_correction=no", "amsgrad=Off", "maximize=YES", "decouple=on", "mode=fast"],
                               "optimizer_args", "x")
    assert parsed == {"use_bias_correction": False, "amsgrad": False, "maximize": True, "decouple": True, "mode": "fast"}
    assert parse_kv_literals(["dora=no"], "network_args", "x", any_text=True) == {"dora": "no"}  # the network's _as_bool


@pytest.mark.parametrize("args, message", [
    ('optimizer_args = ["betas=0.9"]', "optimizer_args (betas=0.9) do not fit AdamW"),
    ('optimizer_type = "Prodigy"\noptimizer_args = ["d_0=1e-3"]', "optimizer_args (d_0=0.001) do not fit Prodigy"),
    # the constructor's IndexError, and a step's unpacking: a traceback after caching, an error at step 1 (2026-11-27)
    ('optimizer_args = ["betas=(0.9,)"]', "optimizer_args (betas=(0.9,)) do not fit AdamW: tuple index out of range"),
    ('optimizer_args = ["betas=(0.9, 0.99, 0.5)"]', "optimizer_args (betas=(0.9, 0.99, 0.5)) do not fit AdamW: its "
                                                    "first step says: too many values to unpack"),
    # read only by a step with a gradient: the stand-in's was zero, and Prodigy returns early on one (2026-12)
    ('optimizer_type = "Prodigy"\nlearning_rate = 1.0\noptimizer_args = ["growth_rate=\'inf\'"]',
     "optimizer_args (growth_rate='inf') do not fit Prodigy: its first step says: can't multiply sequence"),
])
def test_optimizer_args_the_optimizer_refuses_fail_at_the_config_check(tmp_path, args, message):
    """The old line took them and failed in the Trainer, after caching and loading the models."""
    cfg = write(tmp_path, BASE + args + "\n")
    with pytest.raises(ConfigError, match=r"/train\.toml: " + re.escape(message)):
        load_config(["--config_file", cfg, "--output_dir", str(tmp_path)])


CALLED = []


def record_call(*args, **kwargs):
    CALLED.append((args, kwargs))


def test_the_early_optimizer_check_calls_only_optimizer_classes():
    """A module.Class may name any callable (os.system): the config check builds optimizers only."""
    optim.check_optimizer("tests.test_train_config.record_call", 1e-3, {"command": "x"})
    assert importlib.import_module("tests.test_train_config").CALLED == []  # (the module optimizer_class imported)


def test_polynomial_at_a_learning_rate_not_above_its_lr_end_is_refused_before_caching(tmp_path):
    """diffusers' polynomial decays to a fixed lr_end = 1e-7: its ValueError came after caching and loading."""
    cfg = write(tmp_path, BASE + 'lr_scheduler = "polynomial"\nlearning_rate = 1e-7\n')
    with pytest.raises(ConfigError, match=r'train\.toml: learning_rate = 1e-07 does not fit lr_scheduler = "polynomial": '
                                          r"lr_end \(1e-07\) must be smaller than initial lr"):
        load_config(["--config_file", cfg, "--output_dir", str(tmp_path)])
    assert load_config(["--config_file", cfg, "--output_dir", str(tmp_path), "--learning_rate", "1e-6"]).learning_rate == 1e-6


@pytest.mark.parametrize("name, bnb_name", [("PagedAdamW32bit", "PagedAdamW32bit"), ("Adam8bit", "Adam8bit"),
                                            ("rmsprop8bit", "RMSprop8bit"), ("PagedAdEMAMix8bit", "PagedAdEMAMix8bit")])
def test_any_bitsandbytes_optimizer_class_is_taken(name, bnb_name):
    """The docs promise any bitsandbytes optimizer; only 7 names were taken (sd-scripts' PagedAdamW32bit refused)."""
    bnb = pytest.importorskip("bitsandbytes")
    assert optim.optimizer_class(name) is getattr(bnb.optim, bnb_name)
    with pytest.raises(ConfigError, match="optimizer_type 'GlobalOptimManager' is unknown"):  # in bnb.optim: no optimizer
        optim.optimizer_class("GlobalOptimManager")
    with pytest.raises(ConfigError, match="optimizer_type 'SGD' is unknown"):  # torch.optim's name: not bnb's SGD
        optim.optimizer_class("SGD")


def test_an_adaptive_optimizer_at_adamws_learning_rate_is_warned_before_caching(tmp_path):
    """Prodigy at the default learning_rate = 1e-4 stepped d * 1e-4, 10,000x smaller than meant, without a word.
    The shipped Prodigy configs (learning_rate = 1.0) say nothing."""
    cfg = write(tmp_path, BASE + 'optimizer_type = "Prodigy"\n')
    with pytest.warns(UserWarning, match=r"train\.toml: learning_rate = 0\.0001 with Prodigy, whose step is d \* "
                                         r"learning_rate .*: 10,000x smaller than at the usual learning_rate = 1\.0"):
        load_config(["--config_file", cfg, "--output_dir", str(tmp_path)])
    configs = os.path.join(os.path.dirname(__file__), "..", "configs", "*.toml")
    shipped = [c for c in glob.glob(configs) if 'optimizer_type = "Prodigy"' in open(c).read()]
    assert len(shipped) >= 6
    for argv in [["--config_file", cfg, "--learning_rate", "1.0"]] + [["--config_file", c] for c in shipped]:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            load_config(argv + ["--output_dir", str(tmp_path)])
        assert [str(w.message) for w in said if "learning_rate =" in str(w.message)] == [], argv


def test_a_warmup_of_steps_and_a_fraction_is_refused(tmp_path):
    """lr_warmup_steps = 1.5 warmed up for int(1.5) = 1 step (sd-scripts refuses it)."""
    cfg = write(tmp_path, BASE + 'lr_scheduler = "linear"\nlr_warmup_steps = 1.5\n')
    with pytest.raises(ConfigError, match=r"train\.toml: key 'lr_warmup_steps' must be a whole number of steps .*got 1\.5"):
        load_config(["--config_file", cfg, "--output_dir", str(tmp_path)])
    assert load_config(["--config_file", cfg, "--output_dir", str(tmp_path), "--lr_warmup_steps", "0.5"]).lr_warmup_steps == 0.5
    assert load_config(["--config_file", cfg, "--output_dir", str(tmp_path), "--lr_warmup_steps", "20"]).lr_warmup_steps == 20


def test_network_dropout_and_a_network_args_dropout_are_not_both_taken(tmp_path):
    """The old line kept network_args' dropout = 0.1 and dropped network_dropout = 0.3 without a word."""
    cfg = write(tmp_path, BASE + 'network_dropout = 0.3\nnetwork_args = ["dropout=0.1"]\n')
    with pytest.raises(ConfigError, match=r"train\.toml: network_dropout = 0\.3 and network_args 'dropout=0\.1' set the same"):
        load_config(["--config_file", cfg, "--output_dir", str(tmp_path)])
    args = load_config(["--config_file", cfg, "--output_dir", str(tmp_path), "--network_args"])
    assert lora_network_args(args) == {"dropout": 0.3}


def test_loraplus_with_prodigy_is_refused_before_training(tmp_path):
    """The old line crashed at the first Prodigy step (after caching): 'Setting different lr values in
    different parameter groups is only supported for values of 0'."""
    cfg = write(tmp_path, BASE + 'optimizer_type = "Prodigy"\nlearning_rate = 1.0\nnetwork_args = ["loraplus_lr_ratio=4"]\n')
    with pytest.raises(ConfigError, match=r"train\.toml: network_args 'loraplus_lr_ratio=4' gives the parameter groups "
                                          r"different learning rates, which Prodigy does not take"):
        load_config(["--config_file", cfg, "--output_dir", str(tmp_path)])
    load_config(["--config_file", cfg, "--output_dir", str(tmp_path), "--optimizer_type", "AdamW"])


def test_weight_decay_1d_is_refused_where_no_pretraining_reads_it(tmp_path):
    cfg = write(tmp_path, BASE + "weight_decay_1d = true\n")
    with pytest.raises(ConfigError, match="key 'weight_decay_1d' does nothing with pretrain = false"):
        load_config(["--config_file", cfg, "--output_dir", str(tmp_path)])


def test_network_args_take_sd_scripts_block_ranges_and_bare_regexes(tmp_path):
    """'train_double_block_indices=0-5,10' (sd-scripts' syntax, and our LoRA's) was refused as 'not a
    Python literal' before the network saw it."""
    cfg = write(tmp_path, FLUX + "network_args = ['train_double_block_indices=0-2,5', 'exclude_patterns=.*_mod\\..*']\n")
    args = load_config(["--config_file", cfg, "--output_dir", str(tmp_path)])
    assert lora_network_args(args) == {"train_double_block_indices": "0-2,5", "exclude_patterns": r".*_mod\..*"}
    with pytest.raises(ConfigError, match="not a Python literal"):  # optimizer_args stay literals
        parse_kv_literals(["betas=0.9,0.99x"], "optimizer_args", "x")


@pytest.mark.parametrize("network_arg, message", [
    ("train_double_block_indices=10-", "network_args 'train_double_block_indices': bad range '10-' in '10-'"),
    ("loraplus_lr_ratio=inf", "network_args 'loraplus_lr_ratio': expected a finite number > 0, got inf"),
    ('exclude_patterns=[".*img_mod.*", 1]', "network_args 'exclude_patterns': item 1 is not a regex string"),
])
def test_network_args_the_network_check_refuses_name_the_config(tmp_path, network_arg, message):
    """As train_lora.py gives them to the check before caching; before, block 10 alone was trained, the loss was
    NaN at step 2, and a raw TypeError ended the run."""
    from library.training.diffusion_task import check_network_settings

    cfg = write(tmp_path, FLUX + f"network_args = [{network_arg!r}]\n")
    args = load_config(["--config_file", cfg, "--output_dir", str(tmp_path)])
    with pytest.raises(ConfigError, match=re.escape(f"train.toml: {message}")):
        check_network_settings(args, "flux")


def test_unknown_optimizer_is_an_error():
    p = torch.nn.Parameter(torch.zeros(2, 2))
    with pytest.raises(ConfigError, match="optimizer_type 'Adamm' is unknown"):
        optim.create_optimizer([{"params": [p]}], "Adamm", 1e-3, {})


def test_prodigy_logs_lr_and_d_times_lr_per_group(tmp_path):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(8, 8))
    b = torch.nn.Parameter(torch.randn(8))
    opt = optim.create_optimizer([{"params": [w], "name": "unet"}, {"params": [b], "name": "bias"}], "Prodigy", 1.0, {})
    logger = optim.LRLogger(str(tmp_path / "run_log.csv"))
    for step in range(1, 6):
        opt.zero_grad()
        ((w @ torch.ones(8)) ** 2).sum().add(b.square().sum()).backward()
        opt.step()
        values = logger.log(step, 0, 1.0 / step, opt)
    with open(tmp_path / "run_log.csv") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "epoch", "loss", "lr/unet", "d*lr/unet", "lr/bias", "d*lr/bias"]
    assert len(rows) == 6
    # the effective step of Prodigy is d * lr, and d grows from its 1e-6 start
    assert values["lr/unet"] == 1.0 and values["d*lr/unet"] == pytest.approx(opt.param_groups[0]["d"])
    assert float(rows[-1][4]) > float(rows[1][4]) >= 1e-6


def test_a_resumed_log_takes_the_columns_its_run_adds(tmp_path):
    """Validation added at a resume: its val_loss was dropped from the CSV (the header was the run before's)."""
    opt = optim.create_optimizer([{"params": [torch.nn.Parameter(torch.zeros(2))], "name": "lora"}], "AdamW", 1e-3, {})
    path = str(tmp_path / "run_log.csv")
    first = optim.LRLogger(path)
    for step in (1, 2, 3):
        first.log(step, 0, 0.5, opt)
    resumed = optim.LRLogger(path, append=True, resumed_step=2)  # step 3 was logged after the state's save
    resumed.log(3, 0, 0.4, opt, {"val_loss": 0.25})
    resumed.log(4, 0, 0.3, opt, {"val_loss": None})
    with open(path) as f:
        rows = list(csv.reader(f))
    assert rows == [["step", "epoch", "loss", "lr/lora", "val_loss"], ["1", "0", "0.5", "0.001", ""],
                    ["2", "0", "0.5", "0.001", ""], ["3", "0", "0.4", "0.001", "0.25"], ["4", "0", "0.3", "0.001", ""]]


def test_adamw_logs_no_d_column_and_weight_decay_skips_1d(tmp_path):
    lin = torch.nn.Linear(4, 4)
    decay, no_decay = optim.split_weight_decay(lin.named_parameters())
    assert [p.dim() for p in decay] == [2] and [p.dim() for p in no_decay] == [1]
    opt = optim.create_optimizer([{"params": decay, "name": "lora"}], "AdamW", 1e-3, {})
    assert optim.effective_lrs(opt) == {"lr/lora": 1e-3}


def test_scheduler_warmup_ratio_and_steps():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    sched = optim.create_scheduler(opt, "constant_with_warmup", run_length.warmup_steps(0.1, 100), 100)
    lrs = []
    for _ in range(12):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == 0.0 and lrs[5] == pytest.approx(0.5) and lrs[11] == 1.0


@pytest.mark.parametrize("ratio,steps,warmup", [(0.15, 10, 1), (0.35, 10, 3), (0.999, 10, 9), (0.1, 100, 10)])
def test_a_warmup_ratio_is_rounded_down_as_sd_scripts_does(ratio, steps, warmup):
    """sd-scripts: int(lr_warmup_steps * steps). Old: round(), one warmup step more at .5 and above
    (0.999 of 10 steps was 10, then refused as no shorter than the run)."""
    assert run_length.warmup_steps(ratio, steps) == warmup


def test_plot_lr_overlays_runs_and_summarises(tmp_path):
    for run, scale in (("a", 1.0), ("b", 2.0)):
        (tmp_path / run).mkdir()
        with open(tmp_path / run / "lora_log.csv", "w") as f:
            f.write("step,epoch,loss,lr/unet,d*lr/unet\n")
            for s in range(1, 11):
                f.write(f"{s},0,{1 / s},1.0,{scale * min(s, 5) * 1e-4}\n")
    out = tmp_path / "plot.png"
    lines = plot_lr.main([str(tmp_path / "a"), str(tmp_path / "b" / "lora_log.csv"), "--out", str(out), "--log"])
    assert out.stat().st_size > 10_000
    assert "a/lora: d*lr/unet: peak 0.0005 at step 5, final 0.0005" in lines
    assert "b/lora: d*lr/unet: peak 0.001 at step 5, final 0.001" in lines


def test_plot_lr_draws_a_plain_lr_beside_prodigy_on_the_effective_step_axis_all_log(tmp_path):
    """An AdamW run's 1e-3 schedule beside a Prodigy run went to the base-lr twin axis (a flat line at 0
    under Prodigy's lr 1.0), and --log left that axis linear."""
    from library.training.lr_plot import plot, read_log

    (tmp_path / "adamw_log.csv").write_text("step,epoch,loss,lr/lora\n" + "".join(
        f"{s},0,{1 / s},{1e-3 * s / 4}\n" for s in range(1, 5)))
    (tmp_path / "prodigy_log.csv").write_text("step,epoch,loss,lr/lora,d*lr/lora\n" + "".join(
        f"{s},0,{1 / s},1.0,{2e-4 * s}\n" for s in range(1, 5)))
    runs = {n: read_log(str(tmp_path / f"{n}_log.csv")) for n in ("adamw", "prodigy")}
    drawn = plot(runs, str(tmp_path / "plot.png"), log_scale=True, beta=0.9)
    assert drawn["effective step axis"] == ["adamw lr/lora (its effective step)", "prodigy d*lr/lora"]
    assert drawn["prodigy lr/lora"] == [1.0] * 4  # Prodigy's base lr stays on the twin axis
    assert set(drawn["y scales"].values()) == {"log"}


def test_plot_lr_keeps_two_runs_whose_folders_share_a_name(tmp_path, monkeypatch):
    """x/run and y/run were both 'run/lora': the second replaced the first, one run drawn and summarised."""
    for parent, loss in (("x", 0.5), ("y", 0.25)):
        (tmp_path / parent / "run").mkdir(parents=True)
        (tmp_path / parent / "run" / "lora_log.csv").write_text(f"step,epoch,loss,lr/unet\n1,0,{loss},1e-4\n")
    monkeypatch.chdir(tmp_path)
    lines = plot_lr.main(["x/run", "y/run", "x/run", "--out", "plot.png"])
    assert [line for line in lines if "loss first" in line] == [
        "x/run/lora (1): loss first 0.5000, last 0.5000, steps 1", "y/run/lora: loss first 0.2500, last 0.2500, steps 1",
        "x/run/lora (2): loss first 0.5000, last 0.5000, steps 1"]


def test_plot_lr_draws_every_log_of_a_folder(tmp_path):
    """An output_dir with two output_names' logs drew the first alone (a_log.csv), without a word."""
    for name, loss in (("a", 0.5), ("b", 0.25)):
        (tmp_path / f"{name}_log.csv").write_text(f"step,epoch,loss,lr/unet\n1,0,{loss},1e-4\n")
    lines = plot_lr.main([str(tmp_path), "--out", str(tmp_path / "plot.png")])
    run = tmp_path.name
    assert [line for line in lines if "loss first" in line] == [
        f"{run}/a: loss first 0.5000, last 0.5000, steps 1", f"{run}/b: loss first 0.2500, last 0.2500, steps 1"]


def test_plot_lr_text_in_a_number_column_is_one_line_naming_file_line_and_column(tmp_path, capsys):
    log = tmp_path / "lora_log.csv"
    log.write_text("step,epoch,loss,lr/unet\n1,0,0.5,1e-4\n2,0,abc,1e-4\n")
    with pytest.raises(SystemExit) as raised:
        plot_lr.main([str(log), "--out", str(tmp_path / "plot.png")])
    assert raised.value.code == 2
    assert capsys.readouterr().err.strip() == f"error: {log}: line 3, column 'loss': 'abc' is not a number"
    assert not (tmp_path / "plot.png").exists()


@pytest.mark.parametrize("out, message", [
    ("lora_log.csv", "--out {log}: expected a .png file name (the plot is written as a PNG)"),  # was overwritten by the PNG
    ("folder", "--out {tmp}/folder: expected a .png file name (the plot is written as a PNG)"),  # was 'Is a directory: .folder.x.tmp'
    ("link.png", "--out {tmp}/link.png: is one of the logs read; write the plot elsewhere"),  # a PNG name linked to the log
    (None, "{tmp}/latin1_log.csv: training log is not valid UTF-8: byte 0xe9 at offset 24"),  # was the codec's, no file named
    ("p.png --smooth 90", "--smooth 90.0: expected an EMA factor in [0, 1)"),  # drew a "smoothed" loss of 1e34
])
def test_plot_lr_refuses_an_out_that_is_a_log_or_a_folder_and_names_a_log_that_is_not_utf8(tmp_path, capsys, out, message):
    log = tmp_path / "lora_log.csv"
    text = "step,loss,lr/unet\n1,0.5,1e-4\n"
    log.write_text(text)
    (tmp_path / "folder").mkdir()
    os.symlink(log, tmp_path / "link.png")
    (tmp_path / "latin1_log.csv").write_bytes("step,loss,note\n1,0.5,caf\u00e9\n".encode("latin-1"))
    out, *more = out.split(" ") if out else [None]
    argv = [str(log), "--out", str(tmp_path / out), *more] if out else [str(tmp_path / "latin1_log.csv"), "--out", str(tmp_path / "p.png")]
    with pytest.raises(SystemExit) as raised:
        plot_lr.main(argv)
    assert raised.value.code == 2
    assert capsys.readouterr().err.strip().startswith("error: " + message.format(log=log, tmp=tmp_path))
    assert log.read_text() == text and not (tmp_path / "p.png").exists()


_CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


@pytest.mark.parametrize("name", sorted(f[:-5] for f in os.listdir(_CONFIGS)
                                        if f.endswith(".toml") and not f.startswith("dataset_")))
def test_example_configs_pass_the_schema(name):
    """Every training config in configs/ (the dataset_*.toml files are the datasets they name)."""
    from library.models.registry import FAMILIES

    args = load_config(["--config_file", os.path.join(_CONFIGS, f"{name}.toml")])
    assert args.model_type in (*FAMILIES, "llm")
    dataset = args.model_type != "llm" and args.dataset_config
    if dataset and dataset.startswith("configs/") and args.validate_every_n_steps:
        # ten configs asked for val_loss of a shipped dataset TOML that holds no image out: refused at start
        import toml

        data = toml.load(os.path.join(os.path.dirname(_CONFIGS), dataset))
        tables = [data.get("general", {}), *data.get("datasets", []),
                  *(s for d in data.get("datasets", []) for s in d.get("subsets", []))]
        assert data.get("validation_datasets") or any(t.get("validation_split") for t in tables), \
            f"{name}.toml: validate_every_n_steps, but {dataset} holds no image out"


def test_dataset_example_config_parses():
    import os

    from library.data.dataset_config import load_dataset_config

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    blueprint = load_dataset_config(os.path.join(root, "configs", "dataset_example.toml"))
    assert blueprint.datasets and blueprint.datasets[0].subsets


def test_scaled_residual_init_outside_pretraining_is_named(tmp_path):
    cfg = write(tmp_path, BASE + "scaled_residual_init = false\n")
    with pytest.raises(ConfigError, match=r"train\.toml: key 'scaled_residual_init' is for llm pretraining"):
        load_config(["--config_file", cfg])


FLUX = ('model_type = "flux"\npretrained_model_name_or_path = "m"\nae = "a"\nclip_l = "c"\nt5xxl = "t"\n'
        'dataset_config = "d.toml"\n')


QWEN = ('model_type = "qwen_image"\npretrained_model_name_or_path = "m"\nae = "a"\ntext_encoder = "t"\n'
        'dataset_config = "d.toml"\n')


def test_a_key_in_two_tables_is_refused_naming_both(tmp_path):
    """The old line let the later table win without a word (TOML refuses a repeat only within one table)."""
    cfg = write(tmp_path, BASE + "[network]\nnetwork_dim = 4\n[output]\nnetwork_dim = 8\n")
    with pytest.raises(ConfigError, match=r"train\.toml: key 'network_dim' given twice \(in \[network\] and in \[output\]\)"):
        load_config(["--config_file", cfg])
    cfg = write(tmp_path, "learning_rate = 1e-3\n" + BASE + "[optimizer]\nlearning_rate = 5e-2\n")
    with pytest.raises(ConfigError, match=r"'learning_rate' given twice \(in the top level and in \[optimizer\]\)"):
        load_config(["--config_file", cfg])


@pytest.mark.parametrize("key, value, problem", [
    ("max_grad_norm", "-1.0", "must be >= 0, got -1"),  # clip_grad_norm_ would flip the gradient
    ("save_last_n_saves", "-1", "must be >= 0, got -1"),  # [:-keep] would delete each save as written
    ("max_train_epochs", "0", "must be >= 1, got 0"),  # silently fell back to max_train_steps
    ("save_every_n_steps", "-2", "must be >= 0"),
    ("learning_rate", "inf", "must be > 0 and finite, got inf"),
    ("learning_rate", "nan", "must be > 0 and finite, got nan"),
    ("network_dropout", "1.5", r"must be in \[0, 1\), got 1.5"),
    ("lr_scheduler_num_cycles", "0", "must be >= 1"),
    ("discrete_flow_shift", "-1", "must be > 0"),
    ("max_data_loader_n_workers", "-1", "must be >= 0"),
    ("guidance_scale", "nan", "must be >= 0 and finite, got nan"),
    ("ema_inv_gamma", "inf", "must be a finite number, got inf"),
])
def test_numbers_out_of_range_are_refused(tmp_path, key, value, problem):
    cfg = write(tmp_path, FLUX + f"{key} = {value}\n")
    with pytest.raises(ConfigError, match=rf"train\.toml: key '{key}' {problem}"):
        load_config(["--config_file", cfg, "--output_dir", str(tmp_path)])


@pytest.mark.parametrize("config, line, message", [
    (FLUX, "batch_size = 4", "key 'batch_size' is read by model_type llm, not by model_type flux "
                             r"\(the batch size of images is the dataset TOML's batch_size\)"),
    (FLUX, "batch_size = 8", "key 'batch_size' is read by model_type llm"),  # the llm's default: was let through
    (BASE, "torch_compile = true", "key 'torch_compile' is read by the diffusion models, not by model_type llm"),
    (BASE, "max_data_loader_n_workers = 2", "key 'max_data_loader_n_workers' is read by the diffusion models"),
    (FLUX, 'train_data = ["x.txt"]', "key 'train_data' is read by model_type llm"),
    (FLUX, 'text_encoder = "q"', "key 'text_encoder' is read by model_type .*qwen_image.*, not by model_type flux"),
    (BASE, 'timestep_sampling = "shift"', "key 'timestep_sampling' is read by the diffusion models, not by model_type llm"),
    (BASE, 'clip_l = "c"', "key 'clip_l' is read by the diffusion models"),
    # a key of one model_type of a family folder (the old line took every key of the folder)
    (QWEN, "layers = 3", "key 'layers' is read by model_type qwen_image_layered, not by model_type qwen_image"),
    (QWEN.replace('"qwen_image"', '"qwen_image_layered"'), 'model_version = "qwen-image-edit-2511"',
     "key 'model_version' is read by model_type .*qwen_image_edit.*, not by model_type qwen_image_layered"),
])
def test_a_key_the_model_type_never_reads_is_refused(tmp_path, config, line, message):
    """The old line ignored them: batch_size = 8 on a FLUX run trained the dataset's batch size."""
    cfg = write(tmp_path, config + line + "\n")
    with pytest.raises(ConfigError, match=rf"train\.toml: {message}"):
        load_config(["--config_file", cfg, "--output_dir", str(tmp_path)])


def test_a_foreign_key_is_refused_at_its_default_too(tmp_path):
    """batch_size = 8 (the llm's default) on a FLUX run was let through, and the dataset's batch trained;
    4 or 16 were refused."""
    cfg = write(tmp_path, FLUX + "blocks_to_swap = 0\n")
    with pytest.raises(ConfigError, match=r"^command line: key 'batch_size' is read by model_type llm"):
        load_config(["--config_file", cfg, "--output_dir", str(tmp_path), "--batch_size", "8"])
    cfg = write(tmp_path, BASE + "blocks_to_swap = 0\n")
    with pytest.raises(ConfigError, match=r"train\.toml: key 'blocks_to_swap' is read by the diffusion models"):
        load_config(["--config_file", cfg, "--output_dir", str(tmp_path)])


@pytest.mark.parametrize("lines, message", [
    ("lr_warmup_steps = 2", "key 'lr_warmup_steps' does nothing with lr_scheduler = \"constant\""),
    ("sample_every_n_steps = 10", "key 'sample_every_n_steps' renders the prompts of sample_prompts, which is not set"),
    ("sample_at_first = true", "key 'sample_at_first' renders the prompts of sample_prompts"),
    ('network_weights = "/nonexistent/lora.safetensors"', "key 'network_weights' = /nonexistent/lora.safetensors: no such file or folder"),
])
def test_keys_that_would_do_nothing_or_fail_after_caching_are_refused_first(tmp_path, lines, message):
    cfg = write(tmp_path, FLUX + lines + "\n")
    with pytest.raises(ConfigError, match=message):
        load_config(["--config_file", cfg, "--output_dir", str(tmp_path)])


@pytest.mark.parametrize("lines, message", [
    ('lr_scheduler = "cosine"\nlr_scheduler_num_cycles = 3',
     "key 'lr_scheduler_num_cycles' does nothing with lr_scheduler = \"cosine\"; it needs lr_scheduler = \"cosine_with_restarts\""),
    ('lr_scheduler = "linear"\nlr_scheduler_power = 2.0', "key 'lr_scheduler_power' does nothing with lr_scheduler = \"linear\""),
    ("discrete_flow_shift = 3.1582", "key 'discrete_flow_shift' does nothing with timestep_sampling unset"),
    ('timestep_sampling = "flux_shift"\ndiscrete_flow_shift = 2.0', 'key \'discrete_flow_shift\' does nothing with timestep_sampling = "flux_shift"; it needs timestep_sampling = "shift"'),
    ('timestep_sampling = "uniform"\nsigmoid_scale = 2.0', "key 'sigmoid_scale' does nothing with timestep_sampling = \"uniform\""),
    ("huber_c = 0.5", "key 'huber_c' does nothing with loss_type = \"l2\""),
    ("block_swap_prefetch = 2", "key 'block_swap_prefetch' does nothing with blocks_to_swap = 0"),
    # fp8_scaled = false (sd-scripts' plain cast) without fp8_base trained a bf16 base without a word
    ("fp8_scaled = false", "key 'fp8_scaled' does nothing with fp8_base = false"),
    ('base_precision = "nf4"\nfp8_scaled = false', "key 'fp8_scaled' does nothing with fp8_base = false"),
])
def test_a_scheduler_or_loss_key_that_its_choice_never_reads_is_refused(tmp_path, lines, message):
    """The old line trained without them: diffusers' get_scheduler passes num_cycles only to
    cosine_with_restarts and power only to polynomial; the shift, scale and huber_c only act in their mode."""
    cfg = write(tmp_path, FLUX + lines + "\n")
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(["--config_file", cfg, "--output_dir", str(tmp_path)])
    used = {"lr_scheduler_num_cycles": 'lr_scheduler = "cosine_with_restarts"', "lr_scheduler_power": 'lr_scheduler = "polynomial"',
            "discrete_flow_shift": 'timestep_sampling = "shift"', "sigmoid_scale": 'timestep_sampling = "sigmoid"',
            "huber_c": 'loss_type = "huber"', "block_swap_prefetch": "blocks_to_swap = 2", "fp8_scaled": "fp8_base = true"}
    key = re.search(r"key '(\w+)'", message).group(1)
    line = next(v for v in lines.split("\n") if v.startswith(key))  # the key alone, where its mode reads it
    load_config(["--config_file", write(tmp_path, FLUX + used[key] + "\n" + line + "\n"), "--output_dir", str(tmp_path)])


@pytest.mark.parametrize("line, message, used", [
    ("persistent_data_loader_workers = true", "does nothing with max_data_loader_n_workers = 0",
     "max_data_loader_n_workers = 2"),
    ('ema_device = "cpu"', "does nothing with ema_decay = 0.0; it needs ema_decay > 0", "ema_decay = 0.9"),
    ('log_prefix = "a_"', "does nothing with log_with unset and logging_dir unset; it needs a tracker", 'logging_dir = "logs"'),
    ("save_last_n_saves = 2", "does nothing with save_every_n_steps = 0 and save_every_n_epochs = 0",
     "save_every_n_epochs = 1"),
])
def test_a_key_whose_feature_is_off_is_refused(tmp_path, line, message, used):
    """The old line took them and did nothing: no worker to keep alive, no EMA, no tracker run to name,
    no intermediate save to prune."""
    cfg = write(tmp_path, FLUX + line + "\n")
    key = line.split(" =")[0]
    with pytest.raises(ConfigError, match=rf"train\.toml: key '{key}' {re.escape(message)}"):
        load_config(["--config_file", cfg, "--output_dir", str(tmp_path)])
    load_config(["--config_file", write(tmp_path, FLUX + line + "\n" + used + "\n"), "--output_dir", str(tmp_path)])


def test_sampling_keys_with_prompts_blanked_are_an_explicit_no(tmp_path):
    cfg = write(tmp_path, FLUX + 'sample_at_first = true\nsample_prompts = ""\nlr_scheduler = "constant_with_warmup"\n'
                                 "lr_warmup_steps = 2\n")
    load_config(["--config_file", cfg, "--output_dir", str(tmp_path)])


@pytest.mark.parametrize("config, lines, margin", [
    (FLUX, "", 37),  # .<name>-step001600.safetensors.xxxxxxxx.tmp: a step save's temporary
    (FLUX, "ema_decay = 0.999\n", 41),  # its EMA's: -step001600_ema.safetensors
    (FLUX, 'sample_prompts = "p.txt"\nsample_every_n_steps = 100\n', 58),  # _step001600_00_<time>_<seed>.png
    (BASE, "", 25),  # an LLM's PEFT adapter folder: .<name>-step001600.xxxxxxxx.tmp
])
def test_an_output_name_too_long_for_the_names_the_run_writes_is_refused_at_load(tmp_path, config, lines, margin):
    """The old line took it, trained every step, and lost the LoRA at its save (or failed at the first sample):
    'File name too long' for the save's temporary, the name itself under the limit."""
    cfg, limit = write(tmp_path, config + lines), os.pathconf(tmp_path, "PC_NAME_MAX")
    load_config(["--config_file", cfg, "--output_dir", str(tmp_path), "--output_name", "x" * (limit - margin)])
    refused = rf"'output_name' is {limit - margin + 1} bytes \(UTF-8\): .* is {limit + 1} bytes, over .* of {limit}"
    with pytest.raises(ConfigError, match=refused):
        load_config(["--config_file", cfg, "--output_dir", str(tmp_path), "--output_name", "x" * (limit - margin + 1)])


def test_an_output_name_is_measured_in_utf8_bytes(tmp_path):
    """80 CJK characters are 240 bytes: under 255 as a name, over it in the save's temporary."""
    cfg, limit = write(tmp_path, FLUX), os.pathconf(tmp_path, "PC_NAME_MAX")
    with pytest.raises(ConfigError) as raised:
        load_config(["--config_file", cfg, "--output_dir", str(tmp_path), "--output_name", "\u5b57" * 80])
    assert str(raised.value) == (
        f"command line: key 'output_name' is 240 bytes (UTF-8): the longest file name the run writes from it, "
        f"'.<output_name>-step001600.safetensors.xxxxxxxx.tmp', is 277 bytes, over the file system's limit of {limit} "
        f"in output_dir '{tmp_path}'; use at most {limit - 37} bytes")


def test_a_folder_given_as_the_config_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"is a folder; expected a training config \(\.toml\) file"):
        load_config(["--config_file", str(tmp_path)])


@pytest.mark.parametrize("lines, message", [
    ('pretrain = true\nnetwork_weights = "x"', "key 'network_weights' is read by LoRA training (pretrain = false)"),
    ("pretrain = true\nnetwork_dim = 32", "key 'network_dim' is read by LoRA training"),
    ('pretrain = true\nsave_format = "kohya"', "save_format 'kohya' is for LLM LoRAs (model_type llm without pretrain)"),
    ('sample_prompt = ""', "key 'sample_prompt' must not be empty"),  # crashed at the first eval
])
def test_llm_keys_that_pretraining_or_sampling_would_ignore_or_crash_on_are_refused(tmp_path, lines, message):
    """The old line trained from scratch with the LoRA keys ignored, and crashed on an empty prompt."""
    cfg = write(tmp_path, BASE + lines + "\n")
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(["--config_file", cfg, "--output_dir", str(tmp_path)])


def test_a_bad_flag_is_one_line_not_the_usage(capsys):
    """The old line printed argparse's usage (every key: ~80 lines) above the error."""
    import train_lora

    assert train_lora.main(["--bogus", "1"]) == 2
    err = capsys.readouterr().err
    assert err == "error: command line: unrecognized arguments: --bogus 1 (python train_lora.py --help lists the keys)\n"


@pytest.mark.parametrize("warmup, said", [("10", "lr_warmup_steps = 10 is not below max_train_steps = 10")])
def test_a_warmup_as_long_as_the_run_is_refused_naming_both_keys(tmp_path, warmup, said):
    """lr_warmup_steps >= max_train_steps was taken: the lr never reached learning_rate (10 of 10 steps
    of warmup ended at 0.9 x lr). A ratio below 1 rounds down, below the run's steps."""
    cfg = write(tmp_path, BASE + 'lr_scheduler = "constant_with_warmup"\nmax_train_steps = 10\n')
    with pytest.raises(ConfigError) as e:
        load_config(["--config_file", cfg, "--output_dir", str(tmp_path), "--lr_warmup_steps", warmup])
    assert str(e.value) == (f"command line and {cfg}: {said}: the lr would never reach learning_rate; shorten the "
                            f"warmup or train longer")
    assert load_config(["--config_file", cfg, "--output_dir", str(tmp_path), "--lr_warmup_steps", "9"]).lr_warmup_steps == 9


def test_resume_refuses_another_schedule_shape_and_takes_older_states(tmp_path):
    """The scheduler's state holds its step, not its lambda: the old line resumed a state written with
    lr_warmup_steps = 100 under 10 (the lr jumped from the warmup's 0.3 to the full rate) without a word."""
    import json

    from library.training.state import SCHEDULE_IDENTITY, load_state, run_digest

    cfg = write(tmp_path, BASE + 'lr_scheduler = "cosine_with_restarts"\nlr_warmup_steps = 100\nlr_scheduler_num_cycles = 2\n')
    written = load_config(["--config_file", cfg, "--output_dir", str(tmp_path)])
    state = tmp_path / "state"
    state.mkdir()

    def write_state(run: dict):
        (state / "train_state.json").write_text(json.dumps(
            {"step": 30, "epoch": 0, "batches_done": 30, "scheduler": {}, "run": json.loads(json.dumps(run, default=str))}))

    write_state(run_digest(written))
    for flag, value in (("--lr_warmup_steps", "10"), ("--lr_scheduler_num_cycles", "3")):
        resumed = load_config(["--config_file", cfg, "--output_dir", str(tmp_path), flag, value])
        with pytest.raises(ValueError, match=f"state was written with {flag[2:]} = .*, this run has {value}"):
            load_state(str(state), resumed)
    old = {k: v for k, v in run_digest(written).items() if k not in SCHEDULE_IDENTITY}  # a state from before
    write_state(old)
    with pytest.raises(CheckpointError, match="trainable.safetensors"):  # past the settings check: the files
        load_state(str(state), load_config(["--config_file", cfg, "--output_dir", str(tmp_path), "--lr_warmup_steps", "10"]))


@pytest.mark.parametrize("progress, planned", [
    (None, 8),  # a fresh run: 2 epochs of 4 steps
    ({"step": 4, "epoch": 0, "batches_done": 4, "batches_per_epoch": 4}, 8),  # at epoch 0's end, the same data
    ({"step": 2, "epoch": 0, "batches_done": 2, "batches_per_epoch": 4}, 8),  # inside epoch 0
    ({"step": 4, "epoch": 1, "batches_done": 0, "batches_per_epoch": 4}, 8),  # an epoch save's state
    ({"step": 3, "epoch": 0, "batches_done": 3, "batches_per_epoch": 3}, 7),  # epoch 0 had 3 batches: 3 + 4
    ({"step": 3, "epoch": 1, "batches_done": 0, "batches_per_epoch": 3}, 7),
    ({"step": 9, "epoch": 2, "batches_done": 0, "batches_per_epoch": 3}, 9),  # both epochs done: nothing left
])
def test_max_train_epochs_counts_the_resumed_epochs_at_the_length_they_had(tmp_path, progress, planned):
    """A resume onto longer epochs planned max_train_epochs x the new length from step 0, on top of the steps the
    resumed run had trained: an extra epoch's worth."""
    from library.training.run_length import plan_steps

    args = load_config(["--config_file", write(tmp_path, BASE + "max_train_epochs = 2\n")])
    assert plan_steps(args, 4, progress) == planned
    args.gradient_accumulation_steps = 3  # epochs of 2 steps (3 batches, then 1)
    inside = {"step": 1, "epoch": 0, "batches_done": 3, "batches_per_epoch": 4}
    assert plan_steps(args, 4, None) == plan_steps(args, 4, inside) == 4


@pytest.mark.parametrize("scheduler, refused", [("cosine", True), ("constant", False)])
def test_resume_with_another_length_is_refused_where_the_schedule_follows_it(tmp_path, scheduler, refused):
    """A cosine run of 10 steps killed at 5 (lr 0.5 x) and resumed with max_train_steps = 20 went on
    from cosine-of-20's 0.85 x: the schedule is rebuilt for the new length. Refused now; a constant
    schedule may still be extended."""
    import json

    from library.training.state import load_state, run_digest

    cfg = write(tmp_path, BASE + f'lr_scheduler = "{scheduler}"\nmax_train_steps = 10\n')
    state = tmp_path / "state"
    state.mkdir()
    (state / "train_state.json").write_text(json.dumps(
        {"step": 5, "epoch": 0, "batches_done": 5, "scheduler": {}, "max_steps": 10,
         "run": json.loads(json.dumps(run_digest(load_config(["--config_file", cfg])), default=str))}))
    longer = load_config(["--config_file", cfg, "--max_train_steps", "20"])
    if refused:
        with pytest.raises(ValueError) as e:
            load_state(str(state), longer)
        assert str(e.value) == (f"{state}: state was written by a run of 10 steps, this run has 20 (max_train_steps / "
                                f"max_train_epochs): the cosine schedule's lr at step 5 would jump onto another curve; "
                                f"resume with the same length")
    with pytest.raises(CheckpointError, match="trainable.safetensors"):  # past the check: the files
        load_state(str(state), longer if not refused else load_config(["--config_file", cfg]))


def test_persistent_data_loader_workers_reaches_one_dataloader_that_serves_every_epoch(tmp_path):
    """sd-scripts' persistent_data_loader_workers was refused as an unknown key; now it is read, and
    with workers one DataLoader (persistent_workers=True) is handed each epoch's batches."""
    from types import SimpleNamespace

    from library.training.diffusion_task import DiffusionTask
    from tests.test_dataset import blueprint, make_image

    cfg = write(tmp_path, FLUX + "persistent_data_loader_workers = true\nmax_data_loader_n_workers = 2\n")
    args = load_config(["--config_file", cfg])
    assert (args.persistent_data_loader_workers, args.max_data_loader_n_workers) == (True, 2)
    for i in range(5):
        make_image(tmp_path / "img" / f"{i}.png", 64, 64)
        (tmp_path / "img" / f"{i}.txt").write_text("a photo")
    from library.data import dataset as D

    data = D.ImageDataset(blueprint(tmp_path / "img"))
    task = SimpleNamespace(args=args, dataset=data, sampler=D.BucketBatchSampler(data), _loader=None,
                           device=torch.device("cpu"), accelerator=SimpleNamespace(process_index=0, num_processes=1))
    keys = []
    for epoch in (0, 1):
        loader = DiffusionTask.epoch_batches(task, epoch)
        keys.append([key for batch in loader for key in batch["keys"]])
    assert loader is task._loader and loader.persistent_workers and loader.num_workers == 2
    expected = [[data[entry]["key"] for batch in D.EpochBatches(task.sampler, epoch) for entry in batch]
                for epoch in (0, 1)]
    assert keys == expected and keys[0] != keys[1]  # each epoch's own order, served by the same workers
    args.max_data_loader_n_workers = 0  # torch refuses persistent workers without workers: the option is moot
    task._loader = None
    loader = DiffusionTask.epoch_batches(task, 0)
    assert not loader.persistent_workers and task._loader is None


def test_a_resumed_eval_log_keeps_its_start_row(tmp_path):
    """An LLM eval log's "start" row (the baseline before step 1, sample_at_first) was dropped at a resume
    with the rows after the state's step: the CSV lost it while TensorBoard kept it at step 0."""
    path = tmp_path / "lm_eval.csv"
    path.write_text("step,val_loss\nstart,5.1\n2,4.9\n4,4.7\nfinal,4.6\n")
    optim.drop_rows_after(str(path), 2)
    assert path.read_text().splitlines() == ["step,val_loss", "start,5.1", "2,4.9"]
    # the sample tags an eval log also holds: step000002 (before the state's step 3) stays (the old line dropped it); the epoch end
    # logged after it is the resumed run's to render again
    path.write_text("step,val_loss\nstart,5.1\nstep000002,4.9\nepoch0001,4.8\nstep000004,4.7\nfinal,4.6\n")
    optim.drop_rows_after(str(path), 3)
    assert path.read_text().splitlines() == ["step,val_loss", "start,5.1", "step000002,4.9"]


def test_every_key_is_named_in_the_configuration_docs():
    """README said docs/configuration.md holds every key; 14 of the schema's were named nowhere (their defaults
    only in --help)."""
    from library.training.config import SCHEMA

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    docs = ""
    for name in ("docs/configuration.md", "README.md"):
        with open(os.path.join(root, name)) as f:
            docs += f.read()
    assert [key for key in SCHEMA if f"`{key}`" not in docs and f"{key} = " not in docs] == []
