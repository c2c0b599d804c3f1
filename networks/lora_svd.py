"""Low-rank factorizations for the LoRA tools (resize, extract, combine): the SVD of a delta, the
rank to keep (fixed, or sd-scripts' dynamic rules), and how much of the delta that rank keeps.

All math is float32. A LoRA's delta is `scale * up @ down` (scale = alpha / rank); its SVD is
taken without forming the [out, in] product: with up = Qu Ru and down^T = Qd Rd (reduced QR),
up @ down = Qu (Ru Rd^T) Qd^T, so only the small [r, r] core is decomposed. This is exact (the
same singular values and vectors as torch.linalg.svd of the product, up to rounding) and costs
O((out + in) r^2) instead of O(out in min(out, in)).

Retained energy is the Frobenius fraction sqrt(sum_{i<k} S_i^2 / sum S_i^2) (sd-scripts'
"fro retained"); the relative error of the kept delta is the other part, ||D - D_k||_F / ||D||_F =
sqrt(sum_{i>=k} S_i^2 / sum S_i^2) (Eckart-Young: no rank-k matrix does better).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MIN_SV = 1e-6  # sd-scripts: a delta whose largest singular value is at most this is kept at rank 1
DYNAMIC_METHODS = ("sv_ratio", "sv_fro", "sv_cumulative")


@dataclass
class Spectrum:
    """SVD of a delta D [out, in] = U diag(S) Vh: U [out, k], S [k] (descending), Vh [k, in].
    `full` = min(out, in): the length of D's whole spectrum (the values past k are zero)."""

    U: torch.Tensor
    S: torch.Tensor
    Vh: torch.Tensor
    full: int
    total_sq: float | None = None  # ||D||_F^2 when S is only the top of the spectrum (randomized SVD)

    def _total(self) -> float:
        return float(self.S.double().pow(2).sum()) if self.total_sq is None else self.total_sq

    def padded(self) -> torch.Tensor:
        """S with the zero singular values appended, as torch.linalg.svd(D) would return it."""
        return torch.cat([self.S, self.S.new_zeros(max(0, self.full - len(self.S)))])

    def fro_retained(self, k: int) -> float:
        total = self._total()
        return min(1.0, (float(self.S[:k].double().pow(2).sum()) / total) ** 0.5) if total > 0 else 1.0

    def rel_error(self, k: int) -> float:
        """||D - D_k||_F / ||D||_F, from the dropped singular values (not 1 - fro: no cancellation)."""
        total = self._total()
        if self.total_sq is not None:  # only the top of the spectrum is known
            return max(0.0, 1 - self.fro_retained(k) ** 2) ** 0.5
        return (float(self.S[k:].double().pow(2).sum()) / total) ** 0.5 if total > 0 else 0.0

    def sum_retained(self, k: int) -> float:
        total = float(self.S.double().sum())
        return float(self.S[:k].double().sum()) / total if total > 0 else 1.0


def svd_of_product(up: torch.Tensor, down: torch.Tensor, device=None) -> Spectrum:
    """Exact SVD of up [out, r] @ down [r, in] through the QR of each factor (see module doc)."""
    up, down = up.to(device=device, dtype=torch.float32), down.to(device=device, dtype=torch.float32)
    qu, ru = torch.linalg.qr(up)  # [out, a], [a, r]
    qd, rd = torch.linalg.qr(down.T)  # [in, b], [b, r]
    u, s, vh = torch.linalg.svd(ru @ rd.T, full_matrices=False)  # the small core [a, b]
    return Spectrum((qu @ u).cpu(), s.cpu(), (vh @ qd.T).cpu(), min(up.shape[0], down.shape[1]))


def svd_of_matrix(delta: torch.Tensor, device=None) -> Spectrum:
    """SVD of a full delta [out, in] (extraction), computed in float32 on `device`."""
    u, s, vh = torch.linalg.svd(delta.to(device=device, dtype=torch.float32), full_matrices=False)
    return Spectrum(u.cpu(), s.cpu(), vh.cpu(), min(delta.shape))


