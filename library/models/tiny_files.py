"""What the tiny real-format model set (tools/make_tiny_models.py) is made of, shared by the families'
writers (library/models/<family>/tiny.py, listed in their spec's TINY): the toy sizes every
component agrees on, per-component seeding, tokenizers trained here, and writers of the text
encoders more than one family uses (CLIP-L, T5, a Qwen2-style causal LM, the Qwen-VL processor
files). Weights are float32 so that parity tests can compare at 1e-5.
"""

from __future__ import annotations

import json
import os

import torch

from library.io import save_safetensors, write_text

# ----------------------------------------------------------------------------------------------
# Sizes (a family's own, e.g. a wider latent, are in its spec's TINY.dims)

TINY = {
    "t5_d_model": 32,  # == the CLIP + T5 transformer's context_in_dim
    "clip_hidden": 32,  # == its vec_in_dim
    "lm_hidden": 32,  # == an LLM-encoded transformer's joint_attention_dim (x 3 where it stacks 3 layers)
    "dit_hidden": 64,  # 2 heads x 32, RoPE axes (8, 12, 12)
    "dit_heads": 2,
    "axes": (8, 12, 12),
    "latent_channels": 16,
}

def random_init(model: torch.nn.Module, seed: int, std: float = 0.02) -> torch.nn.Module:
    """Every matrix N(0, std), biases zero, norm scales as built (the mid-size random transformers)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * std)
            elif name.endswith("bias"):
                p.zero_()
    return model


# A small corpus: the tokenizers learn whole words of a text encoder's ChatML prompt template (the
# first entry, whose system prefix must split into the tokens its pipeline drops) and some captions.
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


def train_bpe(vocab_size: int, pre_tokenizer, decoder, normalizer=None, specials=(), unk=None, templates=(CORPUS[0],)):
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


def fast_tokenizer(tok, **special):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok, **special)


def build_clip_tokenizer():
    """CLIP-style: lowercased byte-level BPE, <|startoftext|> ... <|endoftext|>, padded with
    <|endoftext|> (the highest id, as in CLIP), 77 tokens."""
    from tokenizers import decoders, normalizers, pre_tokenizers, processors

    tok = train_bpe(320, pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel(), normalizers.Lowercase())
    tok.add_special_tokens(["<|startoftext|>", "<|endoftext|>"])
    bos, eos = tok.token_to_id("<|startoftext|>"), tok.token_to_id("<|endoftext|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|startoftext|> $A <|endoftext|>", special_tokens=[("<|startoftext|>", bos), ("<|endoftext|>", eos)]
    )
    return fast_tokenizer(tok, bos_token="<|startoftext|>", eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                          unk_token="<|endoftext|>", model_max_length=77)


def build_t5_tokenizer():
    """T5-style: sentencepiece-like (Metaspace) BPE, <pad>=0, </s>=1, <unk>=2, '</s>' appended."""
    from tokenizers import decoders, pre_tokenizers, processors

    tok = train_bpe(320, pre_tokenizers.Metaspace(), decoders.Metaspace(), specials=("<pad>", "</s>", "<unk>"), unk="<unk>")
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return fast_tokenizer(tok, eos_token="</s>", pad_token="<pad>", unk_token="<unk>", model_max_length=512)


def build_qwen_tokenizer(vision_templates: tuple[str, ...] | None = None):
    """Qwen2-style: byte-level BPE with the Qwen2 split pattern, no BOS/EOS added, ChatML special
    tokens <|endoftext|> (pad), <|im_start|>, <|im_end|> after the learned vocabulary.

    vision_templates: a Qwen2.5-VL tokenizer, with the vision special tokens, whose vocabulary is
    also trained on these prompt templates (so that a template's system prefix splits into the
    count of tokens its pipeline drops, as with the real tokenizer)."""
    from tokenizers import Regex, decoders, pre_tokenizers

    from library.data.tokenizer import QWEN2_SPLIT  # the Qwen2/Qwen2.5 tokenizer.json pattern
    from library.data.vlm_inputs import VISION_TOKENS

    pre = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    vision = vision_templates is not None
    if vision:  # a vocabulary large enough to learn every word of the templates
        tok = train_bpe(1024, pre, decoders.ByteLevel(), templates=(CORPUS[0], *vision_templates))
    else:
        tok = train_bpe(448, pre, decoders.ByteLevel())
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>", *(VISION_TOKENS if vision else ())])
    return fast_tokenizer(tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", model_max_length=32768)


# The Qwen2 / Qwen2.5 instruct chat template (ChatML) verbatim for system / user / assistant / tool
# messages: a default system message when the conversation has none, the tool definitions (`tools`) in the
# system turn, tool calls, consecutive tool results in one user turn.
QWEN2_CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided "
    "with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


# The Qwen3 chat template's rendering of plain (system / user / assistant) messages and its generation
# prompt verbatim: with enable_thinking=False it appends an empty think block, which a text encoder's
# pipeline may ask for. Tools, reasoning_content and multi-step handling are left out.
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
# is a string or a list of text parts (what a diffusion pipeline sends); images and tools left out.
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


def build_mistral_tokenizer(templates: tuple[str, ...]):
    """Mistral-style: byte-level BPE, the control tokens first, <s> added in front by the tokenizer
    (as the released tokenizer.json does), <pad> to pad, and the chat template. templates: prompt
    templates whose words the vocabulary learns whole."""
    from tokenizers import decoders, pre_tokenizers, processors

    tok = train_bpe(448, pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel(), specials=MISTRAL_SPECIALS,
                    templates=templates)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", 1)])
    fast = fast_tokenizer(tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>", model_max_length=131072)
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
# Writing: each component seeds its own generator, so the set does not depend on the writers' order


def seed_component(seed: int, offset: int):
    """Seed torch for one component: `offset` is the component's own, fixed for ever (its bytes)."""
    torch.manual_seed(seed * 1000 + offset)


