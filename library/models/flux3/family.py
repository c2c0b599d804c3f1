"""FLUX.3 [klein] as a diffusion family: the BFL-named transformer (model.py, loaded by checkpoint.py), FLUX.2's
VAE (the same AutoencoderKLFlux2 with BatchNorm-normalised patchified latents: flux2/vae.py, which this folder
builds on) and Qwen3-VL-4B text, 8 stacked hidden states per token, each caption its own window of a multiple
of 80 tokens that the transformer sees whole, pads included (text_encoder.py).

Releases, read from the transformer checkpoint: a flow-map model (`ref_time_in`: the step-distilled
flux-3-image-klein) or the base (flux-3-image-klein-base). Inference as diffusers' modular FLUX.3 pipelines run
it: a constant shift 6.93 (spec.py SAMPLING); the base over 50 steps with classifier-free guidance 3.5 and the
empty negative prompt, pred = uncond + g (cond - uncond); the distilled model over 16 steps without CFG, each
step also given the sigma it jumps to (the schedule's next, 0 after the last: target_timestep). Training on the
distilled model (not its purpose: LoRAs train on the base) passes the sigma itself as the target: a jump of
length 0 is the instantaneous velocity, the flow-matching target.

Positions: image tokens (0, row / 2, col / 2, l) float32 (image_rope_scale 0.5: never in the compute dtype,
model.py), text tokens (0, 0, 0, index).

References (the image-conditioned pipeline, a dataset's control_directory, a sample prompt's --ci): each
reference's latent is packed like the target's and given to the transformer as `image_cond` tokens (their own
per-mode blocks, modulated at timestep 0, no output) at l = -(1 + k) (Flux3PrepareImageCondLatentsStep); the
text encoder never sees them. Each is sized as the pipeline sizes several references (its "crop" mode: its own
size up to 1 MP, sides floored to 16: FLUX.2's references.py rule). One reference alone the pipeline keeps
whole up to 4 MP, reflect-padded to the token grid, and crops the output back to it ("fill"): not reproduced
here, a single reference is sized as one of several.

Text of a batch: captions whose windows differ are run in groups of one window each (predict), as diffusers
never masks the text and any token added to a window would change its prediction (text_encoder.py).
"""

from __future__ import annotations

import functools

import torch

from library.models.family import CheckpointNames, DiffusionFamily, ModelFile, file_fingerprint
from library.models.flux3.spec import SPEC

BASE, DISTILLED = "flux3", "flux3-distilled"  # model_version, as diffusers' single-file types flux-3-image(-distilled)


