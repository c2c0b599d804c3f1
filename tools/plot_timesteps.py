"""The sigmas a training config trains on: their histogram at one or more image sizes, and the loss weighting over
sigma, as musubi-tuner's --show_timesteps shows its draw, from the config's own keys (timestep_sampling or the
model's own, discrete_flow_shift, sigmoid_scale / sigmoid_mean, shifted_draw, mode_scale, timestep_bias, logsnr_mean /
logsnr_std, min_timestep / max_timestep, preserve_distribution_shape, num_timestep_buckets, weighting_scheme).

    python tools/plot_timesteps.py --config_file my_run.toml [--resolution 512,1024,1024x768] [--out sigmas.png]
    python tools/plot_timesteps.py --config_file my_run.toml -- --timestep_sampling logsnr --min_timestep 200

Training keys after `--` (as train_lora.py takes them) override the config's, to try a draw before writing it.
Prints one line per size: the law's quantiles and its share of high noise (sigma > 0.5, > 0.9). The draws are the
trainer's (DiffusionFamily.draw_sigmas on the config's model, built on the meta device from the files' headers),
`--draws` of them from one seed. A bad config or flag is one `error: ...` line, exit status 2, no plot written.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from library.errors import exit_without_collecting  # noqa: E402
from tools.cli import Parser, check_command_line, check_png_out  # noqa: E402

QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config_file", required=True, help="the training config (TOML)")
    p.add_argument("--resolution", default="1024", help="image sizes, comma-separated: 1024 (square) or 1024x768 "
                                                        "(width x height); the shifts depend on the token count")
    p.add_argument("--out", default="timesteps.png", help="PNG to write")
    p.add_argument("--draws", type=int, default=100_000, help="sigmas drawn per size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("overrides", nargs=argparse.REMAINDER,
                   help="after --: training keys over the config's, as train_lora.py takes them")
    return p


def sizes(text: str) -> list[tuple[int, int]]:
    """--resolution's "512,1024x768" -> [(512, 512), (1024, 768)] (width, height)."""
    out = []
    for item in text.split(","):
        width, _, height = item.strip().partition("x")
        try:
            w, h = int(width), int(height or width)
        except ValueError:
            raise ValueError(f"--resolution {item!r}: expected a size in pixels, 1024 or 1024x768") from None
        if w < 16 or h < 16:
            raise ValueError(f"--resolution {item!r}: expected at least 16 pixels a side")
        out.append((w, h))
    return out


def check_flags(args) -> None:
    check_png_out(args.out)
    if args.draws < 100:
        raise ValueError(f"--draws {args.draws}: expected at least 100 (a histogram of 100 bins)")
    sizes(args.resolution)


def config_model(config):
    """(family, its transformer built on the meta device from the files' headers): what tells the model's own law."""
    from library.models.family import get_family
    from library.training.config import base_precision, compute_dtype

    family = get_family(config)
    return family, family.load_transformer(compute_dtype(config), base_precision(config), read_weights=False)


def trained_sigmas(config, family, model, width: int, height: int, count: int, seed: int):
    """`count` sigmas of the law the config trains on at width x height (float32), and that law's name."""
    import torch

    from library.models import flow_matching as fm

    lh, lw = height // family.vae_downsample, width // family.vae_downsample
    generator = torch.Generator().manual_seed(seed)
    buckets = config.num_timestep_buckets or 1
    quantiles = None  # num_timestep_buckets: the draws stratified as one epoch of `count` samples
    if buckets > 1:
        strata = torch.arange(count, dtype=torch.float64) * buckets // count
        quantiles = (strata + torch.rand(count, generator=generator, dtype=torch.float64)) / buckets
    sigmas = fm.sigmas_in_range(lambda n: family.draw_sigmas(model, config, generator, lh, lw, n, quantiles), count,
                               *fm.timestep_range(config), config.preserve_distribution_shape)
    return sigmas, config.timestep_sampling or f"{family.default_timestep_sampling(model)} (the model's own)"


def summary(sigmas, width: int, height: int, law: str) -> str:
    import torch

    q = torch.quantile(sigmas.double(), torch.tensor(QUANTILES, dtype=torch.float64)).tolist()
    quantiles = ", ".join(f"{p:.0%} {v:.3f}" for p, v in zip(QUANTILES, q))
    return (f"{width}x{height}: timestep_sampling {law}; sigma quantiles {quantiles}; above 0.5: "
            f"{(sigmas > 0.5).double().mean().item():.1%}, above 0.9: {(sigmas > 0.9).double().mean().item():.1%}")


def range_said(config) -> str:
    """The title's words for a timestep range ("" without one)."""
    from library.models import flow_matching as fm

    lo, hi = fm.timestep_range(config)
    if (lo, hi) == (0.0, 1.0):
        return ""
    return f", sigma in [{lo:g}, {hi:g}] ({'cut' if config.preserve_distribution_shape else 'scaled'})"


def loss_weights(grid, weighting: str, table: str | None):
    """The loss weight over the sigmas of `grid` (float32) and its label: weighting_scheme's times the
    timestep_loss_weights table's; None where both weigh nothing."""
    from library.models import flow_matching as fm

    if weighting == "none" and not table:
        return None
    weights = fm.loss_weighting(grid, weighting)
    if table:
        weights = weights * fm.table_weights(grid, fm.loss_table(table))
    said = [weighting] * (weighting != "none") + [f"table {os.path.basename(table)}"] * bool(table)
    return weights, f"loss weight ({' x '.join(said)})"


def plot(draws: dict[str, object], weighting: str, out: str, title: str, table: str | None = None) -> None:
    """One step histogram (density, 100 bins over [0, 1]) per size; the loss weighting (weighting_scheme's and
    timestep_loss_weights') on a second axis."""
    import matplotlib
    import torch

    from library.io import atomic_path

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for label, sigmas in draws.items():
        ax.hist(sigmas.numpy(), bins=100, range=(0.0, 1.0), density=True, histtype="step", label=label)
    ax.set_xlabel("sigma (1 = pure noise)")
    ax.set_ylabel("density of the trained sigmas")
    grid = torch.linspace(0.005, 0.995, 199)
    weighted = loss_weights(grid, weighting, table)
    if weighted is not None:
        weights, label = weighted
        twin = ax.twinx()
        twin.plot(grid.numpy(), weights.numpy(), "k--", alpha=0.6, label=label)
        if weights.max() > 100 * weights.min():  # sigma_sqrt's 1 / sigma^2 near 0
            twin.set_yscale("log")
        twin.set_ylabel("loss weight")
        twin.legend(fontsize=8, loc="upper center")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    with atomic_path(out) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
        check_flags(args)
        from library.training.config import load_config

        overrides = args.overrides[1:] if args.overrides[:1] == ["--"] else args.overrides
        config = load_config(["--config_file", args.config_file, *overrides])
        if config.model_type == "llm":
            raise ValueError(f"{args.config_file}: model_type llm draws no sigmas (a diffusion model's config)")
        draws, (family, model) = {}, config_model(config)
        for width, height in sizes(args.resolution):
            sigmas, law = trained_sigmas(config, family, model, width, height, args.draws, args.seed)
            print(summary(sigmas, width, height, law))
            draws[f"{width}x{height}"] = sigmas
        title = f"{config.model_type}: timestep_sampling {law}{range_said(config)}"
        plot(draws, config.weighting_scheme, args.out, title, config.timestep_loss_weights)
        print(f"wrote {args.out}")
    except (ValueError, OSError) as e:  # ConfigError and CheckpointError are ValueErrors
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    check_command_line(build_parser)
    exit_without_collecting(main)
