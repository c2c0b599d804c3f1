"""num_timestep_buckets (musubi-tuner's stratified timesteps): each epoch deals its samples the N equal slices of the
sigma law's quantiles evenly, a sample's quantile is drawn within its slice from its own generator and mapped through
the law (every law of flow_matching.sample_sigmas, timestep_bias included, and Ideogram 4's own). Unset: each
sample's own draw, bit for bit as before."""

from collections import Counter

import pytest
import torch
from safetensors import safe_open

import train_lora
from library.data import dataset as D
from library.models import flow_matching as fm
from library.models.flux1.family import FluxFamily
from library.models.ideogram4.sampling import training_sigmas
from library.training.config import ConfigError, load_config
from tests.test_dataset import blueprint, make_image
from tests.test_reliability import flux_args
from tests.test_timestep_range import FLUX, loss_args

LAWS = {  # sample_sigmas' keywords
    "uniform": dict(method="uniform"),
    "uniform, low_noise bias": dict(method="uniform", bias="low_noise"),
    "sigmoid scale 1.5, high_noise bias": dict(method="sigmoid", sigmoid_scale=1.5, bias="high_noise"),
    "shift 3": dict(method="shift", shift=3.0),
    "flux_shift at 1024 px": dict(method="flux_shift", image_seq_len=4096),
    "logsnr": dict(method="logsnr"),
}


@pytest.mark.parametrize("name", LAWS)
def test_a_quantile_maps_to_the_laws_own_quantile(name):
    """The law at quantiles (j + 0.5) / 200 is the law: each mapped sigma equals the empirical quantile of 200,000
    draws of it at that level (0.01 -> 0.99 of the sorted draws; uniform's sigma is 1 - u: sorted both)."""
    q = (torch.arange(200, dtype=torch.float64) + 0.5) / 200
    mapped = fm.sample_sigmas(200, generator=None, quantiles=q, **LAWS[name])
    draws = fm.sample_sigmas(200_000, generator=torch.Generator().manual_seed(0), **LAWS[name])
    want = torch.quantile(draws.double(), q)
    assert mapped.dtype == torch.float32 and mapped.shape == (200,)
    assert (mapped.double().sort().values - want).abs().max() < 5e-3


def test_ideogram4s_own_law_takes_the_quantiles_too():
    q = (torch.arange(100, dtype=torch.float64) + 0.5) / 100
    mapped = training_sigmas(100, 1024, 1024, quantiles=q)
    want = torch.quantile(training_sigmas(200_000, 1024, 1024, torch.Generator().manual_seed(0)).double(), q)
    assert (mapped.double() - want).abs().max() < 5e-3  # (its sigma grows with its quantile)


def test_the_sampler_deals_each_epoch_the_strata_evenly(tmp_path):
    """18 samples, 4 strata: each 4 or 5 times an epoch, in an order that differs by epoch and is the same again
    for the same (seed, epoch); the batches themselves as without strata. Unset or 1: the keys as ever."""
    for i in range(6):
        make_image(tmp_path / "img" / f"{i}.png", 64, 64)
    ds = D.ImageDataset(blueprint(tmp_path / "img", resolution=64, batch_size=4, num_repeats=3, class_tokens="x"))
    plain = D.BucketBatchSampler(ds, seed=3).batches(0)
    assert D.BucketBatchSampler(ds, seed=3, timestep_buckets=1).batches(0) == plain
    sampler = D.BucketBatchSampler(ds, seed=3, timestep_buckets=4)
    epochs = [sampler.batches(epoch) for epoch in (0, 1)]
    assert [[(e, ep) for e, ep, _ in b] for b in epochs[0]] == plain
    for batches in epochs:
        counts = Counter(k for b in batches for _, _, k in b)
        assert sorted(counts) == [0, 1, 2, 3] and sorted(counts.values()) == [4, 4, 5, 5]
    assert [k for b in epochs[0] for *_, k in b] != [k for b in epochs[1] for *_, k in b]
    assert epochs[0] == D.BucketBatchSampler(ds, seed=3, timestep_buckets=4).batches(0)
    loader = torch.utils.data.DataLoader(ds, batch_sampler=epochs[0], collate_fn=D.collate_batch)
    assert [batch["strata"] for batch in loader] == [[k for *_, k in b] for b in epochs[0]]
    plain_batch = D.collate_batch([ds[key] for key in plain[0]])
    assert "strata" not in plain_batch


