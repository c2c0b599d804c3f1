"""The kohya_ss GUI's TOML: the GUI writes one per run (config_lora-<date>.toml) and starts sd-scripts' LoRA
training script with --config_file naming it, so sd_scripts.py translates it. Every field of the GUI is in it,
an empty one as "", 0, [] or false (sd-scripts' "not given": sd_scripts.py drops those), and a few keys of the
GUI's own that are no argument of that script: sd-scripts takes a TOML key its parser lacks into args, and
nothing reads it. KEYS holds those, each dropped with why. No torch here (rules.py)."""

from __future__ import annotations

from library.training.peers.rules import Rule, ignored

KEYS: dict[str, Rule] = {
    "epoch": ignored("the kohya_ss GUI's epoch count, which it wrote into max_train_steps; sd-scripts does not read it"),
    "noise_offset_type": ignored("the kohya_ss GUI's choice of noise_offset or multires noise; sd-scripts does not "
                                 "read it"),
    **{key: ignored("sd-scripts' full fine-tuning's; its LoRA training does not read it") for key in (
        "mem_eff_save", "single_blocks_to_swap", "double_blocks_to_swap", "blockwise_fused_optimizers")},
    "stop_text_encoder_training": ignored("train_db.py's; sd-scripts' LoRA training does not read it"),
    **{key: ignored("the kohya_ss GUI's; no sd-scripts argument, nothing reads it") for key in (
        "train_inpainting", "show_timesteps", "show_timesteps_resolution")},
}
