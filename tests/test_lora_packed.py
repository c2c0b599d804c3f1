"""A LoRA of a packed weight (networks/lora_packed.py): W [E, K, N] used as x @ W[e], one rank-r delta per expert in
PEFT's ParamWrapper layout, added inside PackedWeights.packed_bmm. Its delta is PEFT's own (get_delta_weight on the
same factors), its forward is the base with every expert's delta merged (fp32, bf16, fp8- and nf4 / int8-stored
bases, one chunk of experts or several), gradients reach its two factors only, and the network's controls
(multiplier, enabled, remove, the max-norm) act on it as on a Linear's LoRA."""

import math

import pytest
import torch
import torch.nn as nn

from library.precision import fp8_packed
from library.precision.fp8_packed import PackedWeights
from networks.lora_files import merge_into_weight
from networks.lora_packed import PackedLoRAModule, PackedTarget, packed_targets

E, K, N, R, ALPHA = 4, 64, 48, 3, 1.5  # K a multiple of 64: fp8_scaled's blocks run along it


class Experts(PackedWeights):
    """One packed weight run as SwiGLUExperts runs its own: by chunks of experts, through packed_bmm."""

    packed_weights = ("w",)

    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = nn.Parameter(torch.randn(E, K, N, generator=g) / math.sqrt(K))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.packed_bmm(x[c], "w", c) for c in self.expert_chunks(x.dtype)])


def lora_on(experts: Experts, seed: int = 1, **kwargs) -> PackedLoRAModule:
    """rank 3, alpha 1.5, both factors random (up too: a zero up would hide a wrong layout)."""
    lora = PackedLoRAModule("experts.w", PackedTarget(experts, "w"), R, ALPHA, **kwargs)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        lora.lora_up.weight.copy_(torch.randn(lora.lora_up.weight.shape, generator=g) * 0.3)
    return lora


def tokens(dtype=torch.float32, seed: int = 2) -> torch.Tensor:
    return torch.randn(E, 7, K, generator=torch.Generator().manual_seed(seed)).to(dtype)


def peft_delta(lora: PackedLoRAModule) -> torch.Tensor:
    """PEFT's ParamWrapper on the same weight ([E, K, N], no is_transposed) and our factors: get_delta_weight."""
    from peft import LoraConfig, inject_adapter_in_model

    holder = nn.Module()
    holder.experts = Experts()
    config = LoraConfig(r=R, lora_alpha=ALPHA, target_modules=[], target_parameters=["experts.w"])
    wrapper = inject_adapter_in_model(config, holder).experts
    with torch.no_grad():
        wrapper.lora_A["default"].weight.copy_(lora.lora_down.weight)
        wrapper.lora_B["default"].weight.copy_(lora.lora_up.weight)
    return wrapper.get_delta_weight("default").detach()


def test_the_factors_are_peft_param_wrappers_and_its_delta_is_peft_s():
    experts = Experts()
    lora = lora_on(experts)
    state = lora.state_dict()
    assert {k: tuple(v.shape) for k, v in state.items()} == {"lora_down.weight": (R * E, N),
                                                           "lora_up.weight": (K, R * E), "alpha": ()}
    assert (lora.rank, lora.experts, lora.scale) == (R, E, ALPHA / R)
    want = peft_delta(lora)
    weights = lora.weights()
    assert (weights.rank, weights.shape) == (R, (E, K, N))
    assert (weights.delta() - want).abs().max() <= 1e-6 * want.abs().max()
    merged = merge_into_weight(experts.w.detach(), [(0.5, weights)])
    assert (merged - (experts.w.detach() + 0.5 * want)).abs().max() <= 1e-6
    assert abs(lora.delta_norm() - want.norm().item()) <= 1e-5 * want.norm().item()


def test_forward_is_the_base_with_each_experts_delta_merged_fp32():
    experts = Experts()
    lora = lora_on(experts)
    x = tokens()
    base = experts(x).detach()
    lora.apply_to_base()
    got = experts(x).detach()
    want = torch.bmm(x, experts.w.detach() + peft_delta(lora))
    print(f"packed LoRA fp32 vs merged weight: {(got - want).abs().max().item():.2e}, effect "
          f"{(got - base).abs().max().item():.3f}")
    assert (got - want).abs().max() <= 2e-6 * want.abs().max() and (got - base).abs().max() > 0.1


