"""Qwen3 on the LLM core (library/models/llm.py): parity with transformers' Qwen3ForCausalLM on tiny
random weights (explicit head_dim, q/k norms, tied and untied embeddings), the full-size FLUX.2
[klein] text encoder configs on meta, config refusals, and LoRA training on a Qwen3 folder."""

import json

import pytest
import torch

from library.models.llm import QWEN3_4B, QWEN3_8B, LLM, LLMConfig, count_parameters, load_llm, position_ids_from_mask

# head_dim 24 != hidden 64 / 4 heads: the explicit head_dim must be honoured, as in Qwen3-4B (2560 / 32 != 128).
TINY = dict(vocab_size=96, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            head_dim=24, intermediate_size=80, rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=128,
            bos_token_id=None, eos_token_id=1, pad_token_id=0)


def randomize_(model):
    """Weights ~ N(0, 0.1), norm weights ~ 1 + N(0, 0.1) (q/k norms included): every parameter matters."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    return model.eval()


def hf_qwen3(tied: bool):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return randomize_(Qwen3ForCausalLM(Qwen3Config(**TINY, tie_word_embeddings=tied, attn_implementation="eager")))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{tied: (transformers model, folder written by save_pretrained)}."""
    torch.manual_seed(0)
    out = {}
    for tied in (False, True):
        hf = hf_qwen3(tied)
        folder = str(tmp_path_factory.mktemp(f"qwen3_tied{int(tied)}"))
        hf.save_pretrained(folder, safe_serialization=True)
        out[tied] = (hf, folder)
    return out


def max_diff(a, b, keep):
    return (a.float() - b.float())[keep].abs().max().item()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_qwen3_logits_and_hidden_states_match_transformers_fp32(saved, tied):
    hf, folder = saved[tied]
    model = load_llm(folder)
    cfg = model.config
    assert (cfg.qk_norm, cfg.qkv_bias, cfg.head_dim, cfg.tie_word_embeddings) == (True, False, 24, tied)
    assert (model.lm_head is None) == tied
    assert model.model.layers[0].self_attn.q_proj.weight.shape == (4 * 24, 64)
    ids = torch.randint(2, 96, (3, 10))
    left = torch.ones(3, 10, dtype=torch.long)
    left[1, :4], left[2, :1] = 0, 0
    with torch.no_grad():
        for mask in (None, left):
            positions = None if mask is None else position_ids_from_mask(mask, 10, "cpu")
            ref = hf(ids, attention_mask=mask, position_ids=positions, output_hidden_states=True)
            logits, states = model(ids, mask, output_hidden_states=True)
            keep = torch.ones(3, 10, dtype=torch.bool) if mask is None else mask.bool()
            assert max_diff(logits, ref.logits, keep) <= 1e-5
            assert len(states) == len(ref.hidden_states) == 4
            for ours, theirs in zip(states, ref.hidden_states):
                assert max_diff(ours, theirs, keep) <= 1e-5
            assert max_diff(model.hidden_states(ids, mask), ref.hidden_states[-1], keep) <= 1e-5
            # The klein selection: intermediate layers and the final (normed) one, running only what is needed.
            picked = model.selected_hidden_states(ids, mask, (1, 3, 2, 0))
            for k, ours in zip((1, 3, 2, 0), picked):
                assert max_diff(ours, ref.hidden_states[k], keep) <= 1e-5


def test_qwen3_q_k_norms_are_used(saved):
    """An oracle check that the q/k norm weights reach the output (a model that skipped them would
    still load): scaling k_norm changes the logits."""
    _, folder = saved[False]
    model = load_llm(folder)
    ids = torch.randint(2, 96, (1, 8))
    with torch.no_grad():
        before = model(ids)
        model.model.layers[1].self_attn.k_norm.weight.mul_(2.0)
        assert (model(ids) - before).abs().max().item() > 1e-3


def test_qwen3_right_padding_with_index_positions_matches_transformers_default(saved):
    """transformers without position_ids uses 0..L-1 for every row, pads included (what the klein
    pipeline runs): passing torch.arange(L) gives every position, pads too, within 1e-5."""
    hf, folder = saved[True]
    model = load_llm(folder)
    ids = torch.randint(2, 96, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, 5:] = 0
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask, output_hidden_states=True).hidden_states
        ours = model.selected_hidden_states(ids, mask, (2, 3), position_ids=torch.arange(9))
    everything = torch.ones(2, 9, dtype=torch.bool)
    assert max_diff(ours[0], ref[2], everything) <= 1e-5 and max_diff(ours[1], ref[3], everything) <= 1e-5


