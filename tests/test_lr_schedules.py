"""The three lr schedules sd-scripts and musubi-tuner take from transformers (cosine_with_min_lr,
warmup_stable_decay, inverse_sqrt): built as their get_scheduler_fix builds them, their keys checked before
training, and carried from the peers' configs."""

import os
import re

import pytest
import torch
from transformers import optimization as transformers_schedules

from library.training import optim, run_length
from library.training.config import ConfigError, load_config
from library.training.peers import musubi_tuner, sd_scripts
from tests.test_train_config import BASE, write


def load(tmp_path, lines: str, *flags: str):
    return load_config(["--config_file", write(tmp_path, BASE + lines), "--output_dir", str(tmp_path), *flags])


def lrs(build, steps: int) -> list[float]:
    """The lr at each step of a schedule that build(optimizer) makes, on an optimizer at lr 1."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    schedule, said = build(opt), []
    for _ in range(steps):
        said.append(opt.param_groups[0]["lr"])
        opt.step()
        schedule.step()
    return said


# (our keys, the run's steps, transformers' function as get_scheduler_fix calls it: the oracle)
ORACLES = {
    "cosine_with_min_lr": ('lr_warmup_steps = 10\nlr_scheduler_min_lr_ratio = 0.1\n', 100,
                           lambda o: transformers_schedules.get_cosine_with_min_lr_schedule_with_warmup(
                               o, num_warmup_steps=10, num_training_steps=100, num_cycles=0.5, min_lr_rate=0.1)),
    "cosine_with_min_lr, 2 cycles": ('lr_warmup_steps = 10\nlr_scheduler_min_lr_ratio = 0.1\n'
                                     'lr_scheduler_num_cycles = 2\n', 100,
                                     lambda o: transformers_schedules.get_cosine_with_min_lr_schedule_with_warmup(
                                         o, num_warmup_steps=10, num_training_steps=100, num_cycles=1.0,
                                         min_lr_rate=0.1)),
    "warmup_stable_decay": ('lr_warmup_steps = 10\nlr_decay_steps = 0.25\nlr_scheduler_min_lr_ratio = 0.05\n', 100,
                            lambda o: transformers_schedules.get_wsd_schedule(
                                o, num_warmup_steps=10, num_decay_steps=25, num_stable_steps=65, num_cycles=0.5,
                                min_lr_ratio=0.05)),
    "warmup_stable_decay, no floor": ('lr_decay_steps = 30\n', 100,
                                      lambda o: transformers_schedules.get_wsd_schedule(
                                          o, num_warmup_steps=0, num_decay_steps=30, num_stable_steps=70,
                                          num_cycles=0.5, min_lr_ratio=0.0)),
    "inverse_sqrt": ('lr_warmup_steps = 10\nlr_scheduler_timescale = 40\n', 200,
                     lambda o: transformers_schedules.get_inverse_sqrt_schedule(o, num_warmup_steps=10, timescale=40)),
    "inverse_sqrt, the warmup's timescale": ('lr_warmup_steps = 0.05\n', 200,
                                             lambda o: transformers_schedules.get_inverse_sqrt_schedule(
                                                 o, num_warmup_steps=10, timescale=None)),
}


@pytest.mark.parametrize("case", ORACLES)
def test_each_schedule_is_transformers_own_as_sd_scripts_calls_it(tmp_path, case):
    """train_lora.py's run_scheduler from the loaded keys, step by step against transformers' function called
    with get_scheduler_fix's arguments (num_cycles halved, the decay at the run's end, the floor 0 by default)."""
    lines, steps, oracle = ORACLES[case]
    args = load(tmp_path, f'lr_scheduler = "{case.split(",")[0]}"\nmax_train_steps = {steps}\n{lines}')
    ours = lrs(lambda o: optim.run_scheduler(o, args, steps), steps)
    assert ours == pytest.approx(lrs(oracle, steps), abs=1e-12)
    step, lr = {"cosine_with_min_lr": (55, 0.1 + 0.9 * 0.5),  # halfway down the half-cosine to 0.1 (lr 1)
                "cosine_with_min_lr, 2 cycles": (55, 0.1),  # a whole wave: the floor halfway, back up at the end
                "warmup_stable_decay": (74, 1.0),  # the stable part: 10 + 65 steps
                "warmup_stable_decay, no floor": (85, 0.5),  # halfway down the last 30 steps
                "inverse_sqrt": (130, 0.5),  # sqrt(40 / (130 - 10 + 40))
                "inverse_sqrt, the warmup's timescale": (30, (10 / 30) ** 0.5)}[case]  # 0.05 x 200 = 10 steps
    assert ours[step] == pytest.approx(lr)


def test_the_schedules_do_not_go_through_diffusers():
    """diffusers' get_scheduler knows none of the three: it raised on their names."""
    from diffusers.optimization import SchedulerType

    names = {s.value for s in SchedulerType}
    assert not set(optim.TRANSFORMERS_SCHEDULES) & names


