"""Lumina Image 2.0's tiny text encoder files (tools/make_tiny_models.py, once the family lists the writer):

  lumina2/text_encoder/                   a transformers Gemma2Model as the diffusers repo's save_pretrained writes
                                          it (`layers.*` keys at the top, config.json naming Gemma2Model): width
                                          TEXT_WIDTH 64, 3 layers (the encoder reads hidden_states[-2]: 2 run), 4
                                          query and 2 key/value heads of Gemma-2-2B's head_dim 256 (it has 8 / 4:
                                          a single file's shapes cannot tell head_dim, so it is the released one), the
                                          released softcaps 50 / 30 and 4096-token window on layers 0 and 2 (a
                                          single file is shaped with them; 256-token prompts never reach the
                                          window: tests/test_llm_gemma2.py runs a shorter one), norm offsets drawn
  lumina2/tokenizer/                      a Gemma-style tokenizer (build_gemma_tokenizer): the released ids of
                                          <pad> 0, <eos> 1, <bos> 2, <unk> 3, spaces as "▁", <bos> prepended,
                                          GemmaTokenizer in tokenizer_config.json
  lumina2/gemma_2_2b_tiny.safetensors     the same weights as ComfyUI's gemma_2_2b_fp16.safetensors holds Gemma-2-2B
                                          (`model.*` keys, no head, the sentencepiece bytes under `spiece_model`
                                          here a stand-in, no config.json beside it)

The transformer's caption embedder reads states of the text encoder's width: its tiny config's caption width must be
TEXT_WIDTH (64; the released 2304). Seed offset 107 is this writer's.
"""

from __future__ import annotations

import os

import torch

TEXT_WIDTH = 64  # the tiny Gemma 2's hidden size = the tiny transformer's caption width (released: 2304)
TEXT_LAYERS = 3
TEXT_WINDOW = 4096  # Gemma-2-2B's (what a single file without config.json is read with)

# Gemma's special tokens in their released ids (google/gemma-2-2b's tokenizer.json)
GEMMA_SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>")


def gemma_corpus() -> list[str]:
    """What the tiny tokenizer learns whole words of: the system prompts (the pipeline's and sd-scripts'), the
    prompt marker and every synthetic scene's caption words (library/data/shapes.py), and the shared captions."""
    from library.data.shapes import BACKGROUNDS, COLOURS, POSITIONS, SHAPES, SIZES
    from library.models.lumina2.text_encoder import LUMINA2_SYSTEM_PROMPT, PROMPT_START, SD_SCRIPTS_SYSTEM_PROMPTS
    from library.models.tiny_files import CORPUS

    scenes = [f"a {size} {colour} {shape} on the {where}, {background} background"
              for size in SIZES for colour in COLOURS for shape in SHAPES for where in POSITIONS
              for background in BACKGROUNDS]
    prefix = [p + PROMPT_START for p in (LUMINA2_SYSTEM_PROMPT, *SD_SCRIPTS_SYSTEM_PROMPTS)]
    return prefix * 8 + scenes + ["in the centre"] * 8 + CORPUS[1:] * 4


def build_gemma_tokenizer():
    """A Gemma-style BPE (the layout transformers' GemmaTokenizer reads from tokenizer.json): spaces replaced by "▁"
    (no prefix space added), the released special ids, <bos> prepended to every text, no <eos>; characters outside
    printable ASCII are <unk>."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    from library.models.tiny_files import fast_tokenizer

    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    # training splits at each "▁" (words keep their leading one, as Gemma's pieces do); at use, the whole text is
    # one piece (Gemma's Split on " " finds no space after the normalizer) and the learned merges make the words
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
    alphabet = sorted({chr(c) for c in range(33, 127)} | {"▁"})
    trainer = trainers.BpeTrainer(vocab_size=512, initial_alphabet=alphabet, special_tokens=list(GEMMA_SPECIALS),
                                  show_progress=False)
    tok.train_from_iterator(gemma_corpus(), trainer)
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse()])
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos> $B",
                                                       special_tokens=[("<bos>", 2)])
    return fast_tokenizer(tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>",
                          model_max_length=8192)


def save_gemma_tokenizer(tokenizer, folder: str) -> None:
    """tokenizer.json + a tokenizer_config.json naming GemmaTokenizer (what google/gemma-2-2b's says) with
    add_bos_token, so AutoTokenizer builds transformers' Gemma class around our tokenizer.json."""
    import json

    from library.models.tiny_files import save_tokenizer, write_json

    save_tokenizer(tokenizer, folder)
    config_file = os.path.join(folder, "tokenizer_config.json")
    with open(config_file) as f:
        config = json.load(f)
    write_json(config_file, {**config, "tokenizer_class": "GemmaTokenizer", "add_bos_token": True,
                             "add_eos_token": False, "padding_side": "right"})


def tiny_gemma2_config(vocab_size: int):
    """LLMConfig of the tiny Gemma 2 (module docstring): Gemma-2-2B's RoPE theta, norm epsilon and softcaps."""
    from library.models.llm import LLMConfig

    return LLMConfig(vocab_size=vocab_size, hidden_size=TEXT_WIDTH, num_layers=TEXT_LAYERS, num_heads=4,
                     num_kv_heads=2, head_dim=256, intermediate_size=2 * TEXT_WIDTH, rope_theta=10000.0,
                     rms_norm_eps=1e-6, tie_word_embeddings=True, qkv_bias=False, max_position_embeddings=8192,
                     sliding_window=TEXT_WINDOW, window_layers=(0, 2), hidden_act="gelu_pytorch_tanh",
                     gemma_norms=True, scale_embeddings=True, query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
                     final_logit_softcapping=30.0)


def write_lumina2_text_encoder(out: str, seed: int) -> dict[str, str]:
    """The text encoder in the diffusers repo's layout (text_encoder/ + tokenizer/) and its weights as the ComfyUI
    single file, under out/lumina2/."""
    from transformers import Gemma2Config, Gemma2Model

    from library.io import save_safetensors
    from library.models.tiny_files import round_up, seed_component, write_json

    root = os.path.join(out, "lumina2")
    paths = {"lumina2_text_encoder": os.path.join(root, "text_encoder"),
             "lumina2_tokenizer": os.path.join(root, "tokenizer"),
             "lumina2_gemma2_single_file": os.path.join(root, "gemma_2_2b_tiny.safetensors")}
    tokenizer = build_gemma_tokenizer()
    seed_component(seed, 107)
    hf = {**tiny_gemma2_config(round_up(len(tokenizer))).to_hf(), "architectures": ["Gemma2Model"],
          "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0}
    model = Gemma2Model(Gemma2Config(**{k: v for k, v in hf.items() if k != "architectures"}))
    with torch.no_grad():  # float32 weights (parity at 1e-5); norm offsets drawn (Gemma's x * (1 + w): 0 = plain)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.2 * torch.randn(p.shape))
    weights = dict(model.state_dict())  # `embed_tokens.weight`, `layers.0...`, `norm.weight`: no `model.`
    save_safetensors(weights, os.path.join(paths["lumina2_text_encoder"], "model.safetensors"))
    write_json(os.path.join(paths["lumina2_text_encoder"], "config.json"), hf)
    stand_in = torch.frombuffer(bytearray(b"tiny sentencepiece stand-in"), dtype=torch.uint8)
    save_safetensors({**{"model." + k: v for k, v in weights.items()}, "spiece_model": stand_in},
                     paths["lumina2_gemma2_single_file"])
    save_gemma_tokenizer(tokenizer, paths["lumina2_tokenizer"])
    return paths
