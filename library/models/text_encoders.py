"""Text encoders: CLIP-L, a CLIP text tower with projection read at its second-to-last layer (CLIP-L or
OpenCLIP's bigG, "CLIP-G") and T5-XXL (transformers models), and the helpers every family's text
encoder uses (configs, tokenizer lookup, precisions). A family's prompt handling (templates, which
outputs it takes) lives in its folder (library/models/<family>/text_encoder.py); the LLM text
encoders run on our LLM core (library/models/llm.py).

All encoders return float32 tensors whatever dtype their weights run in; they never train here, so
their forwards run under no_grad. CLIP-L gives its pooled output (`pooler_output`, 77 tokens padded
to max_length) -> [B, 768]; T5 its last hidden state, prompts padded to max_length and run without
an attention mask -> [B, L, 4096].

Loaders read safetensors only (library/io), into models built on `meta`: HF folders (or a diffusers
pipeline repo with text_encoder/ and text_encoder_2/), and the single files users have
(`clip_l.safetensors`, `t5xxl_fp16.safetensors`). A single file takes its config from `config`, a
config.json beside it, or the built-in full-size config; its tokenizer from a folder path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import torch
from accelerate import init_empty_weights
from transformers import (
    AutoTokenizer, CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, T5Config, T5EncoderModel,
)

from library.io import (
    CheckpointError, CheckpointReader, PrefixedReader, component_folder, load_streaming, read_json_file,
)
from library.models.llm import QWEN2_5_7B, QWEN3_VL_4B, QWEN3_VL_8B, LLMConfig
from library.models.spec import FP8Rules, TextWeights

# ----------------------------------------------------------------------------------------------
# Built-in configs of the released encoders (openai/clip-vit-large-patch14 text tower, google/t5-v1_1-xxl)

CLIP_L_CONFIG = {
    "vocab_size": 49408,
    "hidden_size": 768,
    "intermediate_size": 3072,
    "projection_dim": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "max_position_embeddings": 77,
    "hidden_act": "quick_gelu",
    "layer_norm_eps": 1e-5,
    "bos_token_id": 0,
    "eos_token_id": 2,  # legacy value of the released config: pooling takes the argmax token (EOT)
    "pad_token_id": 1,
}

# text_encoder_precision = fp8: every T5 Linear but the feed-forward `wo`, which stays bf16 because
# transformers' T5 casts wo's *input* to wo.weight.dtype (an fp8 weight would round every activation
# to e4m3 there). Its embedding is not a Linear.
T5_FP8 = FP8Rules(keep=(r".*\.wo",))

T5_XXL_CONFIG = {
    "vocab_size": 32128,
    "d_model": 4096,
    "d_kv": 64,
    "d_ff": 10240,
    "num_layers": 24,
    "num_heads": 64,
    "relative_attention_num_buckets": 32,
    "relative_attention_max_distance": 128,
    "layer_norm_epsilon": 1e-6,
    "feed_forward_proj": "gated-gelu",
    "dense_act_fn": "gelu_new",
    "is_gated_act": True,
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "eos_token_id": 1,
}

# The OpenCLIP ViT-bigG/14 text tower (laion/CLIP-ViT-bigG-14-laion2B-39B-b160k; "CLIP-G"): a diffusers pipeline's
# text_encoder_2/config.json (CLIPTextModelWithProjection) and ComfyUI's clip_config_bigg.json. Its ids are CLIP-L's
# vocabulary; eos_token_id 2 is the legacy value, as CLIP-L's: pooling takes the argmax token (EOT, the highest id).
CLIP_G_CONFIG = {
    "vocab_size": 49408,
    "hidden_size": 1280,
    "intermediate_size": 5120,
    "projection_dim": 1280,
    "num_hidden_layers": 32,
    "num_attention_heads": 20,
    "max_position_embeddings": 77,
    "hidden_act": "gelu",
    "layer_norm_eps": 1e-5,
    "bos_token_id": 0,
    "eos_token_id": 2,
    "pad_token_id": 1,
}

CLIP_MAX_LENGTH = 77

# The Qwen3-VL language models a single file without config.json may be (load_qwen3_vl_language_model's
# single_file), by name: the callers' expected model, checked by embedding width.
QWEN3_VL_SINGLE_FILES = {"Qwen3-VL-4B": QWEN3_VL_4B, "Qwen3-VL-8B": QWEN3_VL_8B}

# text_encoder_precision -> (dtype the weights load and compute in, fp8 storage of the big encoders'
# Linears or None). fp8 applies to T5-XXL and the LLM text encoders, dequantized to bf16 per layer;
# CLIP-L (123 M parameters) stays bf16 then. Outputs are float32 whatever the precision.
TEXT_ENCODER_PRECISIONS = {
    "fp32": (torch.float32, None), "fp16": (torch.float16, None), "bf16": (torch.bfloat16, None),
    "fp8": (torch.bfloat16, "fp8"), "fp8_scaled": (torch.bfloat16, "fp8_scaled"),
}


def encoder_precision(precision: str) -> tuple[torch.dtype, str | None]:
    if precision not in TEXT_ENCODER_PRECISIONS:
        raise ValueError(f"text_encoder_precision must be one of {', '.join(TEXT_ENCODER_PRECISIONS)}, got {precision!r}")
    return TEXT_ENCODER_PRECISIONS[precision]


class OneAtATime:
    """Text encoders placed on `device` that do not fit it together (memory_plan.text_encoders_one_at_a_time):
    models[0] (a small one) stays resident; every other model's frozen weights live in (pinned) host memory and
    come in for its own stage of each encode, released after it (BlockSwap's copies), so the device holds models[0]
    and the largest other at most. The price: one host -> device copy of each other model per encoded batch. The
    outputs are bit-identical to the encoders resident together."""

    def __init__(self, models: list[torch.nn.Module], device):
        from library.models.block_swap import BlockSwap

        self.swap = BlockSwap(models, len(models) - 1, device)  # before the models move: swapped never arrive whole
        for model in models:
            model.to(device)  # models[0]; the others' placeholders, empty, are there already

    def stage(self, index: int):
        """models[index] on the device for the with-block (models[0] always is)."""
        return self.swap.held(index)


class Resident:
    """Text encoders resident together (where they were loaded or placed): every stage is already there."""

    def stage(self, index: int):
        return contextlib.nullcontext()


RESIDENT = Resident()


def place_text_encoders(models: list[torch.nn.Module], device, one_at_a_time: bool) -> OneAtATime | Resident:
    """Every encoder on `device` (RESIDENT), or, one_at_a_time, OneAtATime's placement; encode in its stages."""
    if one_at_a_time and len(models) > 1:
        return OneAtATime(models, device)
    for model in models:
        model.to(device)
    return RESIDENT


# ----------------------------------------------------------------------------------------------
# Loading HF text encoders from folders or single files


def _read_config(path: str, config: dict | str | None, default: dict) -> dict:
    """config argument (dict or config.json path) > config.json in/beside `path` > built-in."""
    if isinstance(config, dict):
        return config
    if config is None:
        folder = path if os.path.isdir(path) else os.path.dirname(path)
        config = os.path.join(folder, "config.json")
        if not os.path.isfile(config):
            if os.path.isdir(path):
                raise CheckpointError(f"{path}: text encoder folder has no config.json")
            return default
    return read_json_file(config)


# What a tokenizer (and a VL processor) is read from: the files tokenizer_files fingerprints for the text cache key.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "spiece.model", "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt", "chat_template.json",
                   "chat_template.jinja", "preprocessor_config.json")