@pytest.mark.parametrize("decay, steps, expected", [(None, 10, 0), (0.15, 10, 1), (0.25, 100, 25), (30, 100, 30)])
def test_lr_decay_steps_is_steps_or_a_fraction_rounded_down_as_sd_scripts_does(decay, steps, expected):
    """sd-scripts: int(lr_decay_steps * steps) for a float, the int itself else; unset decays nothing."""
    assert run_length.decay_steps(decay, steps) == expected


@pytest.mark.parametrize("lines, message", [
    ('lr_scheduler = "cosine_with_min_lr"\n',
     'lr_scheduler = "cosine_with_min_lr" needs key \'lr_scheduler_min_lr_ratio\' (the lr it ends at, as a fraction of '
     'learning_rate, e.g. 0.1)'),
    ('lr_scheduler = "warmup_stable_decay"\n',
     'lr_scheduler = "warmup_stable_decay" needs key \'lr_decay_steps\' (its decay\'s steps at the run\'s end, or a '
     'fraction of the run, e.g. 0.1; without it the lr never decays)'),
    ('lr_scheduler = "warmup_stable_decay"\nlr_warmup_steps = 60\nlr_decay_steps = 0.5\n',
     "lr_warmup_steps = 60 and lr_decay_steps = 0.5 (50 steps) together are longer than max_train_steps = 100: the "
     "decay would start part-way down; shorten one or train longer"),
    ('lr_scheduler = "warmup_stable_decay"\nlr_decay_steps = 101\n',
     "lr_decay_steps = 101 is longer than max_train_steps = 100: the decay would start part-way down; shorten it or "
     "train longer"),
    ('lr_scheduler = "warmup_stable_decay"\nlr_decay_steps = 2.5\n',
     "key 'lr_decay_steps' must be a whole number of steps (>= 1) or a fraction of max_train_steps (< 1), got 2.5"),
    ('lr_scheduler = "warmup_stable_decay"\nlr_decay_steps = 0\n', "key 'lr_decay_steps' must be > 0, got 0"),
    ('lr_scheduler = "cosine_with_min_lr"\nlr_scheduler_min_lr_ratio = 1.0\n',
     "key 'lr_scheduler_min_lr_ratio' must be in [0, 1), got 1"),
    ('lr_scheduler = "inverse_sqrt"\nlr_scheduler_timescale = 0\n', "key 'lr_scheduler_timescale' must be >= 1, got 0"),
    ('lr_scheduler = "cosine"\nlr_decay_steps = 10\n',
     'key \'lr_decay_steps\' does nothing with lr_scheduler = "cosine"; it needs lr_scheduler = "warmup_stable_decay"'),
    ('lr_scheduler = "cosine"\nlr_scheduler_min_lr_ratio = 0.1\n',
     'key \'lr_scheduler_min_lr_ratio\' does nothing with lr_scheduler = "cosine"; it needs lr_scheduler = '
     '"cosine_with_min_lr", "warmup_stable_decay" or "rex"'),
    ('lr_scheduler = "cosine_with_min_lr"\nlr_scheduler_min_lr_ratio = 0.1\nlr_scheduler_timescale = 5\n',
     'key \'lr_scheduler_timescale\' does nothing with lr_scheduler = "cosine_with_min_lr"; it needs lr_scheduler = '
     '"inverse_sqrt"'),
    ('lr_scheduler = "inverse_sqrt"\nlr_scheduler_num_cycles = 2\n',
     'key \'lr_scheduler_num_cycles\' does nothing with lr_scheduler = "inverse_sqrt"; it needs lr_scheduler = '
     '"cosine_with_restarts", "cosine_with_min_lr" or "warmup_stable_decay"'),
])
def test_each_schedule_key_that_cannot_work_is_one_line_before_training(tmp_path, lines, message):
    """transformers stops on cosine_with_min_lr without its ratio only when the scheduler is built, after caching;
    the others ran otherwise than written, or were taken without a word."""
    with pytest.raises(ConfigError) as e:
        load(tmp_path, "max_train_steps = 100\n" + lines)
    assert str(e.value) == f"{tmp_path / 'train.toml'}: {message}"


