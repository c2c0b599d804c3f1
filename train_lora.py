#!/usr/bin/env python
"""LoRA training for the registered diffusion families (library/models/registry.py) and Llama/Qwen2 LLMs.

    python train_lora.py --config_file configs/quickstart.toml [--any_key value ...]
    accelerate launch [--config_file configs/accelerate/multi_gpu_ddp.yaml] train_lora.py --config_file ...

The story, top to bottom: read the config -> set up accelerate -> build the task (models, data,
caches, LoRA network) -> optimizer and scheduler -> the loop (loss, backward, clip, step, log,
sample, save) -> the final LoRA. Ctrl-C / SIGTERM save the LoRA and the state before exiting 130 (during
sample_at_first's samples: they stop at the next image and the run before step 1, nothing saved; during a
step's samples: they stop at the next image, and the resume renders the rest first; during the final
samples: they stop at the next image, the final LoRA written); a
non-finite gradient norm stops the run before its update, with the LoRA saved; a non-finite loss
or non-finite weights at a save stop it without calling the weights good. A sample render that fails
(out of memory) is a warning line: the run goes on without those samples.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import time
import warnings

from library.errors import INTERRUPTED, exit_without_collecting, one_line_warnings
from library.training.config import build_parser

# The arguments are checked before torch and the library load (seconds): --help and a bad flag answer at once.
if __name__ == "__main__":
    # SIGINT is the stop request (Ctrl-C, the web UI's Stop): a process started with it ignored (a script's
    # background job, as a UI started with `... &` runs its jobs) lost a Stop before the loop's handler.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        build_parser().parse_args()
    except ValueError as e:  # ConfigError: an unknown or malformed flag, one line
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    one_line_warnings()

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from library.io import CheckpointError  # noqa: E402
from library.training import fsdp, run_locks, tracking  # noqa: E402
from library.training.optim import LRLogger, create_optimizer, progress_postfix, run_scheduler, step_ds  # noqa: E402
from library.training.config import ConfigError, load_config, optimizer_kwargs  # noqa: E402
from library.training.output_names import sample_tag  # noqa: E402
from library.training.run_length import check_planned_steps, epoch_steps, plan_steps  # noqa: E402
from library.training.ema import TrainableEMA  # noqa: E402
from library.training.host_memory import return_freed_buffers  # noqa: E402
from library.training.lr_plot import plot_runs  # noqa: E402
from library.training.schedule_free import OptimizerModes  # noqa: E402
from library.training.state import (NothingToTrain, SavedState, check_no_unfinished_state,  # noqa: E402
                                    check_trainable_fit, item_digests, load_state, restore_rng, rng_states, sample_seed)
from library.training.saves import Saver, earlier_emas, keep_finished_final, resumed_saves, saves_at  # noqa: E402
from library.training.task import Task  # noqa: E402


class StopTraining(Exception):
    """Raised inside the loop to end the run; `code` becomes the exit status. `agreed`: every process stops
    at the same point (an agreed signal, a loss, norm or weights all processes share), so each waits there for
    the main process's save: one that left first made the launcher kill the main one mid-save."""

    def __init__(self, message: str, code: int, agreed: bool = True):
        super().__init__(message)
        self.code, self.agreed = code, agreed


class SamplesFailed(RuntimeError):
    """A render failed under FSDP (Trainer.render_failed): the other processes cannot go on without this one."""


class Interrupts:
    """Ctrl-C / SIGTERM set a flag; the loop saves and exits at the next optimizer step. A second one
    leaves at once, except while `saving` (the stop's save, the run ends right after it): a launcher's
    SIGTERM or a second Ctrl-C cut the save the first one asked for."""

    def __init__(self):
        self.requested = None
        self.saving = False
        self.previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)}

    def close(self):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame):
        if self.requested is not None and not self.saving:  # a second Ctrl-C: leave now
            raise KeyboardInterrupt
        self.requested = self.requested or signal.Signals(signum).name


