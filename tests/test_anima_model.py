"""Anima transformer: parity with diffusers' CosmosTransformer3DModel fed by its AnimaTextConditioner on the same
weights (square and non-square grids, padded Qwen3 / T5 prompts), the released size on `meta`, the precision
doctor's positions, checkpoint layouts (the released "net." single file with its RoPE buffers, ComfyUI's prefix,
a diffusers pipeline folder) and one-line errors."""

import types

import pytest
import torch
import torch.nn.functional as F
from diffusers import CosmosTransformer3DModel
from diffusers.models.condition_embedders.condition_embedder_anima import AnimaTextConditioner
from diffusers.models.transformers import transformer_cosmos
from safetensors.torch import load_file, save_file

from library.io import CheckpointError
from library.models.anima import model as anima_model
from library.models.anima.checkpoint import (
    diffusers_configs, diffusers_name, load_anima, save_anima_diffusers, save_anima_single_file,
)
from library.models.anima.model import ANIMA, Anima, AnimaConfig, random_inputs
from library.models.anima.tiny import tiny_config, write_anima, write_sized_anima
from tests.model_checks import checkpointing_gradients, randomized

# head_dim 32 (RoPE 12 / 10 / 10); the DiT's text width (48) differs from the adapter's (64: an in_proj) and the
# Qwen width (40), the output channels (12) from the input's (16), so that a swapped projection cannot pass.
TINY = dict(hidden_size=64, num_heads=2, num_blocks=2, out_channels=12, text_dim=48, adaln_lora_dim=16,
            adapter_layers=2, adapter_dim=64, adapter_heads=2, adapter_source_dim=40)
B, S, T = 2, 7, 6  # batch, Qwen tokens, T5 tokens (each padded)
QWEN_LENGTHS, T5_LENGTHS = (4, 7), (3, 6)  # row 0 is a short prompt: padding masked in both


def no_torchvision(monkeypatch):
    """diffusers' Cosmos resizes the padding mask with torchvision (not installed): a nearest resize of the
    mask, already at the latent's size, is the mask itself."""
    resize = lambda mask, size, interpolation=None: F.interpolate(mask, size=size, mode="nearest")  # noqa: E731
    monkeypatch.setattr(transformer_cosmos, "transforms", types.SimpleNamespace(
        functional=types.SimpleNamespace(resize=resize), InterpolationMode=types.SimpleNamespace(NEAREST=0)),
        raising=False)


def random_model(config: AnimaConfig, seed: int = 0) -> Anima:
    """Every parameter random (diffusers and sd-scripts zero-init some): norms around 1."""
    return randomized(Anima(config), seed)


def diffusers_pair(model: Anima) -> tuple[CosmosTransformer3DModel, AnimaTextConditioner]:
    """diffusers' two classes at the model's config with its weights (converted by checkpoint.diffusers_name). Their
    DiT's QK RMSNorms get eps 1e-6: diffusers builds them with Attention's default 1e-5, the original with 1e-6."""
    transformer_json, conditioner_json = (
        {k: v for k, v in c.items() if not k.startswith("_")} for c in diffusers_configs(model.config))
    transformer, conditioner = CosmosTransformer3DModel(**transformer_json), AnimaTextConditioner(**conditioner_json)
    parts = {"transformer": {}, "text_conditioner": {}}
    for key, value in model.state_dict().items():
        component, theirs = diffusers_name(key)
        parts[component][theirs] = value
    transformer.load_state_dict(parts["transformer"], strict=True)
    conditioner.load_state_dict(parts["text_conditioner"], strict=True)
    for attention in (m for m in transformer.modules() if getattr(m, "norm_q", None) is not None):
        attention.norm_q.eps = attention.norm_k.eps = model.config.qk_norm_eps
    return transformer.eval(), conditioner.eval()


