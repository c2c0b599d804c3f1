"""The dataset TOML keys of the peers' formats that ours does not have (musubi-tuner's image_directory where
ours has image_dir ...): an unknown-key error naming one ends with the command that translates the file
(tools/convert_config.py). The data layer cannot ask library/training/peers (imports point one way), so the
names are here; library/training/peers/musubi_dataset.py holds what each means."""

from __future__ import annotations

MUSUBI_DATASET_KEYS = (
    "image_directory", "image_jsonl_file", "cache_directory", "no_resize_control", "control_resolution",
    "flux_kontext_no_resize_control", "qwen_image_edit_no_resize_control", "qwen_image_edit_control_resolution",
    "video_directory", "video_jsonl_file", "target_frames", "frame_extraction", "frame_stride", "frame_sample",
    "max_frames", "source_fps", "fp_latent_window_size", "fp_1f_clean_indices", "fp_1f_target_index", "fp_1f_no_post",
)


def peer_dataset_hint(key: str, source: str) -> str:
    """The end of the unknown-key line for `key` in the dataset TOML `source`: '' unless a peer's key."""
    if key not in MUSUBI_DATASET_KEYS:
        return ""
    return (f"; {source} is a musubi-tuner dataset TOML: `python tools/convert_config.py <its training config> "
            f"--dataset_config {source}` writes it as ours")
