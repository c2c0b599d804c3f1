"""The memory planner's answers against the rest of a run's config: the card rows offer only base precisions the
config can train with (and its own), and accumulated micro-batches are planned with the held LoRA grads."""

import pytest
import torch

from tests.test_memory_plan import tiny_flux, write_config


@pytest.mark.parametrize("ckpt", [False, True])
def test_accumulated_micro_batches_are_planned_with_the_earlier_ones_lora_grads_held(tiny_set, ckpt):
    """train_lora.py zeroes the LoRA's grads after a step's last micro-batch: under gradient_accumulation_steps = 2 the
    second micro-batch runs its forward and backward with the first one's grads held. The planner simulated one
    micro-batch (FLUX.1-dev 1024 px, rank 16: planned 14.92 GiB, 15.21 held). The plan is the live tensor bytes of a
    real CPU step (LiveBytes on "cpu"), its optimizer's state made by an earlier step."""
    from library.models.core import checkpointing
    from library.training.memory_plan import LiveBytes, tensor_bytes, training_plan
    from networks.factory import build_network
    from tools import plan_memory

    family, args = tiny_flux(tiny_set), plan_memory.default_args("flux")
    args.mixed_precision, args.gradient_checkpointing, args.gradient_accumulation_steps = "no", ckpt, 2
    args.checkpoint_saves_attention = args.checkpoint_saves_projections = False
    batch, side, tokens = 1, 64, 32
    planned = training_plan(family, args, side, side, batch, tokens).phase(0).peak
    model = family.load_transformer(torch.float32, "bf16").requires_grad_(False)
    model.gradient_checkpointing = checkpointing(ckpt, False, False)
    network = build_network(args.network_module, model, "flux", 16, 16)
    network.apply()
    network.train()
    optimizer = torch.optim.AdamW([p for p in network.parameters() if p.requires_grad], lr=1e-4)

    def step(live=None):
        for _ in range(args.gradient_accumulation_steps):
            latents = torch.randn(batch, 16, side // 8, side // 8)
            text = {k: torch.randn(v.shape, dtype=v.dtype) for k, v in family.text_on_meta(model, batch, tokens).items()}
            for t in (latents, *text.values()) if live else ():
                live.track(t)
            loss, _ = family.training_loss(model, latents, text, args, [torch.Generator().manual_seed(0)])
            loss.backward()
            del loss, latents, text
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # the optimizer's state exists from the first step on
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    with LiveBytes("cpu") as live:
        for t in (*model.parameters(), *model.buffers(), *network.state_dict().values(), *state):
            live.track(t)
        step(live)
    grads = tensor_bytes([p for p in network.parameters() if p.requires_grad])
    assert abs(planned - live.peak) < grads / 10, (planned, live.peak, grads)  # one micro-batch's plan: ~grads under


@pytest.mark.parametrize("case", ["fp8_compute", "algo=full"])
def test_the_card_rows_leave_out_the_base_precisions_the_config_cannot_train_with(tiny_set, tmp_path, capsys, case):
    """Old: every base precision got its rows whatever the rest of the config: fp8_compute (an fp8 base's) offered a
    bf16 row that fit, which the web UI applied and train_lora refused; LyCORIS algo=full (a high-precision base's)
    printed its run's plan and died on the fp8_scaled row. Each such base is now one line saying why, and
    --base_precision naming it is an error."""
    from tools import plan_memory

    keys = dict(model_type="flux", pretrained_model_name_or_path=tiny_set["flux_bfl"], ae=tiny_set["flux_vae_single"],
                clip_l=tiny_set["clip_l"], t5xxl=tiny_set["t5xxl"], dataset_config=tiny_set["dataset_config"],
                output_dir=str(tmp_path / "out"))
    if case == "fp8_compute":
        keys.update(fp8_base=True, fp8_scaled=True, mixed_precision="bf16", fp8_compute=True)
        planned, refused = ["fp8_scaled"], {base: 'fp8_compute needs an fp8 base (base_precision = "fp8_scaled" or '
                                                  f'"fp8"), got {base}' for base in ("bf16", "nf4", "int8")}
    else:
        keys.update(network_module="lycoris.kohya", network_args=["algo=full"])
        planned, refused = ["bf16"], {base: f"network_args 'algo=full' trains a full copy of each target weight, which "
                                            f"needs a high-precision base; 'base_precision' stores it in {base}: set "
                                            f'base_precision = "bf16"' for base in ("fp8_scaled", "nf4", "int8")}
    config = write_config(tmp_path / "run.toml", **keys)
    assert plan_memory.main(["--config_file", config, "--vram", "12"]) == 0
    out = capsys.readouterr().out
    rows = [line.split()[0] for line in out.splitlines() if "gradient_checkpointing=" in line and " = true (+" not in line]
    assert rows == [base for base in planned for _ in (False, True)], out
    assert [line for line in out.splitlines() if " left out: " in line] == [
        f"  {base:10s} left out: {why}" for base, why in refused.items()]
    only = next(iter(refused))
    assert plan_memory.main(["--config_file", config, "--vram", "12", "--base_precision", only]) == 2
    assert capsys.readouterr() == ("", f"error: --base_precision {only}: {config}: {refused[only]}\n")


def test_a_config_s_own_base_precision_is_planned_on_every_card(tiny_set, tmp_path, capsys):
    """Old: an nf4 run's rows on a 16 or 24 GB card were bf16 and fp8_scaled only (the 4- and 8-bit bases are tried
    on smaller cards): the precision the run trains in was never among the answers."""
    from tools import plan_memory

    config = write_config(tmp_path / "run.toml", model_type="flux", pretrained_model_name_or_path=tiny_set["flux_bfl"],
                          ae=tiny_set["flux_vae_single"], clip_l=tiny_set["clip_l"], t5xxl=tiny_set["t5xxl"],
                          dataset_config=tiny_set["dataset_config"], output_dir=str(tmp_path / "out"),
                          base_precision="nf4")
    assert plan_memory.main(["--config_file", config, "--vram", "24"]) == 0
    out = capsys.readouterr().out
    rows = [line.split()[0] for line in out.splitlines() if "gradient_checkpointing=" in line and " = true (+" not in line]
    assert rows == ["bf16", "bf16", "fp8_scaled", "fp8_scaled", "nf4", "nf4"], out


def test_a_16_gib_card_is_planned_in_nf4_and_int8_too():
    """Cards of 16 GiB and less get the 4- and 8-bit rows: at 16 GiB Nucleus-Image's fp8_scaled base needs
    blocks_to_swap 8 where its nf4 base (the experts too) fits without swap; `--vram 16` showed no nf4 row before."""
    import types

    from tools.plan_memory import card_bases

    no_config = types.SimpleNamespace(config_file=None)
    assert card_bases(None, no_config, 16.0) == ("bf16", "fp8_scaled", "nf4", "int8")
    assert card_bases(None, no_config, 12.0) == ("bf16", "fp8_scaled", "nf4", "int8")
    assert card_bases(None, no_config, 24.0) == ("bf16", "fp8_scaled")
    assert card_bases(None, no_config, 16.0, only="fp8_scaled") == ("fp8_scaled",)