def make_accelerator(args):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedDataParallelKwargs, ProjectConfiguration

    # accelerate keeps one AcceleratorState per process and refuses a second run's other
    # mixed_precision; clear it (not the process-group part) so main() can run again in-process.
    AcceleratorState._reset_state(reset_partial_state=False)

    if args.allow_tf32 and torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    trackers = tracking.trackers(args.log_with, args.logging_dir)
    # Gradient accumulation is done by the loop (Trainer.run_epoch), not by accelerate: an
    # optimizer step never spans two epochs, and the last partial group of an epoch steps too.
    # find_unused_parameters: some LoRAs get no gradient in a step (a last double-stream block's
    # text stream feeds nothing; module_dropout skips whole modules), and DDP would wait for them forever.
    accelerator = Accelerator(
        mixed_precision=args.mixed_precision,
        kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)],
        log_with=trackers or None,
        project_config=ProjectConfiguration(project_dir=args.output_dir, logging_dir=args.logging_dir),
    )
    check_process_group(accelerator)
    return accelerator


def check_process_group(accelerator):
    """A launcher (torchrun, accelerate launch) that started N processes for which accelerate found
    no backend (the multi-GPU yaml on a machine without GPUs: no nccl) would get N single-process
    runs writing the same files."""
    world_size = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world_size > 1 and accelerator.num_processes == 1:
        raise ConfigError(f"WORLD_SIZE={world_size} but no process group was set up (no GPU for the nccl backend), so "
                          f"each process would train alone into the same files; to run on CPU set ACCELERATE_USE_CPU=1 "
                          f"(the gloo backend), e.g. ACCELERATE_USE_CPU=1 torchrun --nproc_per_node {world_size} "
                          f"train_lora.py ..., or accelerate launch --cpu")


def output_lock(args, accelerator):
    """The run holds <output_dir>/.<output_name>.lock (library/training/run_locks.py), so a second run
    writing the same outputs stops at once."""
    from library.training.run_locks import held_by_run, lock_file

    return held_by_run(lock_file(args.output_dir, args.output_name), accelerator,
                       f"another training is writing output_name '{args.output_name}' in this output_dir; let it "
                       f"finish, or choose another output_dir or output_name")


def build_task(args, accelerator, state: SavedState | None = None,
               held: contextlib.ExitStack | None = None) -> Task:
    """The run's task; `state`: the one a resumed run loaded, which the task checks against its data (its
    length, batches per epoch and files) before any slow work (an LLM's eval log is cut back to its step);
    `held`: what the run holds to its end (a diffusion run's cache folder locks)."""
    if args.model_type == "llm":
        from library.training.llm_task import LLMTask

        return LLMTask(args, accelerator, state)
    from library.training.diffusion_task import DiffusionTask

    return DiffusionTask(args, accelerator, state, held)


def planned_epochs(args, batches_per_epoch: int, max_steps: int, step: int, epoch: int, batches_done: int) -> int:
    """The run's epochs in all (ss_num_epochs, sd-scripts' num_train_epochs): the `epoch` epochs done where
    it starts (a resumed run's, at the length they had: plan_steps), then those its steps left take at this
    run's length, counted from the start of the epoch in progress (`batches_done` of it done)."""
    done = math.ceil(batches_done / args.gradient_accumulation_steps)  # steps of the epoch in progress
    return epoch + max(1, math.ceil((max_steps - step + done) / epoch_steps(args, batches_per_epoch)))


