"""HunyuanImage-2.1 prompt encoding: Qwen2.5-VL-7B's language model on our LLM core plus a byT5-small "glyph"
encoder of the prompt's quoted text.

As diffusers' HunyuanImagePipeline.encode_prompt (pipelines/hunyuan_image/pipeline_hunyuanimage.py):
- Qwen2.5-VL (_get_qwen_prompt_embeds): the prompt goes into HUNYUAN_IMAGE_TEMPLATE, a chat turn with a fixed system
  prompt but no assistant turn (it ends at the user's `<|im_end|>`, no "\\n<|im_start|>assistant\\n"), tokenized
  with truncation at 1000 + 34 tokens; the state read is hidden_states[-3] (hidden_state_skip_layer 2): the output of
  decoder layer 26 of 28, no final norm, so only 26 layers are loaded and run; the template's first 34 tokens
  (system turn + "<|im_start|>user\\n") are dropped. The pipeline pads to 1034 on the right: a real token never sees
  a pad (causal), its positions are 0..n-1 either way, so each caption's real tokens are those of its padded run.
- byT5 (_get_byt5_prompt_embeds): extract_glyph_text collects the text in '...', "...", ‘...’ and “...” (in that
  order, each kind's matches in turn) as 'Text "x". ' pieces; byT5's ByT5Tokenizer (bytes + 3, `</s>` appended)
  cuts it at 128 tokens, T5EncoderModel runs it with its mask, the last hidden state is read. A prompt without
  quoted text has none: the pipeline feeds zeros with an all-False mask there (encode gives no "glyph" key then; the
  transformer takes glyph=None as that). T5 masks the pad keys (weight exactly 0 after softmax) and its relative
  position bias depends on distances only: the real tokens' states do not depend on the padding.

The released glyph checkpoint (Glyph-SDXL-v2's byt5_small_glyphxl; ComfyUI's byt5_config_small_glyph.json) has
vocabulary 1510 = ByT5's 384 + 138 color and 988 font tokens that Glyph-SDXL-v2 / sd-scripts' add_special_token add
to the tokenizer (`<color-N>`, `<en-font-N>`, ...). They are whole-string added tokens: plain text is still split
into bytes with the same ids (tests/test_hunyuan_image_text.py measures it), only a prompt spelling `<color-3>`
itself would differ. Neither the pipeline nor the prompts here use them (the official format_prompt leaves color
and font None), so the plain ByT5Tokenizer is used when no tokenizer_2/ folder is found.

Where the peers differ (measured on what they do, not on weights):
- sd-scripts (library/hunyuan_image_text_encoder.py): the same template, drop 34 and hidden_states[-3], but
  TOKENIZER_MAX_LENGTH 1024 (cut at 1058, not 1034: a caption of 1001..1024 tokens after the drop keeps up to 24
  more tokens there; none of a caption under 1000 changes) and its byT5 pattern list leaves out single quotes
  (pattern_quote_single commented out): "a sign saying 'hi'" gets glyph states from the pipeline and here, none in
  sd-scripts (the transformer then sees the zeros).
- ComfyUI (comfy/text_encoders/hunyuan_image.py): the same template, layer_idx -3 and the 34-token drop (found as
  the second <|im_start|> + "user\\n"), no 1000-token cut on either encoder (its byT5 tokenizer max_length is
  99999999: a glyph text over 127 bytes is not cut at 128), and like sd-scripts no single quotes.

Files: path is a HunyuanImage-2.1 diffusers repo (text_encoder/ + tokenizer/), a Qwen2.5-VL HF folder or ComfyUI's
single file qwen_2.5_vl_7b.safetensors (read as Qwen2.5-VL-7B, its tokenizer from `tokenizer`); glyph_path the
repo (text_encoder_2/ + tokenizer_2/), a T5 HF folder or ComfyUI's byt5_small_glyphxl_fp16.safetensors (HF T5 key
names `shared.weight`, `encoder.block.N...`; its config shaped from its tensors: glyph_t5_config).

Memory planner (hunyuan_image_text_weights, on meta): Qwen2.5-VL-7B's embedding (544,997,376) and 26 of 28 decoder
layers (233,057,792 each), the final norm (loaded, never run), no head: TextWeights(6,604,503,552,
fp8_weights=6,059,196,416, fp8_scales=94,674,944) (fp8: the 182 decoder Linears; the whole language model with its
head is 7,615,616,512); byT5-small's encoder at vocabulary 1510: TextWeights(219,314,944, fp32_in_fp16=63,307,776)
(never fp8: a 0.22 B encoder; its 12 `wo` stay float32 in fp16).
"""

