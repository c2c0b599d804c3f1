"""The dataset TOML keys of the peers' formats that ours does not have (musubi-tuner's image_directory where
ours has image_dir, sd-scripts' enable_wildcard ...): an unknown-key error naming one ends with the command that
translates the file (tools/convert_config.py) and says what becomes of each key. The data layer cannot ask
library/training/peers (imports point one way), so the names are here; library/training/peers/musubi_dataset.py
and sd_scripts_dataset.py hold what each means (tests/test_convert_config_sd_scripts.py keeps the lists equal)."""

from __future__ import annotations

MUSUBI_DATASET_KEYS = (
    "image_directory", "image_jsonl_file", "cache_directory", "no_resize_control", "control_resolution",
    "flux_kontext_no_resize_control", "qwen_image_edit_no_resize_control", "qwen_image_edit_control_resolution",
    "video_directory", "video_jsonl_file", "target_frames", "frame_extraction", "frame_stride", "frame_sample",
    "max_frames", "source_fps", "fp_latent_window_size", "fp_1f_clean_indices", "fp_1f_target_index", "fp_1f_no_post",
)


# sd-scripts' dataset keys (config_util's schemas) ours has not: each an sd-scripts feature, not a typo
SD_SCRIPTS_DATASET_KEYS = (
    "secondary_separator", "enable_wildcard", "token_warmup_step", "token_warmup_min", "custom_attributes",
    "resize_interpolation", "network_multiplier", "metadata_file", "conditioning_data_dir", "cache_info",
    "debug_dataset",
)


def peer_dataset_hint(key: str, source: str) -> str:
    """The end of the unknown-key line for `key` in the dataset TOML `source`: '' unless a peer's key."""
    peer = ("musubi-tuner" if key in MUSUBI_DATASET_KEYS else "sd-scripts" if key in SD_SCRIPTS_DATASET_KEYS
            else None)
    if peer is None:
        return ""
    return (f"; {source} is {'a' if peer == 'musubi-tuner' else 'an'} {peer} dataset TOML: `python "
            f"tools/convert_config.py <its training config> --dataset_config {source}` writes it as ours and says "
            f"what becomes of each key")