def test_the_decay_is_checked_against_the_epochs_once_they_are_known(tmp_path):
    """With max_train_epochs the run's steps come from the dataset: check_planned_steps refuses it then, before
    caching, naming where the keys were set."""
    args = load(tmp_path, 'lr_scheduler = "warmup_stable_decay"\nmax_train_epochs = 2\nlr_warmup_steps = 5\n',
                "--lr_decay_steps", "8")
    run_length.check_planned_steps(args, 13)
    with pytest.raises(ConfigError, match=re.escape(
            f"{tmp_path / 'train.toml'} and command line: lr_warmup_steps = 5 and lr_decay_steps = 8 together are "
            f"longer than max_train_epochs = 2 (12 steps): the decay")):
        run_length.check_planned_steps(args, 12)


@pytest.mark.parametrize("lines", ['lr_scheduler = "cosine_with_min_lr"\nlr_scheduler_min_lr_ratio = 0\n'
                                   'lr_scheduler_num_cycles = 3\n',
                                   'lr_scheduler = "warmup_stable_decay"\nlr_decay_steps = 0.1\n'
                                   'lr_scheduler_min_lr_ratio = 0.2\nlr_scheduler_num_cycles = 1\n',
                                   'lr_scheduler = "inverse_sqrt"\nlr_scheduler_timescale = 100\n'])
def test_the_keys_each_schedule_reads_are_taken(tmp_path, lines):
    args = load(tmp_path, lines)
    assert args.lr_scheduler == lines.split('"')[1]


def test_a_resumed_run_keeps_the_schedules_keys_and_inverse_sqrt_may_run_longer(tmp_path):
    """The scheduler's state holds its step, not its lambda: another decay, floor or timescale would move the lr
    onto another curve. inverse_sqrt does not read the run's length (a constant_with_warmup's extension)."""
    from library.training.state import SCHEDULE_IDENTITY, check_resumed_length

    assert {"lr_decay_steps", "lr_scheduler_min_lr_ratio", "lr_scheduler_timescale"} <= set(SCHEDULE_IDENTITY)
    progress = {"step": 5, "max_steps": 10}
    check_resumed_length("s", progress, 20, load(tmp_path, 'lr_scheduler = "inverse_sqrt"\n'))
    with pytest.raises(ValueError, match="the warmup_stable_decay schedule's lr at step 5 would jump"):
        check_resumed_length("s", progress, 20, load(tmp_path, 'lr_scheduler = "warmup_stable_decay"\n'
                                                               'lr_decay_steps = 2\n'))


# ----------------------------------------------------------------------------------------------
# The peers' configs


def translations(keys: dict):
    yield sd_scripts.translate({"network_train_unet_only": True, **keys}, "x.toml")
    yield musubi_tuner.translate({"network_module": "networks.lora_zimage", **keys}, "x.toml")