class Trainer:
    """The run's objects and counters; `run()` is the loop."""

    def __init__(self, args, accelerator=None, held: contextlib.ExitStack | None = None):
        """held: where the run's locks go (its cache folders'), let go when the run ends (train());
        without it, when the process ends (a lock is a bare descriptor: collecting the task closes none)."""
        self.args, self.started = args, time.time()
        self.accelerator = accelerator = accelerator or make_accelerator(args)
        if fsdp.uses_fsdp(accelerator):
            fsdp.check_fsdp(accelerator, args)
        torch.manual_seed(args.seed)
        if accelerator.is_main_process:  # this run's output lock is held: what a killed save left is its own
            for line in run_locks.recover_saves(args):
                accelerator.print(line)
        accelerator.wait_for_everyone()
        # Read and checked before the models load: a damaged or foreign state fails in seconds.
        state = load_state(args.resume, args) if args.resume else None
        if state is None:
            check_no_unfinished_state(args)  # a forgotten --resume: before this run replaces it
        earlier = earlier_emas(args)
        os.makedirs(args.output_dir, exist_ok=True)
        self.task = task = build_task(args, accelerator, state, held)
        self.data_digests = item_digests(task.data_items())  # once: a save stats no file

        groups = task.param_groups(args.learning_rate)
        for group in (g for g in groups if "matches" in g):  # network_reg_lrs: the log's lr/reg<i> is this regex's
            accelerator.print(f"param group {group['name']}: the {group['modules']} modules network_reg_lrs' "
                              f"{group['matches']!r} matches, at lr {group['lr']:g}")
        optimizer = create_optimizer(groups, args.optimizer_type, args.learning_rate, optimizer_kwargs(args))
        self.max_steps = plan_steps(args, task.batches_per_epoch(), state.progress if state else None)
        if args.max_train_epochs:  # it wins over max_train_steps: say what it came to, as sd-scripts does
            per_epoch = epoch_steps(args, task.batches_per_epoch())
            resumed = (f", {max(0, self.max_steps - state.progress['step'])} of them after the resumed step "
                       f"{state.progress['step']}" if state else "")
            accelerator.print(f"max_train_epochs = {args.max_train_epochs}: {self.max_steps} optimizer steps "
                              f"({per_epoch} an epoch{resumed}), in place of max_train_steps")
        check_planned_steps(args, self.max_steps)  # (an llm's epochs: known now)
        # Stepped by hand once per optimizer step (accelerate would step a prepared scheduler once
        # per process), so the schedule is the same on 1 or N processes.
        self.scheduler = run_scheduler(optimizer, args, self.max_steps)
        # Batches are sharded by the task itself (explicit epochs make resume exact), so only the
        # trainable module (DDP-wrapped on several processes) and the optimizer are prepared.
        if fsdp.uses_fsdp(accelerator):  # the base is sharded by the task; the LoRA is prepared as for DDP
            self.module, self.optimizer = fsdp.prepare(accelerator, task.module, optimizer)
        else:
            self.module, self.optimizer = accelerator.prepare(task.module, optimizer)
        self.modes = OptimizerModes(self.optimizer)  # a schedule-free one: steps in train mode, read in eval mode
        self.modes.train()
        self.step, self.epoch, self.batches_done = 0, 0, 0
        self.val_loss = None  # the latest, shown in the progress bar between validations
        self.norm_counts = {}  # scale_weight_norms' counts of this step, for its log row
        self.step_ds = None  # each group's d the last optimizer step applied (adaptive optimizers)
        self.ema = None
        if args.ema_decay:  # after prepare and network_weights: the EMA starts from the weights training starts from
            self.ema = TrainableEMA(task.named_trainable_parameters(), args.ema_decay, args.ema_warmup,
                                    args.ema_start_step, args.ema_device, args.ema_inv_gamma, args.ema_power)
        self.samples_cut = None  # the samples a stop cut: {tag, step, prompts done}, for the resume to finish
        self.resample = None  # those of the state resumed, at its step
        if state:
            self.resume(args.resume, state)
        # A fresh run gets its own timestamped TensorBoard folder; a resumed one continues its state's.
        self.log_run = tracking.start_trackers(accelerator, args, state.progress.get("log_run") if state else None,
                                               self.step)
        # A resumed run continues the log from its state's step (rows after it, logged before a kill, go).
        self.logger = LRLogger(os.path.join(args.output_dir, f"{args.output_name}_log.csv"), accelerator,
                               append=bool(args.resume), resumed_step=self.step)
        saves = resumed_saves(state.progress, args) if state else None
        epochs = planned_epochs(args, task.batches_per_epoch(), self.max_steps, self.step, self.epoch,
                                self.batches_done)
        if not args.max_train_epochs:  # the epochs it comes to, as sd-scripts prints them
            accelerator.print(f"max_train_steps = {self.max_steps}: {epochs} epochs of "
                              f"{epoch_steps(args, task.batches_per_epoch())} optimizer steps")
        self.saver = Saver(args, task, accelerator, self.started, self.max_steps, epochs, self.ema, saves, earlier,
                           self.modes.reading)
        self.last_save: tuple[int, str | None, str | None] = (-1, None, None)  # step, LoRA, state folder or None

    def save_epoch(self) -> int:
        """The epoch a save now falls in, from 1 (ss_epoch, sd-scripts' loop counter + 1): the one in
        progress, or the one that has just ended."""
        return self.epoch + 1 if self.batches_done else max(1, self.epoch)

    def resume(self, folder: str, state: SavedState):
        progress = state.progress
        check_trainable_fit(folder, state.trainable, self.task.trainable_tensors())
        self.task.load_trainable_tensors(state.trainable)
        self.optimizer.load_state_dict(state.optimizer)
        self.scheduler.load_state_dict(progress["scheduler"])
        self.step, self.epoch, self.batches_done = progress["step"], progress["epoch"], progress["batches_done"]
        if self.batches_done and self.batches_done == progress.get("batches_per_epoch"):
            # written at its epoch's end (a step save, a Ctrl-C): that epoch is done whatever this run's count
            # (the new data's longer epoch went on with the batches after the old count, as the same epoch)
            self.batches_done = self.task.batches_per_epoch()
        if self.accelerator.scaler is not None and "grad_scaler" in progress:
            self.accelerator.scaler.load_state_dict(progress["grad_scaler"])
        if self.ema is not None:
            self.ema.load_state_tensors(state.ema, folder)
        cut = progress.get("samples_cut")  # (at a step before the state's: those weights are gone)
        self.resample = cut if cut and cut["step"] == self.step else None
        restore_rng(state.rng)
        # epochs counted from 1, as ss_epoch: "(epoch 1)" was step 6, in the second, and step 8, after the second
        where = (f"epoch {self.epoch + 1}, {self.batches_done} of its batches done" if self.batches_done
                 else f"after epoch {self.epoch}" if self.epoch else "at the start")
        self.accelerator.print(f"resumed from {folder} at step {self.step} ({where})")
        if self.accelerator.is_main_process:  # a finished run trained on: its final LoRA is not written over
            for old, new in keep_finished_final(self.args, self.step):
                self.accelerator.print(f"kept {old}, the final save of the run resumed, as {new}")
        self.accelerator.wait_for_everyone()

    def run(self) -> int:
        # (a state resumed at its run's end stopped before the models loaded: state.NothingToTrain)
        # Kept to the end: a Ctrl-C during the last step lets the final LoRA and state be written (and
        # skips the final samples) rather than leaving a run that trained every step without its LoRA.
        self.interrupts = Interrupts()
        try:
            return self.train_and_save()
        finally:
            self.interrupts.close()

    def train_and_save(self) -> int:
        args = self.args
        self.progress_bar = tqdm(total=self.max_steps, initial=self.step, desc="training",
                                 disable=not self.accelerator.is_local_main_process)
        self.module.train()  # the LoRA network: its dropouts act from here; the frozen base stays in eval
        try:
            if args.sample_at_first and self.step == 0:
                self.render_samples("start")
                if requested := self.render_stop():  # as a Ctrl-C while loading: nothing trained, nothing saved
                    raise StopTraining(f"{requested} during the first samples: stopped before step 1; nothing "
                                       f"trained, nothing saved", code=INTERRUPTED,
                                       agreed=False)  # this process's own signal
            if self.resample:
                self.finish_cut_samples(**self.resample)
            self.clock = tracking.StepClock()
            while self.step < self.max_steps:
                self.run_epoch()
                if self.batches_done == 0:  # the epoch ran to its end
                    self.epoch += 1
                    if args.save_every_n_epochs and self.epoch % args.save_every_n_epochs == 0 and self.step < self.max_steps:
                        self.save_intermediate()
                    if tag := sample_tag(args.sample_every_n_steps, args.sample_every_n_epochs, self.step,
                                         self.max_steps, self.epoch):
                        self.render_samples(tag)
                    self.clock.restart()
            self.check_finite()  # the last update's weights, before they are saved as the result
        except StopTraining as stop:
            self.progress_bar.close()  # the bar's line ends before the message
            self.accelerator.print(str(stop), file=sys.stderr) if stop.code else self.accelerator.print(str(stop))
            if stop.agreed:  # every process is here: none leaves while the main one writes the save
                self.accelerator.wait_for_everyone()
            self.accelerator.end_training()
            return stop.code
        finally:
            self.progress_bar.close()
        path = self.saver.lora(self.step, self.save_epoch(), final=True)
        if args.save_state or args.save_state_on_train_end:
            self.saver.state(self.optimizer, self.scheduler, self.progress())
        if self.accelerator.is_main_process:
            plot_runs([self.logger.path], os.path.join(args.output_dir, f"{args.output_name}_lr.png"))
        interrupted = self.final_samples()
        self.accelerator.wait_for_everyone()
        self.accelerator.end_training()
        self.accelerator.print(f"saved {path} after {self.step} steps in {time.time() - self.started:.1f} s")
        return INTERRUPTED if interrupted else 0  # (a Ctrl-C: 130 as mid-training, with the final LoRA saved)

    def finish_cut_samples(self, tag: str, step: int, done: int):
        """The samples of the resumed step that a stop cut (the state's samples_cut), from the first not
        rendered; a stop again ends the run before the next step, nothing trained (the state is as it was)."""
        self.accelerator.print(f"rendering the samples {tag} of step {step} from prompt {done + 1} on: a stop cut "
                               f"them before the state was saved")
        self.render_samples(tag, first=done)
        if requested := self.render_stop():
            raise StopTraining(f"{requested} during the samples of step {step}: stopped before step {step + 1}; "
                               f"nothing trained since the state resumed", code=INTERRUPTED, agreed=False)

    def final_samples(self) -> str | None:
        """The final samples (llm: the final eval), after the final LoRA is written. A Ctrl-C /
        SIGTERM before them skips them, one during them stops them at the next image (a second one
        at once); the signal's name is returned. A render that fails is one warning line, as
        render_samples' (a finished run exits 0: its LoRA is final)."""
        if requested := self.render_stop():  # during the last step
            self.accelerator.print(f"{requested} after the last step: final samples skipped; the LoRA is final")
            return requested
        paths, written = [], "stopped at once"
        try:
            with self.sampling():
                paths = self.task.finish(self.args.output_dir, lambda: self.render_stop() is not None) or []
            written = f"{len(paths)} written, the rest skipped"
        except KeyboardInterrupt:  # the second Ctrl-C: the image in progress is dropped
            pass
        except (RuntimeError, OSError, ValueError) as e:  # as render_samples: torch.OutOfMemoryError is a RuntimeError
            self.render_failed("the final samples", "; the LoRA is final", e)
        tracking.log_sample_images(self.accelerator, paths, self.step)
        if requested := self.render_stop():
            self.accelerator.print(f"{requested} during the final samples: {written}; the LoRA is final")
        return requested

    def save_intermediate(self, state: bool | None = None) -> tuple[str, str | None]:
        """A step or epoch save: the LoRA, and with save_state (or `state`) the state to resume from it. Once a step:
        a step save that ends an epoch is that epoch's save too, and a Ctrl-C after it adds only the state (each
        was written again, the LoRA under the same name and the state, gigabytes at full size, twice)."""
        step, path, folder = self.last_save
        if step != self.step:
            self.check_finite()
            path, folder = self.saver.lora(self.step, self.save_epoch()), None
        if (self.args.save_state if state is None else state) and folder is None:
            folder = self.saver.state(self.optimizer, self.scheduler, self.progress())
        self.last_save = (self.step, path, folder)
        return path, folder

    def progress(self) -> dict:
        return {"step": self.step, "epoch": self.epoch, "batches_done": self.batches_done, "log_run": self.log_run,
                "saves": self.saver.saves, "saves_at": saves_at(self.args), "max_steps": self.max_steps,
                "batches_per_epoch": self.task.batches_per_epoch(), "data_items": self.data_digests,
                "epoch_settings": self.task.epoch_settings(),
                **({"samples_cut": self.samples_cut} if self.samples_cut else {}),
                # fp16's loss scale: a resume at 65536 again skipped the steps until it fell back (4 of 5 here)
                **({"grad_scaler": self.accelerator.scaler.state_dict()} if self.accelerator.scaler is not None else {})}

    @contextlib.contextmanager
    def evaluating(self):
        """Samples and evaluations run with the LoRA network in eval mode (no dropout)."""
        self.module.eval()
        try:
            yield
        finally:
            self.module.train()

    def render_samples(self, tag: str, first: int = 0):
        """Samples to output_dir (the task's files) and to the trackers beside loss and lr. A render
        that fails (out of memory, a full disk, a reference image gone) is one warning line and the
        run goes on without those samples: a preview must not cost the steps since the last save. A stop
        (Ctrl-C) that cuts them is kept in samples_cut (the state's progress): a resume renders the rest."""
        failed, prompts_done = False, [first]
        self.samples_cut = None

        def stop() -> bool:  # asked before each prompt's image
            if self.render_stop() is None:
                prompts_done[0] += 1
                return False
            self.samples_cut = {"tag": tag, "step": self.step, "done": prompts_done[0]}
            return True

        try:
            with self.sampling():
                paths = self.task.render_samples(self.args.output_dir, tag, stop, first)
        except (RuntimeError, OSError, ValueError) as e:  # torch.OutOfMemoryError is a RuntimeError
            self.render_failed(f"samples {tag} at step {self.step}", ", training goes on", e)
            failed = True
        if failed:  # (the failed render's tensors went with its exception: none held past the except)
            if self.accelerator.device.type == "cuda":
                torch.cuda.empty_cache()
            return
        tracking.log_sample_images(self.accelerator, paths or [], self.step)

    def render_failed(self, what: str, then: str, error: Exception) -> None:
        """A render that failed on this process (out of memory on its GPU, a full disk): one warning line from
        this process, whichever it is (the main process's print alone said nothing of process 1's), and the run
        goes on without those images (`then`: what goes on, with its separator). Under FSDP every process's
        sampling forward all-gathers the sharded base, and the others wait in it for this one: no process can go
        on, so the run stops, each process with the line (the others' is the broken all-gather's), exit 1."""
        failure = " ".join(f"{type(error).__name__}: {error}".split())
        process = f" in process {self.accelerator.process_index}" if self.accelerator.num_processes > 1 else ""
        if fsdp.uses_fsdp(self.accelerator):
            raise SamplesFailed(f"{what} failed{process} under FSDP, whose other processes wait for it in the "
                                f"sampling forward: the run stops (its last save is the one to resume from): {failure}")
        print(f"warning: {what} failed{process} and are skipped{then}: {failure}", file=sys.stderr, flush=True)

    def render_stop(self) -> str | None:
        """The signal that ends a render before its next prompt. Under FSDP every process's forward
        all-gathers the sharded base, so all render the same prompts: the stop is agreed, as each step's
        (a SIGTERM to one process sent it from the render to the step's all-reduce while the others waited
        in the all-gather: a deadlock, nothing saved). Otherwise this process's own: a render of its own."""
        return self.interrupt_requested() if fsdp.uses_fsdp(self.accelerator) else self.interrupts.requested

    @contextlib.contextmanager
    def sampling(self):
        """Samples: eval mode, with sample_with_ema the EMA weights swapped in, and the RNG states put
        back afterwards (as sd-scripts does): a render that draws from them (a bf16 reference's LoRA
        init) must not change the dropout draws of the steps after it."""
        use_ema = self.ema is not None and self.args.sample_with_ema
        rng = rng_states()
        try:
            with self.evaluating(), self.modes.reading(), self.ema.swapped_in() if use_ema else contextlib.nullcontext():
                yield
        finally:
            restore_rng(rng)

    def run_epoch(self):
        """One pass over the data, resuming after `batches_done` batches; leaves batches_done at
        0 when the epoch ran to its end, or where it stopped at max_steps.

        An optimizer step takes gradient_accumulation_steps micro-batches counted from the start
        of the epoch; the epoch's last step takes what is left. Each micro-batch's loss is weighted
        by the task (Task.loss_weight: an image model's divided by the number of micro-batches of its
        step, an LLM's by its share of the step's trained tokens), so a step's gradient is the gradient
        of the logged loss whatever the grouping and the number of processes."""
        args, accelerator = self.args, self.accelerator
        accumulation, total = args.gradient_accumulation_steps, self.task.batches_per_epoch()
        losses = []
        for batch in self.clock.batches(self.task.epoch_batches(self.epoch, skip=self.batches_done)):
            step_start = self.batches_done - self.batches_done % accumulation
            micro_batches = min(accumulation, total - step_start)
            last = self.batches_done == step_start + micro_batches - 1
            if self.batches_done == step_start:
                self.seed_dropout()
            step_batches = range(step_start, step_start + micro_batches)
            weight, weights = self.task.loss_weight(self.epoch, self.batches_done, step_batches)
            # Gradients are all-reduced (DDP) only on the step's last micro-batch.
            with contextlib.nullcontext() if last else accelerator.no_sync(self.module):
                loss = self.module(*self.task.batch_inputs(batch, self.step))
                if not self.every_loss_finite(loss):
                    what = f"loss is {loss.item()}" if not torch.isfinite(loss.detach()) else "another process's loss is not finite"
                    raise StopTraining(self.diverged(what), code=3)
                accelerator.backward(loss * weight / weights)
            self.batches_done += 1
            losses.append(loss.detach() * weight / weights)
            if not last:
                continue
            if args.max_grad_norm:
                norm = accelerator.clip_grad_norm_(self.task.trainable_parameters(), args.max_grad_norm)
                # fp16's grad scaler expects inf gradients (it skips those steps); otherwise the update
                # would make every weight it touches inf or NaN: stop before it, with weights that were fine.
                if accelerator.scaler is None and norm is not None and not torch.isfinite(norm):
                    path = self.saver.lora(self.step, self.save_epoch(), final=True)
                    raise StopTraining(f"error: the gradient norm is {norm.item()} at step {self.step + 1} (epoch "
                                       f"{self.epoch}), not applied: the LoRA of step {self.step} (its loss was "
                                       f"finite) is saved at {path}", code=3)
            stepped = self.optimizer_step()
            self.optimizer.zero_grad(set_to_none=True)
            if args.scale_weight_norms and stepped:  # before the EMA takes the step's weights
                self.norm_counts = self.task.scale_weight_norms(args.scale_weight_norms)
            if self.ema is not None and stepped:  # per optimizer step; every rank averages the same (all-reduced) weights
                self.ema.update(self.step + 1)
            self.finish_step(accelerator.reduce(torch.stack(losses).sum(), reduction="mean").item(), stepped)
            losses = []
            if self.step >= self.max_steps and self.batches_done < total:  # at the epoch's end: it counts as run
                return
        self.batches_done = 0

    def interrupt_requested(self) -> str | None:
        """The Ctrl-C / SIGTERM this process got, or where another process got one, "a signal to another
        process": agreed every step, so all stop at the same one and the main process saves (a SIGTERM to
        one worker's pid stopped that worker alone; the others failed in the next collective, nothing saved)."""
        requested = self.interrupts.requested
        if self.accelerator.num_processes > 1:
            flag = torch.tensor([0.0 if requested is None else 1.0], device=self.accelerator.device)
            if self.accelerator.reduce(flag, reduction="sum").item() and requested is None:
                requested = "a signal to another process"
        return requested

    def seed_dropout(self):
        """Seed the global RNG, from which only the LoRA's dropouts draw in the loop (every other draw is
        seeded by its sample), by (seed, step, process): each process draws its own masks (every process
        drew the same ones, one mask for N samples), and a resumed run the straight run's."""
        torch.manual_seed(sample_seed(self.args.seed, self.step, f"dropout|{self.accelerator.process_index}"))

    def every_loss_finite(self, loss: torch.Tensor) -> bool:
        """Whether every process's micro-batch loss is finite. Checked together: a process that stopped on
        its own NaN left the others (the main one saves and prints) to fail in the next collective,
        with no line and no save."""
        bad = (~torch.isfinite(loss.detach())).float().reshape(1)
        if self.accelerator.num_processes > 1:
            bad = self.accelerator.reduce(bad, reduction="sum")
        return bad.item() == 0

    def diverged(self, what: str | None = None) -> str:
        """The stop line for a non-finite loss (`what`) or, with `what` None, for the non-finite
        weights check_finite found. The weights that gave a non-finite loss are the last update's, so
        they are not called good: kept (as an intermediate save, none pruned) only where finite."""
        saves = self.saver.intermediate_saves()
        earlier = [s for s in self.saver.saves if s < self.step and s in saves]  # this run's, not another's
        before = (f"the last save before it: step {earlier[-1]}, {saves[earlier[-1]][0]}" if earlier
                  else "no save before it (save_every_n_steps keeps some)")
        lead = f"error: {what} at step {self.step + 1} (epoch {self.epoch}); the" if what else "error: the"
        if what is None or not self.weights_finite():  # (check_finite has just scanned them)
            return f"{lead} LoRA's weights are no longer finite after step {self.step}: not saved; {before}"
        path = self.saver.lora(self.step, self.save_epoch(), prune=False)
        return (f"{lead} LoRA of step {self.step} gave it (its weights are finite: check it before use) and "
                f"is saved at {path}; {before}")

    def weights_finite(self) -> bool:
        return all(bool(torch.isfinite(t).all()) for t in self.task.trainable_tensors().values())

    def check_finite(self):
        """Before a save: an update can make the weights inf or NaN with its own loss still finite."""
        if not self.weights_finite():
            raise StopTraining(self.diverged(), code=3)

    def optimizer_step(self) -> bool:
        """optimizer.step(); False where fp16's grad scaler skipped it (an inf/NaN gradient: the
        weights stay, the scale drops). Read from the scale: accelerate's step_was_skipped stays
        False for optimizers that skip inside their own kernel (fused AdamW)."""
        scaler = self.accelerator.scaler
        scale = scaler.get_scale() if scaler is not None else None
        self.step_ds = step_ds(self.optimizer)  # Prodigy's d this step applies: the step leaves the next one's
        self.optimizer.step()
        return scaler is None or scaler.get_scale() >= scale

    def validation_due(self, step: int, ends_epoch: bool = False) -> bool:
        """Every validate_every_n_steps, at the end of every validate_every_n_epochs-th epoch (`ends_epoch`: step ends
        the epoch self.epoch counts from 0), and at the run's last step."""
        every, epochs = self.args.validate_every_n_steps, getattr(self.args, "validate_every_n_epochs", 0)
        return bool(self.task.validation_size()) and ((every and step % every == 0) or step == self.max_steps or bool(
            epochs and ends_epoch and (self.epoch + 1) % epochs == 0))

    def finish_step(self, loss: float, stepped: bool = True):
        """After an optimizer step: validate (when due), log (with the lr this step used),
        schedule, sample, save, and honour Ctrl-C / SIGTERM. A step fp16's grad scaler skipped (not
        `stepped`) leaves the schedule where it was, as accelerate's scheduler (the peers') does."""
        args = self.args
        extras, self.norm_counts = {**self.task.step_extras(), **self.norm_counts}, {}
        timing = self.clock.lap()  # before validation: a step's time is its training
        if self.task.validation_size():  # a val_loss column from the first row on, empty between validations
            extras["val_loss"] = None
            if self.validation_due(self.step + 1, self.batches_done == self.task.batches_per_epoch()):
                with self.evaluating(), self.modes.reading():
                    self.val_loss = extras["val_loss"] = self.task.validation_loss()
        extras.update(timing)
        values = {"loss": loss}
        if self.accelerator.is_main_process:
            values = self.logger.log(self.step + 1, self.epoch, loss, self.optimizer, extras, self.step_ds)
        if stepped:
            self.scheduler.step()
        self.step += 1
        self.progress_bar.update(1)
        self.progress_bar.set_postfix(progress_postfix({**values, "val_loss": self.val_loss}))
        # An LLM's eval and sample: with sample_with_ema on the EMA weights, as its final one.
        with self.sampling() if self.task.evaluates_after(self.step) else self.evaluating():
            self.task.after_step(self.step, args.output_dir)
        if tag := sample_tag(args.sample_every_n_steps, args.sample_every_n_epochs, self.step, self.max_steps):
            self.render_samples(tag)
        if args.save_every_n_steps and self.step % args.save_every_n_steps == 0 and self.step < self.max_steps:
            self.save_intermediate()
        requested = self.interrupt_requested()
        if requested and self.step < self.max_steps:  # (after the last: the final save as usual)
            self.interrupts.saving = True  # the run ends after this save: a second signal must not cut it
            path, folder = self.save_intermediate(state=True)
            raise StopTraining(f"{requested}: saved {path} and state {folder} at step {self.step}; "
                               f"continue with --resume {folder}", code=INTERRUPTED)
        self.clock.restart()