@pytest.mark.parametrize("storage", ["bf16", "fp8", "fp8_scaled", "fp8_tensor_scaled", "nf4", "nf4_dq", "int8"])
def test_bf16_and_quantized_experts_take_the_lora_unchanged(storage, monkeypatch):
    """The base weight as stored (bf16, or fp8 / nf4 / int8 codes and statistics run by chunks of experts: a chunk of
    one expert here; nf4's codes are [E, K N / 2], the LoRA reads E, K, N from packed_shape), its LoRA on top: the
    output is the stored weight's plus x @ delta, the delta in float32 (fp32 compute)."""
    monkeypatch.setattr(fp8_packed, "DEQUANTIZED_CHUNK_BYTES", K * N * 4)  # one expert per chunk
    experts = Experts()
    if storage == "bf16":
        experts.w.data = experts.w.data.to(torch.bfloat16)
    else:
        experts.quantize_packed("w", storage)
        assert len(experts.expert_chunks(torch.float32)) == E
    lora = lora_on(experts)
    x = tokens()
    base = experts(x).detach()
    stored = PackedTarget(experts, "w").dequantized_weight(torch.float32)
    assert (base - torch.bmm(x, stored)).abs().max() <= 1e-5
    lora.apply_to_base()
    got = experts(x).detach()
    want = torch.bmm(x, stored + peft_delta(lora))
    assert got.dtype == torch.float32 and (got - want).abs().max() <= 2e-6 * want.abs().max(), storage


def test_gradients_reach_the_two_factors_only_as_through_the_merged_weight():
    experts = Experts().requires_grad_(False)
    lora = lora_on(experts)
    lora.apply_to_base()
    x = tokens()
    experts(x).square().mean().backward()
    assert experts.w.grad is None
    grads = {n: p.grad.clone() for n, p in lora.named_parameters()}
    assert set(grads) == {"lora_down.weight", "lora_up.weight"} and all(g.abs().max() > 0 for g in grads.values())
    # the same loss through W + delta built from the factors by PEFT's own formula ("o r e, e r i -> e o i")
    down, up = (p.detach().clone().requires_grad_(True) for p in (lora.lora_down.weight, lora.lora_up.weight))
    delta = torch.einsum("ore,eri->eoi", up.reshape(K, R, E), down.reshape(E, R, N)) * (ALPHA / R)
    torch.bmm(x, experts.w + delta).square().mean().backward()
    for name, reference in (("lora_down.weight", down.grad), ("lora_up.weight", up.grad)):
        assert (grads[name] - reference).abs().max() <= 1e-6 * reference.abs().max(), name


def test_the_factors_reach_bmm_dense_for_every_chunk():
    """The up factor's view of lora_up [K, r E] is [E, K, r] with strides (1, r E, E): CPU bmm runs that without
    BLAS, 5.5x slower at the released size (chunks of 12 of 64 experts, 128 tokens, K 2048, r 16: 18 ms against
    3.3 ms with the copy), which made the LoRA cost more than the experts' bf16 step. Both factors go dense."""
    lora = lora_on(Experts())
    for experts in (slice(None), slice(1, 3), 2):
        up, down = lora.expert_factors(experts)
        assert up.is_contiguous() and down.is_contiguous(), experts
        want = lora.lora_up.weight.view(K, R, E)[:, :, experts]  # up_e = up.view(K, r, E)[:, :, e] (PEFT's)
        assert torch.equal(up, want if isinstance(experts, int) else want.permute(2, 0, 1)), experts


def test_multiplier_enabled_and_remove_act_on_the_packed_delta():
    experts = Experts()
    lora = lora_on(experts)
    x = tokens()
    base = experts(x).detach()
    lora.apply_to_base()
    lora.apply_to_base()  # once only
    assert experts.packed_adapters["w"] == [lora]
    full = experts(x).detach() - base
    lora.multiplier = 0.5
    half = experts(x).detach() - base
    assert (half - 0.5 * full).abs().max() <= 1e-6
    lora.enabled = False
    assert torch.equal(experts(x), base)
    lora.enabled, lora.multiplier = True, 1.0
    lora.remove_from_base()
    assert experts.packed_adapters["w"] == [] and torch.equal(experts(x), base)