@pytest.mark.parametrize("keys, ours", [
    ({"lr_scheduler": "cosine_with_min_lr", "lr_scheduler_min_lr_ratio": 0.1, "lr_scheduler_num_cycles": 2},
     {"lr_scheduler": "cosine_with_min_lr", "lr_scheduler_min_lr_ratio": 0.1, "lr_scheduler_num_cycles": 2}),
    ({"lr_scheduler": "cosine_with_min_lr", "lr_scheduler_min_lr_ratio": 0},  # a ratio: transformers' plain cosine
     {"lr_scheduler": "cosine_with_min_lr", "lr_scheduler_min_lr_ratio": 0}),
    ({"lr_scheduler": "warmup_stable_decay", "lr_decay_steps": "20%", "lr_scheduler_min_lr_ratio": 0.05},
     {"lr_scheduler": "warmup_stable_decay", "lr_decay_steps": 0.2, "lr_scheduler_min_lr_ratio": 0.05}),
    ({"lr_scheduler": "warmup_stable_decay", "lr_decay_steps": 1.0, "max_train_steps": 500},  # a TOML float there
     {"lr_scheduler": "warmup_stable_decay", "lr_decay_steps": 500, "max_train_steps": 500}),
    ({"lr_scheduler": "inverse_sqrt", "lr_scheduler_timescale": 200, "lr_warmup_steps": 50},
     {"lr_scheduler": "inverse_sqrt", "lr_scheduler_timescale": 200, "lr_warmup_steps": 50}),
    ({"lr_scheduler": "inverse_sqrt", "lr_scheduler_timescale": 0},  # a GUI's empty field: not given
     {"lr_scheduler": "inverse_sqrt"}),
    ({"lr_scheduler": "cosine", "lr_decay_steps": 100, "lr_scheduler_timescale": 3, "lr_scheduler_min_lr_ratio": 0.1},
     {"lr_scheduler": "cosine"}),  # each read by another schedule only: dropped
])
def test_the_peers_schedules_are_carried_with_their_keys(keys, ours):
    """Both peers' get_scheduler (sd-scripts' get_scheduler_fix): these were "not carried" before."""
    for t in translations(keys):
        assert {k: v for k, v in t.config.items() if k in ours} == ours, t.peer
        assert [line.key for line in t.lines if line.verdict == "not carried" and line.key.startswith("lr_")] == [], t.peer


@pytest.mark.parametrize("keys, why", [
    ({"lr_scheduler": "cosine_with_min_lr"}, "{peer} stops on it without lr_scheduler_min_lr_ratio"),
    ({"lr_scheduler": "warmup_stable_decay", "lr_decay_steps": 0},
     "without lr_decay_steps (0, the default there) the lr never decays in {peer}, which ours refuses"),
])
def test_a_peer_schedule_without_the_key_it_needs_is_not_carried_with_why(keys, why):
    for t in translations(keys):
        line = next(line for line in t.lines if line.key == "lr_scheduler")
        assert (line.verdict, line.text.startswith(why.format(peer=t.peer))) == ("not carried", True), line.text
        assert "lr_scheduler" not in t.config


# ----------------------------------------------------------------------------------------------
# rex (musubi-tuner's REX schedule)


def rex_curve(steps: int, warmup: int = 0, floor: float = 0.01, alpha: float = 0.1, beta: float = 0.9) -> list[float]:
    """The paper's curve after a linear warmup from the floor: r + (1 - r) z / (alpha + beta z), z the share of the
    decay's steps left."""
    decay = steps - warmup
    return [floor + (1 - floor) * k / warmup if k < warmup else
            floor + (1 - floor) * ((decay - k + warmup) / decay) / (alpha + beta * (decay - k + warmup) / decay)
            for k in range(steps)]


@pytest.mark.parametrize("lines, steps, expected", [
    ("", 100, rex_curve(100)),
    ("lr_warmup_steps = 10\nlr_scheduler_min_lr_ratio = 0.1\n", 100, rex_curve(100, 10, 0.1)),
    ("lr_scheduler_rex_alpha = 0.5\nlr_scheduler_rex_beta = 0.5\n", 50, rex_curve(50, alpha=0.5, beta=0.5)),
])
def test_rex_is_the_papers_curve_from_its_keys(tmp_path, lines, steps, expected):
    """Starts at learning_rate (alpha + beta = 1), holds near it longer than a linear decay (0.91 at half the run
    with musubi-tuner's 0.1 / 0.9, the linear 0.5), ends near the floor (0.01 by default, as musubi-tuner)."""
    args = load(tmp_path, f'lr_scheduler = "rex"\nmax_train_steps = {steps}\n{lines}')
    ours = lrs(lambda o: optim.run_scheduler(o, args, steps), steps)
    assert ours == pytest.approx(expected, abs=1e-12)
    if not lines:
        assert ours[0] == 1.0 and ours[50] == pytest.approx(0.01 + 0.99 * 0.5 / 0.55) and ours[-1] < 0.12