def test_qwen3_config_round_trip_and_refusals():
    config = json.loads(json.dumps(QWEN3_4B.to_hf()))
    assert config["model_type"] == "qwen3" and config["head_dim"] == 128
    assert LLMConfig.from_hf(config) == QWEN3_4B
    window = LLMConfig.from_hf({**config, "use_sliding_window": True})  # transformers' defaults: 4096 from layer 28 on
    assert (window.sliding_window, window.window_layers) == (4096, tuple(range(28, 36)))
    with pytest.raises(ValueError, match="sliding"):
        LLMConfig.from_hf({**config, "layer_types": ["full_attention"] * 35 + ["sliding_attention"]})
    with pytest.raises(ValueError, match="attention_bias=true with model_type 'qwen3'"):
        LLMConfig.from_hf({**config, "attention_bias": True})
    yarn = LLMConfig.from_hf({**config, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}).rope_scaling
    assert (yarn.rope_type, yarn.original_max_position_embeddings) == ("yarn", 40960)  # as transformers defaults it
    with pytest.raises(ValueError, match="longrope"):
        LLMConfig.from_hf({**config, "rope_scaling": {"rope_type": "longrope", "factor": 4.0}})
    with pytest.raises(ValueError, match="selected_hidden_states"):
        with torch.device("meta"):
            LLM(LLMConfig(**{**QWEN3_4B.__dict__, "num_layers": 2})).selected_hidden_states(torch.zeros(1, 2, dtype=torch.long), None, (3,))


def test_klein_text_encoder_configs_on_meta_match_transformers_parameter_counts():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    counts = {}
    for name, cfg in (("4b", QWEN3_4B), ("8b", QWEN3_8B)):
        hf_config = Qwen3Config(**{k: v for k, v in cfg.to_hf().items() if k not in ("architectures", "model_type")})
        with torch.device("meta"):
            ours, theirs = count_parameters(LLM(cfg)), count_parameters(Qwen3ForCausalLM(hf_config))
        assert ours == theirs, name
        counts[name] = ours
    # Qwen3-4B ties its head to the embeddings (4.02 B), Qwen3-8B does not (8.19 B).
    assert counts == {"4b": 4_022_468_096, "8b": 8_190_735_360}


# ----------------------------------------------------------------------------------------------
# FLUX.2 [klein] prompt encoding vs diffusers' Flux2KleinPipeline

PROMPTS = ["a cat", "a painting of a house by the sea at sunset, oil on canvas, with a dog"]


@pytest.fixture(scope="module")
def klein(tmp_path_factory):
    from library.models.flux2 import tiny

    return tiny.write_qwen3_text_encoder(str(tmp_path_factory.mktemp("klein")), 0)


def _diffusers_klein_pipeline(klein):
    """diffusers' Flux2KleinPipeline holding only transformers' Qwen3ForCausalLM and the tokenizer
    loaded from the tiny folders (sharded weights, tied embeddings, chat template in tokenizer_config.json)."""
    from diffusers.pipelines.flux2.pipeline_flux2_klein import Flux2KleinPipeline
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    text_encoder = Qwen3ForCausalLM.from_pretrained(klein["flux2_text_encoder"]).eval()
    tokenizer = AutoTokenizer.from_pretrained(klein["flux2_tokenizer"])
    return Flux2KleinPipeline(scheduler=None, vae=None, text_encoder=text_encoder, tokenizer=tokenizer, transformer=None)


@pytest.mark.parametrize("max_length", [512, 24], ids=["default-512", "truncated-24"])
def test_klein_prompt_embeds_and_text_ids_match_diffusers(klein, max_length):
    from library.models.flux2.text_encoder import load_klein_text_encoder

    ours = load_klein_text_encoder(klein["flux2_text_encoder"], max_length=max_length)
    # 27 of the 28 layers are loaded (layer 27's output is the deepest one read), no lm_head.
    assert len(ours.llm.model.layers) == 27 and ours.llm.lm_head is None and ours.embed_dim == 96
    embeds, text_ids = ours.encode(PROMPTS)
    with torch.no_grad():
        ref, ref_ids = _diffusers_klein_pipeline(klein).encode_prompt(PROMPTS, device=torch.device("cpu"), max_sequence_length=max_length)
    assert embeds.shape == ref.shape == (2, max_length, 3 * 32) and embeds.dtype == torch.float32
    assert torch.equal(text_ids, ref_ids) and text_ids.dtype == torch.int64
    diff = (embeds - ref).abs().max().item()
    assert diff <= 1e-5, diff
    tokens = ours.tokenizer([ours.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                             add_generation_prompt=True, enable_thinking=False) for p in PROMPTS]).input_ids
    if max_length == 512:  # pads are part of the output, and they are not all alike (they attend to the prompt)
        assert len(tokens[0]) < len(tokens[1]) < 512
        assert (embeds[0, len(tokens[0]) :] - embeds[0, -1]).abs().max().item() > 0
    else:  # the long prompt is cut at max_length
        assert len(tokens[1]) > max_length


def test_klein_chat_template_renders_qwen3_no_thinking_prompt(klein):
    from transformers import AutoTokenizer

    from library.models.flux2.text_encoder import QWEN3_NO_THINKING_PROMPT, klein_prompt_text, klein_text_ids

    tokenizer = AutoTokenizer.from_pretrained(klein["flux2_tokenizer"])
    text = klein_prompt_text(tokenizer, "a cat")
    assert text == "<|im_start|>user\na cat<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert text == QWEN3_NO_THINKING_PROMPT.format("a cat")
    tokenizer.chat_template = None  # no template: the built-in rendering gives the same text
    assert klein_prompt_text(tokenizer, "a cat") == text
    assert klein_text_ids(2, 3).tolist() == [[[0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2]]] * 2


