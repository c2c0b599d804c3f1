"""HiDream-I1 (Full / Dev / Fast) prompt encoding: CLIP-L's and CLIP-G's projected pooled outputs, T5-XXL's last hidden
state and Llama-3.1-8B-Instruct's hidden states of all 32 layers, each of 128 tokens.

As diffusers' HiDreamImagePipeline.encode_prompt (pipelines/hidream_image/pipeline_hidream_image.py, one prompt for the
four encoders, max_sequence_length 128):
- _get_clip_prompt_embeds, once per CLIP: padded to max_length = min(max_sequence_length, 218) = 128 tokens with each
  tokenizer's own pad, cut there (<|startoftext|> + 126 + <|endoftext|>), run without a mask; output [0] of
  CLIPTextModelWithProjection = text_embeds (the EOT token's final-normed state through text_projection).
  pooled = cat(CLIP-L 768, CLIP-G 1280) = [2048]. 128 tokens need more than CLIP's 77 positions: transformers refuses a
  longer input than max_position_embeddings, so the released text_encoder/ and text_encoder_2/ are Long-CLIP towers
  (the HiDream-I1 paper: "Long-Context CLIP"; Long-CLIP has 248 positions, HIDREAM_CLIP_POSITIONS). The released
  config.json files were not in reach here: 248 is inferred, and a tower's own count is always read from its
  position_embedding's rows. Under CLIP's causal mask the EOT state does not depend on the pads after it, so only the
  cut matters; a 77-position tower (which diffusers cannot run at 128) is cut at 77 here.
- _get_t5_prompt_embeds: min(128, tokenizer_3.model_max_length 512) = 128 tokens, padded with <pad>, `</s>` appended,
  cut at 128, run WITH the tokenizer's attention mask (the pads hidden as keys; their own states kept): [128, 4096].
- _get_llama3_prompt_embeds: tokenizer_4.pad_token = eos_token (the pipeline's __init__; Llama-3.1-Instruct's eos is
  <|eot_id|> 128009), <|begin_of_text|> prepended, no eos appended, padded to 128 and cut at 128, run with the mask
  and no position_ids (transformers' positions 0..127: the pads keep their index; a pad query sees the real tokens,
  never a pad key); hidden_states[1:], stacked: [32, 128, 4096], the embeddings (hidden_states[0]) dropped, the last
  entry after the final norm (as transformers records it). LlamaForCausalLM reads the config's llama3 rope_scaling
  (factor 8, low 1, high 4, original 8192): the frequencies with wavelengths over 2048 tokens are scaled (llm_rope.py).

Where the peers differ (read from their code):
- ai-toolkit (extensions_built_in/diffusion_models/hidream: its own copy of the pipeline, _encode_prompt with
  max_sequence_length 128): the same 128 / 218 / mask / pad / hidden_states[1:] steps; its Llama is
  unsloth/Meta-Llama-3.1-8B-Instruct (the same weights) loaded by transformers, so the same rope scaling.
- ComfyUI (comfy/text_encoders/hidream.py, sd1_clip.py, long_clipl.py, hunyuan_video.py, llama.py): the CLIPs are
  tokenized in windows of the file's position_embedding rows (248 for a Long-CLIP file, else 77) and the pooled
  vectors are the first window's (a cut at 248, not 128); T5 at 128 tokens (min_length = max_length = 128, the
  first window) with its attention mask; Llama padded with 128009 to 128 tokens at least but NEVER cut (a longer
  prompt gives more than 128 tokens), all layers with the first (the embeddings) dropped; its Llama2 class has no
  llama3 rope scaling (rope_theta 500000 only), which moves the states of the low frequencies.

dtypes: the encoders run in `dtype` (bf16 on GPU; CLIPs stay in it under fp8, T5-XXL and Llama as their loaders keep
fp8); every output is float32 as every encoder here returns (text_encoders module docstring), the caches store bf16
(library/data/caches.py CACHE_DTYPE). Per caption the released sizes are t5 128 x 4096, llama 32 x 128 x 4096 and
pooled 2048 elements: 34,607,104 bytes in the bf16 cache (32 MiB of them Llama's), twice that as returned.

Files: CLIP-L / CLIP-G / T5 as sd3/text_encoder.py finds them (a diffusers repo's text_encoder/ + tokenizer/,
text_encoder_2/ + tokenizer_2/, text_encoder_3/ + tokenizer_3/, each component folder, or ComfyUI's single files
clip_l_hidream.safetensors, clip_g_hidream.safetensors, t5xxl_*.safetensors (`text_model.*` + `text_projection.weight`;
`shared.weight` + `encoder.*`) with their configs and tokenizers from the component folders beside); unlike SD3,
CLIP-L's own projection is applied from a single file too (ComfyUI: clip_l return_projected_pooled=True). Llama: a
transformers folder (meta-llama/Llama-3.1-8B-Instruct: config.json, shards + index, tokenizer.json), a pipeline
folder's text_encoder_4/ + tokenizer_4/, or ComfyUI's single file (llama_3.1_8b_instruct_fp8_scaled.safetensors:
`model.*` keys, scaled fp8 read by load_llm; config.json beside it or Llama-3.1-8B's, its shapes checked), its tokenizer
from `llama_tokenizer`, the folder itself or tokenizer_4/ beside.

Memory planner (hidream_text_weights, on meta, the released configs): CLIP-L 123,781,632 and CLIP-G 694,878,720
(248 positions; projections included; never fp8), T5-XXL's encoder 4,762,310,656 (sd3's numbers), Llama-3.1-8B as
loaded here (all 32 layers, the final norm, no head): 7,504,924,672 (fp8: 6,979,321,856 weights of its 224 Linears,
109,051,904 scale elements).
"""