def place_written(writer, seed: int, targets: dict[str, str]) -> None:
    """Run a tiny writer (out, seed) -> {manifest key: path} in a temporary folder and move the files or folders of
    `targets` (manifest key -> destination path) there, replacing what was there; the rest it wrote is dropped."""
    import shutil
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        written = writer(tmp, seed)
        for key, target in targets.items():
            shutil.rmtree(target, ignore_errors=True)
            shutil.move(written[key], target)


def save_learned_transformer(model: torch.nn.Module, paths: dict[str, str], diffusers: bool, save_single,
                             save_diffusers=None, diffusers_folder: str = "transformer") -> None:
    """A learned base's transformer (a family's learned.py save_transformer): its state dict in bf16, as the releases
    ship, by `save_single(weights, path, config)` to the files' pretrained_model_name_or_path; with `diffusers` also
    by `save_diffusers(weights, config, folder)` into diffusers/<diffusers_folder> beside the VAE file (beside the
    transformer's for a family without one)."""
    weights = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    save_single(weights, paths["pretrained_model_name_or_path"], model.config)
    if diffusers:
        beside = paths.get("ae") or paths["pretrained_model_name_or_path"]
        save_diffusers(weights, model.config, os.path.join(os.path.dirname(beside), "diffusers", diffusers_folder))


def write_json(path: str, obj: dict):
    write_text(path, json.dumps(obj, indent=2) + "\n")


def round_up(n: int, to: int = 16) -> int:
    return (n + to - 1) // to * to


