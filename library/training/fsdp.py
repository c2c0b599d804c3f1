"""FSDP (accelerate's `distributed_type: FSDP`, fsdp_version 2): the frozen base sharded across the
processes, the LoRA replicated on each. For bases that do not fit one card whole (a 20 B
base in bf16, 41 GB): with N processes each holds 1/N of every frozen tensor, plus one block in full while
it runs.

    accelerate launch --config_file configs/accelerate/fsdp.yaml train_lora.py --config_file X.toml

Why train_lora.py shards the base itself instead of `accelerator.prepare`: the module accelerate
prepares (LoRALoss) owns only the LoRA network; the frozen base is held outside its tree on purpose
(DDP must not broadcast or all-reduce it). accelerate's FSDP2 path would shard that module, i.e.
the LoRA only, and leave the base whole on every card; it would also turn the LoRA parameters into
DTensor shards (the optimizer, EMA, clipping, saving and resume would all see shards) and cast
fp8 codes to its mixed-precision param dtype. So:
- base: torch's `fully_shard` on each transformer block (`swappable_blocks()`), then on the base
  itself (embedders, final layer). A block's weights are all-gathered just before it runs (forward,
  checkpoint recompute, backward) and freed after (`fsdp_reshard_after_forward`). Sharding starts
  on the CPU copy and moves one block at a time, so the base is never on a card whole.
- fp8, nf4 / int8, GGUF: the low-bit layers keep their stored tensors (codes, scales, blocks) as buffers,
  which FSDP does not shard (it replicates buffers); they become frozen Parameters first (the same
  tensors; FSDP2 all-gathers float8 and uint8 as it does bf16). The 0-dim scale of fp8_tensor_scaled
  stays a (replicated, 4-byte) buffer.
- LoRA: replicated, in DDP on a process group of its own (its gradient all-reduces never interleave
  with the base's all-gathers), as in the DDP path: every rank has the full LoRA, rank 0 saves it.
Other fsdp_config keys (auto wrap policy, state dict type, cpu_ram_efficient_loading) do not apply:
the blocks are the model's own, and only the (full, replicated) LoRA is ever saved.
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from library.training.config import ConfigError, where_set


def fsdp_settings(accelerator) -> dict | None:
    """{"version", "reshard_after_forward"} when this run shards the base, else None.

    On GPUs: accelerate's distributed_type FSDP and its plugin. On CPU accelerate never selects
    FSDP (its FSDP1 needs an accelerator: "FSDP needs a non-CPU accelerator device"), but torch's
    FSDP2 runs on gloo: with ACCELERATE_USE_CPU=1 the launcher's FSDP settings (the environment
    `accelerate launch --config_file configs/accelerate/fsdp.yaml` sets) are honoured on the
    MULTI_CPU processes. That is how the CPU test runs the real config."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type == DistributedType.FSDP:
        plugin = accelerator.state.fsdp_plugin
        return {"version": plugin.fsdp_version, "reshard_after_forward": plugin.reshard_after_forward}
    env = os.environ
    if accelerator.distributed_type == DistributedType.MULTI_CPU and env.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        reshard = env.get("FSDP_RESHARD_AFTER_FORWARD", "true").lower() in ("true", "1", "yes")
        return {"version": int(env.get("FSDP_VERSION", "1")), "reshard_after_forward": reshard}
    return None


def uses_fsdp(accelerator) -> bool:
    return fsdp_settings(accelerator) is not None


def check_fsdp(accelerator, args):
    """One clear line for what the sharded base does not support, naming where the refused key was set."""
    version = fsdp_settings(accelerator)["version"]
    if version != 2:
        raise ConfigError(f"accelerate config: fsdp_version {version}; train_lora.py shards the base with "
                          f"FSDP2 (torch fully_shard): set fsdp_version: 2")
    if args.model_type == "llm":
        raise ConfigError(f"{where_set(args, 'model_type')}: model_type = 'llm' under FSDP: only diffusion bases are "
                          f"sharded; launch LLMs with configs/accelerate/multi_gpu_ddp.yaml")
    if args.blocks_to_swap:
        raise ConfigError(f"{where_set(args, 'blocks_to_swap')}: blocks_to_swap = {args.blocks_to_swap} under FSDP: "
                          f"the sharded base and block swap both keep the base off the card; use one "
                          f"(blocks_to_swap = 0 with FSDP)")
    if args.torch_compile:
        raise ConfigError(f"{where_set(args, 'torch_compile')}: torch_compile = true under FSDP is not supported "
                          f"(untested); set it to false")
    if args.mixed_precision == "fp16":
        raise ConfigError(f"{where_set(args, 'mixed_precision')}: mixed_precision = 'fp16' under FSDP is not "
                          f"supported (no sharded grad scaler); use 'bf16'")


