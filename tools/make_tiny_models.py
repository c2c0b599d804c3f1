"""Write a tiny, random, but real-format model set: every file is laid out as users have the real
ones, with the real architectures at toy sizes, so the loaders, converters and the whole training
path can be exercised on a CPU in seconds.

    python tools/make_tiny_models.py --out DIR [--seed 0]

DIR/
  flux/flux1-tiny.safetensors          BFL single file (FLUX.1-dev layout, with guidance_in)
  flux/diffusers/transformer/          the same weights as a diffusers transformer folder
  flux/ae/                             AutoencoderKL diffusers folder (16 latent channels, FLUX shift/scale)
  flux/ae.safetensors                  the same VAE in BFL's single-file `ae.safetensors` layout
  flux/clip_l/  flux/t5xxl/            CLIPTextModel / T5EncoderModel HF folders with tokenizers
  qwen_image/transformer/              diffusers QwenImageTransformer2DModel folder
  qwen_image/vae/                      AutoencoderKLQwenImage diffusers folder
  qwen_image/text_encoder/             Qwen2-style LM (HF Qwen2 names and config)
  qwen_image/tokenizer/                its tokenizer (chat-template special tokens; the Qwen-Image
                                       template prefix is exactly 34 tokens, as with Qwen2.5-VL's)
  qwen_image_edit/transformer/         Qwen-Image-Edit / Edit-2509 transformer (diffusers folder)
  qwen_image_edit/text_encoder/        Qwen2_5_VLForConditionalGeneration (vision tower + M-RoPE LM)
  qwen_image_edit/tokenizer/           its tokenizer (vision special tokens; edit template prefix = 64
                                       tokens, the pipelines' drop index, as with the real one)
  qwen_image_edit/processor/           Qwen2VLImageProcessor preprocessor_config.json + tokenizer
  qwen_image_edit_2511/transformer/    Edit-2511 transformer (zero_cond_t)
  llm/                                 Qwen2-style causal LM + tokenizer
  flux2/text_encoder/                  FLUX.2 [klein] text encoder: Qwen3ForCausalLM (HF names, tied
                                       embeddings, explicit head_dim), two shards + index.json
  flux2/tokenizer/                     its tokenizer, with a Qwen3-style chat template in
                                       tokenizer_config.json (enable_thinking=False -> empty <think>)
  flux2/flux2-tiny.safetensors         FLUX.2 [klein]-like transformer (no guidance_in), BFL single file
  flux2/transformer/                   the same weights as a diffusers Flux2Transformer2DModel folder
  flux2/flux2-dev-tiny.safetensors     FLUX.2 [dev]-like transformer (guidance_in), BFL single file
  flux2/dev/text_encoder/              FLUX.2 [dev] text encoder: Mistral3ForConditionalGeneration (tiny Pixtral
                                       tower + Mistral LM, released `language_model.model.*` keys, 31 layers)
  flux2/dev/tokenizer/                 its Mistral-style tokenizer (<s> added, <pad>) with a chat template
  flux2/vae/                           AutoencoderKLFlux2 diffusers folder (32 latent channels, BatchNorm
                                       statistics set away from 0 / 1 so that normalisation is seen)
  manifest.json                        what was written, with sizes and dims

Dimensions are consistent across the set: T5 d_model == FLUX context_in_dim, CLIP hidden ==
FLUX vec_in_dim, 16 latent channels (64 packed), LM hidden == Qwen-Image joint_attention_dim; the
klein text encoder stacks 3 hidden states of width lm_hidden (FLUX.2 joint_attention_dim 3 x 32 = 96).
Everything is deterministic from --seed (each component seeds its own generator). Weights are
float32 so that parity tests can compare at 1e-5.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

if __package__ in (None, ""):  # run as a script: make `library` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.cli import check_command_line  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--seed", type=int, default=0)
    return parser


# The arguments are checked before torch and the library load (seconds): --help and a bad flag answer at once.
if __name__ == "__main__":
    check_command_line(build_parser)

import torch  # noqa: E402

from library.io import save_safetensors, write_text  # noqa: E402

# ----------------------------------------------------------------------------------------------
# Sizes

TINY = {
    "t5_d_model": 32,  # == FLUX context_in_dim
    "clip_hidden": 32,  # == FLUX vec_in_dim
    "lm_hidden": 32,  # == Qwen-Image joint_attention_dim
    "dit_hidden": 64,  # 2 heads x 32, RoPE axes (8, 12, 12)
    "dit_heads": 2,
    "axes": (8, 12, 12),
    "latent_channels": 16,
    "flux2_latent_channels": 32,  # AutoencoderKLFlux2's
}

# A small corpus: the tokenizers learn whole words for the Qwen-Image template and some captions.
CORPUS = [
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n",
    "a photo of a cat sitting on a red chair",
    "a painting of a house by the sea at sunset, oil on canvas",
    "a close up photo of a dog with a blue ball in the grass",
    "an illustration of a city street at night with neon signs",
    "The quick brown fox jumps over the lazy dog. 0123456789",
]


# ----------------------------------------------------------------------------------------------
# Tokenizers (trained here with the `tokenizers` library; saved as tokenizer.json + tokenizer_config.json)


def _bpe(vocab_size: int, pre_tokenizer, decoder, normalizer=None, specials=(), unk=None, templates=(CORPUS[0],)):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=unk))
    tok.pre_tokenizer, tok.decoder = pre_tokenizer, decoder
    if normalizer is not None:
        tok.normalizer = normalizer
    corpus = [t.format(c) for t in templates for c in CORPUS[1:]] * 4 + CORPUS[1:]
    # Byte-level: all 256 bytes, never an unknown token. Otherwise (T5-like) the corpus characters.
    alphabet = pre_tokenizers.ByteLevel.alphabet() if unk is None else sorted(set("".join(corpus)) | {"▁"})
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=alphabet, special_tokens=list(specials), show_progress=False
    )
    tok.train_from_iterator(corpus, trainer)
    return tok


def _fast(tok, **special):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok, **special)


def build_clip_tokenizer():
    """CLIP-style: lowercased byte-level BPE, <|startoftext|> ... <|endoftext|>, padded with
    <|endoftext|> (the highest id, as in CLIP), 77 tokens."""
    from tokenizers import decoders, normalizers, pre_tokenizers, processors

    tok = _bpe(320, pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel(), normalizers.Lowercase())
    tok.add_special_tokens(["<|startoftext|>", "<|endoftext|>"])
    bos, eos = tok.token_to_id("<|startoftext|>"), tok.token_to_id("<|endoftext|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|startoftext|> $A <|endoftext|>", special_tokens=[("<|startoftext|>", bos), ("<|endoftext|>", eos)]
    )
    return _fast(tok, bos_token="<|startoftext|>", eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                 unk_token="<|endoftext|>", model_max_length=77)


def build_t5_tokenizer():
    """T5-style: sentencepiece-like (Metaspace) BPE, <pad>=0, </s>=1, <unk>=2, '</s>' appended."""
    from tokenizers import decoders, pre_tokenizers, processors

    tok = _bpe(320, pre_tokenizers.Metaspace(), decoders.Metaspace(), specials=("<pad>", "</s>", "<unk>"), unk="<unk>")
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return _fast(tok, eos_token="</s>", pad_token="<pad>", unk_token="<unk>", model_max_length=512)


def build_qwen_tokenizer(vision: bool = False):
    """Qwen2-style: byte-level BPE with the Qwen2 split pattern, no BOS/EOS added, ChatML special
    tokens <|endoftext|> (pad), <|im_start|>, <|im_end|> after the learned vocabulary.

    vision: the Qwen2.5-VL tokenizer of the Qwen-Image-Edit repos: also trained on the edit prompt
    template (whose system prefix is then 64 tokens, the pipelines' drop index, as with the real
    tokenizer) and with the vision special tokens."""
    from tokenizers import Regex, decoders, pre_tokenizers

    from library.data.tokenizer import QWEN2_SPLIT  # the Qwen2/Qwen2.5 tokenizer.json pattern
    from library.models.qwen_image.edit_encoder import EDIT_PLUS_PROMPT_TEMPLATE, VISION_TOKENS

    pre = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    if vision:  # a vocabulary large enough to learn every word of both templates
        tok = _bpe(1024, pre, decoders.ByteLevel(), templates=(CORPUS[0], EDIT_PLUS_PROMPT_TEMPLATE))
    else:
        tok = _bpe(448, pre, decoders.ByteLevel())
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>", *(VISION_TOKENS if vision else ())])
    return _fast(tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", model_max_length=32768)


# The Qwen3 chat template's rendering of plain (system / user / assistant) messages and its generation
# prompt verbatim: with enable_thinking=False it appends an empty think block, which the FLUX.2
# [klein] pipeline asks for. Tools, reasoning_content and multi-step handling are left out.
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)


def build_qwen3_tokenizer():
    """The Qwen2-style tokenizer plus Qwen3's <think> / </think> added tokens and its chat template."""
    tok = build_qwen_tokenizer()
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = QWEN3_CHAT_TEMPLATE
    return tok