from __future__ import annotations

import dataclasses
import os

import torch

from library.io import CheckpointError, component_folder
from library.models.llm import LLAMA3_8B, LLMConfig
from library.models.llm_rope import RopeScaling
from library.models.sd3.text_encoder import (
    CLIP_G_FILES, CLIP_L_FILES, T5_FILES, EncoderFiles, load_sd3_t5, resolve_encoder,
)
from library.models.spec import TextWeights
from library.models.text_encoders import (
    RESIDENT, CLIPPenultimateEncoder, T5TextEncoder, place_text_encoders, tokenizer_folder,
)

HIDREAM_MAX_LENGTH = 128  # the pipeline's max_sequence_length default (ai-toolkit's and ComfyUI's T5 / Llama length)
CLIP_LENGTH_CAP = 218  # _get_clip_prompt_embeds: max_length = min(max_sequence_length, 218)
HIDREAM_CLIP_POSITIONS = 248  # Long-CLIP's position count (module docstring: inferred for the released towers)
LLAMA_COMPONENT, LLAMA_TOKENIZER = "text_encoder_4", "tokenizer_4"  # a pipeline folder's names (the pipeline's args)
POSITION_KEY = "text_model.embeddings.position_embedding.weight"
# meta-llama/Llama-3.1-8B-Instruct's config.json: Llama-3-8B's layers with the llama3 rope scaling and 131072 positions
LLAMA3_1_8B = dataclasses.replace(
    LLAMA3_8B, max_position_embeddings=131072,
    rope_scaling=RopeScaling("llama3", factor=8.0, original_max_position_embeddings=8192, low_freq_factor=1.0,
                             high_freq_factor=4.0))
# What the cached text depends on beyond the files and max_length (the family's text_encoding_constants)
ENCODING_CONSTANTS = {"clip_length_cap": CLIP_LENGTH_CAP, "llama_states": "hidden_states[1:]", "t5_mask": True,
                      "llama_pad": "eos"}


def clip_token_length(max_length: int, positions: int) -> int:
    """The tokens each CLIP gets: the pipeline's min(max_length, 218), at most the tower's positions."""
    return min(max_length, CLIP_LENGTH_CAP, positions)