from __future__ import annotations

import os
import re

import torch

from library.io import CheckpointError, CheckpointReader, component_folder, read_json_file
from library.models.llm import QWEN2_5_7B, LLMConfig, hidden_state_index
from library.models.spec import TextWeights
from library.models.text_encoders import right_padded, tokenizer_kind

# Copied verbatim from diffusers' HunyuanImagePipeline (prompt_template_encode / prompt_template_encode_start_idx)
HUNYUAN_IMAGE_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>"
)
HUNYUAN_IMAGE_DROP_TOKENS = 34  # the system turn + "<|im_start|>user\n"
HUNYUAN_IMAGE_MAX_TOKENS = 1000  # the pipeline's tokenizer_max_length, counted after the drop
HUNYUAN_IMAGE_HIDDEN_STATE = -3  # hidden_states[-(hidden_state_skip_layer 2 + 1)]
GLYPH_MAX_TOKENS = 128  # the pipeline's tokenizer_2_max_length (`</s>` included)
# extract_glyph_text's patterns, in its order: single, double, Chinese single, Chinese double quotes
GLYPH_QUOTES = (r"\'(.*?)\'", r"\"(.*?)\"", r"‘(.*?)’", r"“(.*?)”")

# byT5-small's encoder as the glyph checkpoint has it (google/byt5-small's config.json; vocabulary 1510 with
# Glyph-SDXL-v2's color and font tokens, ComfyUI's byt5_config_small_glyph.json): the single file's default shapes
BYT5_SMALL_GLYPH_CONFIG = {
    "vocab_size": 1510, "d_model": 1472, "d_kv": 64, "d_ff": 3584, "num_layers": 12, "num_heads": 6,
    "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128, "layer_norm_epsilon": 1e-6,
    "feed_forward_proj": "gated-gelu", "tie_word_embeddings": False, "pad_token_id": 0, "eos_token_id": 1,
}


def extract_glyph_text(caption: str) -> str | None:
    """The pipeline's extract_glyph_text: every quoted piece as 'Text "x". ', None when the caption quotes nothing."""
    pieces = [text for pattern in GLYPH_QUOTES for text in re.findall(pattern, caption)]
    return "".join(f'Text "{text}". ' for text in pieces) if pieces else None


