"""tools/convert_config.py on sd-scripts' lumina_train_network.py configs and ai-toolkit's Lumina 2 jobs: its
documented command line and a TOML become configs train_lora.py reads; its LoRA module's modules at their ranks are
ours' (networks.lora_lumina's own LoRANetwork on the tiny model, where an sd-scripts checkout is at hand); its
nextdit_shift is refused with ours' closest draw, whose distance is measured here."""

import math
import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from library.text_files import toml_loads
from library.training.config import load_config, lora_network_args
from library.training.peers import ai_toolkit, sd_scripts
from library.models import flow_matching as fm
from library.training.peers.rules import NOT_CARRIED, RENAMED
from networks.lora import LoRANetwork
from tests.test_convert_config_sd_scripts import CHECKOUT, convert, their_dataset
from tools import convert_config

# every Linear of its JointTransformerBlocks and FinalLayer (LUMINA_TARGET_REPLACE_MODULE), at network_dim
DEFAULT_ITEMS = ["train_modulation=true", "refiner_dim=8", "refiner_mod_dim=8", "final_layer_dim=8"]


def lumina_command(tiny_set, dataset: str, out: str, *extra: str) -> str:
    """sd-scripts' docs/lumina_train_network.md command line (section 4), its paths on the tiny set."""
    return " ".join([
        "accelerate launch --num_cpu_threads_per_process 1 lumina_train_network.py",
        f'--pretrained_model_name_or_path="{tiny_set["lumina2"]}"',
        f'--gemma2="{tiny_set["lumina2_text_encoder"]}"', f'--ae="{tiny_set["flux_vae_single"]}"',
        f'--dataset_config="{dataset}"', f'--output_dir="{out}"', '--output_name="my_lumina_lora"',
        "--save_model_as=safetensors", "--network_module=networks.lora_lumina", "--network_dim=8", "--network_alpha=8",
        "--learning_rate=1e-4", '--optimizer_type="AdamW"', '--lr_scheduler="constant"',
        '--timestep_sampling="nextdit_shift"', "--discrete_flow_shift=6.0", '--model_prediction_type="raw"',
        '--system_prompt="You are an assistant designed to generate high-quality images based on user prompts."',
        "--max_train_epochs=10", "--save_every_n_epochs=1", '--mixed_precision="bf16"', "--gradient_checkpointing",
        "--cache_latents", "--cache_text_encoder_outputs", *extra,
    ])


def test_documented_command_converts_and_train_lora_reads_it(tiny_set, tmp_path, capsys):
    """gemma2 -> text_encoder, its system prompt kept, its default LoRA (refiners, modulation, final layer) as ours'
    network_args; nextdit_shift as ours' flux_shift of a uniform draw; a Gemma 2 LoRA (no network_train_unet_only)
    and another token length not carried;
    the FLUX.1 script's guidance_scale unknown."""
    dataset = their_dataset(tmp_path, tiny_set["image_dir"])
    command = lumina_command(tiny_set, dataset, str(tmp_path / "run"), "--use_flash_attn", "--sample_batch_size=2",
                             "--gemma2_max_token_length=256", "--guidance_scale=1.0", "--blocks_to_swap=4")
    out = tmp_path / "ours.toml"
    code, rows, text = convert(["--command", command, "--out", str(out)], capsys)
    assert code == 0, text
    assert (rows["gemma2"], rows["ae"], rows["system_prompt"]) == (
        ("renamed", "text_encoder"), ("kept", ""), ("kept", ""))
    for dropped in ("use_flash_attn", "sample_batch_size", "gemma2_max_token_length", "model_prediction_type",
                    "discrete_flow_shift"):  # (nextdit_shift reads no discrete_flow_shift)
        assert rows[dropped][0] == "dropped", (dropped, rows[dropped])
    assert rows["timestep_sampling"] == ("renamed", 'timestep_sampling = "flux_shift" with shifted_draw = "uniform" '
                                                    '(the same draw, continuous)')
    assert rows["network_train_unet_only (default)"][0] == "not carried"  # it trains a Gemma 2 LoRA on the cache
    assert rows["guidance_scale"][0] == "unknown" and rows["blocks_to_swap"] == ("kept", "")
    assert rows["network_args (default)"][0] == "renamed"
    assert "check: train_lora.py reads it as written" in text
    ours = toml_loads(out.read_text())
    assert (ours["model_type"], ours["text_encoder"], ours["ae"]) == (
        "lumina2", tiny_set["lumina2_text_encoder"], tiny_set["flux_vae_single"])
    assert ours["system_prompt"].startswith("You are an assistant designed")
    assert ours["network_args"] == DEFAULT_ITEMS
    assert (ours["timestep_sampling"], ours["shifted_draw"]) == ("flux_shift", "uniform")
    args = load_config(["--config_file", str(out)])
    assert (args.model_type, args.network_dim, args.blocks_to_swap) == ("lumina2", 8, 4)