class HiDreamTextEncoder:
    """encode(captions) -> one dict per caption, all float32: "t5" [L, D_t5], "llama" [layers, L, D_llama] and "pooled"
    [P_l + P_g] (module docstring; L = max_length). `.models`: the loaded modules (for .to(device))."""

    def __init__(self, clip_l: CLIPPenultimateEncoder, clip_g: CLIPPenultimateEncoder, t5: T5TextEncoder, llama,
                 llama_tokenizer, max_length: int = HIDREAM_MAX_LENGTH):
        self.clip_l, self.clip_g, self.t5 = clip_l, clip_g, t5
        self.llama, self.llama_tokenizer = llama.eval().requires_grad_(False), llama_tokenizer
        self.max_length = max_length
        self.placement = RESIDENT  # text_encoders.OneAtATime where the encoders take turns on the device (place)

    @property
    def models(self) -> list[torch.nn.Module]:
        return [self.clip_l.model, self.clip_g.model, self.t5.model, self.llama]

    def place(self, device, one_at_a_time: bool = False) -> None:
        """All four on `device`, or CLIP-L resident and CLIP-G, T5-XXL, then Llama, each on it for its own stage
        (HiDreamFamily.text_encoders_take_turns; text_encoder_weights' order)."""
        self.placement = place_text_encoders(self.models, device, one_at_a_time)

    @property
    def llama_layers(self) -> int:
        return self.llama.config.num_layers

    def pooled(self, captions: list[str]) -> torch.Tensor:
        """[B, P_l + P_g] float32: each CLIP's text_embeds at clip_token_length tokens, joined."""
        parts = []
        for stage, encoder in enumerate((self.clip_l, self.clip_g)):
            with self.placement.stage(stage):
                positions = encoder.model.config.max_position_embeddings
                parts.append(encoder.pooled(captions, clip_token_length(self.max_length, positions)))
        return torch.cat(parts, dim=-1)

    def t5_states(self, captions: list[str]) -> torch.Tensor:
        """[B, L, D_t5] float32, with T5's attention mask; L = min(max_length, the tokenizer's model_max_length)."""
        length = min(self.max_length, self.t5.tokenizer.model_max_length)
        return self.t5.encode(captions, length, masked=True)

    @torch.no_grad()
    def llama_states(self, captions: list[str]) -> torch.Tensor:
        """[layers, B, L, D] float32 on the CPU: hidden_states[1:] of the eos-padded, masked run at positions 0..L-1.
        The states leave the device as they widen: widened there, a batch of 8 would hold 1 GiB more (float32)."""
        length = min(self.max_length, self.llama_tokenizer.model_max_length)
        tokens = self.llama_tokenizer(captions, padding="max_length", max_length=length, truncation=True,
                                      add_special_tokens=True, return_tensors="pt")
        device = self.llama.model.embed_tokens.weight.device
        ids, mask = tokens.input_ids.to(device), tokens.attention_mask.to(device)  # int64 [B, L]
        positions = torch.arange(ids.shape[1], device=device)  # int64: transformers' default, pads keep their index
        indices = tuple(range(1, self.llama_layers + 1))  # hidden_states[1:]: every layer, the last after the norm
        states = self.llama.selected_hidden_states(ids, mask, indices, position_ids=positions)  # compute dtype
        widened = torch.empty(len(states), *states[0].shape, dtype=torch.float32)
        for layer, state in enumerate(states):
            widened[layer].copy_(state)
        return widened

    def encode(self, captions: list[str]) -> list[dict[str, torch.Tensor]]:
        pooled = self.pooled(captions)  # stages 0 and 1
        with self.placement.stage(2):
            t5 = self.t5_states(captions)
        with self.placement.stage(3):
            llama = self.llama_states(captions)
        return [{"t5": t5[i], "llama": llama[:, i], "pooled": pooled[i]} for i in range(len(captions))]


def _clip_config(found, title: str) -> dict:
    """The tower's config with its position count read from the file (a single file's config comes from a folder
    beside it, or the released one, whose count may not be the file's: Long-CLIP's 248, ComfyUI reads it so)."""
    from library.io import CheckpointReader, PrefixedReader

    reader = CheckpointReader(found.weights)
    reader = PrefixedReader(reader, found.prefix) if found.prefix else reader
    if POSITION_KEY not in reader:
        raise CheckpointError(f"{found.weights}: no '{found.prefix}{POSITION_KEY}': not a {title} text tower")
    return {**found.config, "max_position_embeddings": reader.shape(POSITION_KEY)[0]}