class HunyuanImageTextEncoder:
    """encode(captions) -> one dict per caption (module docstring): "embeds" float32 [T, D] and "mask" bool [T] of its
    real tokens after the drop (T <= 1000), plus "glyph" float32 [G, 1472] and "glyph_mask" bool [G] (G <= 128) when
    it quotes text. `.llm` (Qwen2.5-VL's first 26 layers) and `.glyph_model` (T5EncoderModel) move with .to()."""

    def __init__(self, llm, tokenizer, glyph_model, glyph_tokenizer, max_tokens: int = HUNYUAN_IMAGE_MAX_TOKENS):
        self.llm, self.tokenizer = llm.eval().requires_grad_(False), tokenizer
        self.glyph_model, self.glyph_tokenizer = glyph_model.eval().requires_grad_(False), glyph_tokenizer
        self.max_tokens = max_tokens
        self.layer = hidden_state_index(HUNYUAN_IMAGE_HIDDEN_STATE, llm.config.num_layers)  # 26 of 28
        if len(llm.model.layers) < self.layer:
            raise ValueError(f"HunyuanImageTextEncoder: hidden_states[-3] needs {self.layer} decoder layers; "
                             f"{len(llm.model.layers)} are loaded")
        prefix = HUNYUAN_IMAGE_TEMPLATE.split("{}")[0]
        n = len(tokenizer(prefix).input_ids)
        if n != HUNYUAN_IMAGE_DROP_TOKENS:
            raise ValueError(f"HunyuanImageTextEncoder: the tokenizer splits the template prefix into {n} tokens, "
                             f"expected {HUNYUAN_IMAGE_DROP_TOKENS} (the Qwen2.5-VL tokenizer)")

    def token_rows(self, captions: list[str]) -> list[list[int]]:
        """Each templated caption's ids as the pipeline's tokenizer call gives them (cut at 1034), unpadded."""
        texts = [HUNYUAN_IMAGE_TEMPLATE.format(c) for c in captions]
        length = self.max_tokens + HUNYUAN_IMAGE_DROP_TOKENS
        return self.tokenizer(texts, max_length=length, truncation=True, padding=False).input_ids

    @torch.no_grad()
    def encode_prompts(self, captions: list[str]) -> list[torch.Tensor]:
        """hidden_states[-3] of each caption's real tokens after the drop, float32 [T, D]."""
        device = self.llm.model.embed_tokens.weight.device
        pad = self.tokenizer.pad_token_id
        ids, mask = right_padded(self.token_rows(captions), 0 if pad is None else pad, device)  # int64 / bool [B, L]
        (state,) = self.llm.selected_hidden_states(ids, mask, (self.layer,))  # compute dtype [B, L, D]
        return [s[m][HUNYUAN_IMAGE_DROP_TOKENS:].float() for s, m in zip(state, mask)]  # -> float32 (the cache's)

    @torch.no_grad()
    def encode_glyphs(self, texts: list[str]) -> list[torch.Tensor]:
        """byT5's last hidden state of each glyph text's real tokens (`</s>` included), float32 [G, d_model]."""
        rows = self.glyph_tokenizer(texts, max_length=GLYPH_MAX_TOKENS, truncation=True, padding=False).input_ids
        device = self.glyph_model.shared.weight.device
        ids, mask = right_padded(rows, self.glyph_tokenizer.pad_token_id, device)  # int64 / bool [B, G]
        state = self.glyph_model(input_ids=ids, attention_mask=mask.long()).last_hidden_state  # [B, G, d_model]
        return [s[m].float() for s, m in zip(state, mask)]  # weights' dtype -> float32

    def encode(self, captions: list[str]) -> list[dict[str, torch.Tensor]]:
        embeds = self.encode_prompts(captions)
        glyph_texts = {i: text for i, c in enumerate(captions) if (text := extract_glyph_text(c)) is not None}
        glyphs = dict(zip(glyph_texts, self.encode_glyphs(list(glyph_texts.values())))) if glyph_texts else {}
        out = []
        for i, e in enumerate(embeds):
            item = {"embeds": e, "mask": torch.ones(e.shape[0], dtype=torch.bool, device=e.device)}
            if i in glyphs:
                g = glyphs[i]
                item.update(glyph=g, glyph_mask=torch.ones(g.shape[0], dtype=torch.bool, device=g.device))
            out.append(item)
        return out


# ----------------------------------------------------------------------------------------------
# The glyph encoder's files