def test_dropouts_train_only_and_keep_the_expected_delta():
    """rank_dropout zeroes rank channels per token in train mode, the survivors scaled up: its mean over draws is the
    plain delta (eval mode, as the network puts its modules for samples)."""
    experts = Experts()
    lora = lora_on(experts, rank_dropout=0.5).eval()
    x = tokens()
    base = experts(x).detach()
    lora.apply_to_base()
    plain = experts(x).detach() - base
    lora.train()
    torch.manual_seed(0)
    draws = torch.stack([experts(x).detach() - base for _ in range(400)])
    assert (draws[0] - plain).abs().max() > 1e-3  # it does drop
    assert (draws.mean(0) - plain).abs().max() <= 0.15 * plain.abs().max()


def test_dora_is_refused_in_one_line():
    with pytest.raises(ValueError, match="packed weight of 4 experts: DoRA is not supported"):
        PackedLoRAModule("experts.w", PackedTarget(Experts(), "w"), R, dora=True)


def test_packed_targets_name_each_weight_by_its_parameter_path():
    holder = nn.Module()
    holder.block = nn.Module()
    holder.block.experts = Experts()
    (path, target), = packed_targets(holder)
    assert path == "block.experts.w" and path in dict(holder.named_parameters())
    assert (target.experts, target.out_features, target.in_features) == (E, K, N)  # PEFT's count: [out, in] = [K, N]


def test_a_merge_writes_the_packed_parameter_and_refuses_fp8_codes():
    experts = Experts()
    lora = lora_on(experts)
    x = tokens()
    lora.apply_to_base()
    want = experts(x).detach()
    lora.merge_into_base()
    assert experts.packed_adapters["w"] == [] and isinstance(experts.w, nn.Parameter)
    assert (experts(x) - want).abs().max() <= 2e-6 * want.abs().max()
    quantized = Experts()
    quantized.quantize_packed("w", "fp8_scaled")
    with pytest.raises(ValueError, match="merging into fp8 loses the delta"):
        lora_on(quantized).merge_into_base()
    nf4 = Experts()
    nf4.quantize_packed("w", "nf4")  # was: "The size of tensor a (1536) must match the size of tensor b (48)"
    with pytest.raises(ValueError, match=r"'experts.w': the base weight is stored as torch.uint8 codes \(nf4 / int8 / "
                                         r"GGUF\); a merge cannot write into them"):
        lora_on(nf4).merge_into_base()


def test_weights_of_a_packed_module_read_back_by_the_header_or_the_target():
    from networks.lora_files import PACKED_EXPERTS_KEY, kohya_state_dict, packed_experts_header, parse_lora
    from library.io import CheckpointError

    weights = {"block.experts.w": lora_on(Experts()).weights()}
    tensors = kohya_state_dict(weights)
    header = packed_experts_header(weights)
    assert header == {PACKED_EXPERTS_KEY: '{"block.experts.w": 4}'}
    for metadata, known in ((header, None), ({}, {"block.experts.w": E})):
        (read,) = parse_lora(tensors, metadata, ["block.experts.w"], experts=known)[0].values()
        assert (read.experts, read.rank, read.alpha) == (E, R, ALPHA)
    (plain,) = parse_lora(tensors, {}, ["block.experts.w"])[0].values()  # nothing says E: a Linear's of rank r E
    assert (plain.experts, plain.rank) == (None, R * E)
    with pytest.raises(CheckpointError, match="LoRA of 4 experts .* the weight it applies to has 8"):
        parse_lora(tensors, header, ["block.experts.w"], experts={"block.experts.w": 8})
    with pytest.raises(CheckpointError, match="not a multiple of 5"):
        parse_lora(tensors, {}, ["block.experts.w"], experts={"block.experts.w": 5})
