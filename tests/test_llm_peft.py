"""LLM LoRAs as PEFT adapter folders: transformers + peft load our folder with our runtime logits,
merge_and_unload() equals merge_lora.py on the HF folder, PEFT's own folders load as
network_weights, and convert_lora.py goes kohya <-> PEFT bit for bit (alpha != rank, ranks and
alphas per module through rank_pattern / alpha_pattern)."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from library.models.llm import LLM, LLMConfig, load_llm, save_hf_folder
from networks.lora import LoRANetwork
from tools import convert_lora, merge_lora

IDS = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))


def hf_folder(folder, qkv_bias: bool, **extra) -> LLM:
    """Our tiny LLM, every weight random (norms near 1), saved as a Hugging Face folder. extra: LLMConfig
    fields (tie_word_embeddings as Qwen's small models, qk_norm as Qwen3)."""
    cfg = LLMConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=48,
                    rope_theta=10000.0, rms_norm_eps=1e-6, qkv_bias=qkv_bias, max_position_embeddings=64, **extra)
    model = LLM(cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.2 * noise if "norm" in name else noise / p.shape[-1] ** 0.5 if p.dim() == 2 else 0.1 * noise)
    save_hf_folder(model, str(folder))
    return model.eval()


def trained_lora(model, dora=False) -> LoRANetwork:
    """rank 4, alpha 8 (scale 2), MLP modules at rank 2, one module at its own alpha: r, lora_alpha,
    rank_pattern and alpha_pattern all matter. lora_up random so the delta shows."""
    torch.manual_seed(2)
    net = LoRANetwork(model, "llm", rank=4, alpha=8.0, network_args={"mlp_dim": 2, "dora": dora})
    with torch.no_grad():
        for m in net.lora_modules():
            m.lora_up.weight.normal_(0, 0.3)
            if m.dora_scale is not None:
                m.dora_scale.mul_(1 + 0.1 * torch.randn_like(m.dora_scale))
    net.lora_modules()[1].set_alpha(3.0)  # model.layers.0.self_attn.k_proj
    return net


def ours_with(model, net) -> torch.Tensor:
    net.apply()
    with torch.no_grad():
        out = model(IDS)
    net.remove()
    return out


def hf_model(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder)).eval()  # the class config.json's model_type names


TIED_QWEN2, QWEN3 = {"tie_word_embeddings": True}, {"qk_norm": True}


@pytest.mark.parametrize("qkv_bias, dora, extra", [(True, False, {}), (False, False, {}), (True, True, {}), (True, False, TIED_QWEN2),
                                                   (False, False, QWEN3)], ids=["qwen2", "llama", "qwen2-dora", "qwen2-tied", "qwen3"])
def test_peft_from_pretrained_gives_our_runtime_logits_fp32(tmp_path, qkv_bias, dora, extra):
    from peft import PeftModel

    model = hf_folder(tmp_path / "base", qkv_bias, **extra)
    assert json.loads((tmp_path / "base" / "config.json").read_text())["model_type"] == ("qwen3" if extra == QWEN3 else
                                                                                        "qwen2" if qkv_bias else "llama")
    net = trained_lora(model, dora)
    net.save_peft(str(tmp_path / "adapter"), base_model="base")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["task_type"], config["peft_type"]) == (4, 8, "CAUSAL_LM", "LORA")
    assert config["rank_pattern"] == {f"layers.{i}.mlp.{p}_proj": 2 for i in (0, 1) for p in ("gate", "up", "down")}
    assert config["alpha_pattern"] == {"layers.0.self_attn.k_proj": 3}
    assert config["target_modules"] == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    assert config["use_dora"] is dora
    keys = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight" in keys
    expected = ours_with(model, net)
    with torch.no_grad():
        plain = model(IDS)
        peft_model = PeftModel.from_pretrained(hf_model(tmp_path / "base"), str(tmp_path / "adapter")).eval()
        got = peft_model(IDS).logits
    assert (expected - plain).abs().max() > 0.1  # the LoRA moves the logits: a wrong scale cannot pass
    assert (got - expected).abs().max().item() <= 1e-5


