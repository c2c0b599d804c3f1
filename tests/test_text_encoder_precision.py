"""text_encoder_precision: the caption encoders load straight into bf16 / fp16 / fp32 / fp8, their
embeddings stay close to fp32, batches equal one-by-one encoding, and the cache key follows it.
ComfyUI's scaled fp8 encoder files load (as stored at fp8, dequantized otherwise) and encode as ComfyUI does."""

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from library.io import CheckpointError
from library.models.flux1.family import FluxFamily
from library.models.qwen_image.family import QwenImageFamily
from library.models.qwen_image.text_encoder import load_qwen_image_text_encoder
from library.models.text_encoders import load_t5
from library.precision.fp8 import FP8Linear

CAPTIONS = ["a red fox in the snow", "two cats", "a lighthouse at dusk, long exposure, film grain"]


def families(ts):
    return {"flux": FluxFamily(ts["flux_bfl"], ts["flux_vae_single"], clip_l=ts["clip_l"], t5xxl=ts["t5xxl"]),
            "qwen_image": QwenImageFamily(ts["qwen_image"], ts["qwen_image_vae"], text_encoder=ts["qwen_image_text_encoder"])}


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("name", ["flux", "qwen_image"])
def test_every_precision_encodes_close_to_fp32(tiny_set, name):
    family = families(tiny_set)[name]
    reference = family.load_text_encoder("fp32")(CAPTIONS)
    bound = {"bf16": 0.02, "fp16": 0.01, "fp8": 0.15, "fp8_scaled": 0.15}
    errors = {}
    for precision, tol in bound.items():
        out = family.load_text_encoder(precision)(CAPTIONS)
        for ref, got in zip(reference, out):
            assert ref.keys() == got.keys()
            for key in ref:
                assert got[key].dtype == ref[key].dtype  # float32 outputs (bool masks as they are)
                if got[key].is_floating_point():
                    errors[precision, key] = max(errors.get((precision, key), 0), rel(got[key], ref[key]))
                else:
                    assert torch.equal(got[key], ref[key])
        assert all(e < tol for (p, _), e in errors.items() if p == precision), errors
    print(name, {f"{p}/{k}": round(e, 5) for (p, k), e in errors.items()})
    assert errors["fp8", next(iter(reference[0]))] > errors["bf16", next(iter(reference[0]))]  # fp8 really ran


def test_weights_load_straight_into_the_chosen_storage(tiny_set):
    t5 = load_t5(tiny_set["t5xxl"], dtype=torch.bfloat16, fp8="fp8_scaled").model
    layers = dict(t5.named_modules())
    assert isinstance(layers["encoder.block.0.layer.0.SelfAttention.q"], FP8Linear)
    assert isinstance(layers["encoder.block.0.layer.1.DenseReluDense.wi_0"], FP8Linear)
    # wo stays bf16: transformers casts wo's input to wo.weight.dtype (fp8 would round activations)
    assert type(layers["encoder.block.0.layer.1.DenseReluDense.wo"]) is torch.nn.Linear
    floats = [p.dtype for p in t5.parameters() if p.is_floating_point()]
    assert set(floats) == {torch.bfloat16}  # no fp32 copy anywhere
    llm = load_qwen_image_text_encoder(tiny_set["qwen_image_text_encoder"], dtype=torch.bfloat16, fp8="fp8").llm
    assert any(isinstance(m, FP8Linear) for m in llm.modules())
    assert {p.dtype for p in llm.parameters()} == {torch.bfloat16}


@pytest.mark.parametrize("name", ["flux", "qwen_image"])
def test_a_batch_encodes_like_one_caption_at_a_time(tiny_set, name):
    encode = families(tiny_set)[name].load_text_encoder("fp32")
    batched = encode(CAPTIONS)
    for caption, together in zip(CAPTIONS, batched):
        alone = encode([caption])[0]
        for key in together:
            assert together[key].shape == alone[key].shape
            assert torch.allclose(together[key].float(), alone[key].float(), atol=1e-5)


def test_the_text_cache_key_follows_the_precision(tiny_set):
    family = families(tiny_set)["flux"]
    options = {"t5_max_length": 512}
    keys = {p: family.text_cache_key(options, p) for p in ("fp32", "bf16", "fp8")}
    assert len(set(keys.values())) == 3
    assert family.text_cache_key(options, "bf16") == keys["bf16"]


def test_a_wrong_precision_is_one_clear_error(tiny_set, tmp_path, capsys):
    import train_lora
    from test_train_lora import flux_args

    assert train_lora.main(flux_args(tiny_set, tmp_path, "--text_encoder_precision", "int4")) == 2
    err = capsys.readouterr().err.strip()
    assert "text_encoder_precision" in err and "int4" in err and len(err.splitlines()) == 1