TOKENIZER_FOLDERS = ("tokenizer", "tokenizer_2", "t5_tokenizer", "processor")  # a diffusers repo's, beside text_encoder/
VOCABULARY_FILES = ("tokenizer.json", "spiece.model", "tokenizer.model", "vocab.json", "vocab.txt")  # one at least


def right_padded(rows: list[list[int]], pad_id: int, device=None, length: int | None = None):
    """Token rows -> (ids int64 [B, L], pad_id after each row's tokens; mask bool [B, L], True on the real tokens),
    L = `length` or the longest row's: right padding, real tokens first, as the LLM text encoders run a batch (a real
    query never sees a pad key under causal attention, so each row's states are those of the row alone)."""
    length = max(len(r) for r in rows) if length is None else length
    ids = torch.tensor([r + [pad_id] * (length - len(r)) for r in rows], dtype=torch.int64, device=device)
    counts = torch.tensor([len(r) for r in rows], device=device)
    return ids, torch.arange(length, device=device)[None] < counts[:, None]


def second_to_last_layer(llm, encoder: str) -> int:
    """The decoder layer whose output is transformers' hidden_states[-2] (0 = the embeddings), which a text encoder
    that reads it (its last layer never run) needs loaded; `encoder` names it in the error."""
    layer = llm.config.num_layers - 1
    if layer < 1 or len(llm.model.layers) < layer:
        raise ValueError(f"{encoder}: hidden_states[-2] needs {layer} decoder layers (of {llm.config.num_layers}); "
                         f"{len(llm.model.layers)} are loaded")
    return layer


