"""train_lora.py with model_type = "llm" on bases in other forms: config.json shapes (a YaRN context window, a
missing shape key), fp8 folders (plain e4m3 / e5m2 stored, fp8_scaled while loading), an index without its
shards, GGUF and quantized releases refused, a base path that does not exist."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

import train_lora
from tests.test_train_llm import llm_args


def test_a_config_json_without_a_shape_key_is_one_line_naming_it(tiny_set, tmp_path, capsys):
    """The old line raised KeyError: 'hidden_size' (a traceback), and KeyError: 'rms_norm_eps' for a config
    that leaves the eps to transformers' default 1e-6, which it now takes."""
    import shutil

    from library.models.llm import _find_config

    folder = tmp_path / "m"
    shutil.copytree(tiny_set["llm"], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "rms_norm_eps"}))
    assert _find_config(str(folder)).rms_norm_eps == 1e-6
    (folder / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "hidden_size"}))
    code = train_lora.main(llm_args(tiny_set, tmp_path, "--pretrained_model_name_or_path", str(folder)))
    assert code == 2
    assert capsys.readouterr().err == (f"error: {folder / 'config.json'}: no hidden_size (expected the model's shape: vocab_size, "
                                       f"hidden_size, num_hidden_layers, num_attention_heads, intermediate_size)\n")


