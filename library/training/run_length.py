"""How long a run is: its optimizer steps from max_train_steps or max_train_epochs (a resumed run's at the
length its epochs had), and the keys counted in steps (the warmup, the EMA's start) checked against it.

Plain arithmetic on the parsed arguments, no torch: config.py checks these at load where
max_train_steps is given, the trainer again once the dataset sets an epoch's length.
"""

from __future__ import annotations

import math

from library.errors import ConfigError, where_set


def plan_steps(args, batches_per_epoch: int, resumed: dict | None = None) -> int:
    """The run's optimizer steps: max_train_epochs x the steps of an epoch where it is set (it wins
    over max_train_steps, as in sd-scripts), else max_train_steps. `resumed`: the progress of the state
    a resumed run continues; with max_train_epochs the run ends where epoch max_train_epochs would begin,
    the epochs it trained counted at the length they had (the data may change between epochs)."""
    if not args.max_train_epochs:
        return args.max_train_steps
    per_epoch = epoch_steps(args, batches_per_epoch)
    if resumed is None:
        return args.max_train_epochs * per_epoch
    epoch, done = resumed["epoch"], resumed["batches_done"]
    if done and done in (resumed.get("batches_per_epoch"), batches_per_epoch):  # written at its epoch's end
        epoch, done = epoch + 1, 0
    # (inside an epoch the state's batches per epoch are this run's: state.check_resumed_epoch)
    left = (args.max_train_epochs - epoch) * per_epoch - math.ceil(done / args.gradient_accumulation_steps)
    return resumed["step"] + max(0, left)


def epoch_steps(args, batches_per_epoch: int) -> int:
    """An epoch's optimizer steps: its batches in groups of gradient_accumulation_steps, the last group short."""
    return max(1, math.ceil(batches_per_epoch / args.gradient_accumulation_steps))


def warmup_steps(warmup: float, max_steps: int) -> int:
    """lr_warmup_steps as steps: itself where >= 1, a fraction of max_steps where < 1, rounded down as
    sd-scripts does (int(ratio * steps)): rounding gave 0.15 of 10 steps a warmup of 2, sd-scripts' 1."""
    return int(warmup * max_steps) if 0 < warmup < 1 else int(warmup)


def decay_steps(decay: float | None, max_steps: int) -> int:
    """lr_decay_steps as steps, read as lr_warmup_steps is (sd-scripts: int(ratio * steps)); unset: none."""
    return 0 if decay is None else warmup_steps(decay, max_steps)


def check_planned_steps(args, max_steps: int) -> None:
    """The keys counted in steps against the run's max_steps once it is known (with max_train_epochs: from the
    dataset, before caching): the warmup, the warmup and decay together, and the EMA's start (with max_train_steps
    they are refused at load too). Each refusal begins with where its keys were set (a file or the command line)."""
    length = "max_train_epochs" if args.max_train_epochs else "max_train_steps"
    check_warmup(args, max_steps, where_set(args, "lr_warmup_steps", length))
    check_decay(args, max_steps, where_set(args, "lr_warmup_steps", "lr_decay_steps", length))
    check_ema_start(args, max_steps, where_set(args, "ema_start_step", length))


def check_ema_start(args, max_steps: int, where: str) -> None:
    """An EMA that starts at or after the run's last step would equal the raw weights: refused."""
    if args.ema_decay and args.ema_start_step >= max_steps:
        raise ConfigError(f"{where}: key 'ema_start_step' = {args.ema_start_step} is not before "
                          f"{_run_length(args, max_steps)}: the EMA would equal the raw weights")


def check_warmup(args, max_steps: int, where: str) -> None:
    """A warmup of max_steps or more never brings the lr to learning_rate (and a decaying schedule never
    decays): refused, naming both values, once max_steps is known (with max_train_epochs: from the
    dataset, before caching)."""
    warmup = warmup_steps(args.lr_warmup_steps, max_steps)
    if not args.lr_warmup_steps or warmup < max_steps:
        return
    said = f"{args.lr_warmup_steps:g}" + (f" ({warmup} steps)" if args.lr_warmup_steps < 1 else "")
    total = _run_length(args, max_steps)
    raise ConfigError(f"{where}: lr_warmup_steps = {said} is not below {total}: the lr would never reach "
                      f"learning_rate; shorten the warmup or train longer")


def check_decay(args, max_steps: int, where: str) -> None:
    """warmup_stable_decay's warmup and decay longer than the run leave its stable part fewer than 0 steps: the
    decay would start part-way down (transformers takes it). Refused, naming the values and the run's length."""
    if args.lr_decay_steps is None or args.lr_scheduler != "warmup_stable_decay":  # (config_keys refuses it there)
        return
    warmup, decay = warmup_steps(args.lr_warmup_steps, max_steps), decay_steps(args.lr_decay_steps, max_steps)
    if warmup + decay <= max_steps:
        return
    said = [f"{key} = {value:g}" + (f" ({steps} steps)" if 0 < value < 1 else "")
            for key, value, steps in (("lr_warmup_steps", args.lr_warmup_steps, warmup),
                                      ("lr_decay_steps", args.lr_decay_steps, decay)) if value]
    raise ConfigError(f"{where}: {' and '.join(said)} {'together are' if len(said) > 1 else 'is'} longer than "
                      f"{_run_length(args, max_steps)}: the decay would start part-way down; shorten "
                      f"{'one' if len(said) > 1 else 'it'} or train longer")


def _run_length(args, max_steps: int) -> str:
    """The run's length as an error line says it: the key that set it."""
    if args.max_train_epochs:
        return f"max_train_epochs = {args.max_train_epochs} ({max_steps} steps)"
    return f"max_train_steps = {max_steps}"
