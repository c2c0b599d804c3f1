"""Schedule-free optimizers: schedulefree's AdamWScheduleFree / RAdamScheduleFree / SGDScheduleFree (sd-scripts'
and musubi-tuner's names for them), or a module.Class with train() / eval() (prodigyplus' ProdigyPlusScheduleFree).

Such an optimizer keeps two points of the weights: it steps them at y (train mode: the point the gradient is
taken at) and keeps their running average x (eval mode), which is the result. The weights are switched in place
(p.lerp_ with its z state), so every read of them for what the run hands out (samples, validation, the LoRA
file) must run in eval mode, and every step in train mode; sd-scripts and musubi-tuner call optimizer.eval() /
.train() around their samples and saves. The switches are not exact inverses in floating point (x -> y rounds,
~1 ulp), so the weights y are kept before eval() and put back after train(): a read changes nothing, and a run
resumed from a save (a state is saved in train mode: y and the optimizer as the next step takes them) ends bit
for bit where the straight run without that save ends.

It has no lr schedule (its average does the annealing): lr_scheduler is constant and a warmup is its own
optimizer_args warmup_steps (sd-scripts ignores both keys for it; ours refuses them rather than let a config
say a schedule it does not run). An EMA of the weights (ema_decay) would average y, not the x it hands out.
"""

from __future__ import annotations

import contextlib

from library.errors import ConfigError, blame


def is_schedule_free_class(cls) -> bool:
    """An optimizer class with train() / eval() (torch.optim.Optimizer has neither)."""
    return callable(getattr(cls, "train", None)) and callable(getattr(cls, "eval", None))


def is_schedule_free(optimizer) -> bool:
    """`optimizer` (or the one accelerate's AcceleratedOptimizer wraps, which forwards train / eval) is schedule-free."""
    return is_schedule_free_class(type(getattr(optimizer, "optimizer", optimizer)))


def check_schedule_free_run(args, origins: dict[str, str], where: str) -> None:
    """The run's keys a schedule-free optimizer does not run with: one ConfigError naming the first, and the files
    that set it and optimizer_type."""
    said = f"optimizer_type {args.optimizer_type} is schedule-free (its running average of the weights is the result)"
    if args.lr_scheduler != "constant":
        raise ConfigError(f"{blame(origins, where, 'optimizer_type', 'lr_scheduler')}: {said}: it runs at a constant "
                          f"learning_rate, not lr_scheduler = \"{args.lr_scheduler}\" (sd-scripts ignores that key for it): "
                          f"leave lr_scheduler out")
    if args.lr_warmup_steps:
        raise ConfigError(f"{blame(origins, where, 'optimizer_type', 'lr_warmup_steps')}: {said}: its warmup is its "
                          f"own, optimizer_args = [\"warmup_steps=N\"], not lr_warmup_steps = {args.lr_warmup_steps:g}")
    if args.ema_decay:
        raise ConfigError(f"{blame(origins, where, 'optimizer_type', 'ema_decay')}: {said}: ema_decay would average "
                          f"the point it steps at, not the average it saves: leave ema_decay out")


class OptimizerModes:
    """Train mode for the steps, eval mode while the weights are read (reading()); nothing for other optimizers."""

    def __init__(self, optimizer):
        self.optimizer = optimizer if is_schedule_free(optimizer) else None
        self.readers = 0  # reading() nests: a save inside a sampling context switches once

    def train(self):
        """Before the first step (schedulefree builds its optimizers in eval mode, and its step refuses that)."""
        if self.optimizer is not None:
            self.optimizer.train()

    @contextlib.contextmanager
    def reading(self):
        self.readers += 1
        if self.readers == 1 and self.optimizer is not None:
            params = [p for group in self.optimizer.param_groups for p in group["params"]]
            steps_at = [p.detach().clone() for p in params]  # y: train() after eval() gives it back within ~1 ulp
            self.optimizer.eval()
        try:
            yield
        finally:
            self.readers -= 1
            if self.readers == 0 and self.optimizer is not None:
                self.optimizer.train()
                for p, y in zip(params, steps_at):
                    p.data.copy_(y)