def svd_lowrank_of_matrix(delta: torch.Tensor, rank: int, device=None, oversample: int = 8, niter: int = 4) -> Spectrum:
    """The top `rank` (+ oversample) singular triplets of `delta` by randomized SVD (Halko et al.,
    torch.svd_lowrank with `niter` power iterations; a fixed seed, so runs repeat). Exact when the
    delta's rank is at most rank + oversample; otherwise close to the best rank-k approximation when
    the spectrum decays. ||D||_F^2 is kept so the retained energy stays relative to the whole delta."""
    d = delta.to(device=device, dtype=torch.float32)
    q = min(rank + oversample, min(d.shape))
    with torch.random.fork_rng(devices=[d.device] if d.is_cuda else []):
        torch.manual_seed(0)
        u, s, v = torch.svd_lowrank(d, q=q, niter=niter)
    return Spectrum(u.cpu(), s.cpu(), v.T.contiguous().cpu(), min(d.shape), float(d.double().pow(2).sum()))


# ----------------------------------------------------------------------------------------------
# Choosing the rank: sd-scripts networks/resize_lora.py's definitions (index_sv_*, rank_resize),
# evaluated on the whole spectrum of length min(out, in) as sd-scripts' full SVD returns it.


def _clamp(index: int, length: int) -> int:
    return max(1, min(index, length - 1))


def index_sv_ratio(S: torch.Tensor, target: float) -> int:
    """How many singular values exceed S[0] / target (clamped to [1, len - 1])."""
    return _clamp(int((S > S[0] / target).sum()), len(S))


def index_sv_cumulative(S: torch.Tensor, target: float) -> int:
    """1 + the first index where the cumulative sum of S reaches `target` of the total."""
    cumulative = torch.cumsum(S.double(), 0) / float(S.double().sum())
    return _clamp(int(torch.searchsorted(cumulative, target)) + 1, len(S))


def index_sv_fro(S: torch.Tensor, target: float) -> int:
    """1 + the first index where the cumulative sum of S^2 reaches target^2 of the total."""
    squares = S.double().pow(2)
    cumulative = torch.cumsum(squares, 0) / float(squares.sum())
    return _clamp(int(torch.searchsorted(cumulative, target**2)) + 1, len(S))


INDEX = {"sv_ratio": index_sv_ratio, "sv_cumulative": index_sv_cumulative, "sv_fro": index_sv_fro}


def choose_rank(spectrum: Spectrum, max_rank: int, method: str | None = None, param: float | None = None) -> int:
    """sd-scripts' rank_resize: a dynamic method gives index + 1 (sd-scripts keeps one value more
    than the index names), capped at `max_rank`; no method gives `max_rank`; a zero delta gives 1.
    We also cap at the factors' own rank (len(S)): the values past it are zero, keeping them adds
    size and nothing else."""
    S = spectrum.padded()
    if method is not None and method not in INDEX:
        raise ValueError(f"--dynamic_method {method!r}: expected one of {', '.join(DYNAMIC_METHODS)}")
    if len(S) == 0 or float(S[0]) <= MIN_SV:
        return 1
    rank = INDEX[method](S, param) + 1 if method else max_rank
    return max(1, min(rank, max_rank, len(spectrum.S)))


def rank_for_energy(spectrum: Spectrum, energy: float, max_rank: int | None = None) -> int:
    """The smallest rank whose retained Frobenius fraction is >= `energy` (capped at max_rank)."""
    squares = spectrum.S.double().pow(2)
    total = float(squares.sum())
    if total <= 0:
        return 1
    cumulative = torch.cumsum(squares, 0) / total
    rank = int(torch.searchsorted(cumulative, energy**2 * (1 - 1e-12))) + 1  # 1e-12: energy 1.0 reached in float
    return max(1, min(rank, len(spectrum.S), max_rank or len(spectrum.S)))


def factors(spectrum: Spectrum, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(down [rank, in] = Vh_k, up [out, rank] = U_k diag(S_k)): sd-scripts' split, which keeps
    the rows of down orthonormal and puts the singular values into up."""
    return spectrum.Vh[:rank].contiguous(), (spectrum.U[:, :rank] * spectrum.S[:rank]).contiguous()


def written_error(delta: torch.Tensor, up: torch.Tensor, down: torch.Tensor, dtype: torch.dtype) -> float:
    """||up @ down - delta|| / ||delta|| with the factors as a file stores them in `dtype` (float32 products):
    the error the written LoRA has, rounding included (a bf16 file's factors are new bf16 numbers)."""
    written = up.to(dtype).float() @ down.to(dtype).float()
    return float((written - delta.float()).norm() / delta.float().norm().clamp_min(1e-30))