def glyph_t5_config(path: str) -> dict:
    """The byT5 T5Config of `path` (text_encoder_2/, an HF folder or a single file): its config.json in or beside it,
    else BYT5_SMALL_GLYPH_CONFIG shaped by the file's tensors (vocabulary, width, depth, heads, head width, MLP)."""
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    if os.path.isfile(os.path.join(folder, "config.json")):
        return read_json_file(os.path.join(folder, "config.json"))
    reader = CheckpointReader(path)
    keys = set(reader.keys())

    def shape(key: str) -> tuple[int, ...]:
        if key not in keys:
            raise CheckpointError(f"{path}: no tensor {key} (keys like {next(iter(keys), None)!r}); not a T5 encoder "
                                  f"(HunyuanImage's glyph encoder is byT5-small), or put its config.json beside it")
        return reader.shape(key)

    vocab, width = shape("shared.weight")
    heads = shape("encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight")[1]
    inner = shape("encoder.block.0.layer.0.SelfAttention.q.weight")[0]
    layers = 1 + max(int(k.split(".")[2]) for k in keys if k.startswith("encoder.block."))
    return {**BYT5_SMALL_GLYPH_CONFIG, "vocab_size": vocab, "d_model": width, "num_heads": heads,
            "d_kv": inner // heads, "num_layers": layers,
            "d_ff": shape("encoder.block.0.layer.1.DenseReluDense.wi_0.weight")[0]}


def load_hunyuan_image_glyph_tokenizer(glyph_path: str, tokenizer: str | None = None):
    """ByT5's tokenizer: the `tokenizer` folder, else a ByT5 tokenizer in or beside the glyph weights (tokenizer_2/ of
    the repo; any color / font tokens it adds leave plain text's ids as they are), else transformers' ByT5Tokenizer
    (byte-level: its vocabulary is code, no file can be missing). A given folder of another kind is refused."""
    from transformers import AutoTokenizer, ByT5Tokenizer

    if tokenizer is None:
        folder = glyph_path if os.path.isdir(glyph_path) else os.path.dirname(os.path.abspath(glyph_path))
        candidates = (folder, os.path.join(folder, "tokenizer_2"),
                      os.path.join(os.path.dirname(folder.rstrip("/")), "tokenizer_2"))
        found = [c for c in candidates if os.path.isfile(os.path.join(c, "tokenizer_config.json"))
                 and tokenizer_kind(c) == "ByT5"]
        if not found:
            return ByT5Tokenizer()
        tokenizer = found[0]
    elif not os.path.isfile(os.path.join(tokenizer, "tokenizer_config.json")):
        raise CheckpointError(f"{tokenizer}: no tokenizer_config.json; expected the folder of byT5's tokenizer")
    loaded = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
    if not isinstance(loaded, ByT5Tokenizer):
        raise CheckpointError(f"{tokenizer}: a {type(loaded).__name__}, given where HunyuanImage's glyph encoder needs "
                              f"ByT5's tokenizer")
    return loaded


def load_hunyuan_image_glyph_model(glyph_path: str, dtype: torch.dtype = torch.bfloat16):
    """byT5's T5EncoderModel (text_encoders.load_t5_model: float32 `wo` in fp16) with glyph_t5_config's shapes."""
    from library.models.text_encoders import load_t5_model

    weights = component_folder(glyph_path, "text_encoder_2")
    return load_t5_model(weights, dtype, config=glyph_t5_config(weights))


def glyph_folder(path: str) -> str:
    """The byT5 folder of a diffusers repo given as the repo or its text_encoder/: text_encoder_2/ in or beside it."""
    candidates = [os.path.join(path, "text_encoder_2"),
                  os.path.join(os.path.dirname(os.path.abspath(path).rstrip("/")), "text_encoder_2")]
    found = [c for c in candidates if os.path.isdir(c)]
    if not found:
        raise CheckpointError(f"{path}: no text_encoder_2/ (byT5, the glyph encoder) in or beside it; give its path "
                              f"(e.g. byt5_small_glyphxl_fp16.safetensors)")
    return found[0]


