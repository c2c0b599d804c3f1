"""FLUX.3: Black Forest Labs' third FLUX transformer (per-mode blocks, then joint single blocks)."""