def tokenizer_files(path: str) -> list[str]:
    """Every tokenizer file the loaders may read for the encoder at `path` (a file, an HF folder, a
    pipeline's component folder or the pipeline folder): TOKENIZER_FILES in its folder and in the
    TOKENIZER_FOLDERS inside it and beside it (tokenizer_folder's and the processors' candidates). A few
    more than one loader reads is harmless: they only go into the text cache key."""
    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    parent = os.path.dirname(folder.rstrip("/"))
    folders = [folder, *(os.path.join(base, name) for base in (folder, parent) for name in TOKENIZER_FOLDERS)]
    return [os.path.join(f, name) for f in folders for name in TOKENIZER_FILES if os.path.isfile(os.path.join(f, name))]


# Each encoder's kind of tokenizer, told from tokenizer_config.json before loading one (a ComfyUI folder
# may hold another encoder's): the released tokenizers name their class (the Fast twin alike); a generic
# class (PreTrainedTokenizerFast, as the tiny test files and library/data/tokenizer.py save) is told by
# its BOS / EOS, which each kind's prompts are built with. A folder neither tells fits any encoder.
TOKENIZER_KIND_CLASSES = {"CLIPTokenizer": "CLIP", "T5Tokenizer": "T5", "Qwen2Tokenizer": "Qwen2",
                          "GemmaTokenizer": "Gemma", "ByT5Tokenizer": "ByT5"}
TOKENIZER_KIND_SPECIALS = {("<|startoftext|>", "<|endoftext|>"): "CLIP", (None, "</s>"): "T5",
                           (None, "<|im_end|>"): "Qwen2", (None, "<|endoftext|>"): "Qwen2", ("<s>", "</s>"): "Mistral",
                           ("<bos>", "<eos>"): "Gemma", ("<|begin_of_text|>", "<|eot_id|>"): "Llama",
                           ("<|begin_of_text|>", "<|end_of_text|>"): "Llama"}


def tokenizer_kind(folder: str) -> str | None:
    """CLIP, T5, ByT5, Qwen2, Mistral, Gemma or Llama (Llama 3's specials): the kind of the tokenizer in `folder`,
    None when its config does not tell."""
    config = read_json_file(os.path.join(folder, "tokenizer_config.json"))
    kind = TOKENIZER_KIND_CLASSES.get(str(config.get("tokenizer_class")).removesuffix("Fast"))
    return kind or TOKENIZER_KIND_SPECIALS.get((_token(config.get("bos_token")), _token(config.get("eos_token"))))


