"""The precision matrix (tools/precision_matrix.py) on mid-size FLUX and Qwen-Image transformers.

    python bench/bench_precision_matrix.py [--out bench_out/matrix] [--steps 20] [--resolution 768]
        [--hidden 1024] [--depth 2] [--families flux,qwen_image]

Mid size here: the real head width (128) and RoPE axes (16, 56, 56), `hidden / 128` heads,
`depth` double + `depth` single blocks (FLUX) or `2 * depth` blocks (Qwen-Image), random weights
N(0, 0.02); the tiny VAE and text encoders of tools/make_tiny_models.py feed it (their widths are
the transformer's context widths). Each family's four LoRAs are trained on the generated shapes
dataset at --resolution (768 px: a 48 x 48 patch grid, where e4m3 positions lose part of 17..47),
then every cell is evaluated; the tables are printed and written under OUT/<family>/.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from library.models.flux1.checkpoint import save_flux_bfl  # noqa: E402
from library.models.flux1.model import Flux, FluxConfig  # noqa: E402
from library.models.qwen_image.model import QwenImage, QwenImageConfig, save_qwen_image_diffusers  # noqa: E402
from tools import precision_matrix  # noqa: E402
from tools.make_tiny_dataset import make_tiny_dataset  # noqa: E402
from library.models.tiny_files import TINY  # noqa: E402
from tools.make_tiny_models import make_tiny_models  # noqa: E402


def random_init(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02 if p.dim() == 2 else (torch.zeros_like(p) if name.endswith("bias") else p))
    return model


def write_transformer(family: str, folder: str, hidden: int, depth: int) -> str:
    heads = hidden // 128
    if family == "flux":
        cfg = FluxConfig(vec_in_dim=TINY["clip_hidden"], context_in_dim=TINY["t5_d_model"], hidden_size=hidden,
                         num_heads=heads, depth=depth, depth_single=depth, guidance_embed=True)
        path = os.path.join(folder, "flux_mid.safetensors")
        save_flux_bfl(random_init(Flux(cfg), 1), path)
        return path
    cfg = QwenImageConfig(num_layers=2 * depth, num_attention_heads=heads, joint_attention_dim=TINY["lm_hidden"])
    path = os.path.join(folder, "qwen_mid")
    model = random_init(QwenImage(cfg), 2)
    save_qwen_image_diffusers(model.state_dict(), cfg, path)
    return path


def write_config(family: str, model: str, tiny: dict, folder: str) -> str:
    if family == "flux":
        paths = (f'model_type = "flux"\npretrained_model_name_or_path = "{model}"\nae = "{tiny["flux_vae_single"]}"\n'
                 f'clip_l = "{tiny["clip_l"]}"\nt5xxl = "{tiny["t5xxl"]}"\nt5xxl_max_token_length = 32\n')
    else:
        paths = (f'model_type = "qwen_image"\npretrained_model_name_or_path = "{model}"\nae = "{tiny["qwen_image_vae"]}"\n'
                 f'text_encoder = "{tiny["qwen_image_text_encoder"]}"\n')
    path = os.path.join(folder, f"{family}.toml")
    with open(path, "w") as f:
        f.write(paths + f'dataset_config = "{tiny["dataset_config"]}"\nmixed_precision = "no"\nnetwork_dim = 16\n'
                'network_alpha = 16\noptimizer_type = "AdamW"\nlearning_rate = 1e-3\ncache_latents_to_disk = true\n'
                f'cache_text_encoder_outputs_to_disk = true\noutput_dir = "{folder}/unused"\nseed = 42\n')
    return path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--out", default="bench_out/matrix")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--resolution", type=int, default=768)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--max_items", type=int, default=2)
    p.add_argument("--sigmas", default="0.3,0.6,0.9")
    p.add_argument("--families", default="flux,qwen_image")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    tiny = make_tiny_models(os.path.join(args.out, "tiny"))
    tiny.update(make_tiny_dataset(os.path.join(args.out, "tiny", "dataset")))
    for family in args.families.split(","):
        start = time.time()
        folder = os.path.join(args.out, family)
        os.makedirs(folder, exist_ok=True)
        config = write_config(family, write_transformer(family, folder, args.hidden, args.depth), tiny, folder)
        code = precision_matrix.main(["--config_file", config, "--out", folder, "--steps", str(args.steps),
                                      "--resolution", str(args.resolution), "--max_items", str(args.max_items),
                                      "--sigmas", args.sigmas])
        print(f"{family}: exit {code} in {time.time() - start:.0f} s")
        if code == 0:
            print(open(os.path.join(folder, "matrix.md")).read())


if __name__ == "__main__":
    main()