def test_toml_reads_its_scripts_defaults(tiny_set, tmp_path, capsys):
    """A TOML (its gemma2 key names the script) that sets no system prompt trains without one (system_prompt = ""),
    draws `shift` at its discrete_flow_shift 6.0; flux_shift is ours by that name; its other prediction types and a
    text encoder LoRA are not carried."""
    dataset = their_dataset(tmp_path, tiny_set["image_dir"])
    config = tmp_path / "lumina_lora.toml"
    config.write_text("\n".join([
        f'pretrained_model_name_or_path = "{tiny_set["lumina2"]}"', f'gemma2 = "{tiny_set["lumina2_text_encoder"]}"',
        f'ae = "{tiny_set["flux_vae_single"]}"', f'dataset_config = "{dataset}"', f'output_dir = "{tmp_path / "run"}"',
        "network_train_unet_only = true", 'network_args = ["refiner_dim=2", "verbose=True"]', ""]))
    code, rows, text = convert([str(config)], capsys)
    assert code == 0, text
    assert rows["system_prompt (default)"] == ("kept", "") and rows["timestep_sampling (default)"] == ("kept", "")
    ours = toml_loads((tmp_path / "lumina_lora_converted.toml").read_text())
    assert (ours["model_type"], ours["system_prompt"]) == ("lumina2", "")
    assert (ours["timestep_sampling"], ours["discrete_flow_shift"]) == ("shift", 6.0)
    # its refiner_dim=2 ranks the refiners' Linears, the noise refiners' adaLN too; the rest at network_dim 4
    assert ours["network_args"] == ["train_modulation=true", "refiner_dim=2", "refiner_mod_dim=2", "final_layer_dim=4"]
    assert "check: train_lora.py reads it as written" in text
    flux = sd_scripts.translate({"gemma2": "g", "timestep_sampling": "flux_shift", "sigmoid_scale": 1.3,
                                 "model_prediction_type": "additive", "network_train_unet_only": False,
                                 "cache_text_encoder_outputs": True, "text_encoder_lr": 1e-5}, "x.toml")
    verdicts = {line.key: line.verdict for line in flux.lines}
    assert (flux.config["timestep_sampling"], flux.config["sigmoid_scale"]) == ("flux_shift", 1.3)
    assert verdicts["model_prediction_type"] == verdicts["network_train_unet_only"] == NOT_CARRIED
    assert verdicts["text_encoder_lr"] == NOT_CARRIED


def test_nextdit_shift_is_ours_flux_shift_of_a_uniform_draw():
    """nextdit_shift (lumina_train_util): t = U(0, 1), mu = FLUX.1's line (256 -> 0.5, 4096 -> 1.15) at the (h/2)(w/2)
    tokens, t' = e^mu / (e^mu + 1 / t - 1); ours at the same quantiles (ours' uniform sigma is 1 - u) is that law
    to float32 rounding, at 1024 px (4096 tokens) and 512 px."""
    q = (torch.arange(1000, dtype=torch.float64) + 0.5) / 1000
    for tokens in (4096, 1024):
        mu = 0.5 + (1.15 - 0.5) / (4096 - 256) * (tokens - 256)
        t = 1 - q
        theirs = math.exp(mu) / (math.exp(mu) + 1 / t - 1)
        ours = fm.sample_sigmas(1000, "flux_shift", generator=None, image_seq_len=tokens, quantiles=q,
                                shifted="uniform")
        assert (ours.double() - theirs).abs().max().item() < 1e-6
    t = sd_scripts.translate({"gemma2": "g", "timestep_sampling": "nextdit_shift", "sigmoid_scale": 1.3}, "x.toml")
    assert (t.config["timestep_sampling"], t.config["shifted_draw"]) == ("flux_shift", "uniform")
    assert "sigmoid_scale" not in t.config  # (nextdit_shift reads none)


def our_lora(network_args: list[str], rank: int) -> dict[str, int]:
    from library.models.lumina2.tiny import random_lumina2, tiny_config

    args = lora_network_args(SimpleNamespace(network_args=network_args, network_dropout=0.0, config_file="x.toml"))
    model = random_lumina2(tiny_config())
    return {m.name: m.rank for m in LoRANetwork(model, "lumina2", rank=rank, network_args=args).lora_modules()}


def test_the_default_trains_every_linear_of_the_blocks_and_the_final_layer():
    """LUMINA_TARGET_REPLACE_MODULE = JointTransformerBlock, FinalLayer: every Linear in them at network_dim, none of
    the embedders (ours' default alone trains the layers' attention and feed-forward: 10 of 25 tiny modules)."""
    from library.models.lumina2.tiny import random_lumina2, tiny_config

    model = random_lumina2(tiny_config())
    blocks = ("layers.", "noise_refiner.", "context_refiner.", "final_layer.")
    theirs = {name for name, m in model.named_modules() if isinstance(m, nn.Linear) and name.startswith(blocks)}
    ours = our_lora(sd_scripts.translate({"gemma2": "g", "network_dim": 8}, "x.toml").config["network_args"], 8)
    assert set(ours) == theirs and set(ours.values()) == {8} and len(theirs) == 25
    assert len(our_lora([], 8)) == 10