def comfy_scaled_fp8(folder: str, out, linear) -> dict[str, torch.Tensor]:
    """ComfyUI's scaled fp8 encoder file (`scaled_fp8` marker; e4m3 codes, a float32 0-dim `scale_weight`
    and `scale_input` beside each Linear `linear(key)` picks) written to `out`, and the twins holding
    what ComfyUI computes with: codes.to(dtype) * scale.to(dtype) in fp32 and in bf16. Returns the file's tensors."""
    source = load_file(os.path.join(folder, "model.safetensors"))
    stored, twins = {"scaled_fp8": torch.empty(2, dtype=torch.float8_e4m3fn)}, {torch.float32: {}, torch.bfloat16: {}}
    for key, w in source.items():
        stored[key] = w
        if linear(key):
            scale = w.abs().amax().float() / 448.0 * 1.5  # non-trivial: the codes do not reach 448
            stored[key] = (w / scale).to(torch.float8_e4m3fn)
            stored[key[: -len("weight")] + "scale_weight"], stored[key[: -len("weight")] + "scale_input"] = scale, torch.ones(())
        for dtype, twin in twins.items():
            twin[key] = stored[key].to(dtype) * scale.to(dtype) if linear(key) else w.to(dtype)
    os.makedirs(out, exist_ok=True)
    shutil.copy(os.path.join(folder, "config.json"), out)
    save_file(stored, os.path.join(out, "encoder_fp8_scaled.safetensors"))
    for dtype, twin in twins.items():
        save_file(twin, os.path.join(out, f"twin_{str(dtype)[6:]}.safetensors"))
    return stored


def assert_codes_kept(model, stored: dict, expected: int) -> None:
    """Every FP8Linear holds the file's codes bit for bit and its scale: per tensor, as stored."""
    layers = {n: m for n, m in model.named_modules() if isinstance(m, FP8Linear)}
    assert len(layers) == expected and {m.mode for m in layers.values()} == {"fp8_tensor_scaled"}
    for name, m in layers.items():
        assert torch.equal(m.weight.view(torch.uint8), stored[f"{name}.weight"].view(torch.uint8))
        assert torch.equal(m.weight_scale, stored[f"{name}.scale_weight"])


def test_comfyuis_scaled_fp8_t5_encodes_as_its_dequantized_twin(tiny_set, tmp_path):
    """t5xxl_fp8_e4m3fn_scaled: at fp32 dequantized while loading, at fp8 kept as stored (wo dequantized to
    bf16); both encode exactly as the twin file of ComfyUI's dequantized weights (max |diff| 0)."""
    linears = tuple(f".{name}.weight" for name in ("q", "k", "v", "o", "wi_0", "wi_1", "wo"))
    stored = comfy_scaled_fp8(tiny_set["t5xxl"], tmp_path, lambda key: key.endswith(linears))
    load = lambda name, **kw: load_t5(str(tmp_path / name), tokenizer=tiny_set["t5xxl"], **kw)  # noqa: E731
    for kw, twin in (({}, "twin_float32"), ({"dtype": torch.bfloat16, "fp8": "fp8_scaled"}, "twin_bfloat16")):
        t5 = load("encoder_fp8_scaled.safetensors", **kw)
        reference = load(f"{twin}.safetensors", dtype=kw.get("dtype", torch.float32))
        diff = (t5.encode(CAPTIONS, 16) - reference.encode(CAPTIONS, 16)).abs().max().item()
        assert diff == 0, (kw, diff)
    layers = dict(t5.model.named_modules())
    wo = layers["encoder.block.0.layer.1.DenseReluDense.wo"]  # kept bf16 (T5_FP8): transformers casts wo's input to it
    assert type(wo) is torch.nn.Linear and wo.weight.dtype == torch.bfloat16
    assert_codes_kept(t5.model, stored, expected=2 * 6)


def test_comfyuis_scaled_fp8_qwen_encoder_encodes_as_its_dequantized_twin(tiny_set, tmp_path):
    """qwen_2.5_vl_7b_fp8_scaled (ComfyUI's `model.layers.*` names): at fp32 dequantized while loading, at fp8
    kept as stored; both encode exactly as the twin of ComfyUI's dequantized weights (max |diff| 0). The same
    layout under names the loader renames is refused naming the key (its scales would be read as 1.0)."""
    folder = tiny_set["qwen_image_text_encoder"]
    tokenizer = os.path.join(os.path.dirname(folder), "tokenizer")
    stored = comfy_scaled_fp8(folder, tmp_path, lambda key: key.startswith("model.layers.") and key.endswith("proj.weight"))
    load = lambda name, **kw: load_qwen_image_text_encoder(str(tmp_path / name), tokenizer=tokenizer, **kw)  # noqa: E731
    for kw, twin in (({}, "twin_float32"), ({"dtype": torch.bfloat16, "fp8": "fp8"}, "twin_bfloat16")):
        encoder = load("encoder_fp8_scaled.safetensors", **kw)
        reference = load(f"{twin}.safetensors", dtype=kw.get("dtype", torch.float32))
        (got, mask), (want, want_mask) = encoder.encode(CAPTIONS), reference.encode(CAPTIONS)
        diff = (got - want).abs().max().item()
        assert diff == 0 and torch.equal(mask, want_mask), (kw, diff)
    assert_codes_kept(encoder.llm, stored, expected=sum(k.endswith(".scale_weight") for k in stored))  # every one
    hf_names = {k.replace("model.", "model.language_model.", 1): v for k, v in stored.items()}  # transformers >= 4.52
    save_file(hf_names, tmp_path / "hf_names.safetensors")
    with pytest.raises(CheckpointError, match=r"'model.language_model.layers.0.mlp.down_proj.scale_weight' would load as "
                                              r"'model.layers.0.mlp.down_proj.scale_weight'"):
        load("hf_names.safetensors", fp8="fp8")
