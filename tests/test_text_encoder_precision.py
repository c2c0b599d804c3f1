"""text_encoder_precision: the caption encoders load straight into bf16 / fp16 / fp32 / fp8, their
embeddings stay close to fp32, batches equal one-by-one encoding, and the cache key follows it."""

import pytest
import torch

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