@pytest.mark.parametrize("dora, extra", [(False, {}), (True, {}), (False, TIED_QWEN2)], ids=["lora", "dora", "lora-tied"])
def test_merge_and_unload_equals_merge_lora_on_the_hf_folder(tmp_path, dora, extra):
    from peft import PeftModel

    model = hf_folder(tmp_path / "base", True, **extra)
    trained_lora(model, dora).save_peft(str(tmp_path / "adapter"))
    assert merge_lora.main(["--model", str(tmp_path / "base"), "--lora", str(tmp_path / "adapter"),
                            "--save_to", str(tmp_path / "merged")]) == 0
    ours = load_file(tmp_path / "merged" / "model.safetensors")
    peft_merged = PeftModel.from_pretrained(hf_model(tmp_path / "base"), str(tmp_path / "adapter")).merge_and_unload()
    theirs = peft_merged.state_dict()
    base = load_file(tmp_path / "base" / "model.safetensors")
    changed = [k for k in ours if not torch.equal(ours[k], base[k])]
    assert len(changed) == 2 * 7  # every adapted Linear, nothing else
    assert max((ours[k] - theirs[k]).abs().max().item() for k in ours) <= 1e-6
    with torch.no_grad():
        assert (load_llm(str(tmp_path / "merged"))(IDS) - peft_merged(IDS).logits).abs().max().item() <= 1e-5


@pytest.mark.parametrize("rslora", [False, True])
def test_a_folder_peft_wrote_loads_as_network_weights_with_peft_logits(tmp_path, rslora):
    from peft import LoraConfig, get_peft_model

    model = hf_folder(tmp_path / "base", True)
    config = LoraConfig(r=4, lora_alpha=6, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False,
                        rank_pattern={"layers.1.mlp.down_proj": 2}, alpha_pattern={"layers.0.self_attn.v_proj": 10},
                        use_rslora=rslora, task_type="CAUSAL_LM")
    torch.manual_seed(4)
    peft_model = get_peft_model(hf_model(tmp_path / "base"), config).eval()
    peft_model.save_pretrained(str(tmp_path / "theirs"))
    net = LoRANetwork.from_weights(model, "llm", str(tmp_path / "theirs"))
    assert len(net.lora_modules()) == 6
    with torch.no_grad():
        expected = peft_model(IDS).logits
    assert (ours_with(model, net) - expected).abs().max().item() <= 1e-5


def test_a_peft_folder_without_lora_alpha_scales_as_peft_does(tmp_path):
    """A hand-written adapter_config.json without lora_alpha: PEFT scales by its LoraConfig default 8 / r, not
    by 1 (alpha = rank), which the reader took before (logits 0.22 apart)."""
    from peft import LoraConfig, PeftModel, get_peft_model

    model = hf_folder(tmp_path / "base", True)
    config = LoraConfig(r=16, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
                        task_type="CAUSAL_LM")
    torch.manual_seed(4)
    get_peft_model(hf_model(tmp_path / "base"), config).save_pretrained(str(tmp_path / "theirs"))
    config_path = tmp_path / "theirs" / "adapter_config.json"
    config = json.loads(config_path.read_text())
    del config["lora_alpha"]
    config_path.write_text(json.dumps(config))
    peft_model = PeftModel.from_pretrained(hf_model(tmp_path / "base"), str(tmp_path / "theirs")).eval()
    with torch.no_grad():
        expected = peft_model(IDS).logits
    net = LoRANetwork.from_weights(model, "llm", str(tmp_path / "theirs"))
    assert (ours_with(model, net) - expected).abs().max().item() <= 1e-5