def stored_buffers_to_parameters(model: nn.Module) -> int:
    """The stored weights low-bit layers keep as buffers become frozen Parameters (the same tensors), so FSDP
    shards them (it replicates buffers: an nf4 / int8 or GGUF base was held whole by every process, 72% / 79% of
    the tiny test base per process of 2 where fp8 held 50%): FP8Linear's codes and block scales, fp8 packed weights'
    (a mixture's experts: sharded by expert), the bitsandbytes layers' stored tensors, GGUFLinear's blocks. Returns
    how many tensors moved."""
    from library.precision.bnb_weights import _BnbLinear
    from library.precision.fp8 import FP8Linear
    from library.precision.fp8_packed import PackedWeights
    from library.precision.gguf_weights import GGUFLinear

    moved = 0
    for module in model.modules():
        if isinstance(module, FP8Linear):
            names = ("weight", "weight_scale")
        elif isinstance(module, _BnbLinear):
            names = module.stored_names
        elif isinstance(module, GGUFLinear):
            names = ("weight",)
        elif isinstance(module, PackedWeights):
            names = module.stored_names()
        else:
            continue
        for name in names:
            t = module._buffers.get(name)
            if t is None or t.dim() == 0:  # a 0-dim per-tensor scale: nothing to shard
                continue
            del module._buffers[name]
            module.register_parameter(name, nn.Parameter(t, requires_grad=False))
            moved += 1
    return moved


def shard_base(base: nn.Module, accelerator) -> nn.Module:
    """fully_shard each block (in run order), then the base: every frozen tensor split over the
    processes on dim 0, on the accelerator's device."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if any(p.requires_grad for p in base.parameters()):
        raise ValueError("FSDP shards a frozen base; a base parameter requires grad")
    stored_buffers_to_parameters(base)
    # The base's output is a view (a slice); the losses use it out of place only, which is what
    # this warning asks for, so it says nothing for us.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDP\w+\) returned a view tensor")
    mesh = init_device_mesh(accelerator.device.type, (accelerator.num_processes,))
    reshard = fsdp_settings(accelerator)["reshard_after_forward"]
    for block in base.swappable_blocks():
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(base, mesh=mesh, reshard_after_forward=reshard)  # moves the buffers too (no base.to: DTensors)
    here, whole = local_bytes(base)
    print(f"fsdp: process {accelerator.process_index} of {accelerator.num_processes} holds {here / 2**20:.3f} MiB "
          f"of the base's {whole / 2**20:.3f} MiB ({here} of {whole} bytes)", flush=True)
    return base


def local_bytes(module: nn.Module) -> tuple[int, int]:
    """(bytes this process holds, bytes of the whole module) over parameters and buffers."""
    from torch.distributed.tensor import DTensor

    local = whole = 0
    for t in [*module.parameters(), *module.buffers()]:
        here = t.to_local() if isinstance(t, DTensor) else t
        local += here.numel() * here.element_size()
        whole += t.numel() * t.element_size()
    return local, whole


class ReplicatedLoRA(DistributedDataParallel):
    """DDP over the LoRA loss module; `set_requires_gradient_sync` is what accelerate's no_sync
    calls on a model under FSDP2 (gradient accumulation: all-reduce on the last micro-batch only)."""

    def set_requires_gradient_sync(self, sync: bool):
        self.require_backward_grad_sync = sync


def prepare(accelerator, module: nn.Module, optimizer: torch.optim.Optimizer):
    """What accelerator.prepare does on the DDP path, for the LoRA module beside a sharded base:
    autocast (mixed_precision) around its forward, DDP on its own process group, and the optimizer."""
    from accelerate.utils import convert_outputs_to_fp32, get_mixed_precision_context_manager

    if accelerator.native_amp:
        autocast = get_mixed_precision_context_manager(accelerator.native_amp, accelerator.autocast_handler)
        module.forward = convert_outputs_to_fp32(autocast(module.forward))
    group = dist.new_group(ranks=list(range(accelerator.num_processes)))
    device_ids = [accelerator.device.index] if accelerator.device.type == "cuda" else None
    # find_unused_parameters: some LoRAs get no gradient in a step (a last double-stream block's
    # text stream feeds nothing; module_dropout skips whole modules); DDP would refuse the next step.
    wrapped = ReplicatedLoRA(module, device_ids=device_ids, process_group=group, find_unused_parameters=True)
    return wrapped, accelerator.prepare_optimizer(optimizer, device_placement=False)