# Mistral's control tokens in their released ids (<unk> 0, <s> 1, </s> 2, ..., [IMG] 10, <pad> 11, ...).
MISTRAL_SPECIALS = ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
                    "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]", "[PREFIX]", "[MIDDLE]",
                    "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]")
# The Mistral Small 3.1 chat template's rendering of system / user / assistant messages whose content
# is a string or a list of text parts (what the FLUX.2 [dev] pipeline sends); images and tools left out.
MISTRAL_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['content'] is string %}{%- set text = message['content'] %}"
    "{%- else %}{%- set text = message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') %}"
    "{%- endif %}"
    "{%- if message['role'] == 'system' %}{{- '[SYSTEM_PROMPT]' + text + '[/SYSTEM_PROMPT]' }}"
    "{%- elif message['role'] == 'user' %}{{- '[INST]' + text + '[/INST]' }}"
    "{%- elif message['role'] == 'assistant' %}{{- text + eos_token }}{%- endif %}"
    "{%- endfor %}"
)


def build_mistral_tokenizer():
    """Mistral-style (the FLUX.2 [dev] tokenizer): byte-level BPE, the control tokens first, <s> added
    in front by the tokenizer (as the released tokenizer.json does), <pad> to pad, and the chat template."""
    from tokenizers import decoders, pre_tokenizers, processors

    from library.models.flux2.dev_text_encoder import DEV_SYSTEM_MESSAGE

    tok = _bpe(448, pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel(), specials=MISTRAL_SPECIALS,
               templates=("{}", DEV_SYSTEM_MESSAGE + " {}"))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", 1)])
    fast = _fast(tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>", model_max_length=131072)
    fast.chat_template = MISTRAL_CHAT_TEMPLATE
    return fast


def save_tokenizer(tokenizer, folder: str):
    """tokenizer.json + tokenizer_config.json, loadable offline by AutoTokenizer (transformers 4 and 5).
    A chat template goes into tokenizer_config.json, where the released Qwen3 tokenizers keep it."""
    os.makedirs(folder, exist_ok=True)
    tokenizer.save_pretrained(folder)
    config_file = os.path.join(folder, "tokenizer_config.json")
    with open(config_file) as f:
        config = json.load(f)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"  # transformers 5 writes its internal name
    config.pop("backend", None)
    template_file = os.path.join(folder, "chat_template.jinja")  # transformers 5 writes it apart
    if os.path.isfile(template_file):
        with open(template_file) as f:
            config["chat_template"] = f.read()
        os.remove(template_file)
    write_text(config_file, json.dumps(config, indent=2) + "\n")


# ----------------------------------------------------------------------------------------------
# Writers, one per component; each seeds its own generator so the set does not depend on order


def _seed(seed: int, offset: int):
    torch.manual_seed(seed * 1000 + offset)


def _write_json(path: str, obj: dict):
    write_text(path, json.dumps(obj, indent=2) + "\n")


def _round_up(n: int, to: int = 16) -> int:
    return (n + to - 1) // to * to


def write_flux(out: str, seed: int) -> dict[str, str]:
    from library.models.flux1.model import Flux, FluxConfig
    from library.models.flux1.checkpoint import save_flux_bfl, save_flux_diffusers

    _seed(seed, 1)
    config = FluxConfig(
        in_channels=4 * TINY["latent_channels"], vec_in_dim=TINY["clip_hidden"], context_in_dim=TINY["t5_d_model"],
        hidden_size=TINY["dit_hidden"], num_heads=TINY["dit_heads"], depth=2, depth_single=2,
        axes_dim=TINY["axes"], guidance_embed=True,
    )
    model = Flux(config)
    bfl = os.path.join(out, "flux", "flux1-tiny.safetensors")
    folder = os.path.join(out, "flux", "diffusers", "transformer")
    save_flux_bfl(model, bfl, config)
    save_flux_diffusers(model, config, folder)
    return {"flux_bfl": bfl, "flux_diffusers": folder}


def write_flux_vae(out: str, seed: int) -> dict[str, str]:
    from diffusers import AutoencoderKL

    from library.models.vae import FLUX_VAE_CONFIG, flux_vae_to_ldm_state_dict

    _seed(seed, 2)
    config = {**FLUX_VAE_CONFIG, "block_out_channels": [8, 16, 16, 16], "norm_num_groups": 4,
              "layers_per_block": 1, "sample_size": 64, "latent_channels": TINY["latent_channels"]}
    vae = AutoencoderKL(**config)
    folder = os.path.join(out, "flux", "ae")
    os.makedirs(folder, exist_ok=True)
    sd = vae.state_dict()
    save_safetensors(sd, os.path.join(folder, "diffusion_pytorch_model.safetensors"), metadata={"format": "pt"})
    _write_json(os.path.join(folder, "config.json"), {"_class_name": "AutoencoderKL", **config})
    single = os.path.join(out, "flux", "ae.safetensors")
    # BFL files carry no config; this one records its toy sizes so that load_flux_vae finds them.
    save_safetensors(flux_vae_to_ldm_state_dict(sd, len(config["block_out_channels"])), single,
                     metadata={"diffusers_config": json.dumps(config)})
    return {"flux_vae": folder, "flux_vae_single": single}


def write_clip(out: str, seed: int) -> dict[str, str]:
    from transformers import CLIPTextConfig, CLIPTextModel

    tokenizer = build_clip_tokenizer()
    _seed(seed, 3)
    h = TINY["clip_hidden"]
    config = CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=h, intermediate_size=2 * h, projection_dim=h, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=77, hidden_act="quick_gelu",
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    model = CLIPTextModel(config)
    folder = os.path.join(out, "flux", "clip_l")
    os.makedirs(folder, exist_ok=True)
    # Key layout of the released files (`text_model.*`), which transformers 5 no longer writes itself.
    sd = {"text_model." + k: v for k, v in model.state_dict().items() if not k.endswith("position_ids")}
    save_safetensors(sd, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    _write_json(os.path.join(folder, "config.json"), {"architectures": ["CLIPTextModel"], **config.to_dict()})
    save_tokenizer(tokenizer, folder)
    return {"clip_l": folder}


def write_t5(out: str, seed: int) -> dict[str, str]:
    from transformers import T5Config, T5EncoderModel

    tokenizer = build_t5_tokenizer()
    _seed(seed, 4)
    d = TINY["t5_d_model"]
    config = T5Config(
        vocab_size=len(tokenizer), d_model=d, d_kv=8, d_ff=2 * d, num_layers=2, num_heads=4,
        feed_forward_proj="gated-gelu", tie_word_embeddings=False, pad_token_id=0, eos_token_id=1,
    )
    model = T5EncoderModel(config)
    folder = os.path.join(out, "flux", "t5xxl")
    os.makedirs(folder, exist_ok=True)
    sd = {k: v for k, v in model.state_dict().items() if k != "encoder.embed_tokens.weight"}  # tied to shared
    save_safetensors(sd, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    _write_json(os.path.join(folder, "config.json"), {"architectures": ["T5EncoderModel"], **config.to_dict()})
    save_tokenizer(tokenizer, folder)
    return {"t5xxl": folder}


def write_qwen_image(out: str, seed: int) -> dict[str, str]:
    from library.models.qwen_image.model import QwenImage, QwenImageConfig, save_qwen_image_diffusers

    _seed(seed, 5)
    config = QwenImageConfig(
        in_channels=4 * TINY["latent_channels"], out_channels=TINY["latent_channels"], num_layers=2,
        attention_head_dim=sum(TINY["axes"]), num_attention_heads=TINY["dit_heads"],
        joint_attention_dim=TINY["lm_hidden"], axes_dims_rope=TINY["axes"],
    )
    folder = os.path.join(out, "qwen_image", "transformer")
    save_qwen_image_diffusers(QwenImage(config).state_dict(), config, folder)
    return {"qwen_image": folder}


def write_qwen_image_edit(out: str, seed: int) -> dict[str, str]:
    """Qwen-Image-Edit transformers, each with its release's config.json flags: qwen_image_edit/
    (Edit and Edit-2509 share theirs) and qwen_image_edit_2511/ (zero_cond_t)."""
    from library.models.qwen_image.edit import EDIT, EDIT_2511, TRANSFORMER_FLAGS
    from library.models.qwen_image.model import QwenImage, QwenImageConfig, save_qwen_image_diffusers

    paths = {}
    for name, version, offset in (("qwen_image_edit", EDIT, 13), ("qwen_image_edit_2511", EDIT_2511, 14)):
        _seed(seed, offset)
        config = QwenImageConfig(
            in_channels=4 * TINY["latent_channels"], out_channels=TINY["latent_channels"], num_layers=2,
            attention_head_dim=sum(TINY["axes"]), num_attention_heads=TINY["dit_heads"],
            joint_attention_dim=TINY["lm_hidden"], axes_dims_rope=TINY["axes"], **TRANSFORMER_FLAGS[version],
        )
        paths[name] = folder = os.path.join(out, name, "transformer")
        save_qwen_image_diffusers(QwenImage(config).state_dict(), config, folder)
    return paths


def write_qwen_vae(out: str, seed: int) -> dict[str, str]:
    from diffusers import AutoencoderKLQwenImage

    _seed(seed, 6)
    vae = AutoencoderKLQwenImage(base_dim=4, z_dim=TINY["latent_channels"])
    folder = os.path.join(out, "qwen_image", "vae")
    os.makedirs(folder, exist_ok=True)
    config = {k: v for k, v in vae.config.items() if not k.startswith("_")}  # "_use_default_values" is a set
    save_safetensors(vae.state_dict(), os.path.join(folder, "diffusion_pytorch_model.safetensors"), metadata={"format": "pt"})
    _write_json(os.path.join(folder, "config.json"), {"_class_name": "AutoencoderKLQwenImage", **config})
    return {"qwen_image_vae": folder}


def write_lm(folder: str, tokenizer, seed: int, offset: int, tokenizer_folder: str | None = None) -> None:
    """A Qwen2ForCausalLM (transformers, HF names) sized TINY['lm_hidden'], plus its tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from library.models.llm import LLMConfig

    _seed(seed, offset)
    h = TINY["lm_hidden"]
    config = LLMConfig(vocab_size=_round_up(len(tokenizer)), hidden_size=h, num_layers=2, num_heads=4, num_kv_heads=2,
                       intermediate_size=2 * h, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                       qkv_bias=True, max_position_embeddings=2048)
    hf = {**config.to_hf(), "bos_token_id": None, "eos_token_id": tokenizer.eos_token_id,
          "pad_token_id": tokenizer.pad_token_id}
    model = Qwen2ForCausalLM(Qwen2Config(**{k: v for k, v in hf.items() if k != "architectures"}))
    os.makedirs(folder, exist_ok=True)
    save_safetensors(model.state_dict(), os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    _write_json(os.path.join(folder, "config.json"), hf)
    save_tokenizer(tokenizer, tokenizer_folder or folder)


def write_qwen_text_encoder(out: str, seed: int) -> dict[str, str]:
    folder, tok_folder = os.path.join(out, "qwen_image", "text_encoder"), os.path.join(out, "qwen_image", "tokenizer")
    write_lm(folder, build_qwen_tokenizer(), seed, 7, tok_folder)
    return {"qwen_image_text_encoder": folder, "qwen_image_tokenizer": tok_folder}


# A tiny Qwen2.5-VL vision tower: the real patch (14), temporal patch (2) and merge (2) sizes, so the
# real Qwen2VLImageProcessor settings apply; windowed blocks and one full-attention block.
TINY_VISION = {"depth": 2, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "patch_size": 14,
               "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 56, "fullatt_block_indexes": [1]}
# The Qwen-Image-Edit processor's image settings (preprocessor_config.json), smaller pixel bounds.
TINY_IMAGE_PROCESSOR = {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 64, "patch_size": 14, "merge_size": 2,
                        "temporal_patch_size": 2}


def write_qwen_vl_text_encoder(out: str, seed: int) -> dict[str, str]:
    """The Qwen-Image-Edit text encoder, diffusers repo layout: text_encoder/ (a transformers
    Qwen2_5_VLForConditionalGeneration: vision tower + language model of width lm_hidden, M-RoPE
    sections (2, 3, 3) of head_dim 16), tokenizer/ and processor/ (Qwen2_5_VLProcessor with a
    Qwen2VLImageProcessor)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tokenizer = build_qwen_tokenizer(vision=True)
    _seed(seed, 12)
    h = TINY["lm_hidden"]
    text = {"vocab_size": _round_up(len(tokenizer)), "hidden_size": h, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 1, "intermediate_size": 2 * h, "rms_norm_eps": 1e-6, "max_position_embeddings": 2048,
            "rope_parameters": {"rope_type": "mrope", "mrope_section": [2, 3, 3], "rope_theta": 1000000.0},
            "bos_token_id": None, "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    config = Qwen2_5_VLConfig(text_config=text, vision_config={**TINY_VISION, "out_hidden_size": h},
                              tie_word_embeddings=False, **vision_token_ids(tokenizer))
    model = Qwen2_5_VLForConditionalGeneration(config)
    root = os.path.join(out, "qwen_image_edit")
    folder = os.path.join(root, "text_encoder")
    model.save_pretrained(folder, safe_serialization=True)
    save_tokenizer(tokenizer, os.path.join(root, "tokenizer"))
    # processor/ as in the released repos: the image processor's and the tokenizer's files (building
    # a Qwen2_5_VLProcessor object would need torchvision for its video processor).
    processor = os.path.join(root, "processor")
    save_vl_processor(processor, TINY_IMAGE_PROCESSOR, "Qwen2_5_VLProcessor", tokenizer)
    return {"qwen_image_edit_text_encoder": folder, "qwen_image_edit_processor": processor}


def vision_token_ids(tokenizer) -> dict[str, int]:
    """A Qwen-VL config's ids of the vision special tokens, as the tokenizer numbers them."""
    return {k: tokenizer.convert_tokens_to_ids(t) for k, t in (("image_token_id", "<|image_pad|>"),
            ("video_token_id", "<|video_pad|>"), ("vision_start_token_id", "<|vision_start|>"),
            ("vision_end_token_id", "<|vision_end|>"))}


def save_vl_processor(folder: str, settings: dict, processor_class: str, tokenizer) -> None:
    """A Qwen-VL processor's files: preprocessor_config.json (Qwen2VLImageProcessor with `settings`,
    naming `processor_class` as the released ones do) and the tokenizer."""
    from transformers import Qwen2VLImageProcessor

    Qwen2VLImageProcessor(**settings).save_pretrained(folder)
    config_file = os.path.join(folder, "preprocessor_config.json")
    with open(config_file) as f:
        config = json.load(f)
    _write_json(config_file, {**config, "image_processor_type": "Qwen2VLImageProcessor", "processor_class": processor_class})
    save_tokenizer(tokenizer, folder)


# The Qwen3-VL chat template's rendering of messages whose content is a string or a list of image /
# text parts, and its generation prompt (no default system message, unlike Qwen2.5-VL's); tools,
# videos and reasoning left out.
QWEN3_VL_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}"
    "{%- else %}{%- for part in message.content %}"
    "{%- if part.type == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part.type == 'text' %}{{- part.text }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Qwen3-VL's image settings (preprocessor_config.json): patch 16, mean / std 0.5; smaller pixel bounds.
TINY_QWEN3_VL_IMAGE_PROCESSOR = {"min_pixels": 64 * 64, "max_pixels": 32 * 32 * 64, "patch_size": 16, "merge_size": 2,
                                 "temporal_patch_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}


def write_qwen3_vl(out: str, seed: int, width: int = TINY["lm_hidden"]) -> dict[str, str]:
    """A Qwen3VLForConditionalGeneration in one folder as the released Qwen3-VL repos hold it (weights,
    config, preprocessor_config.json, tokenizer with the chat template), for tools/caption_images.py.
    width: the language model's (64 gives every Linear the multiples of 32 outputs and 64 inputs that
    bitsandbytes' 4-bit CPU kernels need). Not part of make_tiny_models' set (training needs no
    captioner); tests write it when they need it."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    tokenizer = build_qwen_tokenizer(vision=True)
    tokenizer.chat_template = QWEN3_VL_CHAT_TEMPLATE
    _seed(seed, 14)
    head_dim = 16
    text = {"vocab_size": _round_up(len(tokenizer)), "hidden_size": width, "num_hidden_layers": 2,
            "num_attention_heads": width // head_dim, "num_key_value_heads": width // head_dim // 2, "head_dim": head_dim,
            "intermediate_size": 2 * width, "rms_norm_eps": 1e-6, "max_position_embeddings": 2048,
            "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True,
                                "rope_theta": 5000000.0},
            "bos_token_id": None, "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    vision = {"depth": 2, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "patch_size": 16,
              "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": width,
              "num_position_embeddings": 64, "deepstack_visual_indexes": [0]}
    model = Qwen3VLForConditionalGeneration(Qwen3VLConfig(text_config=text, vision_config=vision,
                                                          **vision_token_ids(tokenizer)))
    folder = os.path.join(out, "qwen3_vl" if width == TINY["lm_hidden"] else f"qwen3_vl_{width}")
    model.save_pretrained(folder, safe_serialization=True)
    save_vl_processor(folder, TINY_QWEN3_VL_IMAGE_PROCESSOR, "Qwen3VLProcessor", tokenizer)
    return {"qwen3_vl": folder}


def write_llm(out: str, seed: int) -> dict[str, str]:
    folder = os.path.join(out, "llm")
    write_lm(folder, build_qwen_tokenizer(), seed, 8)
    return {"llm": folder}


def _save_sharded(state_dict: dict, folder: str, shards: int = 2) -> None:
    """model-0000i-of-0000n.safetensors + model.safetensors.index.json, the layout of released HF models."""
    keys = sorted(state_dict)
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = keys[i * len(keys) // shards : (i + 1) * len(keys) // shards]
        save_safetensors({k: state_dict[k] for k in part}, os.path.join(folder, name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    _write_json(os.path.join(folder, "model.safetensors.index.json"), {"metadata": {}, "weight_map": weight_map})


def write_qwen3_text_encoder(out: str, seed: int) -> dict[str, str]:
    """FLUX.2 [klein] text encoder (diffusers repo layout text_encoder/ + tokenizer/): a transformers
    Qwen3ForCausalLM with 28 layers, so that the pipeline's hidden layers 9, 18, 27 exist; head_dim 16
    != hidden / heads (8) and tied embeddings, as in Qwen3-4B (whose files have no lm_head.weight)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from library.models.llm import LLMConfig

    tokenizer = build_qwen3_tokenizer()
    _seed(seed, 9)
    h = TINY["lm_hidden"]
    config = LLMConfig(vocab_size=_round_up(len(tokenizer)), hidden_size=h, num_layers=28, num_heads=4, num_kv_heads=2,
                       head_dim=16, intermediate_size=2 * h, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, qkv_bias=False, qk_norm=True, max_position_embeddings=40960)
    hf = {**config.to_hf(), "bos_token_id": None, "eos_token_id": tokenizer.eos_token_id,
          "pad_token_id": tokenizer.pad_token_id}
    model = Qwen3ForCausalLM(Qwen3Config(**{k: v for k, v in hf.items() if k != "architectures"}))
    folder, tok_folder = os.path.join(out, "flux2", "text_encoder"), os.path.join(out, "flux2", "tokenizer")
    os.makedirs(folder, exist_ok=True)
    _save_sharded({k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}, folder)
    _write_json(os.path.join(folder, "config.json"), hf)
    save_tokenizer(tokenizer, tok_folder)
    return {"flux2_text_encoder": folder, "flux2_tokenizer": tok_folder}


def write_flux2_dev_text_encoder(out: str, seed: int) -> dict[str, str]:
    """FLUX.2 [dev] text encoder (repo layout flux2/dev/text_encoder/ + tokenizer/): a transformers
    Mistral3ForConditionalGeneration (tiny Pixtral tower + projector + Mistral language model) saved
    by save_pretrained, whose keys are the released `language_model.model.*` layout; 31 layers so that
    the pipeline's hidden layers 10, 20, 30 exist, head_dim 16 != hidden / heads (8), untied head."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    tokenizer = build_mistral_tokenizer()
    _seed(seed, 13)
    h = TINY["lm_hidden"]
    text = {"model_type": "mistral", "vocab_size": _round_up(len(tokenizer)), "hidden_size": h, "num_hidden_layers": 31,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": h,
            "rms_norm_eps": 1e-5, "rope_theta": 1000000000.0, "sliding_window": None, "max_position_embeddings": 2048,
            "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 11}
    vision = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "head_dim": 8,
              "patch_size": 14, "image_size": 56}
    model = Mistral3ForConditionalGeneration(Mistral3Config(text_config=text, vision_config=vision, tie_word_embeddings=False))
    with torch.no_grad():  # init leaves <pad>'s row (padding_idx) at 0; released rows are not, and pad rows are kept
        model.get_input_embeddings().weight[11].normal_(0.0, 0.02)
    root = os.path.join(out, "flux2", "dev")
    folder, tok_folder = os.path.join(root, "text_encoder"), os.path.join(root, "tokenizer")
    model.save_pretrained(folder, safe_serialization=True)
    save_tokenizer(tokenizer, tok_folder)
    return {"flux2_dev_text_encoder": folder, "flux2_dev_tokenizer": tok_folder}


def write_flux2(out: str, seed: int) -> dict[str, str]:
    """FLUX.2 transformers: [klein]-like (BFL file + diffusers folder, same weights) and [dev]-like
    (BFL file). 32 latent channels (128 packed); context = 3 stacked text-encoder layers of lm_hidden."""
    from library.models.flux2.checkpoint import save_flux2_bfl, save_flux2_diffusers
    from library.models.flux2.model import Flux2, Flux2Config

    paths = {}
    for name, guidance, offset in (("flux2-tiny", False, 10), ("flux2-dev-tiny", True, 11)):
        _seed(seed, offset)
        head_dim = TINY["dit_hidden"] // TINY["dit_heads"]
        config = Flux2Config(
            in_channels=4 * TINY["flux2_latent_channels"], context_in_dim=3 * TINY["lm_hidden"], hidden_size=TINY["dit_hidden"],
            num_heads=TINY["dit_heads"], depth=2, depth_single=2, axes_dim=(head_dim // 4,) * 4, guidance_embed=guidance,
        )
        model = Flux2(config)
        paths[name.replace("-", "_")] = bfl = os.path.join(out, "flux2", f"{name}.safetensors")
        save_flux2_bfl(model, bfl, config)
        if not guidance:
            paths["flux2_diffusers"] = folder = os.path.join(out, "flux2", "transformer")
            save_flux2_diffusers(model, config, folder)
    return paths


def write_flux2_vae(out: str, seed: int) -> dict[str, str]:
    from diffusers import AutoencoderKLFlux2

    _seed(seed, 12)
    config = {"block_out_channels": [8, 16, 16, 16], "norm_num_groups": 4, "layers_per_block": 1, "sample_size": 64,
              "latent_channels": TINY["flux2_latent_channels"]}
    vae = AutoencoderKLFlux2(**config)
    with torch.no_grad():  # released statistics are far from the fresh (0, 1): make the tiny ones so too
        vae.bn.running_mean.copy_(0.5 * torch.randn_like(vae.bn.running_mean))
        vae.bn.running_var.copy_(0.2 + torch.rand_like(vae.bn.running_var))
    folder = os.path.join(out, "flux2", "vae")
    os.makedirs(folder, exist_ok=True)
    save_safetensors(vae.state_dict(), os.path.join(folder, "diffusion_pytorch_model.safetensors"), metadata={"format": "pt"})
    full = {k: list(v) if isinstance(v, tuple) else v for k, v in vae.config.items() if not k.startswith("_")}
    _write_json(os.path.join(folder, "config.json"), {"_class_name": "AutoencoderKLFlux2", **full})
    return {"flux2_vae": folder}


WRITERS = (
    write_flux, write_flux_vae, write_clip, write_t5, write_qwen_image, write_qwen_vae, write_qwen_text_encoder, write_llm,
    write_qwen3_text_encoder, write_flux2, write_flux2_vae, write_qwen_image_edit, write_qwen_vl_text_encoder,
    write_flux2_dev_text_encoder,
)


def _size(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, files in os.walk(path) for f in files)


def make_tiny_models(out_dir: str, seed: int = 0) -> dict[str, str]:
    """Write the tiny set under out_dir; returns {component name: path} (also in manifest.json)."""
    paths: dict[str, str] = {}
    for writer in WRITERS:
        paths.update(writer(out_dir, seed))
    manifest = {
        "seed": seed,
        "dims": {k: list(v) if isinstance(v, tuple) else v for k, v in TINY.items()},
        "paths": {k: os.path.relpath(v, out_dir) for k, v in paths.items()},
        "bytes": {k: _size(v) for k, v in paths.items()},
    }
    _write_json(os.path.join(out_dir, "manifest.json"), manifest)
    return paths


def main(argv=None):
    args = build_parser().parse_args(argv)
    paths = make_tiny_models(args.out, args.seed)
    for name, path in paths.items():
        print(f"{name:26s} {_size(path) / 1024:8.1f} KiB  {path}")
    print(f"{'total':26s} {_size(args.out) / 1024:8.1f} KiB  {os.path.join(args.out, 'manifest.json')}")


if __name__ == "__main__":
    main()
