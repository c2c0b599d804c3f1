"""Every family's tiny transformer computes on CUDA what it computes on the CPU: the same file loaded in float32
(TF32 off) and as an fp8_scaled base (the same codes, dequantized to float32), the same random inputs, one forward.
A kernel that reads a layout wrong on CUDA only (a packed expert's scale blocks, a grouped-query attention mask,
RoPE tables built on the device) shows here as an error far above float32's rounding. Skipped without CUDA: run on a
lent GPU by `bash bench/gpu_session.sh families`.

Bound: 1e-4 of the output's largest value. float32 kernels of the two devices sum in other orders (~1e-6 relative at
these widths); a mixture's expert choice (Nucleus-Image) is a top-k of float32 scores, and random inputs leave no
near-tie at that precision."""

import pytest
import torch

from library.models.registry import arch_specs
from tests.test_family_spec import DIFFUSION_ARCHS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
BOUND = 1e-4
# Tiny files that are pre-quantized (Ideogram 4's ships in BFL's nvfp4): they load as stored, not as an fp8 base
AS_STORED = {"ideogram4"}


def forward(path: str, arch: str, mode: str, device: str) -> torch.Tensor:
    """The tiny transformer at `path` loaded as `mode` on `device` (float32 weights and compute), one forward of
    the doctor's random inputs (seed 0) at sigma 0.5; the output on the CPU."""
    from tools import precision_doctor as doctor

    model = doctor.disk_variant(path, arch, mode, device=device, dtype=torch.float32)
    inputs = doctor.make_inputs(arch, model.config, 64, 48, seed=0, text_len=8, device=device)
    with torch.no_grad():
        return model(**inputs.make_kwargs(0.5)).float().cpu()


def relative_error(arch: str, mode: str, tiny_set, device: str = "cuda") -> float:
    path = tiny_set[arch_specs()[arch].tiny.transformer]
    reference = forward(path, arch, mode, "cpu")
    return ((forward(path, arch, mode, device) - reference).abs().max() / reference.abs().max()).item()


@pytest.fixture
def no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.mark.parametrize("mode", ("fp32", "fp8_scaled"))
@pytest.mark.parametrize("arch", DIFFUSION_ARCHS)
def test_the_tiny_transformer_on_cuda_computes_what_it_computes_on_the_cpu(arch, mode, tiny_set, no_tf32):
    if mode != "fp32" and arch in AS_STORED:
        pytest.skip(f"{arch}'s tiny file is pre-quantized: it loads as stored")
    assert relative_error(arch, mode, tiny_set) < BOUND