def save_sharded(state_dict: dict, folder: str, shards: int = 2) -> None:
    """model-0000i-of-0000n.safetensors + model.safetensors.index.json, the layout of released HF models."""
    keys = sorted(state_dict)
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = keys[i * len(keys) // shards : (i + 1) * len(keys) // shards]
        save_safetensors({k: state_dict[k] for k in part}, os.path.join(folder, name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    write_json(os.path.join(folder, "model.safetensors.index.json"), {"metadata": {}, "weight_map": weight_map})


# ----------------------------------------------------------------------------------------------
# Shared text encoders (a family's writer picks the folder and the seed offset) and the set's LLM


def write_clip_l(folder: str, seed: int, offset: int) -> None:
    """A CLIPTextModel HF folder sized TINY['clip_hidden'], with its tokenizer, in the released key
    layout."""
    from transformers import CLIPTextConfig, CLIPTextModel

    tokenizer = build_clip_tokenizer()
    seed_component(seed, offset)
    h = TINY["clip_hidden"]
    config = CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=h, intermediate_size=2 * h, projection_dim=h, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=77, hidden_act="quick_gelu",
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    model = CLIPTextModel(config)
    os.makedirs(folder, exist_ok=True)
    # Key layout of the released files (`text_model.*`), which transformers 5 no longer writes itself.
    sd = {"text_model." + k: v for k, v in model.state_dict().items() if not k.endswith("position_ids")}
    save_safetensors(sd, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    write_json(os.path.join(folder, "config.json"), {"architectures": ["CLIPTextModel"], **config.to_dict()})
    save_tokenizer(tokenizer, folder)


def write_t5_encoder(folder: str, seed: int, offset: int, d_model: int | None = None) -> None:
    """A T5EncoderModel HF folder of width `d_model` (None: TINY['t5_d_model']), with its tokenizer."""
    from transformers import T5Config, T5EncoderModel

    tokenizer = build_t5_tokenizer()
    seed_component(seed, offset)
    d = TINY["t5_d_model"] if d_model is None else d_model
    config = T5Config(
        vocab_size=len(tokenizer), d_model=d, d_kv=8, d_ff=2 * d, num_layers=2, num_heads=4,
        feed_forward_proj="gated-gelu", tie_word_embeddings=False, pad_token_id=0, eos_token_id=1,
    )
    model = T5EncoderModel(config)
    os.makedirs(folder, exist_ok=True)
    sd = {k: v for k, v in model.state_dict().items() if k != "encoder.embed_tokens.weight"}  # tied to shared
    save_safetensors(sd, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    write_json(os.path.join(folder, "config.json"), {"architectures": ["T5EncoderModel"], **config.to_dict()})
    save_tokenizer(tokenizer, folder)


def write_lm(folder: str, tokenizer, seed: int, offset: int, tokenizer_folder: str | None = None) -> None:
    """A Qwen2ForCausalLM (transformers, HF names) sized TINY['lm_hidden'], plus its tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from library.models.llm import LLMConfig

    seed_component(seed, offset)
    h = TINY["lm_hidden"]
    config = LLMConfig(vocab_size=round_up(len(tokenizer)), hidden_size=h, num_layers=2, num_heads=4, num_kv_heads=2,
                       intermediate_size=2 * h, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                       qkv_bias=True, max_position_embeddings=2048)
    hf = {**config.to_hf(), "bos_token_id": None, "eos_token_id": tokenizer.eos_token_id,
          "pad_token_id": tokenizer.pad_token_id}
    model = Qwen2ForCausalLM(Qwen2Config(**{k: v for k, v in hf.items() if k != "architectures"}))
    os.makedirs(folder, exist_ok=True)
    save_safetensors(model.state_dict(), os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    write_json(os.path.join(folder, "config.json"), hf)
    save_tokenizer(tokenizer, tokenizer_folder or folder)


def write_llm(out: str, seed: int) -> dict[str, str]:
    """The LLM of the set: llm/, a Qwen2-style causal LM with its tokenizer."""
    folder = os.path.join(out, "llm")
    write_lm(folder, build_qwen_tokenizer(), seed, 8)
    return {"llm": folder}


# ----------------------------------------------------------------------------------------------
# Qwen-VL files (a VL text encoder's and a captioner's)


def vision_token_ids(tokenizer) -> dict[str, int]:
    """A Qwen-VL config's ids of the vision special tokens, as the tokenizer numbers them."""
    return {k: tokenizer.convert_tokens_to_ids(t) for k, t in (("image_token_id", "<|image_pad|>"),
            ("video_token_id", "<|video_pad|>"), ("vision_start_token_id", "<|vision_start|>"),
            ("vision_end_token_id", "<|vision_end|>"))}


def tiny_qwen3_vl_config(tokenizer, layers: int, images: bool = False):
    """A tiny transformers Qwen3VLConfig: a Qwen3 language model of width lm_hidden with explicit head_dim 16
    and interleaved M-RoPE sections (2, 3, 3), and a one-block vision tower with a deepstack tap. images: the
    tower takes pictures (16 px patches) and the config numbers the tokenizer's vision tokens."""
    from transformers import Qwen3VLConfig

    h = TINY["lm_hidden"]
    text = {"vocab_size": round_up(len(tokenizer)), "hidden_size": h, "num_hidden_layers": layers, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 2 * h, "rms_norm_eps": 1e-6,
            "max_position_embeddings": 2048, "pad_token_id": tokenizer.pad_token_id,
            "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True,
                                "rope_theta": 5000000.0}}
    vision = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": h,
              "num_position_embeddings": 16, "deepstack_visual_indexes": [0], **({"patch_size": 16} if images else {})}
    return Qwen3VLConfig(text_config=text, vision_config=vision, **(vision_token_ids(tokenizer) if images else {}))


def save_vl_processor(folder: str, settings: dict, processor_class: str, tokenizer) -> None:
    """A Qwen-VL processor's files: preprocessor_config.json (Qwen2VLImageProcessor with `settings`,
    naming `processor_class` as the released ones do) and the tokenizer."""
    from transformers import Qwen2VLImageProcessor

    Qwen2VLImageProcessor(**settings).save_pretrained(folder)
    config_file = os.path.join(folder, "preprocessor_config.json")
    with open(config_file) as f:
        config = json.load(f)
    write_json(config_file, {**config, "image_processor_type": "Qwen2VLImageProcessor", "processor_class": processor_class})
    save_tokenizer(tokenizer, folder)

