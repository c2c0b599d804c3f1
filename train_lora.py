#!/usr/bin/env python
"""LoRA training for FLUX.1, Qwen-Image and Llama/Qwen2 LLMs.

    python train_lora.py --config_file configs/quickstart.toml [--any_key value ...]
    accelerate launch [--config_file configs/accelerate/multi_gpu_ddp.yaml] train_lora.py --config_file ...

The story, top to bottom: read the config -> set up accelerate -> build the task (models, data,
caches, LoRA network) -> optimizer and scheduler -> the loop (loss, backward, clip, step, log,
sample, save) -> the final LoRA. Ctrl-C / SIGTERM save the LoRA and the state before exiting; a
non-finite loss stops the run after saving the last good LoRA.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time

import torch
from tqdm import tqdm

from library.io import CheckpointError
from library.optim import LRLogger, create_optimizer, create_scheduler, progress_postfix
from library.train_config import ConfigError, load_config, parse_kv_literals
from library.train_state import load_state, restore_rng, save_state

SAVE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class StopTraining(Exception):
    """Raised inside the loop to end the run; `code` becomes the exit status."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


class Interrupts:
    """Ctrl-C / SIGTERM set a flag; the loop saves and exits at the next optimizer step."""

    def __init__(self):
        self.requested = None
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        if self.requested is not None:  # a second Ctrl-C: leave now
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name


def make_accelerator(args):
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    if args.allow_tf32 and torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    tracker = "tensorboard" if args.logging_dir else None
    return Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        mixed_precision=args.mixed_precision,
        log_with=tracker,
        project_config=ProjectConfiguration(project_dir=args.output_dir, logging_dir=args.logging_dir),
    )


def build_task(args, accelerator):
    if args.model_type == "llm":
        from library.llm_training import LLMTask

        return LLMTask(args, accelerator)
    from library.diffusion_training import DiffusionTask

    return DiffusionTask(args, accelerator)


def lora_metadata(args, task, step: int, epoch: int, started: float) -> dict:
    from networks.lora_files import build_metadata

    return build_metadata(
        network_module=args.network_module, network_dim=args.network_dim, network_alpha=args.network_alpha,
        network_args=parse_kv_literals(args.network_args, "network_args", "config"),
        base_model_version=task.base_model_version(), base_model=args.pretrained_model_name_or_path,
        base_precision=task.base_precision(), mixed_precision=args.mixed_precision, resolution=task.resolution(),
        steps=step, epochs=epoch, batch_size=task.total_batch_size(), optimizer=args.optimizer_type
        + (f" ({' '.join(args.optimizer_args)})" if args.optimizer_args else ""),
        lr=args.learning_rate, lr_scheduler=args.lr_scheduler, timestep_sampling=task.timestep_sampling(),
        shift=args.discrete_flow_shift, guidance=args.guidance_scale, seed=args.seed, dataset=task.dataset_summary(),
        training_started_at=int(started), training_finished_at=int(time.time()),
        training_seconds=round(time.time() - started, 1), output_name=args.output_name,
    )


class Saver:
    """Writes LoRAs (atomically, with metadata) and states; keeps the newest N intermediates."""

    def __init__(self, args, task, accelerator, started: float):
        self.args, self.task, self.accelerator, self.started = args, task, accelerator, started
        self.intermediate: list[str] = []

    def lora(self, step: int, epoch: int, final: bool = False) -> str:
        name = self.args.output_name + ("" if final else f"-step{step:06d}")
        path = os.path.join(self.args.output_dir, name + ".safetensors")
        if self.accelerator.is_main_process:
            metadata = lora_metadata(self.args, self.task, step, epoch, self.started)
            self.task.save(path, metadata, SAVE_DTYPES[self.args.save_precision])
            if not final:
                self.intermediate.append(path)
                self._prune()
        return path

    def state(self, optimizer, scheduler, progress: dict) -> str:
        folder = os.path.join(self.args.output_dir, f"{self.args.output_name}-state")
        if self.accelerator.is_main_process:
            save_state(folder, self.task.trainable_tensors(), optimizer, scheduler, progress, self.args)
        return folder

    def _prune(self):
        keep = self.args.save_last_n_saves
        while keep and len(self.intermediate) > keep:
            old = self.intermediate.pop(0)
            if os.path.exists(old):
                os.remove(old)


def plan_steps(args, batches_per_epoch: int, accelerator) -> int:
    steps_per_epoch = max(1, math.ceil(batches_per_epoch / args.gradient_accumulation_steps))
    if args.max_train_epochs:
        return args.max_train_epochs * steps_per_epoch
    return args.max_train_steps


