"""What a task offers the Trainer (train_lora.py): the one contract between the training loop and
what is trained. DiffusionTask (library/training/diffusion_task.py: every registered diffusion
family) and LLMTask (library/training/llm_task.py) both fulfil it; the Trainer calls nothing else on
a task (tests/test_task_contract.py reads train_lora.py to keep it so).

The words model_type, family and arch mean what library/models/registry.py says: a task trains one
model_type; the network and fp8 rules it builds are chosen by the family's arch.

A task is built with the state a resumed run loaded (or None) and checks it against its data
(library/training/state.py check_resumed_fit) as soon as it knows its batches, before any slow
work: a resume that cannot continue fails before minutes of caching.

Dtypes: the loss is a float32 scalar whatever the compute dtype; trainable tensors are in the
dtype they train in (the LoRA's, float32 by default); `save` casts to the dtype it is given.
"""

from __future__ import annotations

from typing import Callable, Iterable, Protocol

import torch
import torch.nn as nn


class Task(Protocol):
    module: nn.Module
    """The module accelerate prepares: it owns only the trainable tensors; module(*batch_inputs(...))
    returns the loss, a float32 scalar."""

    def param_groups(self, lr: float) -> list[dict]:
        """The optimizer's parameter groups (each with "params" and a "name" the LR log uses)."""

    def batches_per_epoch(self) -> int:
        """How many batches this process gets per epoch (the same on every process)."""

    def data_items(self) -> list[str]:
        """One line per training file (its place in the dataset, name and size; no contents): a state
        written inside an epoch resumes only on the same files."""

    def epoch_settings(self) -> list | None:
        """What orders an epoch's batches besides its files and their count (JSON values; None: nothing
        more): a state written inside an epoch resumes only with the same."""

    def epoch_batches(self, epoch: int, skip: int = 0) -> Iterable:
        """This process's batches of `epoch`, after the first `skip` (those trained before a resume)."""

    def loss_weight(self, epoch: int, batch: int, step_batches: range) -> tuple[float, float]:
        """(w, d): the loss of this process's batch `batch` of `epoch` enters the gradient of its optimizer
        step (the epoch's batches `step_batches`, on every process: DDP averages the processes' gradients)
        as loss * w / d, and the step's logged loss is the processes' mean of their sums of loss * w / d."""

    def batch_inputs(self, batch, step: int) -> tuple:
        """The module's forward arguments for `batch` at optimizer step `step`, on the device."""

    def trainable_parameters(self) -> list[nn.Parameter]:
        """The parameters the optimizer steps (their gradients are clipped)."""

    def named_trainable_parameters(self) -> dict[str, nn.Parameter]:
        """The same by name (the EMA keeps a copy of each)."""

    def trainable_tensors(self) -> dict[str, torch.Tensor]:
        """The trained tensors, detached, in the dtype they train in (what a state saves)."""

    def load_trainable_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Put back what trainable_tensors returned (resume)."""

    def validation_size(self) -> int:
        """Held-out samples the Trainer's val_loss is measured on (0: no validation)."""

    def validation_loss(self) -> float:
        """The held-out loss of the current weights (float32 math, no grad); called only when
        validation_size() > 0."""

    def scale_weight_norms(self, max_norm: float) -> dict:
        """After an optimizer step: the trained LoRA's modules scaled to a delta norm <= max_norm (sd-scripts'
        max-norm regularization); returns the counts for the step's log row."""

    def step_extras(self) -> dict:
        """Extra columns for this optimizer step's log row."""

    def after_step(self, step: int, output_dir: str) -> None:
        """Work after optimizer step `step` (the LLM's periodic evaluation)."""

    def evaluates_after(self, step: int) -> bool:
        """Whether after_step(step) evaluates and samples (the Trainer then swaps in the EMA weights
        where sample_with_ema asks, as for render_samples)."""

    def render_samples(self, out_dir: str, tag: str, stop: Callable[[], bool] | None = None,
                       first: int = 0) -> list[str]:
        """Samples of the current weights, written to out_dir; the image paths (text: none). Where
        `stop()` turns true (a Ctrl-C), it ends at the next image: the paths of those written. `stop()` is
        asked once before each prompt's image; `first`: the prompts before it are skipped (a stop cut them)."""

    def save(self, path: str, metadata: dict, dtype: torch.dtype) -> list[str] | None:
        """Write the trained weights for `path` (<output_dir>/<name>.safetensors) cast to `dtype`, with
        the string `metadata` in the header; what was written (None: just `path`)."""

    def finish(self, output_dir: str, stop: Callable[[], bool] | None = None) -> list[str] | None:
        """End of training: the final samples' paths (or the final evaluation); `stop` as for
        render_samples."""

    def metadata(self) -> dict:
        """The training facts only the task knows, as networks.lora_files.build_metadata fields:
        base_model_version, base_precision, resolution, batch_size, timestep_sampling, dataset (and
        base_loras, the LoRAs merged into the frozen base, where any; guidance, the guidance_scale trained
        at, where the model reads one: an LLM's header has no ss_guidance_scale)."""