def _token(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value  # an AddedToken is saved as a dict


def tokenizer_folder(weights_path: str, tokenizer: str | None, sibling: str, kind: str,
                     beside_file: bool = False) -> str:
    """The folder an encoder's tokenizer loads from: `tokenizer` if given, else the weights folder itself
    when it holds one of `kind` (tokenizer_kind), else (beside_file, the weights given as a file) the `sibling`
    folder beside the file (a ComfyUI checkpoint bundling the encoder in models/checkpoints/, its tokenizer/ put
    next to it), else `sibling` next to the weights folder (diffusers repo layout: text_encoder/ + tokenizer/).
    No torch: the families' check_model_files ask it before any caching."""
    if tokenizer is not None:
        return tokenizer
    if not os.path.exists(weights_path):  # before looking beside it: the path itself is the mistake
        raise CheckpointError(f"{weights_path}: no such file or folder")
    folder = weights_path if os.path.isdir(weights_path) else os.path.dirname(weights_path)
    candidates = [folder, os.path.join(os.path.dirname(folder.rstrip("/")), sibling)]
    if beside_file and os.path.isfile(weights_path):
        candidates.insert(1, os.path.join(folder, sibling))
    found = [c for c in candidates if os.path.isfile(os.path.join(c, "tokenizer_config.json"))]
    fits = [c for c in found if tokenizer_kind(c) in (kind, None)]
    if not fits:
        skipped = "".join(f"; skipped {c}: a {tokenizer_kind(c)} tokenizer" for c in found)
        raise CheckpointError(f"{weights_path}: no {kind} tokenizer found in {candidates}{skipped}; "
                              f"put the {kind} tokenizer's files in one of those folders")
    # (without one, transformers' five lines on sentencepiece came at the caption caching, after the latents')
    if not any(os.path.isfile(os.path.join(fits[0], name)) for name in VOCABULARY_FILES):
        raise CheckpointError(f"{fits[0]}: tokenizer_config.json but no vocabulary ({', '.join(VOCABULARY_FILES)}); "
                              f"copy the tokenizer's files whole")
    return fits[0]


def _load_tokenizer(weights_path: str, tokenizer: str | None, sibling: str, kind: str):
    """The tokenizer from tokenizer_folder."""
    return AutoTokenizer.from_pretrained(tokenizer_folder(weights_path, tokenizer, sibling, kind), local_files_only=True)


def load_chat_tokenizer(folder: str):
    """The tokenizer in `folder` with its chat template: the tokenizer's own (tokenizer_config.json or
    chat_template.jinja), else a processor's legacy chat_template.json beside it (Qwen-VL processor folders)."""
    loaded = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    legacy = os.path.join(folder, "chat_template.json")
    if not getattr(loaded, "chat_template", None) and os.path.isfile(legacy):
        loaded.chat_template = read_json_file(legacy).get("chat_template")
    return loaded


def qwen3_config_from_shapes(path: str, like: LLMConfig, model: str = "Qwen3-VL language model") -> LLMConfig:
    """A Qwen3 (or Qwen3-VL language) model as a checkpoint's tensors shape it (vocabulary, width, depth, heads,
    head_dim, MLP; tied when the file has no lm_head), with `like`'s RoPE, norm epsilon and context, which shapes do
    not tell and the models of one line share (Qwen3-VL's dense ones: theta 5e6, interleaved M-RoPE 24 / 20 / 20,
    eps 1e-6, 262144 positions; Qwen3's: theta 1e6, eps 1e-6). `model`: what the file should be, for the error."""
    from library.models.llm import checkpoint_key_to_llm

    reader = CheckpointReader(path)
    keys = {checkpoint_key_to_llm(k, False): k for k in reader.keys()}  # our names (None: vision keys)

    def shape(name: str) -> tuple[int, ...]:
        if name not in keys:
            raise CheckpointError(f"{path}: no tensor for {name} (keys like {next(iter(reader.keys()), None)!r}); "
                                  f"not a {model}, or put its config.json beside it")
        return reader.shape(keys[name])

    vocab, width = shape("model.embed_tokens.weight")
    head_dim = shape("model.layers.0.self_attn.q_norm.weight")[0]
    layers = 1 + max(int(n.split(".")[2]) for n in keys if n and n.startswith("model.layers."))
    return dataclasses.replace(
        like, vocab_size=vocab, hidden_size=width, num_layers=layers, head_dim=head_dim,
        num_heads=shape("model.layers.0.self_attn.q_proj.weight")[0] // head_dim,
        num_kv_heads=shape("model.layers.0.self_attn.k_proj.weight")[0] // head_dim,
        intermediate_size=shape("model.layers.0.mlp.gate_proj.weight")[0],
        tie_word_embeddings="lm_head.weight" not in keys)


def _qwen3_vl_single_file(path: str, single_file: str) -> LLMConfig:
    """The language model of a file without config.json: told by its embedding width to be the `single_file`
    model (QWEN3_VL_SINGLE_FILES), then shaped by its tensors (qwen3_config_from_shapes)."""
    expected = QWEN3_VL_SINGLE_FILES[single_file]
    reader = CheckpointReader(path)
    key = next((k for k in reader.keys() if k.endswith("embed_tokens.weight")), None)
    width = reader.shape(key)[-1] if key else None
    if width != expected.hidden_size:
        raise CheckpointError(f"{path}: embedding width {width} is not {single_file}'s ({expected.hidden_size}); "
                              f"put its config.json beside it")
    return qwen3_config_from_shapes(path, expected)


def qwen3_vl_language_config(path: str, single_file: str = "Qwen3-VL-4B") -> LLMConfig:
    """The LLMConfig load_qwen3_vl_language_model builds for `path`: its config.json (in or beside it, a pipeline
    folder's text_encoder/), else, for a single file without one, the `single_file` model's shaped by the file."""
    from library.models.llm import _find_config

    path = component_folder(path, "text_encoder")
    if os.path.isfile(path) and not os.path.isfile(os.path.join(os.path.dirname(path), "config.json")):
        return _qwen3_vl_single_file(path, single_file)
    return _find_config(path)


def load_qwen3_vl_language_model(path: str, deepest: int, dtype: torch.dtype = torch.float32, prepare=None,
                                 single_file: str = "Qwen3-VL-4B"):
    """Qwen3-VL's language model on the LLM core (library/models/llm.py) for a prompt encoder that reads hidden
    states 0..`deepest`, from a pipeline folder (text_encoder/: a Qwen3VLModel or a
    Qwen3VLForConditionalGeneration), a Qwen3-VL HF folder or a single file (without config.json beside it: the
    `single_file` model of QWEN3_VL_SINGLE_FILES, told by its embedding width and shaped by its tensors; ComfyUI's
    qwen3vl_4b_bf16.safetensors). Vision keys and the lm_head are never read, nor the layers after `deepest` (all
    are kept when it is the last: its state is after the final norm). dtype: the weights' and the compute dtype;
    prepare: load_llm's hook (the caller's fp8_prepare(fp8, "llm") for decoder Linears stored in fp8)."""
    from library.models.llm import load_llm

    config = qwen3_vl_language_config(path, single_file)
    keep = deepest if deepest < config.num_layers else config.num_layers
    path = component_folder(path, "text_encoder")
    return load_llm(path, config=config, dtype=dtype, prepare=prepare, keep_layers=keep)


def qwen3_vl_text_weights(path: str, deepest: int) -> TextWeights:
    """What load_qwen3_vl_language_model(path, deepest) reads of its checkpoint (the planner's text weights): the
    embeddings, the decoder layers up to `deepest` and the final norm; no head, no vision tower."""
    from library.models.llm import _kept_layer_key, checkpoint_key_to_llm, llm_text_weights

    reader = CheckpointReader(component_folder(path, "text_encoder"))
    used = [k for k in reader.keys() if (name := _kept_layer_key(checkpoint_key_to_llm(k, True), deepest)) is not None
            and not name.startswith("lm_head.")]
    return llm_text_weights(reader, used)


def qwen2_5_vl_language_config(path: str):
    """The LLMConfig of the Qwen2.5-VL language model at `path` (a pipeline folder's text_encoder/, an HF folder or a
    single file): its config.json in or beside it; a single file without one (ComfyUI's qwen_2.5_vl_7b.safetensors)
    is Qwen2.5-VL-7B's (QWEN2_5_7B, its language model: shapes cannot tell Qwen2's head count)."""
    from library.models.llm import _find_config

    path = component_folder(path, "text_encoder")
    if os.path.isfile(path) and not os.path.isfile(os.path.join(os.path.dirname(path), "config.json")):
        return QWEN2_5_7B
    return _find_config(path)


def load_qwen2_5_vl_language_model(path: str, dtype: torch.dtype = torch.float32, config=None, prepare=None,
                                   keep_layers: int | None = None):
    """Qwen2.5-VL's language model on the LLM core from a pipeline repo (text_encoder/), an HF folder or a single file
    (vision keys skipped; config: qwen2_5_vl_language_config's when None). prepare: load_llm's hook (the caller's
    fp8_prepare(fp8, "llm") for decoder Linears stored in fp8; embeddings and lm_head stay in `dtype`). keep_layers:
    only the first decoder layers, no head (a reader of an intermediate hidden state)."""
    from library.models.llm import load_llm  # the LLM core is also this text encoder

    config = config or qwen2_5_vl_language_config(path)
    return load_llm(component_folder(path, "text_encoder"), config=config, dtype=dtype, prepare=prepare,
                    keep_layers=keep_layers)


def load_qwen2_5_vl_tokenizer(path: str, tokenizer: str | None = None):
    """Qwen2.5-VL's tokenizer: `tokenizer`, else in the weights folder, else tokenizer/ beside it (a pipeline repo)."""
    return _load_tokenizer(component_folder(path, "text_encoder"), tokenizer, "tokenizer", "Qwen2")


def _clip_key(key: str) -> str | None:
    """clip_l.safetensors / HF `text_model.*` keys -> CLIPTextModel keys (transformers 5 has no
    `text_model.` level); the projection, logit scale and position_ids buffer are not part of it."""
    if key in ("text_projection.weight", "logit_scale") or key.endswith("position_ids"):
        return None
    return key.removeprefix("text_model.")


def bundled_prefix(reader: CheckpointReader, name: str) -> str:
    """`text_encoders.<name>.transformer.` when `reader` is a ComfyUI full checkpoint holding the text encoder `name`
    (clip_l, clip_g, t5xxl: comfy/sd.py's names; llm.py BUNDLED_TEXT_ENCODERS), else '' (the encoder's own file)."""
    prefix = f"text_encoders.{name}.transformer."
    return prefix if any(k.startswith(prefix) for k in reader.keys()) else ""


def _t5_key(key: str) -> str | None:
    # encoder.embed_tokens is tied to `shared`; it is filled from `shared.weight` (see _tie_t5).
    return None if key == "encoder.embed_tokens.weight" else key


def _tie_t5(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    if name == "shared.weight":
        return {name: tensor, "encoder.embed_tokens.weight": tensor}
    return {name: tensor}


class CLIPTextEncoder:
    """CLIP-L text tower + tokenizer. encode(prompts) -> pooled output [B, 768] float32."""

    def __init__(self, model: CLIPTextModel, tokenizer, max_length: int = CLIP_MAX_LENGTH):
        self.model, self.tokenizer, self.max_length = model.eval().requires_grad_(False), tokenizer, max_length

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> torch.Tensor:
        ids = self.tokenizer(
            prompts, padding="max_length", max_length=self.max_length, truncation=True, return_tensors="pt"
        ).input_ids
        return self.model(ids.to(self.model.device)).pooler_output.float()


class T5TextEncoder:
    """T5 encoder + tokenizer. encode(prompts, max_length) -> last hidden state [B, max_length, D]
    float32; prompts padded to max_length and run without a mask, as most diffusers pipelines do; masked=True: with
    the tokenizer's attention mask (the pads hidden as keys, their own states still computed and returned), as the
    pipelines that pass T5 its `attention_mask` do."""

    def __init__(self, model: T5EncoderModel, tokenizer):
        self.model, self.tokenizer = model.eval().requires_grad_(False), tokenizer

    @torch.no_grad()
    def encode(self, prompts: list[str], max_length: int, masked: bool = False) -> torch.Tensor:
        tokens = self.tokenizer(
            prompts, padding="max_length", max_length=max_length, truncation=True, return_tensors="pt"
        )
        mask = tokens.attention_mask.to(self.model.device) if masked else None  # int64 [B, L], 1 = a real token
        return self.model(tokens.input_ids.to(self.model.device), attention_mask=mask).last_hidden_state.float()


class CLIPPenultimateEncoder:
    """A CLIP text tower with its projection (transformers' CLIPTextModelWithProjection) + tokenizer, read as the
    pipelines that take CLIP's second-to-last layer do. encode(prompts) -> (hidden_states[-2] [B, 77, D] float32: the
    last layer's input, no final norm; text_embeds [B, P] float32: the EOT token's final state through the
    projection). Prompts are padded to max_length with the tokenizer's own pad token and run without a mask."""

    def __init__(self, model: CLIPTextModelWithProjection, tokenizer, max_length: int = CLIP_MAX_LENGTH):
        self.model, self.tokenizer, self.max_length = model.eval().requires_grad_(False), tokenizer, max_length

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = self.tokenizer(
            prompts, padding="max_length", max_length=self.max_length, truncation=True, return_tensors="pt"
        ).input_ids
        out = self.model(ids.to(self.model.device), output_hidden_states=True)  # weights' dtype
        return out.hidden_states[-2].float(), out.text_embeds.float()

    @torch.no_grad()
    def pooled(self, prompts: list[str], max_length: int | None = None) -> torch.Tensor:
        """text_embeds alone [B, P] float32 (no hidden state kept), prompts padded and cut to max_length (None:
        self.max_length; at most the tower's max_position_embeddings). Under CLIP's causal mask the EOT token's state
        does not depend on the pads after it: only where the cut falls changes it."""
        length = max_length or self.max_length
        positions = self.model.config.max_position_embeddings
        if length > positions:
            raise ValueError(f"CLIP pooled output of {length} tokens: the tower has {positions} positions")
        ids = self.tokenizer(prompts, padding="max_length", max_length=length, truncation=True,
                             return_tensors="pt").input_ids
        return self.model(ids.to(self.model.device)).text_embeds.float()  # weights' dtype -> float32


def load_clip_with_projection(path: str, tokenizer: str, dtype: torch.dtype = torch.float32, config: dict | None = None,
                              prefix: str = "", identity_projection: bool = False) -> CLIPPenultimateEncoder:
    """A CLIP text tower with projection from an HF folder or a single file (`text_model.*` + `text_projection.weight`,
    HF's Linear orientation [P, D]: clip_g.safetensors, a diffusers text_encoder_2/) or the part of a ComfyUI full
    checkpoint under `prefix` (bundled_prefix). config: the tower's (a dict; None: config.json in or beside `path`,
    which must exist); tokenizer: its folder (tokenizer_folder). identity_projection: the projection is the identity
    (P == D) whatever the file holds, for a model whose conditioning took the unprojected pooled output."""
    cfg = CLIPTextConfig(**(config if config is not None else _read_config(path, None, {})))
    if not cfg.hidden_size or (identity_projection and cfg.projection_dim != cfg.hidden_size):
        raise CheckpointError(f"{path}: CLIP config hidden_size {cfg.hidden_size} / projection_dim "
                              f"{cfg.projection_dim}: an identity projection needs both equal")
    with init_empty_weights():  # parameters on meta; the position_ids buffer stays real
        model = CLIPTextModelWithProjection(cfg)
    reader = CheckpointReader(path)
    reader = PrefixedReader(reader, prefix) if prefix else reader
    load_streaming(model.text_model, reader, _clip_key, dtype=dtype)  # every key but the projection's
    if identity_projection:
        projection = torch.eye(cfg.hidden_size, dtype=dtype)
    elif "text_projection.weight" not in reader:
        raise CheckpointError(f"{path}: no '{prefix}text_projection.weight': not a CLIP text tower with projection")
    else:
        projection = reader.get("text_projection.weight").to(dtype)
    if tuple(projection.shape) != (cfg.projection_dim, cfg.hidden_size):
        raise CheckpointError(f"{path}: '{prefix}text_projection.weight' has shape {tuple(projection.shape)}, the "
                              f"model expects {(cfg.projection_dim, cfg.hidden_size)}")
    model.text_projection.weight = torch.nn.Parameter(projection, requires_grad=False)
    return CLIPPenultimateEncoder(model, AutoTokenizer.from_pretrained(tokenizer, local_files_only=True))


def clip_with_projection_weights(config: dict) -> TextWeights:
    """What load_clip_with_projection keeps of a tower of `config`, counted on meta: the text model and its
    projection (never fp8: the CLIP towers stay in the compute dtype)."""
    with init_empty_weights():
        model = CLIPTextModelWithProjection(CLIPTextConfig(**config))
    return module_text_weights(model)


def load_clip_l(path: str, tokenizer: str | None = None, dtype: torch.dtype = torch.float32, config=None) -> CLIPTextEncoder:
    """CLIP-L from an HF folder, a diffusers pipeline repo (text_encoder/, tokenizer/) or clip_l.safetensors."""
    path = component_folder(path, "text_encoder")
    cfg = CLIPTextConfig(**_read_config(path, config, CLIP_L_CONFIG))
    with init_empty_weights():  # parameters on meta; the position_ids buffer stays real
        model = CLIPTextModel(cfg)
    load_streaming(model, CheckpointReader(path), _clip_key, dtype=dtype)
    return CLIPTextEncoder(model, _load_tokenizer(path, tokenizer, "tokenizer", "CLIP"))


def load_t5(path: str, tokenizer: str | None = None, dtype: torch.dtype = torch.float32, config=None,
            fp8: str | None = None, prefix: str = "") -> T5TextEncoder:
    """T5 encoder from an HF folder, a diffusers pipeline repo (text_encoder_2/, tokenizer_2/) or
    t5xxl_*.safetensors (load_t5_model), with its tokenizer."""
    path = component_folder(path, "text_encoder_2")
    model = load_t5_model(path, dtype, config, fp8, prefix)
    return T5TextEncoder(model, _load_tokenizer(path, tokenizer, "tokenizer_2", "T5"))


def load_t5_model(path: str, dtype: torch.dtype = torch.float32, config=None, fp8: str | None = None,
                  prefix: str = "") -> T5EncoderModel:
    """transformers' T5EncoderModel from an HF folder, a diffusers pipeline repo (text_encoder_2/) or a single file
    (config: a dict, else config.json in or beside it, else T5-XXL's); prefix: only the keys under it, named without
    it (a ComfyUI full checkpoint's `text_encoders.t5xxl.transformer.`: bundled_prefix). In float16 the feed-forward
    output projections
    (`wo`) stay float32, as transformers keeps them (T5 activations overflow fp16 there). fp8 ("fp8" / "fp8_scaled"):
    every Linear stored as FP8Linear, quantized from the file's dtype as it is read, run in `dtype`.
    ComfyUI's scaled fp8 file (t5xxl_fp8_e4m3fn_scaled) is never quantized again: with fp8 (either) its
    Linears keep their codes and per-tensor scales, without it they are dequantized to `dtype`; `wo`
    is dequantized either way (fp8_checkpoints.scaled_fp8_converter)."""
    from library.precision.fp8_checkpoints import scaled_fp8_converter

    path = component_folder(path, "text_encoder_2")
    cfg = T5Config(**_read_config(path, config, T5_XXL_CONFIG))
    with init_empty_weights():
        model = T5EncoderModel(cfg)
    reader = CheckpointReader(path)
    reader = PrefixedReader(reader, prefix) if prefix else reader
    stored = scaled_fp8_converter(model, reader, path, T5_FP8 if fp8 else None, dtype, rename=_t5_key)
    fp16 = dtype == torch.float16
    convert = _tie_t5 if stored is None else _Chain(_tie_t5, stored)
    convert = _Chain(convert, _wo_in_float32) if fp16 else convert
    if fp8 and stored is None:
        from library.precision.fp8 import fp8_load_converter, prepare_fp8

        convert = _Chain(convert, fp8_load_converter(prepare_fp8(model, fp8, T5_FP8)))  # (`wo` is never fp8)
    load_streaming(model, reader, _t5_key, dtype=dtype, convert=convert,
                   keep_dtype=t5_float32_in_fp16 if fp16 else (lambda name: False))
    return model


def t5_float32_in_fp16(name: str) -> bool:
    """The T5 tensors a float16 load keeps float32: the feed-forward output projections `wo`."""
    return ".wo." in name


def _wo_in_float32(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """A float16 T5's `wo` weights, widened to float32 from whatever the file stores: t5xxl_fp16 and bf16
    files too (load_streaming keeps their dtype, which alone left them fp16 / bf16 in the fp16 model)."""
    return {name: tensor.float() if t5_float32_in_fp16(name) else tensor}


# ----------------------------------------------------------------------------------------------
# What the loaders keep, counted without reading a weight (the memory planner's caching phase)


def module_text_weights(model: torch.nn.Module, fp8_rules: FP8Rules | None = None,
                        float32_in_fp16=lambda name: False) -> TextWeights:
    """A text encoder built as its loader builds it (on meta, before fp8 or dtype): its parameters (a tied
    one once), the weights of the Linears prepare_fp8 makes FP8Linear under fp8_rules (None: never fp8) with
    their fp8_scaled scales, and those float32_in_fp16(parameter name) keeps float32 in an fp16 load."""
    from library.precision.fp8 import is_high_precision, scale_shape

    params = dict(model.named_parameters())  # one entry per Parameter: a tied one once
    fp8 = [m for name, m in model.named_modules() if fp8_rules is not None and type(m) is torch.nn.Linear
           and not is_high_precision(name, fp8_rules)]
    scales = [scale_shape(m.out_features, m.in_features) for m in fp8]
    return TextWeights(params=sum(p.numel() for p in params.values()),
                       fp8_weights=sum(m.weight.numel() for m in fp8), fp8_scales=sum(o * i for o, i in scales),
                       fp32_in_fp16=sum(p.numel() for name, p in params.items() if float32_in_fp16(name)))


def t5_text_weights(path: str | None = None, config: dict | None = None) -> TextWeights:
    """T5 as load_t5 builds it from `path` (its config; None: T5-XXL's) or from `config`, on meta: `shared` tied
    to the encoder's embedding, T5_FP8 under fp8, `wo` float32 in fp16."""
    if config is None:
        config = _read_config(component_folder(path, "text_encoder_2"), None, T5_XXL_CONFIG) if path else T5_XXL_CONFIG
    with init_empty_weights():
        model = T5EncoderModel(T5Config(**config))
    model.encoder.embed_tokens.weight = model.shared.weight  # one tensor, as _tie_t5 loads it
    return module_text_weights(model, T5_FP8, t5_float32_in_fp16)


class _Chain:
    """Two load_streaming convert hooks, one after the other; a tensor either wants in the file's dtype
    comes so (a scaled fp8 file's codes must reach their scale before a later hook)."""

    def __init__(self, first, second):
        self.first, self.second = first, second
        keeps = [getattr(hook, "keep_dtype", lambda name: False) for hook in (first, second)]
        self.keep_dtype = lambda name: keeps[0](name) or keeps[1](name)

    def __call__(self, key: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        return {k: v for name, t in self.first(key, tensor).items() for k, v in self.second(name, t).items()}
