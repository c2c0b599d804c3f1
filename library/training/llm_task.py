"""What train_lora.py needs to train a Llama/Qwen2-style LLM: a LoRA on a pretrained model, or
the whole model (pretrain = true) from a checkpoint or from a config.json alone (random init).

Data: .txt files and .jsonl records -> one token stream (each document encoded with the tokenizer's own
special tokens, e.g. Llama's BOS, and ended by EOS; a plain-text prompt / completion record likewise, the loss
on its completion; each conversation rendered by the chat template, the loss on its assistant tokens; all
tokens with train_on_all_tokens) -> train/val split -> sliding
windows of max_length + 1 tokens. Unless attend_across_documents, a window that packs several documents
attends within each alone (a block-diagonal causal mask), counts each one's positions from 0 and does not
train the target after a document's end (the next document's first token): the windows' `documents`.
Every eval_every_n_steps: val loss (token-weighted over the whole held-out split, `held_out_loss`; none
when val_fraction holds nothing out), perplexity and a sample from sample_prompt (temperature / top-k;
with sample_chat_template, the prompt is one user turn of the chat template and the sample its reply
alone), printed and written to <output_name>_eval.csv.
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import warnings
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from library.data.chat_records import chat_encoder, end_of_turn_id, user_turn_ids
from library.data.dataset import process_share
from library.data.packing import PackedWindowDataset, packing_of
from library.data.text_corpus import (IGNORE, TextWindowDataset, batch_documents, check_corpus, corpus_files,
                                      document_borders, kept_windows, measured, split_starts, tokenize_corpus,
                                      train_val_split, warn_long_conversations, window_documents, window_targets)
from library.models.core import checkpointing
from library.models.llm import (LLM, LLMConfig, _find_config, config_json_path, cross_entropy_loss, generate, load_llm,
                                perplexity, save_hf_folder)
from library.models.llm_lora_files import nested_path, nests_language_model, peft_base_path
from library.data.tokenizer import load_tokenizer
from library.io import append_csv_row
from library.training.config import (ConfigError, base_precision, check_stored_precision, compute_dtype, lora_formats,
                                     lora_network_args, network_modules_from, slow_cpu_compute_line)
from library.training.lora_inputs import (check_lora_inputs, check_network_fits, check_network_settings,
                                          load_network_weights)
from library.training.optim import drop_rows_after
from library.training.output_names import step_tag
from library.training.state import SavedState, check_resumed_fit
from networks.factory import build_network

VOCAB_MULTIPLE = 64  # pretraining pads the vocab so the embedding / head matmuls tile well


def compute_autocast(device: torch.device | str, dtype: torch.dtype | None):
    """torch.autocast to `dtype` on device's type; off for None / float32. Pretraining's fp32 weights
    need it in every forward: accelerate autocasts only the prepared forward and only where it has
    native AMP (not fp16 on CPU), and evals run outside that forward."""
    return torch.autocast(torch.device(device).type, dtype=dtype, enabled=dtype not in (None, torch.float32))


class LMLoss(nn.Module):
    """The module accelerate prepares: the LoRA network (LoRA) or the model itself (pretrain).
    autocast_dtype: the compute dtype of a model with fp32 master weights (pretrain), else None."""

    def __init__(self, model: LLM, network: nn.Module | None, autocast_dtype: torch.dtype | None = None):
        super().__init__()
        if network is None:
            self.model = model
        else:
            self.network = network
            self._model = [model]
        self.autocast_dtype = autocast_dtype

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        """documents: int64 [B, L], each input token's document in a packed window (None: one a window)."""
        model = self.model if hasattr(self, "model") else self._model[0]
        with compute_autocast(input_ids.device, self.autocast_dtype):
            return cross_entropy_loss(model(input_ids, documents=documents), targets)


RESIDUAL_PROJECTIONS = ("o_proj.weight", "down_proj.weight")  # what each layer adds to the residual stream


def init_weights(model: LLM, std: float = 0.02, scaled_residual: bool = True):
    """GPT-2 style init for pretraining from scratch: matrices N(0, std), the residual projections
    (o_proj, down_proj) N(0, std / sqrt(2 * num_layers)) when scaled_residual (GPT-2, nanoGPT: the
    2 * num_layers additions then leave the residual stream's variance about where it starts);
    biases 0, norms 1."""
    residual_std = std / math.sqrt(2 * model.config.num_layers) if scaled_residual else std
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            nn.init.normal_(p, std=residual_std if name.endswith(RESIDUAL_PROJECTIONS) else std)
        elif name.endswith("bias"):
            nn.init.zeros_(p)
        else:
            nn.init.ones_(p)