def inputs(config: AnimaConfig, h: int, w: int, seed: int = 1) -> dict:
    """Our forward's arguments: tokens of an h x w patch grid, short prompts padded (states zero there, ids 0)."""
    g = torch.Generator().manual_seed(seed)
    qwen_mask = torch.arange(S)[None] < torch.tensor(QWEN_LENGTHS)[:, None]
    t5_mask = torch.arange(T)[None] < torch.tensor(T5_LENGTHS)[:, None]
    qwen = torch.randn(B, S, config.adapter_source_dim, generator=g) * qwen_mask[..., None]
    t5_ids = torch.randint(1, config.t5_vocab_size, (B, T), generator=g) * t5_mask
    return dict(img=torch.randn(B, h * w, config.token_width, generator=g), qwen=qwen, t5_ids=t5_ids,
                timesteps=torch.tensor([0.3, 0.85]), h=h, w=w, qwen_mask=qwen_mask, t5_mask=t5_mask)


def diffusers_forward(transformer, conditioner, x: dict) -> torch.Tensor:
    """As the modular pipeline runs them: the conditioner (with both masks), then the transformer on the latent
    [B, C, 1, 2h, 2w] with timestep = sigma, a zero padding mask and no attention mask; output as our tokens."""
    b, (h, w), p = x["img"].shape[0], (x["h"], x["w"]), 2
    latent = x["img"].view(b, h, w, -1, p, p).permute(0, 3, 1, 4, 2, 5).reshape(b, -1, 1, h * p, w * p)
    with torch.no_grad():
        context = conditioner(source_hidden_states=x["qwen"], target_input_ids=x["t5_ids"],
                              target_attention_mask=x["t5_mask"], source_attention_mask=x["qwen_mask"])
        out = transformer(hidden_states=latent, timestep=x["timesteps"], encoder_hidden_states=context,
                          padding_mask=torch.zeros(1, 1, h * p, w * p), return_dict=False)[0]
    return out[:, :, 0].unflatten(2, (h, p)).unflatten(4, (w, p)).permute(0, 2, 4, 1, 3, 5).reshape(b, h * w, -1)


# Measured: 2.2e-6 (3 x 5) and 2.4e-6 (4 x 4) with outputs ~1.6 on average (float32 against float64 RoPE angles).
@pytest.mark.parametrize("grid", [(3, 5), (4, 4)])
def test_anima_matches_diffusers_fp32(grid, monkeypatch):
    no_torchvision(monkeypatch)
    config = AnimaConfig(**TINY)
    model = random_model(config)
    x = inputs(config, *grid)
    expected = diffusers_forward(*diffusers_pair(model), x)
    with torch.no_grad():
        out = model(**x)
    diff = (out - expected).abs().max().item()
    print(f"grid {grid}: max |ours - diffusers| {diff:.2e}, mean |out| {expected.abs().mean():.2f}")
    assert out.shape == (B, grid[0] * grid[1], 48) and out.dtype == torch.float32
    assert expected.abs().mean() > 0.5 and diff <= 1e-5


def test_padding_is_masked_and_the_zero_tokens_count(monkeypatch):
    """Masked Qwen states and T5 ids change nothing; the adapter's zero padding to 512 tokens does change the
    output (the DiT's cross-attention has no mask), as diffusers' does; a mask masking nothing equals none."""
    no_torchvision(monkeypatch)
    config = AnimaConfig(**TINY)
    model = random_model(config)
    x = inputs(config, 3, 4)
    with torch.no_grad():
        out = model(**x)
        changed = {**x, "qwen": x["qwen"].clone(), "t5_ids": x["t5_ids"].clone()}
        changed["qwen"][0, QWEN_LENGTHS[0]:] = 50.0
        changed["t5_ids"][0, T5_LENGTHS[0]:] = 17
        assert (model(**changed) - out).abs().max().item() <= 1e-5
        full = {**x, "qwen_mask": None, "t5_mask": None}
        ones = {**x, "qwen_mask": torch.ones(B, S, dtype=torch.bool), "t5_mask": torch.ones(B, T, dtype=torch.bool)}
        assert torch.equal(model(**full), model(**ones))
        unpadded = Anima(AnimaConfig(**TINY, min_text_len=T))
        unpadded.load_state_dict(model.state_dict())
        assert (unpadded.eval()(**x) - out).abs().max().item() > 1e-2
    transformer, conditioner = diffusers_pair(model)
    conditioner.register_to_config(min_sequence_length=T)
    assert (unpadded(**x) - diffusers_forward(transformer, conditioner, x)).abs().max().item() <= 1e-5