def test_klein_text_encoder_refuses_layers_it_does_not_have(klein):
    from library.models.flux2.text_encoder import KleinTextEncoder, load_klein_text_encoder

    enc = load_klein_text_encoder(klein["flux2_text_encoder"], hidden_layers=(1, 2))
    with pytest.raises(ValueError, match="need 9 decoder layers"):
        KleinTextEncoder(enc.llm, enc.tokenizer, hidden_layers=(3, 9))
    with pytest.raises(RuntimeError, match="selected_hidden_states"):
        enc.llm(torch.zeros(1, 3, dtype=torch.long))


# ----------------------------------------------------------------------------------------------
# LoRA training on a Qwen3 folder (model_type = "llm")


def test_llm_lora_trains_on_a_qwen3_folder_and_peft_loads_it(klein, tmp_path):
    """train_lora.py, 2 steps on the tiny Qwen3 (tied embeddings, q/k norms): a LoRA on every
    attention and MLP Linear of the 28 layers, whose PEFT folder transformers + peft load onto
    Qwen3ForCausalLM with our runtime logits, and merge_lora.py writes a Qwen3 folder that
    transformers loads with the same logits."""
    import shutil

    from peft import PeftModel
    from transformers import Qwen3ForCausalLM

    import train_lora
    from networks.lora import LoRANetwork
    from tools import merge_lora

    base = tmp_path / "qwen3"
    shutil.copytree(klein["flux2_text_encoder"], base)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # model_type llm reads the tokenizer from the model folder
        shutil.copy(f"{klein['flux2_tokenizer']}/{name}", base / name)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(PROMPTS * 40))
    out = tmp_path / "out"
    code = train_lora.main(["--model_type", "llm", "--pretrained_model_name_or_path", str(base), "--train_data", str(corpus),
                            "--output_dir", str(out), "--output_name", "q3", "--mixed_precision", "no", "--max_length", "16",
                            "--stride", "16", "--batch_size", "2", "--max_train_steps", "2", "--eval_every_n_steps", "0",
                            "--optimizer_type", "AdamW", "--learning_rate", "5e-2", "--network_dim", "4",
                            "--save_format", "peft+kohya"])
    assert code == 0
    kohya = load_file_keys(out / "q3.safetensors")
    assert len([k for k in kohya if k.endswith("lora_up.weight")]) == 28 * 7
    assert "lora_te_model_layers_27_self_attn_k_proj.lora_down.weight" in kohya
    model = load_llm(str(base))
    net = LoRANetwork.from_weights(model, "llm", str(out / "q3"))
    ids = torch.randint(0, 400, (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        plain = model(ids)
        net.apply()
        ours = model(ids)
        net.remove()
        peft_logits = PeftModel.from_pretrained(Qwen3ForCausalLM.from_pretrained(str(base)), str(out / "q3")).eval()(ids).logits
    assert (ours - plain).abs().max().item() > 0.05  # two steps at 5e-2 moved the LoRA off zero (0.55 measured)
    assert (peft_logits - ours).abs().max().item() <= 1e-5
    assert merge_lora.main(["--model", str(base), "--lora", str(out / "q3"), "--save_to", str(tmp_path / "merged")]) == 0
    with torch.no_grad():
        merged = Qwen3ForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()(ids).logits
    assert (merged - ours).abs().max().item() <= 1e-5


def load_file_keys(path):
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return set(f.keys())


def test_klein_text_encoder_from_a_single_file(klein, tmp_path):
    """A single file without config.json beside it (ComfyUI's qwen_3_4b.safetensors layout): the
    config comes from the embedding width (Qwen3-4B 2560, Qwen3-8B 4096), otherwise one clear line;
    with the config given, the same embeds as the folder."""
    from library.io import CheckpointError, CheckpointReader, save_safetensors
    from library.models.flux2.text_encoder import _single_file_config, load_klein_text_encoder

    reader = CheckpointReader(klein["flux2_text_encoder"])
    single = str(tmp_path / "qwen_3_tiny.safetensors")
    save_safetensors(dict(reader.items()), single)
    with pytest.raises(CheckpointError, match="embedding width 32 is neither Qwen3-4B's"):
        load_klein_text_encoder(single, tokenizer=klein["flux2_tokenizer"])
    for width, preset in ((2560, QWEN3_4B), (4096, QWEN3_8B)):
        path = str(tmp_path / f"w{width}.safetensors")
        save_safetensors({"model.embed_tokens.weight": torch.zeros(2, width)}, path)
        assert _single_file_config(path) == preset
    config = LLMConfig.from_hf(json.load(open(f"{klein['flux2_text_encoder']}/config.json")))
    folder_enc = load_klein_text_encoder(klein["flux2_text_encoder"], max_length=24)
    file_enc = load_klein_text_encoder(single, tokenizer=klein["flux2_tokenizer"], config=config, max_length=24)
    assert torch.equal(file_enc.encode(PROMPTS)[0], folder_enc.encode(PROMPTS)[0])