OTHER_WEIGHT_FORMATS = {".gguf": "a llama.cpp GGUF file", ".bin": "a PyTorch pickle", ".pt": "a PyTorch pickle",
                        ".pth": "a PyTorch pickle"}


def refuse_other_weight_formats(path: str) -> None:
    """An LLM base is a Hugging Face safetensors model (GGUF is read for diffusion transformers only):
    a .gguf / .bin file given, or a folder holding such weights and no .safetensors, is one ConfigError
    before the tokenizer is looked for (which would blame a missing tokenizer.json)."""
    if has_weights(path):
        return
    names = sorted(os.listdir(path)) if os.path.isdir(path) else [os.path.basename(path)]
    found = next((n for n in names if os.path.splitext(n)[1].lower() in OTHER_WEIGHT_FORMATS), None)
    if found:
        where = os.path.join(path, found) if os.path.isdir(path) else path
        raise ConfigError(f"pretrained_model_name_or_path {where}: {OTHER_WEIGHT_FORMATS[os.path.splitext(found)[1].lower()]}; "
                          f"an LLM base must be a Hugging Face safetensors model (a folder with config.json, "
                          f"tokenizer.json and *.safetensors)")


def has_weights(path: str) -> bool:
    """Whether `path` holds safetensors weights in a form load_llm reads (a file, an index, a folder
    holding either). An index whose shards are not all beside it (a download stopped after the index)
    is one ConfigError naming the missing files, not a base without weights."""
    names = sorted(os.listdir(path)) if os.path.isdir(path) else [os.path.basename(path)]
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    index = next((n for n in names if n.endswith(".safetensors.index.json")), None)
    if index is None:
        return any(n.endswith(".safetensors") for n in names)
    try:
        with open(os.path.join(folder, index)) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"{os.path.join(folder, index)}: not a safetensors index (a JSON object with a weight_map): "
                          f"{type(e).__name__}: {e}") from None
    missing = [s for s in shards if not os.path.isfile(os.path.join(folder, s))]
    if missing:
        raise ConfigError(f"{os.path.join(folder, index)}: {len(missing)} of its {len(shards)} shard files are missing "
                          f"beside it: {', '.join(missing)}")
    return True


def check_before_loading(args) -> None:
    """What train_lora.py checks of an LLM config first, from the config and the files' names and headers (seconds:
    no tokenizer, text or weights read): LLMTask and the web UI's config check (library/ui/config_check.py) run
    this one function, so a config one refuses the other refuses with the same line."""
    if not os.path.exists(args.pretrained_model_name_or_path):  # a typo: not "no tokenizer.json here"
        raise ConfigError(f"pretrained_model_name_or_path {args.pretrained_model_name_or_path}: no such file or folder")
    refuse_other_weight_formats(args.pretrained_model_name_or_path)
    corpus_files(args.train_data)  # a missing entry, a folder without text (check_corpus reads them later)
    if not args.pretrain:
        check_network_settings(args, "llm")  # network_args' keys and values, before any module is built
        check_lora_inputs(args, "llm")  # network_weights: its header, before the model loads