def test_a_yarn_config_stretches_the_context_window_max_length_is_checked_against(tiny_set, tmp_path, capsys):
    """Qwen's model cards add yarn (factor 4, original 32768) to a config.json whose max_position_embeddings
    stays 40960: the window is factor x original, as vLLM takes it (the old line refused any yarn config)."""
    import shutil

    folder = tmp_path / "yarn"
    shutil.copytree(tiny_set["llm_scratch"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
    (folder / "config.json").write_text(json.dumps(config))
    code = train_lora.main(llm_args(tiny_set, tmp_path, "--pretrained_model_name_or_path", str(folder), "--pretrain",
                                    "--max_length", "4096"))
    assert code == 2
    assert ("max_length 4096 is longer than the model's context window (rope_scaling factor 4 x "
            "original_max_position_embeddings 256 = 1024)") in capsys.readouterr().err


def test_llm_lora_on_fp8_scaled_base_records_the_base_precision(tiny_set, tmp_path):
    from safetensors import safe_open

    out = tmp_path / "fp8"
    code = train_lora.main(llm_args(tiny_set, out, "--pretrained_model_name_or_path", tiny_set["llm"], "--output_name", "lm",
                                    "--max_train_steps", "3", "--fp8_base", "--eval_every_n_steps", "0"))
    assert code == 0
    with safe_open(str(out / "lm" / "adapter_model.safetensors"), "pt") as f:  # the default PEFT folder's header
        assert f.metadata()["ss_base_precision"] == "fp8_scaled"


def test_fp8_llm_keeps_head_and_embeddings_high_precision(tiny_set):
    from library.models.family import fp8_prepare
    from library.precision.fp8 import FP8Linear
    from library.models.llm import load_llm

    model = load_llm(tiny_set["llm"], prepare=fp8_prepare("fp8_scaled", "llm"))
    kinds = {name: type(m).__name__ for name, m in model.named_modules() if isinstance(m, (FP8Linear, torch.nn.Linear))}
    assert kinds["model.layers.0.self_attn.q_proj"] == "FP8Linear" and kinds["model.layers.0.mlp.down_proj"] == "FP8Linear"
    assert kinds.get("lm_head", "Linear") == "Linear"
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.float8_e4m3fn


def plain_fp8_folder(tiny_set, folder, dtype=torch.float8_e4m3fn):
    """The tiny LLM as a plain-fp8 Hugging Face folder: every decoder Linear weight `dtype`, no
    scales (embeddings, norms and the head as they were); returns q_proj's stored codes of layer 0."""
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(tiny_set["llm"], folder)
    tensors = load_file(os.path.join(tiny_set["llm"], "model.safetensors"))
    tensors = {k: v.to(dtype) if k.endswith("_proj.weight") else v for k, v in tensors.items()}
    save_file(tensors, os.path.join(folder, "model.safetensors"), {"format": "pt"})
    return tensors["model.layers.0.self_attn.q_proj.weight"]


def test_a_plain_fp8_folder_trains_as_stored_and_records_fp8(tiny_set, tmp_path):
    """The old line refused base_precision fp8 ('... is already torch.float8_e4m3fn: re-quantizing fp8
    compounds error') and, without it, widened the base and recorded ss_base_precision fp32."""
    from safetensors import safe_open

    from library.training.config import load_config

    codes = plain_fp8_folder(tiny_set, tmp_path / "fp8")
    args = load_config(llm_args(tiny_set, tmp_path / "out", "--pretrained_model_name_or_path", str(tmp_path / "fp8"),
                                "--output_name", "lm", "--max_train_steps", "1", "--eval_every_n_steps", "0",
                                "--base_precision", "fp8"))
    trainer = train_lora.Trainer(args)
    q_proj = trainer.task.model.model.layers[0].self_attn.q_proj
    assert q_proj.weight.dtype == torch.float8_e4m3fn and torch.equal(q_proj.weight.view(torch.uint8), codes.view(torch.uint8))
    assert trainer.run() == 0
    with safe_open(str(tmp_path / "out" / "lm" / "adapter_model.safetensors"), "pt") as f:
        assert f.metadata()["ss_base_precision"] == "fp8"


def test_a_plain_fp8_folder_without_the_fp8_setting_is_refused(tiny_set, tmp_path, capsys):
    plain_fp8_folder(tiny_set, tmp_path / "fp8")
    code = train_lora.main(llm_args(tiny_set, tmp_path / "out", "--pretrained_model_name_or_path", str(tmp_path / "fp8"),
                                    "--max_train_steps", "1", "--eval_every_n_steps", "0"))
    assert code == 2
    assert ("stores a pre-quantized fp8 base (used as it is), but the config asks for bf16; set fp8_base = true and "
            "fp8_scaled = false") in capsys.readouterr().err


def test_a_plain_e5m2_folder_refuses_an_fp8_base_by_file_and_records_e5m2(tiny_set, tmp_path, capsys):
    """An fp8 base asked of a plain e5m2 folder failed while the weights loaded, naming a tensor and no
    file; trained with a bf16 base, ss_base_precision said "fp32" (the weights' dtype). Now one line
    naming the file, and "fp8_e5m2": widening is exact, so that file is the base trained on."""
    from safetensors import safe_open

    plain_fp8_folder(tiny_set, tmp_path / "e5m2", torch.float8_e5m2)
    args = llm_args(tiny_set, tmp_path / "out", "--pretrained_model_name_or_path", str(tmp_path / "e5m2"),
                    "--output_name", "lm", "--max_train_steps", "1", "--eval_every_n_steps", "0")
    assert train_lora.main(args + ["--base_precision", "fp8"]) == 2
    assert capsys.readouterr().err == (f"error: {tmp_path / 'e5m2'}: 'model.layers.0.mlp.down_proj.weight' is "
                                       f"float8_e5m2 (a plain e5m2 file, widened exactly to the compute dtype), but "
                                       f"the config asks for a fp8 base; set base_precision = \"bf16\" (fp8_base = "
                                       f"false), or give a bf16 checkpoint\n")
    with pytest.warns(UserWarning, match="float8_e5m2 tensors"):
        assert train_lora.main(args) == 0
    with safe_open(str(tmp_path / "out" / "lm" / "adapter_model.safetensors"), "pt") as f:
        assert f.metadata()["ss_base_precision"] == "fp8_e5m2"


@pytest.mark.parametrize("pretrain", [False, True])
def test_an_llm_base_folder_with_an_index_and_no_shards_names_the_missing_shards(tiny_set, tmp_path, capsys, pretrain):
    """A folder holding model.safetensors.index.json and none of its shards (a download stopped early):
    the type check took the index as weights, the loader did not; a LoRA then blamed the base ('no
    .safetensors weights'), and pretrain = true trained a new model from scratch, the index ignored."""
    import json
    import shutil

    folder = tmp_path / "base"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(os.path.join(tiny_set["llm"], name), folder)
    weight_map = {"a.weight": "model-00001-of-00002.safetensors", "b.weight": "model-00002-of-00002.safetensors"}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    extra = ("--pretrain",) if pretrain else ()
    assert train_lora.main(llm_args(tiny_set, tmp_path / "out", "--pretrained_model_name_or_path", str(folder),
                                    "--max_train_steps", "1", *extra)) == 2
    assert capsys.readouterr().err == (f"error: {folder / 'model.safetensors.index.json'}: 2 of its 2 shard files are "
                                       f"missing beside it: model-00001-of-00002.safetensors, "
                                       f"model-00002-of-00002.safetensors\n")


@pytest.mark.parametrize("beside_tokenizer", [True, False])
def test_a_gguf_llm_base_is_refused_naming_what_is_read(tiny_set, tmp_path, capsys, beside_tokenizer):
    """The old line blamed the base ('no .safetensors weights; a LoRA needs a pretrained model (or set
    pretrain = true)') or, alone, a missing tokenizer.json."""
    import shutil

    import gguf
    import numpy as np

    folder = tmp_path / "gg"
    folder.mkdir()
    if beside_tokenizer:
        for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
            shutil.copy(os.path.join(tiny_set["llm"], name), folder)
    writer = gguf.GGUFWriter(str(folder / "m-Q8_0.gguf"), "qwen2")
    writer.add_tensor("token_embd.weight", np.zeros((16, 8), dtype=np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    base = str(folder) if beside_tokenizer else str(folder / "m-Q8_0.gguf")
    assert train_lora.main(llm_args(tiny_set, tmp_path, "--pretrained_model_name_or_path", base)) == 2
    assert capsys.readouterr().err == (f"error: pretrained_model_name_or_path {folder / 'm-Q8_0.gguf'}: a llama.cpp GGUF file; "
                                       f"an LLM base must be a Hugging Face safetensors model (a folder with config.json, "
                                       f"tokenizer.json and *.safetensors)\n")


def test_a_quantized_hf_release_is_refused_naming_its_config(tiny_set, tmp_path, capsys):
    """Before its weights are looked at (the old line: 'stores a pre-quantized fp8 base ... set fp8_base = true
    and fp8_scaled = false', then 'unexpected keys for this model: ...weight_scale_inv')."""
    import shutil

    shutil.copytree(tiny_set["llm"], tmp_path / "fp8_release")
    config = json.loads((tmp_path / "fp8_release" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (tmp_path / "fp8_release" / "config.json").write_text(json.dumps(config))
    args = llm_args(tiny_set, tmp_path, "--pretrained_model_name_or_path", str(tmp_path / "fp8_release"), "--max_train_steps", "1")
    assert train_lora.main(args) == 2
    assert capsys.readouterr().err.startswith(f"error: {tmp_path / 'fp8_release' / 'config.json'}: quantization_config "
                                              f"(quant_method 'fp8'): a Hugging Face quantized checkpoint is not read")


@pytest.mark.parametrize("missing", ["folder", "file"])
def test_a_base_path_that_does_not_exist_is_named_as_such(tiny_set, tmp_path, capsys, missing):
    """A typo in pretrained_model_name_or_path: the old line said 'no tokenizer.json here', also for a
    misspelled .safetensors file in a folder that holds tokenizer.json."""
    base = str(tmp_path / "no_such_model") if missing == "folder" else os.path.join(tiny_set["llm"], "modle.safetensors")
    assert train_lora.main(llm_args(tiny_set, tmp_path, "--pretrained_model_name_or_path", base)) == 2
    assert capsys.readouterr().err == f"error: pretrained_model_name_or_path {base}: no such file or folder\n"