class Flux3Family(DiffusionFamily):
    """FLUX.3 [klein]: BFL module names, 32 latent channels, Qwen3-VL text (8 layers per token, unmasked windows),
    CFG for the base, a flow map (target sigma) for the distilled model."""

    name = "flux3"
    vae = "library.models.flux2.vae:Flux2VAE"  # its VAE wrapper (DiffusionFamily.load_vae / vae_on_meta)
    text_path_keys = ("text_encoder",)
    sample_guidance = SPEC.sample_guidance["base"]  # the base pipeline's guidance_scale (the distilled reads none)
    true_cfg = True  # the base: the negative prompt ("" unless --n) encoded for samples (guided_velocity decides)
    latent_channels = 32
    max_controls = 4  # the pipeline takes any number, each at its own l; four as the other edit models
    plan_controls = 0  # a text-to-image model first: presets plan none, a dataset's references are counted

    # -- the release ---------------------------------------------------------------------------
    @functools.cached_property
    def is_distilled(self) -> bool:
        """The step-distilled flow map: its checkpoint has `ref_time_in` (read from the key names, no weights)."""
        from library.io import component_folder

        path = component_folder(self.model_path, "transformer")
        return _has_flow_map_keys(path, file_fingerprint(path))

    def model_version(self, model) -> str:
        return DISTILLED if model.config.flow_map else BASE

    @property
    def sample_steps(self) -> int:
        """Default --s: the pipelines' 50 (base), 16 (distilled)."""
        return SPEC.sample_steps["distilled" if self.is_distilled else "base"]

    def unread_sample_options(self) -> dict[str, str]:
        if self.is_distilled:
            return dict.fromkeys(("negative", "guidance"), f"{self.model_path} is the step-distilled FLUX.3: it "
                                                           f"samples without CFG")
        return {}

    # -- loading -------------------------------------------------------------------------------
    def model_files(self) -> list[ModelFile]:
        from library.models.vae import vae_markers

        return [
            ModelFile("ae", self.vae_path, "a FLUX.2 VAE (32 latent channels)", "vae",
                      {**vae_markers(self.latent_channels), "bn.running_mean": None}),  # the BatchNorm of its latents
            ModelFile("text_encoder", self.text_paths["text_encoder"], "a Qwen3-VL language model", "text_encoder",
                      {"embed_tokens.weight": None, "layers.0.self_attn.q_norm.weight": None},
                      (None, "tokenizer", "Qwen2")),  # as its loader looks for the tokenizer
        ]

    def text_widths(self, config) -> dict[str, int]:
        """txt_in takes the 8 stacked hidden states side by side."""
        from library.models.flux3.text_encoder import FLUX3_TAPS

        return {"text_encoder": config.context_in_dim // len(FLUX3_TAPS)}

    def text_on_meta(self, model, batch, tokens):
        # every caption's window `tokens` long, pads included (one window: no grouping, no mask read on the host)
        return {"embeds": torch.empty(batch, tokens, model.config.context_in_dim, device="meta")}

    @classmethod
    def checkpoint_names(cls, keys, shape):
        """Our (BFL's) names, plain or behind a ComfyUI prefix, or a diffusers folder's (renamed through the
        module map, the final adaLN's halves swapped; nothing fused)."""
        from library.models.flux3.checkpoint import BFL_PREFIXES, FLUX3_MARKERS, names_for
        from library.models.flux3.lora_files import linear_names, row_map

        bfl, diffusers = FLUX3_MARKERS
        prefix = next((p for p in BFL_PREFIXES if p + bfl in keys), None)
        if prefix is not None:
            return CheckpointNames("bfl", prefix)
        if diffusers not in keys:
            return None
        names = linear_names(names_for(keys, diffusers=True))
        table = row_map(names, {ours: shape(theirs + ".weight")[0] for ours, theirs in names.items()})
        return CheckpointNames("diffusers", "", table, native=False)

    # -- text ----------------------------------------------------------------------------------
    def text_encoding_constants(self) -> dict:
        from library.models.flux3 import text_encoder as te

        return {"taps": list(te.FLUX3_TAPS), "max_length": te.FLUX3_MAX_SEQUENCE_LENGTH,
                "pad_multiple": te.FLUX3_PAD_MULTIPLE, "pad_position": te.FLUX3_PAD_POSITION,
                "fallback_template": te.QWEN3_VL_USER_PROMPT}

    def caption_token_limit(self, args):
        """The pipeline cuts the chat text (template included) at max_sequence_length (8192) tokens."""
        from library.data.check import TokenLimit
        from library.models.flux3 import text_encoder as te

        tokenizer = te.load_flux3_tokenizer(self.text_paths["text_encoder"])
        return TokenLimit("Qwen3-VL", te.FLUX3_MAX_SEQUENCE_LENGTH,
                          lambda text: len(tokenizer(te.flux3_prompt_text(tokenizer, text), verbose=False).input_ids))

    def load_text_encoder(self, precision="bf16", device=None):
        from library.models.flux3.text_encoder import load_flux3_text_encoder
        from library.models.text_encoders import encoder_precision

        dtype, fp8 = encoder_precision(precision)
        encoder = load_flux3_text_encoder(self.text_paths["text_encoder"], dtype=dtype, fp8=fp8)
        encoder.llm.to(device)

        def encode(captions: list[str]) -> list[dict]:
            embeds, mask = encoder.encode(captions)  # [B, T, 8 D] float32, mask: each caption's window
            return [{"embeds": e[: int(m.sum())], "mask": m[: int(m.sum())]} for e, m in zip(embeds, mask)]

        return encode

    def text_encoder_weights(self):
        """The embeddings and the decoder layers up to the deepest stacked state (32 of Qwen3-VL-4B's 36) and the
        final norm; no head, no vision tower (llm.checkpoint_key_to_llm's mapping)."""
        from library.models.flux3.text_encoder import FLUX3_TAPS
        from library.models.text_encoders import qwen3_vl_text_weights

        return [qwen3_vl_text_weights(self.text_paths["text_encoder"], max(FLUX3_TAPS))]

    # -- references ----------------------------------------------------------------------------
    def control_bucket(self, bucket, size, resolution=None):
        """The pipeline's size for one of several references, whatever the target's: its own up to 1024 x 1024
        pixels (larger ones scaled to that area), sides floored to 16 (flux2/references.py; module docstring)."""
        from library.models.flux2.references import condition_size

        return condition_size(size)

    def reference_resize(self, bucket, size):
        """The pipeline's pixels for one of several references: resized (Lanczos) only over 1 MP, then
        centre-cropped (its _resize_if_exceeds_area, as FLUX.2's)."""
        from library.models.flux2.references import resized_size

        return resized_size(size)

    def largest_reference(self, bucket):
        """The planner's reference without files: one of 1024 x 1024 pixels, the most a reference keeps."""
        return 1024, 1024

    # -- the denoiser --------------------------------------------------------------------------
    def predict(self, model, x_t, sigmas, text, h, w, guidance, control=None, target_sigmas=None):
        """x_t: the packed noisy target [B, h*w, 128]; text: embeds [B, T, 8 D] (mask [B, T]: each caption's
        window, where a batch's windows differ); control: reference latents [B, 32, H_k, W_k] (float32,
        BN-normalised as the target's); target_sigmas [B]: the sigma a flow-map model's step jumps to (default:
        sigmas, the instantaneous velocity). Returns the target tokens' velocity [B, h*w, 128]."""
        windows = caption_windows(text, x_t.shape[0])
        if len(set(windows)) == 1:
            return self._forward(model, x_t, sigmas, text["embeds"][:, : windows[0]], h, w, control, target_sigmas)
        parts, order = [], []
        for window in sorted(set(windows)):  # one forward per window length: each caption sees only its own
            rows = torch.tensor([i for i, n in enumerate(windows) if n == window], device=x_t.device)
            pick = lambda t: None if t is None else t.index_select(0, rows.to(t.device))  # noqa: E731
            parts.append(self._forward(model, pick(x_t), pick(sigmas), pick(text["embeds"])[:, :window], h, w,
                                       [pick(c) for c in control] if control else None, pick(target_sigmas)))
            order.append(rows)
        return torch.cat(parts).index_select(0, torch.argsort(torch.cat(order)))

    def _forward(self, model, x_t, sigmas, txt, h, w, control, target_sigmas):
        from library.models.flux3.model import make_img_ids, make_txt_ids

        b, device = x_t.shape[0], x_t.device
        txt = txt.to(device)
        cond, cond_ids = reference_tokens(control or [], b, device, x_t.dtype)
        target = (sigmas if target_sigmas is None else target_sigmas) if model.config.flow_map else None
        return model(img=x_t, img_ids=make_img_ids(b, h, w, device=device), txt=txt,
                     txt_ids=make_txt_ids(b, txt.shape[1], device), timesteps=sigmas, img_cond=cond,
                     img_cond_ids=cond_ids, target_timesteps=target)

    def guided_velocity(self, model, x, s, text, negative_text, h, w, guidance, control=None):
        """The base pipeline's ClassifierFreeGuidance: uncond + g (cond - uncond) when g > 1, the references in
        both passes; the distilled model never (sample_latents)."""
        cond = self.predict(model, x, s, text, h, w, guidance, control).float()
        if model.config.flow_map or negative_text is None or guidance is None or guidance <= self.cfg_above:
            return cond
        uncond = self.predict(model, x, s, negative_text, h, w, guidance, control).float()
        return uncond + guidance * (cond - uncond)

    @torch.no_grad()
    def sample_latents(self, model, text, width, height, steps, seed, guidance, negative_text=None, control=None,
                       flow_shift=None):
        """The base: the shared Euler sampler (DiffusionFamily). The flow map: the same schedule and noise, each step
        given the sigma it jumps to, as Flux3DistilledLoopDenoiser passes target_timestep; no CFG."""
        from library.models import flow_matching as fm

        if not model.config.flow_map:
            return super().sample_latents(model, text, width, height, steps, seed, guidance, negative_text,
                                          control, flow_shift)
        lh, lw = height // self.vae_downsample, width // self.vae_downsample
        h, w = lh // self.patch, lw // self.patch
        embeds = text["embeds"]
        noise = self.initial_noise(embeds.shape[0], lh, lw, torch.Generator("cpu").manual_seed(seed)).to(embeds.device)
        sigmas = fm.inference_sigmas(steps, h * w, self.arch, sampling=self.inference_sampling(), shift=flow_shift)
        x = self.pack_target(noise)
        for s, s_next in zip(sigmas[:-1].to(x.device), sigmas[1:].to(x.device)):
            at = lambda v: v.expand(x.shape[0])  # noqa: E731
            x = x + (s_next - s) * self.predict(model, x, at(s), text, h, w, None, control, at(s_next)).float()
        return self.unpack_target(x, noise.shape)

    def initial_noise(self, batch, lh, lw, generator):
        # Flux3PrepareLatentsStep draws [B, 4C, lh/2, lw/2] (patchified) in float32, then packs.
        from library.models.latents import unpatchify

        return unpatchify(torch.randn(batch, 4 * self.latent_channels, lh // 2, lw // 2, generator=generator,
                                      dtype=torch.float32))


@functools.lru_cache(maxsize=16)
def _has_flow_map_keys(path: str, fingerprint: str) -> bool:
    from library.io import CheckpointReader

    return any("ref_time_in." in k or "target_timestep_embedder." in k for k in CheckpointReader(path).keys())


def caption_windows(text: dict, batch: int) -> list[int]:
    """Each caption's window length: its mask's count where the batch carries one (collate zero-pads shorter
    windows), else the whole text length."""
    mask = text.get("mask")
    if mask is None:
        return [text["embeds"].shape[1]] * batch
    return [int(n) for n in mask.sum(1).tolist()]


def reference_tokens(control: list[torch.Tensor], batch: int, device, dtype):
    """(tokens [B, R, 128], ids [B, R, 4] float32) of reference latents [B, 32, H_k, W_k], each packed as the target
    at l = -(1 + k) (Flux3PrepareImageCondLatentsStep); (None, None) without references."""
    from library.models.flux3.model import make_img_ids
    from library.models.latents import pack_latents

    if not control:
        return None, None
    tokens, ids = [], []
    for k, ref in enumerate(control):
        if ref.ndim != 4 or ref.shape[0] != batch or ref.shape[1] != 32 or ref.shape[2] % 2 or ref.shape[3] % 2:
            raise ValueError(f"reference latent {k} has shape {tuple(ref.shape)}; expected [{batch}, 32, h, w] with "
                             f"even h and w (2x2 patches)")
        tokens.append(pack_latents(ref.to(device=device, dtype=dtype)))
        ids.append(make_img_ids(batch, ref.shape[2] // 2, ref.shape[3] // 2, l=-(1 + k), device=device))
    return torch.cat(tokens, dim=1), torch.cat(ids, dim=1)
