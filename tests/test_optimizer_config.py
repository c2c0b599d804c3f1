"""The optimizer's config (optimizer_args as literals, the early optimizer check, bitsandbytes classes),
the LR schedules' warmup, and LR tracking (the CSV log with Prodigy's d * lr, tools/plot_lr.py)."""

import csv
import glob
import importlib
import math
import os
import re
import warnings

import pytest
import torch

from library.training import config, optim, run_length
from library.training.config import ConfigError, load_config, lora_network_args, parse_kv_literals
from tests.test_train_config import BASE, write
from tools import plot_lr


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
    optim.check_optimizer("tests.test_optimizer_config.record_call", 1e-3, {"command": "x"})
    assert importlib.import_module("tests.test_optimizer_config").CALLED == []  # (the module optimizer_class imported)


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
    assert optim.optimizer_class("SGD") is torch.optim.SGD  # torch.optim's name (sd-scripts'), not bnb's SGD


class ScheduleFreeLike(torch.optim.SGD):
    """Stepped in train mode, read in eval mode, as schedulefree.AdamWScheduleFree."""

    def train(self):
        pass

    def eval(self):
        pass


def test_sd_scripts_and_musubi_optimizer_names_build_what_they_build_there(tmp_path):
    """SGD, SGDNesterov, Adafactor (musubi-tuner's docs: with relative_step=False ...) and the DAdapt names were
    'unknown'; the run refused them, naming none of what to write."""
    def built(name, *args):
        cfg = write(tmp_path, BASE + f'optimizer_type = "{name}"\noptimizer_args = {list(args)!r}\n'.replace("'", '"'))
        args = load_config(["--config_file", cfg, "--output_dir", str(tmp_path)])
        return optim.create_optimizer([{"params": [torch.nn.Parameter(torch.zeros(2, 2))]}], name, 1e-3,
                                      config.optimizer_kwargs(args))

    assert type(built("SGD", "momentum=0.9")) is torch.optim.SGD
    sgd = built("SGDNesterov").defaults  # sd-scripts: torch's SGD, nesterov, momentum 0.9 unless given
    assert (sgd["nesterov"], sgd["momentum"]) == (True, 0.9) and built("SGDNesterov", "momentum=0.5").defaults["momentum"] == 0.5
    from transformers.optimization import Adafactor

    adafactor = built("adafactor", "relative_step=False", "scale_parameter=False", "warmup_init=False")
    assert type(adafactor) is Adafactor and adafactor.defaults["lr"] == 1e-3
    with pytest.raises(ConfigError, match=r"train\.toml: optimizer_type Adafactor: Adafactor's relative_step .* not supported; "
                                          r"add optimizer_args = \[\"relative_step=False\", \"scale_parameter=False\""):
        built("Adafactor")
    try:
        import dadaptation
    except ImportError:
        with pytest.raises(ConfigError, match="optimizer_type 'DAdaptAdam' needs the package 'dadaptation'"):
            optim.optimizer_class("DAdaptAdam")
    else:
        assert optim.optimizer_class("DAdaptation") is dadaptation.experimental.DAdaptAdamPreprint


@pytest.mark.parametrize("name", ["AdamWScheduleFree", "schedulefree.RAdamScheduleFree",
                                  "tests.test_optimizer_config.ScheduleFreeLike"])
def test_a_schedule_free_optimizer_passes_the_config_check(tmp_path, name):
    """Refused until 2026-11-29 (its train / eval modes were not switched); now switched around every read of the
    weights (tests/test_schedule_free.py), with the schedule keys it does not run with refused."""
    cfg = write(tmp_path, BASE + f'optimizer_type = "{name}"\n')
    assert load_config(["--config_file", cfg, "--output_dir", str(tmp_path)]).optimizer_type == name
    with pytest.raises(ConfigError, match=rf"train\.toml and command line: optimizer_type {re.escape(name)} is schedule-free .* not "
                                          r'lr_scheduler = "cosine"'):
        load_config(["--config_file", cfg, "--output_dir", str(tmp_path), "--lr_scheduler", "cosine"])


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


def test_a_warmup_as_a_percentage_is_its_fraction_on_the_command_line_and_in_the_toml(tmp_path):
    """sd-scripts takes --lr_warmup_steps 10% (its int_or_float): ours refused it ('must be float'). The TOML's
    "10%" too; a percentage of 100 or more, or no number, is one line naming the key."""
    cfg = write(tmp_path, BASE + 'lr_scheduler = "linear"\nlr_warmup_steps = "10%"\n')
    assert load_config(["--config_file", cfg, "--output_dir", str(tmp_path)]).lr_warmup_steps == 0.1
    assert load_config(["--config_file", cfg, "--output_dir", str(tmp_path), "--lr_warmup_steps", "5%"]
                       ).lr_warmup_steps == 0.05
    for value in ("100%", "x%"):
        with pytest.raises(ConfigError, match=f"^command line: key 'lr_warmup_steps' must be steps, a fraction of "
                                              f"max_train_steps \\(< 1\\) or a percentage of it .*got '{value}'"):
            load_config(["--config_file", cfg, "--output_dir", str(tmp_path), "--lr_warmup_steps", value])


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
    cfg = write(tmp_path, BASE + 'optimizer_type = "Prodigy"\nlearning_rate = 1.0\n'
                                 'network_args = ["network_reg_lrs=single_blocks=0.5"]\n')
    with pytest.raises(ConfigError, match=r"network_args 'network_reg_lrs=single_blocks=0.5' gives the parameter "
                                          r"groups different learning rates, which Prodigy does not take"):
        load_config(["--config_file", cfg, "--output_dir", str(tmp_path)])


def test_network_reg_dims_is_refused_with_dim_from_weights(tmp_path):
    """dim_from_weights trains the file's modules at the file's ranks: a rank regex would do nothing."""
    (tmp_path / "init.safetensors").write_bytes(b"")
    cfg = write(tmp_path, BASE + 'network_args = ["network_reg_dims=single=2"]\n')
    with pytest.raises(ConfigError, match="network_args 'network_reg_dims' selects modules or ranks"):
        load_config(["--config_file", cfg, "--output_dir", str(tmp_path), "--dim_from_weights", "true",
                     "--network_weights", str(tmp_path / "init.safetensors")])


def test_weight_decay_1d_is_refused_where_no_pretraining_reads_it(tmp_path):
    cfg = write(tmp_path, BASE + "weight_decay_1d = true\n")
    with pytest.raises(ConfigError, match="key 'weight_decay_1d' does nothing with pretrain = false"):
        load_config(["--config_file", cfg, "--output_dir", str(tmp_path)])


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
