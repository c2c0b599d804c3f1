"""ERNIE-Image: Baidu's text-to-image diffusion transformer."""