def load_hunyuan_image_text_encoder(
    path: str,
    glyph_path: str | None = None,
    dtype: torch.dtype = torch.bfloat16,
    fp8: str | None = None,
    tokenizer: str | None = None,
    glyph_tokenizer: str | None = None,
) -> HunyuanImageTextEncoder:
    """The encoders from a HunyuanImage-2.1 diffusers repo or the single files (module docstring). glyph_path None:
    text_encoder_2/ of the repo `path` (glyph_folder). dtype: both models' weights and compute dtype; fp8: a base
    precision for Qwen2.5-VL's decoder Linears (byT5 stays in `dtype`). tokenizer / glyph_tokenizer: tokenizer folders
    when not beside the weights."""
    from library.models.family import fp8_prepare
    from library.models.text_encoders import (
        load_qwen2_5_vl_language_model, load_qwen2_5_vl_tokenizer, qwen2_5_vl_language_config,
    )

    glyph_path = glyph_folder(path) if glyph_path is None else component_folder(glyph_path, "text_encoder_2")
    qwen_tokenizer = load_qwen2_5_vl_tokenizer(path, tokenizer)  # before the weights: a quick error
    byt5_tokenizer = load_hunyuan_image_glyph_tokenizer(glyph_path, glyph_tokenizer)
    config = qwen2_5_vl_language_config(path)
    keep = hidden_state_index(HUNYUAN_IMAGE_HIDDEN_STATE, config.num_layers)  # the last two layers never run
    llm = load_qwen2_5_vl_language_model(path, dtype, config, fp8_prepare(fp8, "llm"), keep_layers=keep)
    glyph_model = load_hunyuan_image_glyph_model(glyph_path, dtype)
    return HunyuanImageTextEncoder(llm, qwen_tokenizer, glyph_model, byt5_tokenizer)


# ----------------------------------------------------------------------------------------------
# Planner and dataset check


def hunyuan_image_text_weights(config: LLMConfig = QWEN2_5_7B,
                               glyph_config: dict | None = None) -> list[TextWeights]:
    """The memory planner's TextWeights of what load_hunyuan_image_text_encoder keeps, built on meta: Qwen2.5-VL's
    embedding, the layers up to hidden_states[-3] and the final norm, no head (fp8: their Linears); byT5's encoder
    (glyph_config: glyph_t5_config's, None: the released one), `shared` tied to its embedding, never fp8, `wo`
    float32 in fp16."""
    from accelerate import init_empty_weights
    from transformers import T5Config, T5EncoderModel

    from library.models.llm import LLM
    from library.models.llm_spec import FP8
    from library.models.text_encoders import module_text_weights, t5_float32_in_fp16

    with torch.device("meta"):
        llm = LLM(config)
        llm.truncate_for_hidden_states(hidden_state_index(HUNYUAN_IMAGE_HIDDEN_STATE, config.num_layers))
    with init_empty_weights():
        glyph = T5EncoderModel(T5Config(**(glyph_config or BYT5_SMALL_GLYPH_CONFIG)))
    glyph.encoder.embed_tokens.weight = glyph.shared.weight  # one tensor, as load_t5_model loads it
    return [module_text_weights(llm, FP8), module_text_weights(glyph, None, t5_float32_in_fp16)]


def hunyuan_image_caption_token_limit(path: str, tokenizer: str | None = None):
    """-> TokenLimit: the templated caption is cut at 1034 tokens, 1000 after the 34-token drop (its closing
    `<|im_end|>` counted), so the dataset check warns when a caption's text would be cut."""
    from library.data.check import TokenLimit
    from library.models.text_encoders import load_qwen2_5_vl_tokenizer

    loaded = load_qwen2_5_vl_tokenizer(path, tokenizer)

    def count(text: str) -> int:
        ids = loaded(HUNYUAN_IMAGE_TEMPLATE.format(text), verbose=False).input_ids
        return len(ids) - HUNYUAN_IMAGE_DROP_TOKENS

    return TokenLimit("Qwen2.5-VL", HUNYUAN_IMAGE_MAX_TOKENS, count)
