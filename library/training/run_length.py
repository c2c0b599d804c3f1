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


def check_planned_steps(args, max_steps: int) -> None:
    """The keys counted in steps against the run's max_steps once it is known (with max_train_epochs: from the
    dataset, before caching): the warmup and the EMA's start (with max_train_steps both are refused at load too).
    Each refusal begins with where its two keys were set (a file or the command line)."""
    length = "max_train_epochs" if args.max_train_epochs else "max_train_steps"
    check_warmup(args, max_steps, where_set(args, "lr_warmup_steps", length))
    check_ema_start(args, max_steps, where_set(args, "ema_start_step", length))


def check_ema_start(args, max_steps: int, where: str) -> None:
    """An EMA that starts at or after the run's last step would equal the raw weights: refused."""
    if args.ema_decay and args.ema_start_step >= max_steps:
        total = (f"max_train_epochs = {args.max_train_epochs} ({max_steps} steps)" if args.max_train_epochs
                 else f"max_train_steps = {max_steps}")
        raise ConfigError(f"{where}: key 'ema_start_step' = {args.ema_start_step} is not before {total}: the EMA "
                          f"would equal the raw weights")


def check_warmup(args, max_steps: int, where: str) -> None:
    """A warmup of max_steps or more never brings the lr to learning_rate (and a decaying schedule never
    decays): refused, naming both values, once max_steps is known (with max_train_epochs: from the
    dataset, before caching)."""
    warmup = warmup_steps(args.lr_warmup_steps, max_steps)
    if not args.lr_warmup_steps or warmup < max_steps:
        return
    said = f"{args.lr_warmup_steps:g}" + (f" ({warmup} steps)" if args.lr_warmup_steps < 1 else "")
    total = (f"max_train_epochs = {args.max_train_epochs} ({max_steps} steps)" if args.max_train_epochs
             else f"max_train_steps = {max_steps}")
    raise ConfigError(f"{where}: lr_warmup_steps = {said} is not below {total}: the lr would never reach "
                      f"learning_rate; shorten the warmup or train longer")