def test_the_training_step_draws_each_sigma_within_its_stratum(tiny_set):
    """The tiny FLUX.1's step, uniform law, 4 strata: sample i's sigma is 1 - u, u in [k / 4, (k + 1) / 4), drawn
    from its generator after its noise; without strata the draw is the one it always was."""
    family = FluxFamily(tiny_set["flux_bfl"])
    model = family.load_transformer(torch.float32)
    latents, text = torch.randn(4, 16, 8, 16), {"t5": torch.randn(4, 7, 32), "clip_pooled": torch.randn(4, 32)}
    args = loss_args(timestep_sampling="uniform", num_timestep_buckets=4)
    gens = lambda: [torch.Generator().manual_seed(s) for s in range(4)]  # noqa: E731
    _, sigmas = family.training_loss(model, latents, text, args, gens(), strata=[3, 0, 2, 1])
    expected = []
    for seed, k in zip(range(4), [3, 0, 2, 1]):
        g = torch.Generator().manual_seed(seed)
        torch.randn(latents.shape[1:], generator=g)
        expected.append(1.0 - (k + torch.rand(1, generator=g, dtype=torch.float64).item()) / 4)
    torch.testing.assert_close(sigmas, torch.tensor(expected, dtype=torch.float32), rtol=0, atol=1e-7)
    _, own = family.training_loss(model, latents, text, args, gens())
    _, unset = family.training_loss(model, latents, text, loss_args(timestep_sampling="uniform"), gens())
    assert torch.equal(own, unset) and not torch.equal(own, sigmas)


def test_a_run_stratifies_every_epoch_and_records_the_count(tiny_set, tmp_path, monkeypatch):
    """8 images, batches of 2, 8 strata, 8 steps: each epoch's 8 samples take the strata 0-7 once each, through
    the sampler, the data loader, the batch and the loss; the LoRA's header says 8."""
    seen, draw = [], fm.stratified_quantiles

    def recorded(strata, buckets, generators):
        quantiles = draw(strata, buckets, generators)
        seen.extend((int(k), buckets, q.item()) for k, q in zip(strata, quantiles))
        return quantiles

    monkeypatch.setattr(fm, "stratified_quantiles", recorded)
    out = tmp_path / "out"
    assert train_lora.main(flux_args(tiny_set, out, "--num_timestep_buckets", "8", "--max_train_steps", "8")) == 0
    assert len(seen) == 16 and all(buckets == 8 and k / 8 <= q < (k + 1) / 8 for k, buckets, q in seen)
    assert sorted(k for k, *_ in seen[:8]) == sorted(k for k, *_ in seen[8:]) == list(range(8))
    with safe_open(str(out / "tiny_flux_lora.safetensors"), framework="pt") as f:
        assert f.metadata()["ss_num_timestep_buckets"] == "8"


@pytest.mark.parametrize("extra, message", [
    (["--num_timestep_buckets", "0"], "key 'num_timestep_buckets' must be >= 1, got 0"),
    (["--num_timestep_buckets", "4", "--max_timestep", "900", "--preserve_distribution_shape", "true"],
     "num_timestep_buckets stratifies the whole sigma law, preserve_distribution_shape redraws the sigmas outside "
     "min_timestep / max_timestep: set one of them"),
])
def test_bad_values_are_refused_in_one_line(extra, message):
    with pytest.raises(ConfigError, match="command line: " + message.replace("(", r"\(")):
        load_config(FLUX + extra)


def test_a_range_scaled_and_one_bucket_are_taken_an_llm_run_refuses_it():
    assert load_config(FLUX).num_timestep_buckets is None
    args = load_config(FLUX + ["--num_timestep_buckets", "4", "--min_timestep", "100"])
    assert (args.num_timestep_buckets, args.min_timestep) == (4, 100)
    assert load_config(FLUX + ["--num_timestep_buckets", "1"]).num_timestep_buckets == 1
    with pytest.raises(ConfigError, match="key 'num_timestep_buckets' is read by the diffusion models"):
        load_config(["--model_type", "llm", "--pretrained_model_name_or_path", "m", "--train_data", "a.txt",
                     "--num_timestep_buckets", "4"])