@pytest.mark.parametrize("field", [{"alora_invocation_tokens": [7, 8]}, {"use_qalora": True}])
def test_peft_variants_with_other_math_are_refused(tmp_path, capsys, field):
    """aLoRA applies the LoRA only from its invocation tokens on (PEFT: "merging is not possible"), QALoRA
    pools its input: merged or applied as W + BA on every token they were 0.54 from PEFT's logits."""
    model = hf_folder(tmp_path / "base", True)
    trained_lora(model).save_peft(str(tmp_path / "a"))
    config_path = tmp_path / "a" / "adapter_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), **field}))
    assert merge_lora.main(["--model", str(tmp_path / "base"), "--lora", str(tmp_path / "a"),
                            "--save_to", str(tmp_path / "merged")]) == 2
    assert f"adapter_config.json: {next(iter(field))} = " in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "merged")


def test_kohya_peft_kohya_and_peft_kohya_peft_round_trips_are_exact(tmp_path, capsys):
    model = hf_folder(tmp_path / "base", False)
    net = trained_lora(model)
    net.save(str(tmp_path / "k.safetensors"))
    net.save_peft(str(tmp_path / "p"))
    assert convert_lora.main([str(tmp_path / "k.safetensors"), str(tmp_path / "k2p"), "--to", "peft"]) == 0
    assert convert_lora.main([str(tmp_path / "k2p"), str(tmp_path / "k2p2k.safetensors"), "--to", "kohya"]) == 0
    assert "llm LoRA: kohya -> peft, 14 modules" in capsys.readouterr().out
    kohya, back = load_file(tmp_path / "k.safetensors"), load_file(tmp_path / "k2p2k.safetensors")
    assert kohya.keys() == back.keys() and all(torch.equal(kohya[k], back[k]) for k in kohya)
    assert convert_lora.main([str(tmp_path / "p" / "adapter_model.safetensors"), str(tmp_path / "p2k.safetensors"), "--to", "kohya"]) == 0
    assert convert_lora.main([str(tmp_path / "p2k.safetensors"), str(tmp_path / "p2k2p"), "--to", "peft"]) == 0
    for folder in ("k2p", "p2k2p"):
        a, b = load_file(tmp_path / "p" / "adapter_model.safetensors"), load_file(tmp_path / folder / "adapter_model.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        ca, cb = (json.loads((tmp_path / f / "adapter_config.json").read_text()) for f in ("p", folder))
        assert [ca[k] for k in ("r", "lora_alpha", "rank_pattern", "alpha_pattern")] == [cb[k] for k in ("r", "lora_alpha", "rank_pattern", "alpha_pattern")]


def test_peft_folder_errors_are_one_line(tmp_path, capsys):
    model = hf_folder(tmp_path / "base", True)
    trained_lora(model).save_peft(str(tmp_path / "a"))
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps({**config, "modules_to_save": ["lm_head"]}))
    assert convert_lora.main([str(tmp_path / "a"), str(tmp_path / "o.safetensors"), "--to", "kohya"]) == 2
    assert "adapter_config.json: modules_to_save = ['lm_head'] is not supported" in capsys.readouterr().err
    os.makedirs(tmp_path / "empty")
    assert convert_lora.main([str(tmp_path / "empty"), str(tmp_path / "o.safetensors"), "--to", "kohya"]) == 2
    assert "a folder without adapter_config.json" in capsys.readouterr().err
    trained_lora(model).save(str(tmp_path / "k.safetensors"))
    assert convert_lora.main([str(tmp_path / "k.safetensors"), str(tmp_path / "d.safetensors"), "--to", "diffusers"]) == 2
    assert "--to diffusers: LLM LoRAs convert with --to peft" in capsys.readouterr().err