def load_hidream_clip(path: str, files: EncoderFiles, dtype: torch.dtype = torch.float32,
                      tokenizer: str | None = None) -> CLIPPenultimateEncoder:
    """CLIP-L (CLIP_L_FILES) or CLIP-G (CLIP_G_FILES) from `path` with its tokenizer and its own projection."""
    from library.models.text_encoders import load_clip_with_projection

    found = resolve_encoder(path, files)
    folder = tokenizer_folder(found.weights, tokenizer, files.tokenizer, files.kind, beside_file=True)
    return load_clip_with_projection(found.weights, folder, dtype, _clip_config(found, files.title), found.prefix)


def llama_config_from_shapes(path: str, like: LLMConfig = LLAMA3_1_8B) -> LLMConfig:
    """The Llama of a single file without config.json: vocabulary, width, depth, heads and MLP from its tensors with
    `like`'s head_dim (128: q_proj's rows are heads x head_dim, the shapes cannot split them), RoPE and epsilon. A file
    with Qwen's qkv biases or q/k norms, or Gemma's extra norms, is refused naming the file."""
    from library.models.llm import checkpoint_key_to_llm, llm_reader

    reader = llm_reader(path)
    keys = {checkpoint_key_to_llm(k, False): k for k in reader.keys()}

    def shape(name: str) -> tuple[int, ...]:
        if name not in keys:
            raise CheckpointError(f"{path}: no tensor for {name} (keys like {next(iter(reader.keys()), None)!r}); not "
                                  f"a Llama text encoder (HiDream-I1's is Llama-3.1-8B-Instruct)")
        return reader.shape(keys[name])

    others = ("self_attn.k_proj.bias", "self_attn.q_norm.weight", "post_feedforward_layernorm.weight")
    found = [n for n in others if f"model.layers.0.{n}" in keys]
    if found:
        raise CheckpointError(f"{path}: has model.layers.0.{found[0]}: a Qwen / Gemma model, not Llama-3.1-8B")
    vocab, width = shape("model.embed_tokens.weight")
    rows = [shape(f"model.layers.0.self_attn.{p}_proj.weight")[0] for p in "qk"]
    if any(r % like.head_dim for r in rows) or rows[0] % rows[1]:
        raise CheckpointError(f"{path}: q_proj / k_proj rows {rows} are not whole heads of {like.head_dim} "
                              f"(Llama-3.1-8B's head_dim); put the model's config.json beside it")
    layers = 1 + max(int(n.split(".")[2]) for n in keys if n and n.startswith("model.layers."))
    heads, kv_heads = (r // like.head_dim for r in rows)
    return dataclasses.replace(like, vocab_size=vocab, hidden_size=width, num_layers=layers, num_heads=heads,
                               num_kv_heads=kv_heads, head_dim=like.head_dim,
                               intermediate_size=shape("model.layers.0.mlp.gate_proj.weight")[0])


def hidream_llama_config(weights: str) -> LLMConfig:
    """The Llama of `weights` (a folder, an index or a .safetensors): its config.json in or beside it, else shaped by
    its tensors (llama_config_from_shapes). A config of another model type is refused."""
    from library.models.llm import _find_config, config_json_path

    if os.path.isfile(weights) and not os.path.isfile(config_json_path(weights)):
        return llama_config_from_shapes(weights)
    config = _find_config(weights)
    if config.qkv_bias or config.qk_norm or config.gemma_norms:
        raise CheckpointError(f"{config_json_path(weights)}: HiDream-I1's fourth text encoder is Llama-3.1-8B-"
                              f"Instruct; this config is another model (width {config.hidden_size}, "
                              f"{config.num_layers} layers)")
    return config


def load_llama_tokenizer(weights: str, tokenizer: str | None = None):
    """Llama 3's tokenizer, padding with its eos as the pipeline sets it: `tokenizer`, else in the weights folder,
    else tokenizer_4/ beside it. A folder of another kind (CLIP, T5, Qwen2, ...) is refused."""
    from transformers import AutoTokenizer

    from library.models.text_encoders import tokenizer_kind

    folder = tokenizer_folder(weights, tokenizer, LLAMA_TOKENIZER, "Llama", beside_file=True)
    if not os.path.isfile(os.path.join(folder, "tokenizer_config.json")):
        raise CheckpointError(f"{folder}: no tokenizer_config.json; expected the folder of Llama 3.1's tokenizer")
    if tokenizer_kind(folder) not in ("Llama", None):
        raise CheckpointError(f"{folder}: a {tokenizer_kind(folder)} tokenizer, given where HiDream-I1 needs "
                              f"Llama 3.1's")
    loaded = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    if loaded.eos_token is None:
        raise CheckpointError(f"{folder}: the tokenizer has no eos token (the pipeline pads Llama's prompts with it)")
    loaded.pad_token = loaded.eos_token  # HiDreamImagePipeline.__init__: tokenizer_4.pad_token = eos_token
    loaded.padding_side = "right"
    return loaded


def load_hidream_llama(path: str, dtype: torch.dtype = torch.float32, fp8: str | None = None):
    """Llama-3.1-8B on the LLM core, all layers and the final norm (hidden_states[1:] reads every one), no head."""
    from library.models.family import fp8_prepare
    from library.models.llm import load_llm

    weights = component_folder(path, LLAMA_COMPONENT)
    if not os.path.exists(weights):
        raise CheckpointError(f"{weights}: no such file or folder (the Llama text encoder)")
    config = hidream_llama_config(weights)
    return load_llm(weights, config=config, dtype=dtype, prepare=fp8_prepare(fp8, "llm"), keep_layers=config.num_layers)


def load_hidream_text_encoders(clip_l: str, clip_g: str, t5xxl: str, llama: str, dtype: torch.dtype = torch.bfloat16,
                               fp8: str | None = None, max_length: int = HIDREAM_MAX_LENGTH,
                               llama_tokenizer: str | None = None) -> HiDreamTextEncoder:
    """The four encoders (one path each; a diffusers repo may be the first three) in `dtype`; fp8 ("fp8" /
    "fp8_scaled"): T5-XXL's and Llama's Linears as their loaders store them, the CLIPs stay in `dtype`.
    llama_tokenizer: the folder of Llama's tokenizer when not in or beside its weights (ComfyUI's single file)."""
    llama_weights = component_folder(llama, LLAMA_COMPONENT)
    tokenizer = load_llama_tokenizer(llama_weights, llama_tokenizer)  # before any weight: a quick error
    encoder_l = load_hidream_clip(clip_l, CLIP_L_FILES, dtype)
    encoder_g = load_hidream_clip(clip_g, CLIP_G_FILES, dtype)
    t5, llm = load_sd3_t5(t5xxl, dtype, fp8), load_hidream_llama(llama, dtype, fp8)
    return HiDreamTextEncoder(encoder_l, encoder_g, t5, llm, tokenizer, max_length)


def hidream_text_weights(clip_l: str | None = None, clip_g: str | None = None, t5xxl: str | None = None,
                         llama: str | None = None) -> list[TextWeights]:
    """The memory planner's TextWeights of what load_hidream_text_encoders keeps, counted on meta from each path's
    config (None: the released one; the CLIPs with HIDREAM_CLIP_POSITIONS) without reading a weight: CLIP-L, CLIP-G
    (never fp8), T5-XXL (sd3_text_weights' rules), Llama (every layer and the final norm, no head; fp8: its Linears)."""
    from library.models.llm import LLM
    from library.models.llm_spec import FP8
    from library.models.text_encoders import clip_with_projection_weights, module_text_weights, t5_text_weights

    clips = [{**files.config, "max_position_embeddings": HIDREAM_CLIP_POSITIONS} if path is None
             else _clip_config(resolve_encoder(path, files), files.title)  # the header's shapes, no weight read
             for path, files in ((clip_l, CLIP_L_FILES), (clip_g, CLIP_G_FILES))]
    t5_config = T5_FILES.config if t5xxl is None else resolve_encoder(t5xxl, T5_FILES, read_keys=False).config
    config = LLAMA3_1_8B if llama is None else hidream_llama_config(component_folder(llama, LLAMA_COMPONENT))
    with torch.device("meta"):
        model = LLM(config)
        model.truncate_for_hidden_states(config.num_layers)
    return [clip_with_projection_weights(c) for c in clips] + [t5_text_weights(config=t5_config),
                                                               module_text_weights(model, FP8)]