def train(args) -> int:
    started = time.time()
    accelerator = make_accelerator(args)
    torch.manual_seed(args.seed)
    os.makedirs(args.output_dir, exist_ok=True)
    task = build_task(args, accelerator)

    optimizer_kwargs = parse_kv_literals(args.optimizer_args, "optimizer_args", args.config_file or "command line")
    optimizer = create_optimizer(task.param_groups(args.learning_rate), args.optimizer_type, args.learning_rate, optimizer_kwargs)
    dataloader = task.dataloader()
    max_steps = plan_steps(args, len(dataloader), accelerator)
    # The scheduler is stepped by hand once per optimizer step (not prepared by accelerate, which
    # would step it once per process), so the schedule is the same on 1 or N processes.
    scheduler = create_scheduler(optimizer, args.lr_scheduler, args.lr_warmup_steps, max_steps,
                                 args.lr_scheduler_num_cycles, args.lr_scheduler_power)
    module, optimizer, dataloader = accelerator.prepare(task.module, optimizer, dataloader)

    step, epoch, batches_done = 0, 0, 0
    if args.resume:
        trainable, optimizer_state, progress, rng = load_state(args.resume, args)
        task.load_trainable_tensors(trainable)
        optimizer.load_state_dict(optimizer_state)
        scheduler.load_state_dict(progress["scheduler"])
        step, epoch, batches_done = progress["step"], progress["epoch"], progress["batches_done"]
        restore_rng(rng)
        accelerator.print(f"resumed from {args.resume} at step {step} (epoch {epoch})")

    if args.logging_dir:
        accelerator.init_trackers(args.log_prefix or args.output_name, config={k: str(v) for k, v in vars(args).items()})
    logger = LRLogger(os.path.join(args.output_dir, f"{args.output_name}_log.csv"), accelerator, append=bool(args.resume))
    saver = Saver(args, task, accelerator, started)
    interrupts = Interrupts()
    if args.sample_at_first and step == 0:
        task.render_samples(args.output_dir, "start")

    progress_bar = tqdm(total=max_steps, initial=step, desc="training", disable=not accelerator.is_local_main_process)
    try:
        while step < max_steps:
            step, batches_done = run_epoch(args, task, accelerator, module, optimizer, scheduler, dataloader, logger,
                                           saver, interrupts, progress_bar, step, epoch, batches_done, max_steps)
            if batches_done == 0:
                epoch += 1
                if args.save_every_n_epochs and epoch % args.save_every_n_epochs == 0 and step < max_steps:
                    saver.lora(step, epoch)
                if args.sample_every_n_epochs and epoch % args.sample_every_n_epochs == 0:
                    task.render_samples(args.output_dir, f"epoch{epoch:04d}")
    except StopTraining as stop:
        progress_bar.close()
        accelerator.print(str(stop), file=sys.stderr) if stop.code else accelerator.print(str(stop))
        accelerator.end_training()
        return stop.code
    progress_bar.close()
    path = saver.lora(step, epoch, final=True)
    task.finish(args.output_dir)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    accelerator.print(f"saved {path} after {step} steps in {time.time() - started:.1f} s")
    return 0


def run_epoch(args, task, accelerator, module, optimizer, scheduler, dataloader, logger, saver, interrupts,
              progress_bar, step, epoch, batches_done, max_steps):
    """One pass over the data (resuming after `batches_done` batches). Returns (step, batches
    done in this epoch, 0 once it finished)."""
    from accelerate import skip_first_batches

    task.set_epoch(epoch)
    batches = skip_first_batches(dataloader, batches_done) if batches_done else dataloader
    losses = []
    for batch in batches:
        with accelerator.accumulate(module):
            loss = module(*task.batch_inputs(batch, step))
            if not torch.isfinite(loss.detach()):
                path = saver.lora(step, epoch, final=True)
                raise StopTraining(f"error: loss is {loss.item()} at step {step + 1} (epoch {epoch}); "
                                   f"the last good LoRA (step {step}) is saved at {path}", code=3)
            accelerator.backward(loss)
            if accelerator.sync_gradients and args.max_grad_norm:
                accelerator.clip_grad_norm_(task.trainable_parameters(), args.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        batches_done += 1
        losses.append(loss.detach())
        if not accelerator.sync_gradients:
            continue
        step_loss = accelerator.reduce(torch.stack(losses).mean(), reduction="mean").item()
        losses = []
        values = logger.log(step + 1, epoch, step_loss, optimizer, task.step_extras()) if accelerator.is_main_process else {"loss": step_loss}
        scheduler.step()
        step += 1
        progress_bar.update(1)
        progress_bar.set_postfix(progress_postfix(values))
        after_step(args, task, accelerator, optimizer, scheduler, saver, interrupts, step, epoch, batches_done, max_steps)
        if step >= max_steps:
            return step, batches_done
    return step, 0


def after_step(args, task, accelerator, optimizer, scheduler, saver, interrupts, step, epoch, batches_done, max_steps):
    """Periodic work after an optimizer step: eval/samples, saves, and interruption."""
    progress = {"step": step, "epoch": epoch, "batches_done": batches_done}
    task.after_step(step, args.output_dir)
    if args.sample_every_n_steps and step % args.sample_every_n_steps == 0:
        task.render_samples(args.output_dir, f"step{step:06d}")
    if args.save_every_n_steps and step % args.save_every_n_steps == 0 and step < max_steps:
        saver.lora(step, epoch)
        if args.save_state:
            saver.state(optimizer, scheduler, progress)
    if interrupts.requested:
        path = saver.lora(step, epoch)
        folder = saver.state(optimizer, scheduler, progress)
        raise StopTraining(f"{interrupts.requested}: saved {path} and state {folder} at step {step}; "
                           f"continue with --resume {folder}", code=130)
    if step >= max_steps and args.save_state:
        saver.state(optimizer, scheduler, progress)


def main(argv=None) -> int:
    try:
        args = load_config(argv)
        return train(args)
    except (ConfigError, CheckpointError, ValueError, FileNotFoundError, PermissionError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