def test_a_peft_embedding_lora_is_refused_naming_it(tmp_path, capsys):
    """PEFT's save_pretrained with embed_tokens in target_modules writes lora_embedding_A / _B and the embedding's
    base_layer.weight: as network_weights, in merge_lora.py and as a raw state dict it is one line naming the
    embedding LoRA. The old line called it "a whole PEFT model's state_dict()" and advised
    get_peft_model_state_dict, which save_pretrained had used."""
    from peft import LoraConfig, get_peft_model

    model = hf_folder(tmp_path / "base", True)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "embed_tokens"], task_type="CAUSAL_LM")
    peft_model = get_peft_model(hf_model(tmp_path / "base"), config)
    peft_model.save_pretrained(str(tmp_path / "adapter"))
    said = (f"{tmp_path / 'adapter'}: an embedding LoRA (lora_embedding_A / lora_embedding_B on "
            f"'base_model.model.model.embed_tokens') is not supported: LoRAs of Linear modules (lora_A / lora_B) are")
    with pytest.raises(ValueError) as refused:
        LoRANetwork.from_weights(model, "llm", str(tmp_path / "adapter"))
    assert str(refused.value).startswith(said)
    assert merge_lora.main(["--model", str(tmp_path / "base"), "--lora", str(tmp_path / "adapter"),
                            "--save_to", str(tmp_path / "merged")]) == 2
    assert f"error: {said}" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"state dict: an embedding LoRA \(.* on 'base_model.model.model.embed_tokens'\)"):
        LoRANetwork.from_weights(model, "llm", peft_model.state_dict())


def test_merge_lora_into_a_plain_fp8_folder_keeps_it_fp8(tmp_path):
    """A LoRA trained on a plain-fp8 LLM folder (train_lora.py uses it as stored) merges into it: each
    merged Linear is the fp32 merge into the widened base, rounded once to float8_e4m3fn. The old line
    refused every fp8 LLM base ("'...' is stored as F8_E4M3 (14 fp8 tensors): ... give a bf16/fp16/fp32
    checkpoint")."""
    from safetensors.torch import save_file

    hf_folder(tmp_path / "wide", False)
    tensors = load_file(tmp_path / "wide" / "model.safetensors")
    fp8 = {k: v.to(torch.float8_e4m3fn) if k.endswith("_proj.weight") else v for k, v in tensors.items()}
    save_file({k: v.float() for k, v in fp8.items()}, tmp_path / "wide" / "model.safetensors", {"format": "pt"})
    hf_folder(tmp_path / "base", False)
    save_file(fp8, tmp_path / "base" / "model.safetensors", {"format": "pt"})
    trained_lora(load_llm(str(tmp_path / "wide"))).save_peft(str(tmp_path / "adapter"))
    for base in ("wide", "base"):  # (rounded to nearest, to compare bits; into an fp8 base stochastically by default)
        assert merge_lora.main(["--model", str(tmp_path / base), "--lora", str(tmp_path / "adapter"),
                                "--save_to", str(tmp_path / f"merged_{base}"), "--no-stochastic_rounding"]) == 0
    wide, merged = (load_file(tmp_path / f"merged_{b}" / "model.safetensors") for b in ("wide", "base"))
    assert {k for k, v in merged.items() if v.dtype == torch.float8_e4m3fn} == {k for k in fp8 if k.endswith("_proj.weight")}
    assert all(torch.equal(merged[k].view(torch.uint8), wide[k].to(torch.float8_e4m3fn).view(torch.uint8)) for k in fp8
               if k.endswith("_proj.weight"))
    assert sum(not torch.equal(merged[k].float(), fp8[k].float()) for k in fp8) == 2 * 7  # every adapted Linear


@pytest.mark.parametrize("header, dropout", [({}, 0.0), ({"ss_network_dropout": "None"}, 0.0),
                                             ({"ss_network_dropout": "0.25"}, 0.25),
                                             ({"ss_network_args": json.dumps({"dropout": 0.1})}, 0.1)])
