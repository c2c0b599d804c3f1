"""HiDream-O1-Image's transformer (library/models/hidream_o1/model.py) against installed transformers'
Qwen3VLTextModel plus the three generation modules as musubi-tuner's _forward_generation runs them (the oracle below:
its own sinusoid, positions and 4D mask), on the same random weights; the LLM core's two-pass attention and its
M-RoPE tables; the released size on meta; every file layout (checkpoint.py).

Tolerance, stated once: transformers computes RoPE angles in float32, ours in float64 (shared/DESIGN.md); at the
image's positions past 4096 the cos tables differ by up to 4.6e-5 here, which moves the tiny model's output by
2.3e-6 / 2.8e-6 of its largest value (square / 3 x 5 grid, measured). With transformers' own tables put in ours, what
is left is float32 summation order: 2.4e-7 / 2.7e-7 of it (measured)."""

import json
import math
import time

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLTextConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextModel

from library.io import CheckpointError
from library.models import core, llm
from library.models.hidream_o1 import model as M
from library.models.hidream_o1.checkpoint import config_from_shapes, load_hidream_o1, save_hidream_o1_single_file, \
    skipped_keys
from library.models.hidream_o1.model import HIDREAM_O1, HiDreamO1, HiDreamO1Config
from library.models.hidream_o1.tiny import VISUAL, tiny_config, write_tiny_hidream_o1
from library.models.llm_config import LLMConfig
from tests.model_checks import checkpointing_gradients, randomized

# 2 layers of width 64: 4 query / 2 key-value heads of 16, M-RoPE sections (2, 3, 3) (the width axis' third band
# falls past the head's 8 frequencies: the interleave's cut-off is exercised), a 300-token vocabulary, tms = 299
TMS = 299
TINY = HiDreamO1Config(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
                       mrope_section=(2, 3, 3), vocab_size=300, tms_token_id=TMS, bottleneck_dim=16)
LENGTHS = (9, 6)  # two captions of different lengths, the second padded by 3


def text_config(cfg: HiDreamO1Config) -> Qwen3VLTextConfig:
    """transformers' Qwen3VLTextConfig of a HiDreamO1Config's language model."""
    config = Qwen3VLTextConfig(
        hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        vocab_size=cfg.vocab_size, rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=262144,
        rope_parameters=dict(rope_type="default", rope_theta=cfg.rope_theta, mrope_section=list(cfg.mrope_section),
                             mrope_interleaved=True))
    config._attn_implementation = "sdpa"
    return config


def transformers_text_model(ours: HiDreamO1) -> Qwen3VLTextModel:
    """transformers' Qwen3VLTextModel of ours' config holding ours' language model weights (a strict load)."""
    ref = Qwen3VLTextModel(text_config(ours.config))
    prefix = "model.language_model."
    ref.load_state_dict({k[len(prefix):]: v for k, v in ours.state_dict().items() if k.startswith(prefix)})
    return ref.eval()


def oracle_positions(text_len: int, h: int, w: int) -> torch.Tensor:
    """int64 [3, L]: musubi's get_rope_index_fix_point for text-to-image: the text 0..T-1, patch (r, c) at (4096,
    4096 + r, 4096 + c) (its table for T = 5 and a 2 x 3 grid is pinned in test_positions_are_musubis_table)."""
    r, c = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    text = torch.arange(text_len)
    return torch.stack([torch.cat([text, torch.full((h * w,), 4096)]), torch.cat([text, 4096 + r.flatten()]),
                        torch.cat([text, 4096 + c.flatten()])])


def oracle_mask(lengths, text_len: int, image_tokens: int) -> torch.Tensor:
    """bool [B, 1, L, L]: musubi's 4D mask: causal, the gen rows (tms, every image token) see all, pad columns
    hidden from every row."""
    length = text_len + image_tokens
    masks = []
    for n in lengths:
        allowed = torch.ones(length, length, dtype=torch.bool).tril()
        allowed[n - 1] = True
        allowed[text_len:] = True
        allowed[:, n:text_len] = False
        masks.append(allowed)
    return torch.stack(masks)[:, None]