def summed_loss(model, inputs: torch.Tensor, targets: torch.Tensor, documents: torch.Tensor | None) -> tuple:
    """(summed cross-entropy in float32, scored targets) of one held-out batch: int64 [B, n] inputs and targets on
    the model's device, documents int64 [B, n] or None."""
    logits = model(inputs, documents=None if documents is None else documents.to(inputs.device))
    return (float(F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")),
            int((targets != IGNORE).sum()))


class LLMTask:
    def __init__(self, args, accelerator, state: SavedState | None = None):
        """state: the one a resumed run loaded (None: a new run), checked against the data once it is read."""
        self.args, self.accelerator, self.device = args, accelerator, accelerator.device
        self._epochs_shuffled: dict[int, list[list[int]]] = {}  # _global_batches' shuffles
        self._step_tokens: tuple = (None, {})  # loss_weight's (step, trained tokens per batch and process)
        self.dtype = compute_dtype(args)
        if line := slow_cpu_compute_line(args, self.device):
            accelerator.print(line, file=sys.stderr)
        # Pretraining keeps fp32 master weights and computes in self.dtype under autocast (bf16
        # weights round most small AdamW updates away; a GradScaler refuses fp16 gradients); the
        # residual stream then stays fp32, as in torch AMP. A LoRA's frozen base is stored in self.dtype.
        self.weights_dtype = torch.float32 if args.pretrain else self.dtype
        self.autocast_dtype = self.dtype if args.pretrain else None
        path = args.pretrained_model_name_or_path
        check_before_loading(args)
        self.tokenizer = load_tokenizer(path)
        # read before the model: a bad train_data entry or record fails at once
        no_template = None if self.tokenizer.chat_template else (
            f"the tokenizer in {path} has no chat template (chat_template in tokenizer_config.json, or "
            f"chat_template.jinja)")
        if args.sample_chat_template and no_template:
            raise ConfigError(f"sample_chat_template = true, but {no_template} to render sample_prompt with")
        files, counts = check_corpus(args.train_data, no_template and f"{no_template} to render it with",
                                     args.train_on_all_tokens)
        self.sample_chat = args.sample_chat_template if args.sample_chat_template is not None else counts.conversations > 0
        self.sample_ids = self._sample_prompt_ids()
        # a chat sample ends at the reply's end of turn too (<|im_end|> where EOS is a base's <|endoftext|>)
        turn_end = end_of_turn_id(self.tokenizer) if self.sample_chat else None
        stops = (self.tokenizer.eos_token_id, turn_end)
        self.sample_stops = tuple(dict.fromkeys(i for i in stops if i is not None)) or None
        self.stored_precision = None  # a pre-quantized (or plain e5m2) base's layout (_base_prepare)
        config, self.from_scratch, prepare = self._model_config(path)
        if not args.pretrain:  # network_args against the model, network_weights' ranks against the network's: before tokenizing
            check_network_fits(args, "llm", lambda: self._meta_model(config))
        self.train_set = self._load_data(files, counts.documents, config.vocab_size)
        if state:  # before the weights load (minutes for a large base): a resume that does not fit fails at once
            check_resumed_fit(args.resume, state.progress, args, self.batches_per_epoch(), self.data_items())
        self.model = self._load_model(path, config, prepare)
        self.model.gradient_checkpointing = checkpointing(args.gradient_checkpointing, args.checkpoint_saves_projections,
                                                          args.checkpoint_saves_attention,
                                                          args.checkpoint_saves_dequantized)
        self.network = None
        if args.pretrain:
            self.model.requires_grad_(True).train()
        else:
            self.network = build_network(args.network_module, self.model, "llm", args.network_dim, args.network_alpha,
                                         network_args=lora_network_args(args), modules_from=network_modules_from(args))
            if args.network_weights:  # the header says the file's ranks and alphas (self.loaded)
                said, self.loaded = load_network_weights(self.network, args)
                accelerator.print(said)
            self.network.apply()
        self.model.to(self.device)
        if self.network is not None:
            self.network.to(self.device)
        self.module = LMLoss(self.model, self.network, self.autocast_dtype)
        self.eval_log = os.path.join(args.output_dir, f"{args.output_name}_eval.csv")
        self.step = 0  # the last optimizer step done (after_step): the step trackers log an eval at
        if accelerator.is_main_process and os.path.exists(self.eval_log):
            if state is None:
                os.remove(self.eval_log)  # a new run's evals, as its log CSV (appended to, they mixed two runs)
            else:  # the evals a run killed after its last save logged are logged again
                drop_rows_after(self.eval_log, state.progress["step"])

    def _meta_model(self, config: LLMConfig) -> nn.Module:
        """The model built on the meta device (no weights): what check_network_fits builds the run's network on."""
        with torch.device("meta"):
            return LLM(config)

    def _model_config(self, path: str) -> tuple[LLMConfig, bool, Callable | None]:
        """(the model's config, whether it trains from scratch, load_llm's prepare hook), read and checked
        before the data and the weights (a refusal here takes seconds): config.json (a quantized release's
        refusal), max_length against the context window, a stored precision against the config's. From
        scratch (pretrain without weights), the vocab holds the tokenizer's, padded to VOCAB_MULTIPLE."""
        if has_weights(path):
            config = _find_config(path)  # first: its refusals (a quantized release's) come before the weights'
            self._check_context(config)
            return config, False, self._base_prepare(path)
        if not self.args.pretrain:
            raise ConfigError(f"{path}: no .safetensors weights; a LoRA needs a pretrained model (or set pretrain = true)")
        config = _find_config(path)  # its errors name the file
        self._check_context(config)
        vocab = -(-max(config.vocab_size, len(self.tokenizer)) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
        return LLMConfig(**{**config.__dict__, "vocab_size": vocab}), True, None

    def _load_model(self, path: str, config: LLMConfig, prepare: Callable | None) -> LLM:
        """The checkpoint's weights (in weights_dtype, through prepare), or from scratch a GPT-2 init."""
        if not self.from_scratch:
            return load_llm(path, config, dtype=self.weights_dtype, prepare=prepare)
        torch.manual_seed(self.args.seed)
        model = LLM(config)  # float32 weights and compute_dtype: autocast_dtype picks the matmul dtype
        init_weights(model, scaled_residual=self.args.scaled_residual_init)
        return model

    def _base_prepare(self, path: str):
        """load_llm's prepare hook. A LoRA's frozen base in a pre-quantized file (plain fp8, fp8_scaled,
        ComfyUI's scaled fp8) is used as it is stored, as a diffusion transformer is: the config must
        say so and the LoRA's metadata names the stored layout. Pretraining widens such weights (they
        train in fp32); a bf16 / fp16 / fp32 file gets the config's base precision while loading."""
        from library.io import CheckpointReader
        from library.models.family import fp8_prepare
        from library.models.registry import arch_spec
        from library.precision.stored_layouts import read_stored_layout, stored_converter, widened_layout

        reader = CheckpointReader(path)
        stored = None if self.args.pretrain else read_stored_layout(reader, path)
        if stored is None:
            if not self.args.pretrain:  # a plain e5m2 file widens: its name, or the fp8 base refused
                self.stored_precision = widened_layout(path, base_precision(self.args))
            return fp8_prepare(base_precision(self.args), "llm")
        self.stored_precision = stored.layout
        check_stored_precision(self.args, stored.layout, path)
        return lambda model: stored_converter(model, stored, arch_spec("llm").fp8, self.weights_dtype, reader, path)

    def _check_context(self, config: LLMConfig):
        if self.args.max_length > config.context_length:
            source = "max_position_embeddings"
            if config.context_length > config.max_position_embeddings:
                source = (f"rope_scaling factor {config.rope_scaling.factor:g} x original_max_position_embeddings "
                          f"{config.rope_scaling.original_max_position_embeddings}")
            raise ConfigError(f"max_length {self.args.max_length} is longer than the model's context window "
                              f"({source} = {config.context_length})")

    def _load_data(self, files: list[str], documents: int, vocab: int):
        """documents: the .txt files, "text" records that hold text and plain-text prompt / completion records, each
        ended by EOS (conversations are bordered by their chat template's tokens, EOS or not); vocab: the model's
        vocab_size."""
        args = self.args
        eos = self.tokenizer.eos_token_id
        if eos is None and documents > 1:
            warnings.warn(f"{args.pretrained_model_name_or_path}: the tokenizer names no eos_token, so the {documents} "
                          f"documents of train_data (.txt files, \"text\" and plain-text \"prompt\" / \"completion\" "
                          f"records) run together with no border between them (set eos_token in its "
                          f"tokenizer_config.json)", stacklevel=2)
        record_lengths = []  # each conversation's and prompt / completion record's (tokens, file:line)
        chat = measured(chat_encoder(self.tokenizer, args.train_on_all_tokens), record_lengths)
        ids, trained, starts = tokenize_corpus(files, self.encode, self.encode_more, eos, chat,
                                               args.train_on_all_tokens, record_lengths)
        warn_long_conversations(record_lengths, args.max_length)
        if len(ids) and int(ids.max()) >= vocab:  # else an IndexError at the first batch holding it, maybe hours in
            top = int(ids.max())
            raise ConfigError(f"{args.pretrained_model_name_or_path}: the tokenizer gives train_data token id {top} "
                              f"({self.tokenizer.convert_ids_to_tokens(top)!r}), beyond the model's vocab_size {vocab}: "
                              f"tokenizer.json and config.json are not of one model (or add_tokens left the embedding short)")
        train_ids, val_ids = train_val_split(ids, args.val_fraction)
        train_trained, self.val_trained = train_val_split(trained, args.val_fraction) if trained is not None else (None, None)
        # Document borders (None: one stream, attended across): the windows' `documents`, and held_out_loss's
        train_starts, self.val_starts = (None, None) if args.attend_across_documents else split_starts(starts,
                                                                                                       len(train_ids))
        best_fit = packing_of(args) == "best_fit"
        if len(train_ids) < args.max_length + 1 and not best_fit:  # named here: the dataset's error knows no key
            held = f" after val_fraction {args.val_fraction:g} holds out {len(val_ids)}" if len(val_ids) else ""
            raise ConfigError(f"train_data {', '.join(args.train_data)}: {len(ids)} tokens{held} leave {len(train_ids)} "
                              f"to train on, fewer than max_length + 1 = {args.max_length + 1}")
        if best_fit:  # a split shorter than a window is one padded window
            train = PackedWindowDataset(train_ids, args.max_length, train_trained, train_starts)
        else:
            train = TextWindowDataset(train_ids, args.max_length, args.stride, train_trained, train_starts)
        # TOKEN_DTYPE [N]: evaluate() scores all of it (its trained tokens: val_trained, less val_starts' borders)
        self.val_ids = val_ids
        # scored in training's layout: stream windows cut 25% of a held-out chat split's replies from their prompt
        # (20,000 conversations at max_length 1024), which best-fit training never asks of the model
        self.val_packed = PackedWindowDataset(val_ids, args.max_length, self.val_trained, self.val_starts) \
            if best_fit and len(val_ids) > 1 else None
        if len(val_ids) > 1 and not self.scores_held_out():
            warnings.warn(f"train_data: val_fraction {args.val_fraction:g} holds out the last {len(val_ids)} tokens, "
                          f"none of them an assistant token or a completion's: no held-out loss is reported (raise "
                          f"val_fraction, or end the last file with a conversation's reply)", stacklevel=2)
        if len(train) == 0:
            what = " with an assistant token or a completion's" if trained is not None else ""
            raise ConfigError(f"train_data: {len(train_ids)} training tokens give no window of max_length "
                              f"{args.max_length}{what}")
        counted = f" ({int(trained.sum())} trained on: assistant / completion tokens)" if trained is not None else ""
        packed = (f" of whole documents (packing best_fit: {train.filled():.0%} of their tokens filled)"
                  if isinstance(train, PackedWindowDataset) else "")
        self.accelerator.print(f"text: {len(ids)} tokens{counted}, {len(train)} train windows{packed}, "
                               f"{self.held_out_windows()} val windows ({len(val_ids)} tokens held out)")
        return train

    def _sample_prompt_ids(self) -> list[int]:
        """sample_prompt's ids. With sample_chat (sample_chat_template, unset: on where train_data holds
        conversations, the form the LoRA learns to answer): one user turn of the chat template and its
        generation prompt, as a chat model is asked at inference; else as a document starts (encode)."""
        if self.sample_chat:
            return user_turn_ids(self.tokenizer, self.args.sample_prompt, "sample_prompt")
        return self.encode(self.args.sample_prompt)

    def encode(self, text: str) -> list[int]:
        """A document's or the sample prompt's ids as the model's users encode text (transformers, PEFT,
        vLLM): with the tokenizer's own special tokens (Llama's and Mistral's BOS first; Qwen's add none),
        less a trailing EOS (a document gets its one EOS from tokenize_corpus; a prompt must not end)."""
        ids = self.tokenizer.encode(text, add_special_tokens=True, verbose=False)
        eos = self.tokenizer.eos_token_id
        return ids[:-1] if ids and eos is not None and ids[-1] == eos else ids

    def encode_more(self, text: str) -> list[int]:
        """The ids of text that continues a document (a later piece of a huge one): no special tokens."""
        return self.tokenizer.encode(text, add_special_tokens=False, verbose=False)

    def decode(self, ids: list[int]) -> str:
        """A sample's text as transformers' text-generation pipeline shows it: special tokens (Llama's BOS,
        the EOS a batch row is padded with) left out."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # -- what the loop uses --------------------------------------------------------------------
    def param_groups(self, lr: float) -> list[dict]:
        if self.network is not None:
            return self.network.param_groups(lr)
        from library.training.optim import split_weight_decay

        decay, no_decay = split_weight_decay(self.model.named_parameters(), self.args.weight_decay_1d)
        return [{"params": decay, "name": "decay"}, {"params": no_decay, "name": "no_decay", "weight_decay": 0.0}]

    def trainable_parameters(self):
        return [p for p in self.module.parameters() if p.requires_grad]

    def named_trainable_parameters(self) -> dict[str, nn.Parameter]:
        source = self.network if self.network is not None else self.model
        return {name: p for name, p in source.named_parameters() if p.requires_grad}

    def trainable_tensors(self) -> dict[str, torch.Tensor]:
        source = self.network if self.network is not None else self.model
        return {k: v.detach() for k, v in source.state_dict().items()}

    def load_trainable_tensors(self, tensors):
        (self.network if self.network is not None else self.model).load_state_dict(tensors)

    def _global_batches(self, epoch: int) -> list[list[int]]:
        shuffled = self._epochs_shuffled  # one shuffle an epoch (loss_weight asks each step)
        if epoch not in shuffled:
            order = list(range(len(self.train_set)))
            random.Random(f"{self.args.seed}:{epoch}").shuffle(order)
            size = self.args.batch_size * self.accelerator.num_processes
            if len(shuffled) > 1:  # kept: the epoch trained and batches_per_epoch's epoch 0
                shuffled.clear()
            shuffled[epoch] = [order[i : i + size] for i in range(0, len(order), size)]
        return shuffled[epoch]

    def loss_weight(self, epoch: int, batch: int, step_batches: range) -> tuple[float, float]:
        """(this process's trained tokens in `batch` x processes, the trained tokens of the step's batches on
        every process): the step's loss is the mean over all its trained tokens, as one process with the
        N-times batch (transformers' num_items_in_batch). A mean per micro-batch weighted the tokens of
        windows with few trained ones (short replies) more, so N processes or accumulation trained another
        objective (the first step's loss 6.14374 vs 6.14358 on a chat corpus, 2 processes; plain text, every
        window full, was equal)."""
        rank, world = self.accelerator.process_index, self.accelerator.num_processes
        step = (epoch, step_batches.start, step_batches.stop)
        if self._step_tokens[0] != step:  # counted once a step, not once a micro-batch
            batches = self._global_batches(epoch)
            counts = {(j, r): sum(int((self.train_set[i][1] != IGNORE).sum())
                                  for i in process_share(batches[j], r, world))
                      for j in step_batches for r in range(world)}
            self._step_tokens = step, counts
        counts = self._step_tokens[1]
        return world * counts[(batch, rank)], sum(counts.values())

    def batches_per_epoch(self) -> int:
        return len(self._global_batches(0))

    def data_items(self) -> list[str]:
        # a folder's own files, as training reads them (the folder alone was "name 0": its files went unchecked)
        return [f"{os.path.basename(p)} {os.path.getsize(p)}" for p in corpus_files(self.args.train_data)]

    def epoch_settings(self) -> None:
        return None  # its batch_size is in the run's identity (state.LLM_DATA_IDENTITY)

    def epoch_batches(self, epoch: int, skip: int = 0):
        """This process's slice of each global batch (batch_size * processes windows)."""
        rank, world = self.accelerator.process_index, self.accelerator.num_processes
        for batch in self._global_batches(epoch)[skip:]:
            local = process_share(batch, rank, world)
            inputs, targets = zip(*(self.train_set[i] for i in local))
            yield torch.stack(inputs), torch.stack(targets), self.train_set.documents(local)

    def batch_inputs(self, batch, step: int):
        """(input_ids, targets, documents or None) on the device: LMLoss's arguments."""
        inputs, targets, documents = batch
        return inputs.to(self.device), targets.to(self.device), None if documents is None else documents.to(self.device)

    def scale_weight_norms(self, max_norm: float) -> dict:
        return self.network.scale_weight_norms(max_norm)

    def step_extras(self) -> dict:
        return {}

    def validation_size(self) -> int:
        return 0  # the trainer's val_loss is for images; the LLM's own eval runs in after_step

    def validation_loss(self) -> float:
        """Not called (validation_size() is 0): the held-out loss that after_step reports."""
        return self.held_out_loss()

    def render_samples(self, out_dir: str, tag: str, stop=None, first: int = 0) -> list[str]:
        """An LLM's samples are text: val loss, perplexity and a generated sample (sample_at_first
        gives the baseline before training). A step whose eval after_step has just reported is not evaluated
        again (eval_every_n_steps and sample_every_n_steps meeting at a step wrote two equal rows)."""
        if not (tag == step_tag(self.step) and self.evaluates_after(self.step)):
            self.report_eval(tag)
        return []

    # -- evaluation ----------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict:
        was_training = self.model.training
        self.model.eval()
        prompt = torch.tensor([self.sample_ids], device=self.device)
        # The same sample draw at each eval, from a generator of its own: no global generator (CPU,
        # CUDA) is reseeded, so training's random stream goes on after an eval as without it.
        gen = torch.Generator(self.device).manual_seed(self.args.seed)
        with compute_autocast(self.device, self.autocast_dtype):  # the compute training runs in
            val = self.held_out_loss() if self.scores_held_out() else None  # None: nothing held out to score
            out = generate(self.model, prompt, self.args.sample_max_new_tokens, self.model.config.context_length,
                           self.args.temperature, self.args.top_k or None, self.sample_stops, generator=gen)
        self.model.train(was_training)
        shown = out[0, prompt.shape[1] :] if self.sample_chat else out[0]  # a chat sample: the reply alone
        return {"val_loss": val, "val_perplexity": None if val is None else perplexity(val),
                "sample": self.decode(shown.tolist())}

    def scores_held_out(self) -> bool:
        """Whether the held-out split has a target to score: a token after its first, trained (every token,
        or with the loss on the replies only, an assistant token) and, with val_starts, no document's first."""
        if self.val_packed is not None:
            return len(self.val_packed) > 0
        n = len(self.val_ids)  # one window of all n - 1 targets, kept as training keeps its windows
        return n > 1 and len(kept_windows(n, n - 1, 1, self.val_trained, document_borders(self.val_starts, n))) > 0

    def held_out_windows(self) -> int:
        """The windows held_out_loss scores (0: no val loss), its last the shorter rest. The count was of full
        windows alone, so a held-out split shorter than max_length + 1 said "0 val windows" beside its val loss."""
        if self.val_packed is not None:
            return len(self.val_packed)
        return -(-(len(self.val_ids) - 1) // self.args.max_length) if self.scores_held_out() else 0

    @torch.no_grad()
    def held_out_loss(self) -> float:
        """Token-weighted mean cross-entropy over every trained target token of the held-out split (nan
        when it has none): windows of max_length targets, stride max_length, so each
        token is predicted once with the context reset per window; the last window is the shorter
        rest. Full windows run batch_size at a time. With val_starts, a window that packs several documents
        attends within each alone, and its border targets are not scored, as training's windows do. With best-fit
        packing, the held-out split's own packed windows (the same targets, each document whole)."""
        if self.val_packed is not None:
            return self._packed_held_out_loss()
        ids, trained, length, doc_starts = self.val_ids, self.val_trained, self.args.max_length, self.val_starts
        borders = document_borders(doc_starts, len(ids))  # int64 [B] or None
        starts = list(range(0, len(ids) - 1, length))
        full = [s for s in starts if s + length + 1 <= len(ids)]
        batches = [full[i : i + self.args.batch_size] for i in range(0, len(full), self.args.batch_size)]
        batches += [[s] for s in starts if s + length + 1 > len(ids)]  # the shorter rest
        total, count = 0.0, 0
        for batch in batches:
            n = min(length, len(ids) - 1 - batch[0])  # the batch's targets a window (the rest's: fewer)
            inputs = torch.stack([ids[s : s + n] for s in batch]).to(self.device, torch.long)  # int64 [B, n]
            targets = torch.stack([window_targets(ids, trained, borders, s + 1, n)
                                   for s in batch]).to(self.device)  # int64 [B, n]
            documents = None if doc_starts is None else batch_documents(
                [window_documents(doc_starts, s, n) for s in batch])
            loss, scored = summed_loss(self.model, inputs, targets, documents)
            total, count = total + loss, count + scored
        return total / count if count else float("nan")

    def _packed_held_out_loss(self) -> float:
        """held_out_loss over the held-out split's packed windows, batch_size at a time."""
        val, size = self.val_packed, self.args.batch_size
        total, count = 0.0, 0
        for batch in (list(range(i, min(i + size, len(val)))) for i in range(0, len(val), size)):
            inputs, targets = (torch.stack(t).to(self.device) for t in zip(*(val[i] for i in batch)))
            loss, scored = summed_loss(self.model, inputs, targets, val.documents(batch))
            total, count = total + loss, count + scored
        return total / count if count else float("nan")

    def after_step(self, step: int, output_dir: str):
        self.step = step
        if self.evaluates_after(step):
            self.report_eval(step)

    def evaluates_after(self, step: int) -> bool:
        every = self.args.eval_every_n_steps
        return bool(every) and step % every == 0

    def report_eval(self, label: int | str):
        """One eval, printed and written to the eval CSV under `label` (a step, or a sample tag:
        start, final, ...), and to the trackers at the step it was made after (theirs are numbers).
        With nothing held out (val_fraction 0) the sample alone: no val loss is printed, logged or
        written (the eval CSV then has the columns step and sample only)."""
        if not self.accelerator.is_main_process:
            return
        result = self.evaluate()
        val = result["val_loss"]
        losses = "no val loss (nothing held out)" if val is None else f"val loss {val:.4f}, perplexity {result['val_perplexity']:.2f}"
        self.accelerator.print(f"step {label}: {losses}\n  sample: {result['sample']!r}")
        columns = ["step", "sample"] if val is None else ["step", "val_loss", "val_perplexity", "sample"]
        row = {"step": label, **result}
        append_csv_row(self.eval_log, [row[k] for k in columns], None if os.path.exists(self.eval_log) else columns)
        if self.accelerator.trackers and val is not None:
            self.accelerator.log({"val_loss": val, "val_perplexity": result["val_perplexity"]}, step=self.step)

    # -- saving --------------------------------------------------------------------------------
    def save(self, path: str, metadata: dict, dtype: torch.dtype) -> list[str]:
        """Write the LoRA (or the pretrained model) for `path` (<output_dir>/<name>.safetensors);
        returns what was written: the kohya file at path, the PEFT adapter folder / the model
        folder at path without .safetensors."""
        folder = path[: -len(".safetensors")]
        if self.network is not None:
            written = []
            if "peft" in lora_formats(self.args):
                # PEFT's pointer to the base: its folder, absolute (peft_base_path)
                base = peft_base_path(self.args.pretrained_model_name_or_path)
                nested = nests_language_model(self._base_config())
                self.network.save_peft(folder, dtype, metadata, base_model=base, rename=nested_path if nested else None)
                written.append(folder)
            if "kohya" in lora_formats(self.args):
                self.network.save(path, dtype=dtype, metadata=metadata)
                written.append(path)
            return written
        # Pretraining: a Hugging Face folder (weights, config.json with the special token ids,
        # generation_config.json, tokenizer) beside path, loadable by transformers 4.x and 5.x.
        save_hf_folder(self.model, folder, self.tokenizer, dtype, metadata, self._base_config(),
                       self._base_config("generation_config.json"), self.sample_stops or ())
        return [folder]

    def _base_config(self, name: str = "config.json") -> dict | None:
        """The base's config.json (or another JSON file `name`), beside its weights as load_llm finds it (the base
        given as its folder, its .safetensors or its index); None: none there (a model built from a config)."""
        if not self.args.pretrained_model_name_or_path:  # built from a config: not the current folder's files
            return None
        source = os.path.join(os.path.dirname(config_json_path(self.args.pretrained_model_name_or_path)), name)
        if not os.path.isfile(source):
            return None
        with open(source) as f:
            return json.load(f)

    def finish(self, output_dir: str, stop=None):
        if self.args.eval_every_n_steps:
            self.report_eval("final")

    # -- metadata ------------------------------------------------------------------------------
    def metadata(self) -> dict:
        c, args = self.model.config, self.args
        precision = self.stored_precision or (base_precision(args) if base_precision(args) != "bf16"
                     else {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[self.weights_dtype])
        return {
            "base_model_version": f"llm-{c.num_layers}x{c.hidden_size}" + ("-scratch" if self.from_scratch else ""),
            "base_precision": precision,
            "resolution": f"{args.max_length} tokens",
            "batch_size": args.batch_size * self.accelerator.num_processes * args.gradient_accumulation_steps,
            "timestep_sampling": None,
            "dataset": {"train_windows": len(self.train_set), "val_windows": self.held_out_windows(),
                        "files": [os.path.basename(p) for p in args.train_data]},
            **getattr(self, "loaded", {}),
        }