def test_kohya_to_peft_says_the_dropout_the_lora_trained_with(tmp_path, header, dropout):
    """adapter_config.json's lora_dropout is the file's trained dropout, as training writes it: sd-scripts'
    ss_network_dropout ("None" when unset), or our ss_network_args' dropout (network_dropout goes there). It was
    0.0 whatever the file said."""
    net = trained_lora(hf_folder(tmp_path / "base", False))
    net.save(str(tmp_path / "k.safetensors"), metadata=header)
    assert convert_lora.main([str(tmp_path / "k.safetensors"), str(tmp_path / "p"), "--to", "peft"]) == 0
    assert json.loads((tmp_path / "p" / "adapter_config.json").read_text())["lora_dropout"] == dropout


@pytest.mark.parametrize("given", ["folder", "relative_file"])
def test_kohya_to_peft_names_the_model_base_folder_absolute_as_training_does(tmp_path, monkeypatch, capsys, given):
    """--model (the base's folder, or its .safetensors given relative) is written as training writes it: the folder,
    absolute, which AutoPeftModelForCausalLM loads from any working directory. It was the header's ss_sd_model_name,
    a basename ("base"), read by from_pretrained as a hub id; without --model it still is, with a warning."""
    from peft import AutoPeftModelForCausalLM

    trained_lora(hf_folder(tmp_path / "base", False)).save(str(tmp_path / "k.safetensors"),
                                                           metadata={"ss_sd_model_name": "base"})
    monkeypatch.chdir(tmp_path)
    model = str(tmp_path / "base") if given == "folder" else os.path.join("base", "model.safetensors")
    assert convert_lora.main(["k.safetensors", "p", "--to", "peft", "--model", model]) == 0
    written = json.loads((tmp_path / "p" / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert written == str(tmp_path / "base") and "warning" not in capsys.readouterr().err
    monkeypatch.chdir(tmp_path / "base")  # another working directory: the adapter still finds its base
    assert AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / "p")).peft_config["default"].r == 4
    assert convert_lora.main([str(tmp_path / "k.safetensors"), str(tmp_path / "q"), "--to", "peft"]) == 0
    assert json.loads((tmp_path / "q" / "adapter_config.json").read_text())["base_model_name_or_path"] == "base"
    assert "ss_sd_model_name 'base', a local base's folder name without its path" in capsys.readouterr().err
    hub = [str(tmp_path / "k.safetensors"), str(tmp_path / "h"), "--to", "peft", "--model", "Qwen/Qwen2.5-0.5B"]
    assert convert_lora.main(hub) == 0  # a hub id: as given
    assert json.loads((tmp_path / "h" / "adapter_config.json").read_text())["base_model_name_or_path"] == "Qwen/Qwen2.5-0.5B"


def test_a_bad_model_or_dropout_for_peft_is_one_line_naming_it(tmp_path, capsys):
    trained_lora(hf_folder(tmp_path / "base", False)).save(str(tmp_path / "k.safetensors"))
    (tmp_path / "empty").mkdir()
    k = str(tmp_path / "k.safetensors")
    for argv, said in (([k, str(tmp_path / "p"), "--to", "peft", "--model", str(tmp_path / "nope")],
                        f"--model {tmp_path / 'nope'}: no such file or folder (nor a hub id, 'org/name')"),
                       ([k, str(tmp_path / "p"), "--to", "peft", "--model", str(tmp_path / "empty")],
                        f"--model {tmp_path / 'empty'}: no config.json beside it; expected the base LLM's folder"),
                       ([k, str(tmp_path / "o.safetensors"), "--to", "kohya", "--model", str(tmp_path / "base")],
                        f"--model {tmp_path / 'base'}: only for --to peft")):
        assert convert_lora.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {said}") and err.count("\n") == 1
    trained_lora(load_llm(str(tmp_path / "base"))).save(k, metadata={"ss_network_dropout": "high"})
    assert convert_lora.main([k, str(tmp_path / "p"), "--to", "peft"]) == 2
    assert capsys.readouterr().err == (f"error: {k}: ss_network_dropout = 'high' is no dropout; expected a number in "
                                       f"[0, 1)\n")
    assert not os.path.exists(tmp_path / "p")