RELEASED_DIT, RELEASED_ADAPTER = 1_956_405_248, 134_663_680  # on meta; 2,091,068,928 in all


def test_released_size_on_meta_matches_diffusers():
    transformer_json, conditioner_json = (
        {k: v for k, v in c.items() if not k.startswith("_")} for c in diffusers_configs(ANIMA))
    with torch.device("meta"):
        ours = Anima(ANIMA)
        transformer = CosmosTransformer3DModel(**transformer_json)
        conditioner = AnimaTextConditioner(**conditioner_json)
    count = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    adapter = count(ours.llm_adapter)
    print(f"Anima: {count(ours) - adapter:,} DiT + {adapter:,} adapter parameters")
    assert (count(ours) - adapter, adapter) == (count(transformer), count(conditioner)) == (RELEASED_DIT,
                                                                                               RELEASED_ADAPTER)
    theirs = {("transformer", k): v.shape for k, v in transformer.state_dict().items()}
    theirs.update({("text_conditioner", k): v.shape for k, v in conditioner.state_dict().items()})
    assert {diffusers_name(k): v.shape for k, v in ours.state_dict().items()} == theirs
    assert ANIMA.rope_dims == (44, 42, 42) and ours.x_embedder.proj[1].in_features == 68


def test_random_inputs_positions_are_what_the_model_feeds_rope(monkeypatch):
    """The precision doctor's expected positions are the model's one [h*w, 2] rope_tables call (h and w share a
    theta); the t axis (all zero) and the adapter's 1-D positions are other calls."""
    seen = []
    original = anima_model.rope_tables
    monkeypatch.setattr(anima_model, "rope_tables", lambda pos, *a: seen.append((pos, *a)) or original(pos, *a))
    config = tiny_config()
    conditioning = random_inputs(config, 3, 4, 8, torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = Anima(config)(img=torch.randn(1, 12, 64), timesteps=torch.tensor([0.5]), **conditioning.fixed)
    assert out.shape == (1, 12, 64) and all(pos.dtype == torch.int64 for pos, *_ in seen)
    spatial = [(pos, axes, theta) for pos, axes, theta in seen if pos.dim() == 2 and pos.shape[-1] == 2]
    assert len(seen) == 4 and len(spatial) == 1  # adapter target + source, DiT t + (h, w)
    assert torch.equal(spatial[0][0], conditioning.positions[0]) and spatial[0][1:] == (conditioning.axes_dim,
                                                                                        conditioning.theta)
    assert conditioning.axes_dim == (10, 10) and conditioning.theta == pytest.approx(10000 * 4 ** (10 / 8))


# ----------------------------------------------------------------------------------------------
# Checkpoints


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The tiny released file (net., bf16, RoPE buffers, no metadata), the same weights under ComfyUI's prefix beside
    a VAE tensor, and a diffusers pipeline folder written by diffusers' own save_pretrained (sharded)."""
    folder = tmp_path_factory.mktemp("anima")
    released = write_anima(str(folder), seed=0)["anima"]
    sd = {k.removeprefix("net."): v for k, v in load_file(released).items() if "pos_embedder" not in k}
    save_file({**{"model.diffusion_model." + k: v for k, v in sd.items()}, "vae.decoder.conv_in.weight": torch.ones(2)},
              folder / "comfy.safetensors")
    model = Anima(tiny_config())
    model.load_state_dict(sd)
    with pytest.MonkeyPatch.context() as mp:
        no_torchvision(mp)
        transformer, conditioner = diffusers_pair(model)
    transformer.save_pretrained(folder / "pipeline" / "transformer", max_shard_size="200KB")
    conditioner.save_pretrained(folder / "pipeline" / "text_conditioner")
    return {"released": released, "comfy": str(folder / "comfy.safetensors"), "diffusers": str(folder / "pipeline"),
            "transformer": str(folder / "pipeline" / "transformer")}


def test_every_layout_loads_the_same_model(files):
    models = [load_anima(files[kind]) for kind in ("released", "comfy", "diffusers", "transformer")]
    assert all(m.config == tiny_config() for m in models)
    weights = [m.state_dict() for m in models]
    assert all(w.keys() == weights[0].keys() and all(torch.equal(w[k], weights[0][k]) for k in w) for w in weights)
    x = inputs(tiny_config(), 2, 3)
    with torch.no_grad():
        outs = [m(**x) for m in models]
    assert all(torch.equal(o, outs[0]) for o in outs)
    meta = load_anima(files["released"], dtype=torch.bfloat16, read_weights=False)
    assert meta.compute_dtype == torch.bfloat16 and next(meta.parameters()).device.type == "meta"


def test_our_saves_reload(files, tmp_path, monkeypatch):
    no_torchvision(monkeypatch)
    model = load_anima(files["released"])
    save_anima_diffusers(model, None, str(tmp_path / "pipeline"))
    transformer = CosmosTransformer3DModel.from_pretrained(str(tmp_path / "pipeline" / "transformer"))
    conditioner = AnimaTextConditioner.from_pretrained(str(tmp_path / "pipeline" / "text_conditioner"))
    for attention in (m for m in transformer.modules() if getattr(m, "norm_q", None) is not None):
        attention.norm_q.eps = attention.norm_k.eps = 1e-6
    x = inputs(tiny_config(), 2, 3)
    with torch.no_grad():
        assert (model(**x) - diffusers_forward(transformer, conditioner, x)).abs().max().item() <= 1e-5
    odd = AnimaConfig(**TINY, rope_extrapolation=(1.0, 3.0, 3.0))  # not what the shapes say: the metadata keeps it
    save_anima_single_file(random_model(odd), str(tmp_path / "odd.safetensors"))
    assert load_anima(str(tmp_path / "odd.safetensors")).config == odd
    sized = load_anima(write_sized_anima(str(tmp_path), 256, 3, seed=0), read_weights=False)
    assert (sized.config.hidden_size, sized.config.num_heads, sized.config.num_blocks) == (256, 2, 3)


def test_wrong_files_are_one_error_naming_the_key(files, tmp_path):
    sd = load_file(files["released"])
    save_file({k: v for k, v in sd.items() if k != "net.blocks.1.cross_attn.v_proj.weight"}, tmp_path / "a.safetensors")
    with pytest.raises(CheckpointError, match=r"a.safetensors: missing keys: blocks.1.cross_attn.v_proj.weight"):
        load_anima(str(tmp_path / "a.safetensors"))
    save_file({k: v for k, v in sd.items() if "llm_adapter" not in k}, tmp_path / "dit.safetensors")
    with pytest.raises(CheckpointError, match=r"dit.safetensors: not an Anima checkpoint \(no key "
                                              r"'llm_adapter.embed.weight'"):
        load_anima(str(tmp_path / "dit.safetensors"))
    save_file({**sd, "net.blocks.0.extra.weight": torch.ones(1)}, tmp_path / "b.safetensors")
    with pytest.raises(CheckpointError, match=r"b.safetensors: unexpected key 'blocks.0.extra.weight'"):
        load_anima(str(tmp_path / "b.safetensors"))


def test_checkpointing_gives_the_same_gradients():
    """Gradient checkpointing through core.run_block (the DiT's and the adapter's blocks): the same gradients for
    every parameter (measured 1.2e-7: the recompute's rounding order) as the plain backward."""
    config = AnimaConfig(**TINY)
    model = random_model(config).train()
    x = inputs(config, 3, 4)
    plain, checkpointed = checkpointing_gradients(model, x)
    assert plain.keys() == checkpointed.keys() and all(g.abs().max() > 0 for g in plain.values())
    assert max((plain[k] - checkpointed[k]).abs().max().item() for k in plain) <= 1e-6