def their_network(network_args: dict[str, str], rank: int) -> dict[str, int]:
    """networks.lora_lumina's own create_network on the tiny model (its block class named as theirs), read from the
    checkout (its `library` is not ours: its one import of it, a log setup, left out)."""
    from library.models.lumina2.model import Lumina2Block
    from library.models.lumina2.tiny import random_lumina2, tiny_config

    source = open(os.path.join(CHECKOUT, "networks", "lora_lumina.py"), encoding="utf-8").read()
    namespace = {"__name__": "lora_lumina"}
    exec(compile(source.replace("from library.utils import setup_logging", "setup_logging = lambda: None"),
                 "lora_lumina.py", "exec"), namespace)
    model = random_lumina2(tiny_config())
    block_class = type("JointTransformerBlock", (Lumina2Block,), {})  # what its named_modules walk looks for
    for module in model.modules():
        if type(module) is Lumina2Block:
            module.__class__ = block_class
    network = namespace["create_network"](1.0, rank, rank, None, [nn.Module()], model, **network_args)
    return {lora.lora_name.removeprefix("lora_unet_"): lora.lora_dim for lora in network.unet_loras}


@pytest.mark.skipif(not os.path.isfile(os.path.join(CHECKOUT, "networks", "lora_lumina.py")),
                    reason="no sd-scripts checkout (.peers/sd-scripts or SD_SCRIPTS_CHECKOUT)")
@pytest.mark.parametrize("network_args", [
    {}, {"attn_dim": "2", "mod_dim": "3"}, {"refiner_dim": "2", "mod_dim": "0"}, {"train_blocks": "transformer"},
    {"train_blocks": "context_refiner", "attn_dim": "5"}, {"train_blocks": "refiners", "mod_dim": "6"},
    {"embedder_dims": "[2,0,3]", "mlp_dim": "5", "refiner_dim": "0"}, {"embedder_dims": "[1,2,3]", "attn_dim": "0"},
])
def test_our_network_trains_its_modules_at_its_ranks(network_args):
    """Each argument set's translation trains the modules networks.lora_lumina trains, each at its rank."""
    given = [f"{k}={v}" for k, v in network_args.items()]
    t = sd_scripts.translate({"gemma2": "g", "network_dim": 4, "network_args": given}, "x.toml")
    ours = {name.replace(".", "_"): rank for name, rank in our_lora(t.config["network_args"], 4).items()}
    assert ours == their_network(network_args, 4)


def test_ai_toolkits_lumina_example_trains_its_blocks_every_linear():
    """ai-toolkit's config/examples/train_lora_lumina.yaml (model.is_lumina2): its LoRA wraps every Linear of
    layers, noise_refiner and context_refiner (lora_special.py), adaLN included; buckets step 16 px."""
    process = {"type": "sd_trainer", "network": {"type": "lora", "linear": 16, "linear_alpha": 16},
               "model": {"name_or_path": "Alpha-VLLM/Lumina-Image-2.0", "is_lumina2": True, "quantize_te": True},
               "train": {"steps": 2000, "timestep_type": "lumina2_shift", "dtype": "bf16"},
               "datasets": [{"folder_path": "/path/to/images/folder", "resolution": [512, 768, 1024]}]}
    t = ai_toolkit.translate({"job": "extension", "config": {"name": "my_first_lumina_lora_v1",
                                                             "process": [process]}}, "train_lora_lumina.yaml")
    assert t.config["model_type"] == "lumina2"
    assert t.config["network_args"] == ["train_modulation=true", "refiner_dim=16", "refiner_mod_dim=16"]
    assert [line.verdict for line in t.lines if line.key == "network_args (added)"] == [RENAMED, RENAMED]
    assert {d["bucket_reso_steps"] for d in t.dataset["datasets"]} == {16}
    from library.models.lumina2.tiny import random_lumina2, tiny_config

    model = random_lumina2(tiny_config())
    blocks = ("layers.", "noise_refiner.", "context_refiner.")
    assert set(our_lora(t.config["network_args"], 16)) == {
        name for name, m in model.named_modules() if isinstance(m, nn.Linear) and name.startswith(blocks)}
    lokr = ai_toolkit.translate({"job": "extension", "config": {"name": "x", "process": [
        {**process, "network": {"type": "lokr", "lokr_full_rank": True}}]}}, "x.yaml")
    assert [line.verdict for line in lokr.lines if line.key == "network_args (added)"][-1] == NOT_CARRIED