def oracle(ref: Qwen3VLTextModel, ours: HiDreamO1, img, ids, lengths, sigmas, h, w) -> torch.Tensor:
    """transformers' text model and ours' three modules as musubi's _forward_generation runs them: t = 1 - sigma,
    the sinusoid of 1000 t (cos first), the tms embedding replaced, the patches appended, x0 at the image."""
    inner, text_len = ours.model, ids.shape[1]
    t = (1 - sigmas).float()
    freqs = torch.exp(-math.log(10000) * torch.arange(128, dtype=torch.float32) / 128)
    args = (t * 1000)[:, None] * freqs[None]
    t_emb = inner.t_embedder1.mlp(torch.cat([torch.cos(args), torch.sin(args)], dim=-1))
    embedded = torch.where((ids == TMS)[..., None], t_emb[:, None], ref.embed_tokens(ids))
    x = torch.cat([embedded, inner.x_embedder.proj2(inner.x_embedder.proj1(img))], dim=1)
    positions = oracle_positions(text_len, h, w)[:, None].expand(3, len(ids), -1)
    out = ref(inputs_embeds=x, attention_mask=oracle_mask(lengths, text_len, h * w), position_ids=positions)
    return inner.final_layer2(out.last_hidden_state[:, text_len:])


def inputs(h: int, w: int, seed: int = 0):
    """(patches [2, h*w, 3072], ids [2, 9] right-padded with zeros, lengths LENGTHS, two sigmas)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, TMS, (2, max(LENGTHS)), generator=g)
    for row, n in enumerate(LENGTHS):
        ids[row, n - 1], ids[row, n:] = TMS, 0
    return torch.randn(2, h * w, 3072, generator=g), ids, torch.tensor(LENGTHS), torch.tensor([0.37, 0.81])


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("grid", [(4, 4), (3, 5)])
def test_matches_transformers_fp32(grid, monkeypatch):
    """A batch of 2 captions of different lengths (one padded) at a square and a 3 x 5 grid: within 1e-5 of the
    output's largest value (measured 2.3e-6 and 2.8e-6: the float64 RoPE angles); with transformers' float32 tables in
    ours, within 1e-6 (measured 2.4e-7 and 2.7e-7)."""
    h, w = grid
    ours = randomized(HiDreamO1(TINY), 1)
    ref = transformers_text_model(ours)
    img, ids, lengths, sigmas = inputs(h, w)
    with torch.no_grad():
        want = oracle(ref, ours, img, ids, lengths, sigmas, h, w)
        got = ours(img, ids, lengths, sigmas, h, w)

        def transformers_tables(config, position_ids):  # [B, L, head_dim] with the halves repeated
            cos, sin = ref.rotary_emb(img, position_ids.permute(2, 0, 1).expand(3, len(ids), -1))
            return cos[..., : config.head_dim // 2], sin[..., : config.head_dim // 2]

        monkeypatch.setattr(llm, "mrope_tables_per_axis", transformers_tables)
        with_their_tables = ours(img, ids, lengths, sigmas, h, w)
    ours_diff, rest = relative(got, want), relative(with_their_tables, want)
    print(f"{h}x{w}: ours vs transformers {ours_diff:.1e}, with its float32 tables {rest:.1e} of the output's max")
    assert got.dtype == torch.float32 and got.shape == (2, h * w, 3072)
    assert ours_diff <= 1e-5 and rest <= 1e-6


def test_a_batch_equals_each_row_alone():
    """Each row of the padded batch predicts what it predicts alone, without pads (measured 3.0e-7 of the output's
    max: the key-masked kernel against the unmasked one; 9.5e-7 to 1.01e-6 on an AMX Xeon, 2026-12-05)."""
    ours = randomized(HiDreamO1(TINY), 2)
    img, ids, lengths, sigmas = inputs(3, 5, seed=1)
    with torch.no_grad():
        batched = ours(img, ids, lengths, sigmas, 3, 5)
        alone = torch.cat([ours(img[b:b + 1], ids[b:b + 1, :n], lengths[b:b + 1], sigmas[b:b + 1], 3, 5)
                           for b, n in enumerate(LENGTHS)])
    diff = relative(batched, alone)
    print(f"batched vs alone: {diff:.1e}")
    assert diff <= 3e-6


def test_two_passes_equal_the_dense_mask(monkeypatch):
    """The forward's two-pass attention (CausalThenFull) against the same layout as one boolean 4D mask through the
    same layers: equal to float32 summation order (measured 3.5e-7 of the output's max)."""
    ours = randomized(HiDreamO1(TINY), 3)
    img, ids, lengths, sigmas = inputs(4, 4, seed=2)
    with torch.no_grad():
        two_pass = ours(img, ids, lengths, sigmas, 4, 4)
        layout = M.generation_attention
        monkeypatch.setattr(M, "generation_attention", lambda *a: layout(*a).dense(a[1] + a[2]))
        dense = ours(img, ids, lengths, sigmas, 4, 4)
    assert relative(two_pass, dense) <= 1e-6


def test_attention_layout_is_musubis_mask():
    """CausalThenFull.dense of two captions (5 and 3 of 5 text tokens) and 4 image tokens is musubi's 4D mask on
    every row that is no pad (a pad row's output is never read, and no row reads a pad key)."""
    layout = M.generation_attention(torch.tensor([5, 3]), 5, 4)
    dense, want = layout.dense(9), oracle_mask((5, 3), 5, 4)
    assert layout.first_full == 2 and layout.key_mask[1].tolist() == [1, 1, 1, 0, 0, 1, 1, 1, 1]
    assert torch.equal(dense[0], want[0]) and torch.equal(dense[1, :, [0, 1, 2, 5, 6, 7, 8]],
                                                          want[1, :, [0, 1, 2, 5, 6, 7, 8]])
    equal_lengths = M.generation_attention(torch.tensor([5, 5]), 5, 4)
    assert equal_lengths.key_mask is None and equal_lengths.first_full == 4  # no pads: the flash-eligible passes
    with pytest.raises(ValueError, match="text_lengths"):
        M.generation_attention(torch.tensor([6]), 5, 4)


def test_positions_are_musubis_table():
    """The run of musubi's get_rope_index_fix_point on 5 text tokens and a 2 x 3 grid (rows t, h, w)."""
    want = [[0, 1, 2, 3, 4] + [4096] * 6, [0, 1, 2, 3, 4] + [4096] * 3 + [4097] * 3,
            [0, 1, 2, 3, 4] + [4096, 4097, 4098] * 2]
    positions = M.sequence_positions(5, 2, 3)
    assert positions.dtype == torch.int64 and positions[0].T.tolist() == want
    assert torch.equal(positions[0].T, oracle_positions(5, 2, 3))


@pytest.mark.parametrize("sections, interleaved", [((24, 20, 20), True), ((2, 3, 3), True), ((16, 24, 24), False)])
def test_mrope_tables_per_axis_are_core_mrope_tables(sections, interleaved):
    """The tables through core.rope_tables (what the precision doctor audits) are core.mrope_tables' bit for bit."""
    head_dim = 2 * sum(sections)
    config = llm.LLMConfig(hidden_size=64, num_heads=1, num_kv_heads=1, head_dim=head_dim, rope_theta=5e6,
                           mrope_section=sections, mrope_interleaved=interleaved)
    ids = M.sequence_positions(7, 5, 9)
    cos, sin = llm.mrope_tables_per_axis(config, ids)
    want = core.mrope_tables(ids, head_dim, 5e6, sections, interleaved)
    assert torch.equal(cos, want[0]) and torch.equal(sin, want[1])


def test_gradient_checkpointing_gives_the_plain_gradients():
    """Every parameter's gradient through the padded batch, with and without checkpointing (measured 0.0)."""
    ours = randomized(HiDreamO1(TINY), 4).train()
    img, ids, lengths, sigmas = inputs(3, 4, seed=3)
    plain, checkpointed = checkpointing_gradients(
        ours, dict(img=img, input_ids=ids, text_lengths=lengths, timesteps=sigmas, h=3, w=4))
    assert plain.keys() == checkpointed.keys()
    assert all(g.abs().max() > 0 for k, g in plain.items() if "embed_tokens" not in k)
    diff = max((plain[k] - checkpointed[k]).abs().max().item() for k in plain)
    print(f"checkpointing: max gradient diff {diff:.2e}")
    assert diff <= 1e-6


def test_released_config_on_meta():
    """HiDream-O1-Image (Full / Dev): 7,606,169,600 parameters run in text-to-image (the language model
    7,568,405,504 = transformers' Qwen3VLTextModel at the released config, and 37,764,096 in the three generation
    modules), its keys the released file's."""
    with torch.device("meta"):
        ours = HiDreamO1(HIDREAM_O1)
        lm = Qwen3VLTextModel(text_config(HIDREAM_O1))
    n = sum(p.numel() for p in ours.parameters())
    language = sum(p.numel() for p in ours.model.language_model.parameters())
    assert n == 7_606_169_600 and language == sum(p.numel() for p in lm.parameters()) == 7_568_405_504
    assert {k for k in ours.state_dict() if k.startswith("model.language_model.")} == \
        {"model.language_model." + k for k in lm.state_dict()}
    assert len(ours.swappable_blocks()) == 36 and HIDREAM_O1.token_width == 3072
    assert ours.model.x_embedder.proj1.weight.shape == (1024, 3072) and ours.model.x_embedder.proj1.bias is None


def test_random_inputs_name_the_positions_rope_tables_gets():
    """random_inputs (the precision doctor's conditioning) drives the model, and its expected positions are what
    core.rope_tables receives: the doctor's audit finds no position changed and the float64 tables."""
    from library.models import precision_doctor as doctor

    conditioning = M.random_inputs(TINY, 3, 4, 6, torch.Generator().manual_seed(0))
    audit = doctor.PositionAudit(conditioning.positions, conditioning.axes_dim, conditioning.theta)
    model = randomized(HiDreamO1(TINY), 1)
    with torch.no_grad(), doctor.patched_rope_tables(audit.wrap):
        out = model(img=torch.randn(1, 12, 3072), timesteps=torch.tensor([0.5]), **conditioning.fixed)
    summary = audit.summary()
    assert out.shape == (1, 12, 3072) and summary["calls"] == 1 and summary["matches_inputs"]
    assert summary["positions_changed"] == 0 and summary["table_max_abs_diff"] < 1e-6
    assert conditioning.fixed["input_ids"][0].tolist().count(TMS) == 1


# ----------------------------------------------------------------------------------------------
# Files


def written_layouts(tmp_path, sd: dict, visual: dict) -> dict:
    """The tiny file's tensors in every layout: ComfyUI's bare names plain and behind its prefixes, musubi's
    "diffusion_model." before the released names, and an HF repo folder (two shards, index, lm_head, config.json)."""
    bare = {k.removeprefix("model."): v for k, v in {**sd, **visual}.items()}
    files = {"comfyui_bare": bare, "comfyui_full": {"model.diffusion_model." + k: v for k, v in bare.items()},
             "lora_style": {"diffusion_model." + k: v for k, v in bare.items()},
             "musubi": {"diffusion_model." + k: v for k, v in {**sd, **visual}.items()}}
    layouts = {}
    for name, tensors in files.items():
        save_file(tensors, str(tmp_path / f"{name}.safetensors"))
        layouts[name] = tmp_path / f"{name}.safetensors"
    folder = tmp_path / "hf"
    folder.mkdir()
    embed = sd["model.language_model.embed_tokens.weight"]
    tensors = {**sd, **visual, "lm_head.weight": torch.zeros_like(embed)}
    keys = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for name, part in shards.items():
        save_file({k: tensors[k] for k in part}, str(folder / name))
    index = {"weight_map": {k: name for name, part in shards.items() for k in part}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    hf_config = {"architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl",
                 "text_config": text_config(tiny_config()).to_dict()}
    (folder / "config.json").write_text(json.dumps(hf_config))
    layouts["hf"] = folder
    return layouts


def test_every_layout_loads_the_same_weights(tmp_path):
    """The tiny writer's file (Comfy-Org's `model.*` names, bf16, tiny `model.visual.*` tensors, our config in the
    metadata), ComfyUI's bare names plain / under "model.diffusion_model." / "diffusion_model.", musubi's
    "diffusion_model." + released names and a sharded HF folder: the same tensors, the vision tower and lm_head never
    read. A file without our metadata whose vocabulary lacks the released tms id asks for its config."""
    path = write_tiny_hidream_o1(str(tmp_path), seed=0)["hidream_o1"]
    want = load_hidream_o1(path)
    assert want.config == tiny_config() and sorted(skipped_keys(path)) == sorted(VISUAL)
    sd = {k: v for k, v in load_file(path).items() if not k.startswith("model.visual.")}
    assert sd.keys() == want.state_dict().keys()
    visual = {k: v for k, v in load_file(path).items() if k.startswith("model.visual.")}
    for name, where in written_layouts(tmp_path, sd, visual).items():
        with pytest.raises(CheckpointError, match="tms_token_id 151673 lies outside the vocabulary"):
            load_hidream_o1(str(where))  # no metadata: the released tms id, which this vocabulary lacks
        got = load_hidream_o1(str(where), config=want.config)
        assert all(torch.equal(got.state_dict()[k], v) for k, v in want.state_dict().items()), name
    meta = load_hidream_o1(path, torch.bfloat16, read_weights=False)
    assert meta.compute_dtype == torch.bfloat16 and next(meta.parameters()).device.type == "meta"


def test_the_config_from_shapes_and_config_json():
    """The released sizes from the shapes alone; eps, theta and the M-RoPE sections from an HF config.json."""
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in HiDreamO1(HIDREAM_O1).state_dict().items()}
    assert config_from_shapes(shapes) == HIDREAM_O1
    text = dict(model_type="qwen3_vl_text", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
                rope_scaling=dict(rope_type="default", mrope_section=[16, 24, 24], mrope_interleaved=True),
                rope_theta=1e6)
    got = config_from_shapes(shapes, hf_config=LLMConfig.from_hf({"model_type": "qwen3_vl", "text_config": text}))
    assert (got.rope_theta, got.rms_norm_eps, got.mrope_section) == (1e6, 1e-5, (16, 24, 24))


def test_other_families_files_are_refused_in_one_line(tmp_path):
    """A FLUX.1 single file and a Qwen3-VL language model's own file (its `model.language_model.*` without the
    generation modules): one CheckpointError each naming the key; a diffusers folder's config.json likewise."""
    files = {"flux1": {"double_blocks.0.img_attn.qkv.weight": torch.zeros(6, 2), "img_in.weight": torch.zeros(2, 64)},
             "qwen3_vl": {"model.language_model.embed_tokens.weight": torch.zeros(4, 2),
                          "lm_head.weight": torch.zeros(4, 2)}}
    for name, tensors in files.items():
        save_file(tensors, str(tmp_path / f"{name}.safetensors"))
        with pytest.raises(CheckpointError, match=r"not a HiDream-O1-Image transformer \(no key "
                                                  r"'final_layer2.linear.bias', plain or under model. / ") as e:
            load_hidream_o1(str(tmp_path / f"{name}.safetensors"))
        assert "\n" not in str(e.value)
    folder = tmp_path / "flux_diffusers"
    folder.mkdir()
    (folder / "config.json").write_text('{"_class_name": "FluxTransformer2DModel"}')
    save_file({"x_embedder.weight": torch.zeros(2, 64)}, str(folder / "diffusion_pytorch_model.safetensors"))
    with pytest.raises(CheckpointError, match="a config of FluxTransformer2DModel, expected HiDream-O1-Image's"):
        load_hidream_o1(str(folder))


FP8_KEEP = (r"model\.(x_embedder\.proj[12]|t_embedder1\.mlp\.[02]|final_layer2\.linear)",)


def test_prequantized_files_load_as_stored(tmp_path):
    """ComfyUI's scaled fp8 (`scaled_fp8` marker, e4m3 Linear weights with a float32 scale_weight) in Comfy-Org's
    names and in ComfyUI's bare names behind "diffusion_model." (its scales found under our module names all the
    same), and a plain e4m3 file: loaded as stored with keep rules for the generation modules, each computes as the
    float32 model of its dequantized tensors (measured 0.0)."""
    from library.models.spec import FP8Rules
    from library.precision.fp8 import FP8Linear

    rules = FP8Rules(keep=FP8_KEEP)
    e4m3 = torch.float8_e4m3fn
    sd = {k: v.float() for k, v in load_file(write_tiny_hidream_o1(str(tmp_path), seed=0)["hidream_o1"]).items()}
    scaled, dequantized = {"scaled_fp8": torch.empty(0, dtype=e4m3)}, {}
    for key, w in sd.items():
        if w.dim() == 2 and ".embed_tokens." not in key:
            scale = w.abs().max() / 448
            scaled[key], scaled[key[: -len("weight")] + "scale_weight"] = (w / scale).to(e4m3), scale
            dequantized[key] = scaled[key].float() * scale
        else:
            scaled[key] = dequantized[key] = w
    bare = {"diffusion_model." + k.removeprefix("model."): v for k, v in scaled.items()}  # the marker under it too
    plain = {k: v.to(e4m3) for k, v in sd.items()}
    img, ids, lengths, sigmas = inputs(2, 3)
    ids = ids.masked_fill(ids == TMS, tiny_config().tms_token_id)
    for name, stored, twin_sd in (("scaled", scaled, dequantized), ("bare", bare, dequantized), ("plain", plain, None)):
        save_file(stored, str(tmp_path / f"{name}.safetensors"))
        loaded = load_hidream_o1(str(tmp_path / f"{name}.safetensors"), fp8_rules=rules, config=tiny_config())
        twin = HiDreamO1(tiny_config())
        twin_sd = twin_sd or {k: v.float() for k, v in stored.items()}
        twin.load_state_dict({k: v for k, v in twin_sd.items() if not k.startswith("model.visual.") and "." in k})
        quantized = [n for n, m in loaded.named_modules() if isinstance(m, FP8Linear)]
        assert "model.language_model.layers.1.mlp.down_proj" in quantized, name
        assert "model.final_layer2.linear" not in quantized and "model.x_embedder.proj1" not in quantized, name
        with torch.no_grad():
            got, want = loaded(img, ids, lengths, sigmas, 2, 3), twin.eval()(img, ids, lengths, sigmas, 2, 3)
        assert torch.equal(got, want), name


def test_fp8_while_loading(tmp_path):
    """A `prepare` hook quantizing while loading (fp8_scaled: the family's fp8_prepare with these keep rules): the
    decoder Linears become FP8Linear, the generation modules stay bf16, and the output stays near the bf16 model's
    (measured 3.1e-2 of its norm)."""
    from library.models.spec import FP8Rules
    from library.precision.fp8 import FP8Linear, fp8_load_converter, prepare_fp8

    path = write_tiny_hidream_o1(str(tmp_path), seed=0)["hidream_o1"]
    rules = FP8Rules(keep=FP8_KEEP)
    loaded = load_hidream_o1(path, torch.bfloat16,
                             prepare=lambda m: fp8_load_converter(prepare_fp8(m, "fp8_scaled", rules)))
    base = load_hidream_o1(path, torch.bfloat16)
    quantized = {n for n, m in loaded.named_modules() if isinstance(m, FP8Linear)}
    assert len(quantized) == 2 * 7 and all(".layers." in n for n in quantized)
    img, ids, lengths, sigmas = inputs(2, 3)
    ids = ids.masked_fill(ids == TMS, tiny_config().tms_token_id)
    with torch.no_grad():
        got, want = loaded(img, ids, lengths, sigmas, 2, 3), base(img, ids, lengths, sigmas, 2, 3)
    error = ((got - want).norm() / want.norm()).item()
    print(f"fp8_scaled vs bf16: {error:.2e} of the output's norm")
    assert got.dtype == torch.float32 and error <= 0.05


def test_the_tiny_file_runs_quickly():
    """The tiny transformer at 32 x 32 patches (1024 px, 1024 image tokens) with a 64-token caption: under a second on
    the CPU (the suite's budget)."""
    from library.models.hidream_o1.tiny import random_hidream_o1

    torch.manual_seed(0)
    config = tiny_config()
    model = random_hidream_o1(config).eval()
    ids = torch.randint(0, config.tms_token_id, (1, 64))
    ids[:, -1] = config.tms_token_id
    start = time.perf_counter()
    with torch.no_grad():
        out = model(torch.randn(1, 1024, 3072), ids, torch.tensor([64]), torch.tensor([0.3]), 32, 32)
    assert out.shape == (1, 1024, 3072) and torch.isfinite(out).all() and time.perf_counter() - start < 1.0