def train(args) -> int:
    accelerator = make_accelerator(args)
    if accelerator.device.type != "cpu":
        # Host RSS follows the live tensors while loading and caching, not glibc's free lists. Not on a
        # CPU run: there every step's activations would be fresh mappings (+25% step time, mid size).
        return_freed_buffers()
    with output_lock(args, accelerator), contextlib.ExitStack() as held:
        return Trainer(args, accelerator, held).run()


def main(argv=None) -> int:
    if os.environ.get("RANK", "0") != "0":
        # A process of torchrun / accelerate launch other than the main one: each reads the config and the prompts and
        # scans the data alike, so the warnings (UserWarning: ours, a library's) are the main process's alone, once
        # each. What fails in one process alone is a printed line (render_failed) or an error, not a warning.
        warnings.filterwarnings("ignore", category=UserWarning)
    try:
        args = load_config(argv)
        return train(args)
    except (ConfigError, CheckpointError, ValueError, OSError) as e:  # OSError: a full disk, a locked output, ...
        if os.environ.get("LORA_TRAINER_DEBUG"):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    except SamplesFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except NothingToTrain as e:  # resumed at its end: before the models load (said once, by the main process)
        if os.environ.get("RANK", "0") == "0":
            print(str(e))
        return 0
    except KeyboardInterrupt:  # Ctrl-C before the loop (loading, caching) or a second one inside it
        print("interrupted: stopped before the next save (cache files are written whole; a rerun reuses them)",
              file=sys.stderr)
        return INTERRUPTED


if __name__ == "__main__":
    exit_without_collecting(main())