MUSUBI = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".peers", "musubi-tuner", "src")


@pytest.mark.parametrize("warmup", [0, 10])
def test_rex_is_musubi_tuners_past_its_warmup(tmp_path, warmup, monkeypatch):
    """musubi-tuner's RexLR, where its checkout is (.peers/musubi-tuner): equal at every step past the warmup (its
    warmup climbs one step later, and its step 0 reads a negative step's modulo)."""
    checkout = os.environ.get("MUSUBI_TUNER_CHECKOUT", MUSUBI)
    if not os.path.isdir(os.path.join(checkout, "musubi_tuner", "modules")):
        pytest.skip("no musubi-tuner checkout (.peers/musubi-tuner or MUSUBI_TUNER_CHECKOUT)")
    monkeypatch.syspath_prepend(checkout)
    from musubi_tuner.modules.lr_schedulers import RexLR

    args = load(tmp_path, f'lr_scheduler = "rex"\nmax_train_steps = 80\nlr_warmup_steps = {warmup}\n'
                          'lr_scheduler_rex_alpha = 0.2\nlr_scheduler_rex_beta = 0.7\n')
    ours = lrs(lambda o: optim.run_scheduler(o, args, 80), 80)
    theirs = lrs(lambda o: RexLR(o, max_lr=1.0, min_lr=0.01, num_steps=80, num_warmup_steps=warmup, rex_alpha=0.2,
                                 rex_beta=0.7), 80)
    assert ours[warmup:] == pytest.approx(theirs[warmup:], abs=1e-12)


@pytest.mark.parametrize("lines, message", [
    ('lr_scheduler = "cosine"\nlr_scheduler_rex_alpha = 0.2\n',
     'key \'lr_scheduler_rex_alpha\' does nothing with lr_scheduler = "cosine"; it needs lr_scheduler = "rex"'),
    ('lr_scheduler = "rex"\nlr_scheduler_rex_alpha = 0\nlr_scheduler_rex_beta = 0\n',
     "rex divides by alpha + beta z: lr_scheduler_rex_alpha (0) + lr_scheduler_rex_beta (0) must be > 0"),
    ('lr_scheduler = "rex"\nlr_scheduler_rex_beta = -1\n', "key 'lr_scheduler_rex_beta' must be >= 0, got -1"),
])
def test_rex_keys_that_cannot_work_are_one_line(tmp_path, lines, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load(tmp_path, "max_train_steps = 100\n" + lines)


@pytest.mark.parametrize("args, verdict, ours", [
    (["rex_alpha=0.2", "rex_beta=0.8"], "renamed", {"lr_scheduler_rex_alpha": 0.2, "lr_scheduler_rex_beta": 0.8}),
    (["rex_alpha=0.2", "gamma=3"], "not carried", {}),
    ([], "dropped", {}),
])
def test_musubi_tuners_rex_is_carried_with_its_arguments(args, verdict, ours):
    t = musubi_tuner.translate({"network_module": "networks.lora_zimage", "lr_scheduler": "rex",
                                "lr_scheduler_min_lr_ratio": 0.05, "lr_scheduler_args": args}, "x.toml")
    assert (t.config["lr_scheduler"], t.config["lr_scheduler_min_lr_ratio"]) == ("rex", 0.05)
    assert next(line.verdict for line in t.lines if line.key == "lr_scheduler_args") == verdict
    assert {k: v for k, v in t.config.items() if k.startswith("lr_scheduler_rex")} == ours
    cosine = musubi_tuner.translate({"network_module": "networks.lora_zimage", "lr_scheduler": "cosine",
                                     "lr_scheduler_args": ["power=2"]}, "x.toml")
    assert next(line.verdict for line in cosine.lines if line.key == "lr_scheduler_args") == "not carried"


def test_sd_scripts_has_no_rex():
    t = sd_scripts.translate({"network_train_unet_only": True, "lr_scheduler": "rex"}, "x.toml")
    assert next(line.verdict for line in t.lines if line.key == "lr_scheduler") == "not carried"
