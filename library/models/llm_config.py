"""The configuration of the LLM core's decoders (library/models/llm.py): LLMConfig, read from and written to a
Hugging Face config.json, and the released models' shapes that the diffusion text encoders use."""

from __future__ import annotations

from dataclasses import dataclass

from library.models.llm_rope import RopeScaling

# ----------------------------------------------------------------------------------------------
# Config


# config.json model_types read (a nested text_config's first): Gemma 1 / 3 and Granite would load name for name
# into these layers and compute something else (norms, multipliers, q/k norms); MoEs have experts.
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2")
VL_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")  # the MLP gate's activation: SwiGLU (Llama, Qwen) / GeGLU (Gemma 2)
REQUIRED_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
# transformers' max_position_embeddings where a config.json leaves it out (dynamic RoPE and the context check read it)
DEFAULT_MAX_POSITIONS = {"llama": 2048, "mistral": 131072, "qwen2": 32768, "qwen3": 32768, "gemma2": 8192}
# transformers' Gemma2Config defaults (configuration_gemma2.py) for what a gemma2 config.json leaves out
GEMMA2_DEFAULTS = {"query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
                   "sliding_window": 4096, "tie_word_embeddings": True}


@dataclass(frozen=True)
class LLMConfig:
    """Architecture of a Llama/Mistral/Qwen2/Qwen3/Gemma 2 decoder. Defaults are the Qwen2.5-VL-7B language model.

    head_dim: 0 = hidden_size // num_heads (Llama, Qwen2); Qwen3 and Mistral Small 3.1 set it
    explicitly (128 for Qwen3-4B, whose hidden_size 2560 / 32 heads would give 80, and for Mistral
    Small 3.1: 5120 / 32 = 160). qk_norm: Qwen3's RMSNorm over head_dim on each query and key head,
    applied before RoPE. Mistral is Llama with an explicit head_dim (and maybe a sliding_window on every layer)."""

    vocab_size: int = 152064
    hidden_size: int = 3584
    num_layers: int = 28
    num_heads: int = 28
    num_kv_heads: int = 4
    intermediate_size: int = 18944
    rope_theta: float = 1000000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = True
    max_position_embeddings: int = 128000
    head_dim: int = 0
    qk_norm: bool = False
    # Qwen2.5-VL's M-RoPE: frequency bands rotated by (time, height, width) ids when 3-axis
    # positions are given (image tokens); () = 1-D RoPE only. Text-only input never needs it.
    mrope_section: tuple[int, ...] = ()
    mrope_interleaved: bool = False  # Qwen3-VL: the axes' frequencies interleaved (core.mrope_tables)
    rope_scaling: RopeScaling | None = None  # linear / dynamic / yarn / llama3 frequencies (llm_rope.py)
    # Sliding-window attention: the layers in window_layers let query i see keys i - sliding_window + 1 .. i only
    # (transformers' rule); 0 / () = none. Mistral-7B-v0.1: 4096 on every layer; Qwen2 / Qwen3 with
    # use_sliding_window: the layers from max_window_layers on (or those layer_types names sliding_attention).
    sliding_window: int = 0
    window_layers: tuple[int, ...] = ()
    # Gemma 2 (transformers' modeling_gemma2.py; every default below is the Llama-like one, so the others are
    # untouched): gemma_norms = RMSNorm computing x * (1 + w) in float32 (weights stored as the offset from 1) and
    # four per layer (input, post_attention on the attention output before the residual add, pre_feedforward,
    # post_feedforward); scale_embeddings = the token embeddings times sqrt(hidden_size) in the hidden dtype;
    # hidden_act = the MLP gate's activation (gelu_pytorch_tanh: gelu(gate, tanh) * up); query_pre_attn_scalar = the
    # attention scale's base (scale = it ** -0.5; 0 = head_dim); attn_logit_softcapping / final_logit_softcapping =
    # tanh(s / c) * c on the attention scores / the logits (0 = none).
    hidden_act: str = "silu"
    gemma_norms: bool = False
    scale_embeddings: bool = False
    query_pre_attn_scalar: int = 0
    attn_logit_softcapping: float = 0.0
    final_logit_softcapping: float = 0.0

    def __post_init__(self):
        object.__setattr__(self, "mrope_section", tuple(self.mrope_section))
        object.__setattr__(self, "window_layers", tuple(self.window_layers) if self.sliding_window else ())
        if self.sliding_window and not (self.window_layers and all(0 <= i < self.num_layers for i in self.window_layers)):
            raise ValueError(f"LLMConfig: sliding_window {self.sliding_window} with window_layers {self.window_layers}: "
                             f"expected the indices (below num_layers {self.num_layers}) of the layers it applies to")
        if self.num_heads % self.num_kv_heads or (not self.head_dim and self.hidden_size % self.num_heads):
            raise ValueError(
                f"LLMConfig: hidden_size {self.hidden_size}, num_heads {self.num_heads}, num_kv_heads "
                f"{self.num_kv_heads}: expected num_heads % num_kv_heads == 0 and, without an explicit "
                f"head_dim, hidden_size % num_heads == 0"
            )
        if not self.head_dim:  # frozen dataclass: fill the derived default once
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"LLMConfig: hidden_act {self.hidden_act!r}: expected one of {', '.join(HIDDEN_ACTS)}")

    @property
    def attention_scale(self) -> float:
        """The factor on q.k: query_pre_attn_scalar ** -0.5 (Gemma 2), else head_dim ** -0.5."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def context_length(self) -> int:
        """The longest sequence the model is for: max_position_embeddings, or what a yarn rope_scaling
        stretches the pretraining context to (Qwen2.5 / Qwen3 with factor 4: 131072)."""
        return max(self.max_position_embeddings, self.rope_scaling.context_length() if self.rope_scaling else 0)

    @classmethod
    def from_hf(cls, config: dict) -> "LLMConfig":
        """From a Hugging Face config.json dict (llama, qwen2, qwen3, qwen2_5_vl with or without a
        nested `text_config`). Features this model does not implement are refused, not ignored."""
        model_type = config.get("model_type", "")
        if "text_config" in config:  # Qwen2.5-VL (transformers >= 4.52), Mistral3: the language model nested
            model_type = config["text_config"].get("model_type", model_type)  # e.g. mistral3 -> mistral
            config = {**config, **config["text_config"]}
        if model_type and (not (model_type in MODEL_TYPES or model_type.startswith(VL_MODEL_TYPES)) or "moe" in model_type):
            raise ValueError(f"config.json: model_type '{model_type}' is not supported (expected {', '.join(MODEL_TYPES)} "
                             f"or the language model of a Qwen-VL / Mistral3 config): its layers are not Llama's")
        quant = config.get("quantization_config")
        if quant:  # its scales / packed weights would be read as (or next to) plain weights
            raise ValueError(f"config.json: quantization_config (quant_method {quant.get('quant_method')!r}): a Hugging "
                             f"Face quantized checkpoint is not read; give the bf16 model (base_precision fp8 / nf4 "
                             f"quantizes it while loading) or a plain fp8 one")
        max_positions = config.get("max_position_embeddings") or DEFAULT_MAX_POSITIONS.get(model_type, 4096)
        config = {**config, "max_position_embeddings": max_positions}  # rope_scaling's defaults read it too
        rope_key = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
        rope = config.get(rope_key) or {}
        rope_scaling = RopeScaling.from_hf(config, rope_key)  # None: plain RoPE (default, mrope)
        if rope_scaling and rope.get("mrope_section"):
            raise ValueError(f"config.json: {rope_key} rope_type '{rope_scaling.rope_type}' with mrope_section is not supported")
        is_qwen3 = model_type in ("qwen3", "qwen3_vl_text")  # Qwen3-VL's language model is Qwen3 (QK norm, no bias)
        # transformers' Llama, Mistral, Qwen2 and Qwen3 attention all take an explicit head_dim when given
        # (Mistral Small 3.1: 128, where 5120 / 32 heads would give 160)
        head_dim = config.get("head_dim") or 0
        if config.get("mlp_bias"):
            raise ValueError("config.json: mlp_bias is not supported")
        is_gemma2 = model_type == "gemma2"
        if is_gemma2:  # what its config.json leaves out is transformers' Gemma2Config default
            config = {**GEMMA2_DEFAULTS, **{k: v for k, v in config.items() if v is not None or k not in
                                            ("query_pre_attn_scalar", "tie_word_embeddings")}}
            if config.get("use_bidirectional_attention"):
                raise ValueError("config.json: use_bidirectional_attention is not supported (a causal decoder)")
        # Gemma 2 names it hidden_activation (transformers reads only that one there); the others hidden_act
        act = config.get("hidden_activation") or "gelu_pytorch_tanh" if is_gemma2 else config.get("hidden_act", "silu")
        expected, key = ("gelu_pytorch_tanh", "hidden_activation") if is_gemma2 else ("silu", "hidden_act")
        if act != expected:  # transformers' MLP takes any; ours the released one's
            raise ValueError(f"config.json: {key} '{act}' is not supported (expected {expected})")
        is_qwen2 = model_type.startswith("qwen2")  # Qwen2 / Qwen2.5-VL: bias on q, k, v (not o)
        missing = [k for k in REQUIRED_KEYS if config.get(k) is None]
        if missing:  # transformers would build its own default shape (Llama-2-7B's) and load nothing into it
            raise ValueError(f"config.json: no {', '.join(missing)} (expected the model's shape: {', '.join(REQUIRED_KEYS)})")
        sliding_window, window_layers = _sliding_window(config, model_type)
        if config.get("attention_bias") and not is_qwen2:
            raise ValueError(f"config.json: attention_bias=true with model_type '{model_type}' (bias on o_proj too) is not supported")
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=config["num_attention_heads"],
            num_kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
            intermediate_size=config["intermediate_size"],
            rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),  # transformers' default for all four
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=is_qwen2,
            max_position_embeddings=config["max_position_embeddings"],
            head_dim=head_dim,
            qk_norm=is_qwen3,
            # Qwen2.5-VL configs name the sections under rope type "mrope" or (transformers >= 4.5x) "default"
            mrope_section=tuple(rope.get("mrope_section") or ()),
            mrope_interleaved=bool(rope.get("mrope_interleaved", False)),
            rope_scaling=rope_scaling,
            sliding_window=sliding_window,
            window_layers=window_layers,
            hidden_act=act,
            gemma_norms=is_gemma2,
            scale_embeddings=is_gemma2,
            query_pre_attn_scalar=int(config["query_pre_attn_scalar"]) if is_gemma2 else 0,
            attn_logit_softcapping=float(config.get("attn_logit_softcapping") or 0.0) if is_gemma2 else 0.0,
            final_logit_softcapping=float(config.get("final_logit_softcapping") or 0.0) if is_gemma2 else 0.0,
        )

    def to_hf(self) -> dict:
        """A Hugging Face config.json dict (qwen3 when qk_norm, qwen2 when qkv_bias, else llama;
        a Mistral without sliding window is a Llama with an explicit head_dim) that from_hf reads back."""
        if self.gemma_norms:
            return self._gemma2_to_hf()
        if self.qk_norm and self.qkv_bias:
            raise ValueError("LLMConfig.to_hf: qk_norm with qkv_bias has no Hugging Face model type")
        gemma = (self.scale_embeddings, self.hidden_act != "silu", self.query_pre_attn_scalar,
                 self.attn_logit_softcapping, self.final_logit_softcapping)
        if any(gemma):
            raise ValueError("LLMConfig.to_hf: Gemma 2's embedding scale, activation, attention scale or softcaps "
                             "without its norms (gemma_norms) have no Hugging Face model type")
        every_layer = self.window_layers == tuple(range(self.num_layers))
        if self.sliding_window and not (self.qk_norm or self.qkv_bias or every_layer):
            raise ValueError(f"LLMConfig.to_hf: sliding_window on layers {self.window_layers} of {self.num_layers} without "
                             f"qk_norm or qkv_bias has no model type (Mistral's window covers every layer)")
        model_type = "qwen3" if self.qk_norm else "qwen2" if self.qkv_bias else "mistral" if self.sliding_window else "llama"
        arch = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
                "llama": "LlamaForCausalLM"}[model_type]
        return {
            "architectures": [arch],
            "model_type": model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            **({"head_dim": self.head_dim} if self.qk_norm or self.head_dim != self.hidden_size // self.num_heads else {}),
            "intermediate_size": self.intermediate_size,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            **({"rope_scaling": self.rope_scaling.to_hf()} if self.rope_scaling else {}),
            **({"sliding_window": self.sliding_window} if self.sliding_window else {}),
            **(self._window_to_hf() if self.sliding_window and model_type != "mistral" else {}),
            "hidden_act": "silu",
        }

    def _gemma2_to_hf(self) -> dict:
        """Gemma2ForCausalLM's config.json (transformers' names; layer_types tells the window layers)."""
        if self.qk_norm or self.qkv_bias or self.rope_scaling or self.mrope_section or not self.scale_embeddings:
            raise ValueError("LLMConfig.to_hf: gemma_norms with qk_norm, qkv_bias, a scaled / multimodal RoPE or "
                             "unscaled embeddings has no Hugging Face model type (Gemma 2 has none of them)")
        layer_types = ["sliding_attention" if i in self.window_layers else "full_attention" for i in range(self.num_layers)]
        return {
            "architectures": ["Gemma2ForCausalLM"],
            "model_type": "gemma2",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "query_pre_attn_scalar": self.query_pre_attn_scalar or self.head_dim,
            "attn_logit_softcapping": self.attn_logit_softcapping or None,
            "final_logit_softcapping": self.final_logit_softcapping or None,
            "sliding_window": self.sliding_window or None,
            "layer_types": layer_types,
            "hidden_activation": self.hidden_act,
        }

    def _window_to_hf(self) -> dict:
        """Qwen2 / Qwen3's switch and layers: layer_types (transformers 5.x reads it) and max_window_layers (4.x)."""
        layer_types = ["sliding_attention" if i in self.window_layers else "full_attention" for i in range(self.num_layers)]
        return {"use_sliding_window": True, "max_window_layers": min(self.window_layers), "layer_types": layer_types}


# max_window_layers where a config.json with use_sliding_window leaves it out (transformers' defaults)
DEFAULT_MAX_WINDOW_LAYERS = {"qwen2": 28, "qwen3": 28, "qwen2_vl": 80, "qwen2_5_vl": 80}


def _sliding_window(config: dict, model_type: str) -> tuple[int, tuple[int, ...]]:
    """(sliding_window, window_layers) as transformers reads a config.json. Mistral: `sliding_window` on every
    layer whenever it is set (transformers' default 4096; Mistral Small 3.1: null). Qwen2 / Qwen3 (and the
    Qwen2-VL / Qwen2.5-VL language models): only with use_sliding_window, on the layers layer_types names
    sliding_attention, or without layer_types those from max_window_layers on. What transformers cannot run
    (sliding layers without the switch or a window) and models whose attention has no window are refused."""
    layer_types = config.get("layer_types") or []
    if model_type == "mistral":
        window = config.get("sliding_window", 4096) or 0
        return window, tuple(range(config["num_hidden_layers"])) if window else ()
    if model_type == "gemma2":  # always on; without layer_types every other layer from layer 0 (Gemma2Config's)
        window, n = config.get("sliding_window") or 0, config["num_hidden_layers"]
        layer_types = layer_types or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
        if len(layer_types) != n:
            raise ValueError(f"config.json: layer_types has {len(layer_types)} entries for num_hidden_layers {n}")
        layers = tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
        return (int(window), layers) if window and layers else (0, ())
    family = max((k for k in DEFAULT_MAX_WINDOW_LAYERS if model_type.startswith(k)), key=len, default=None)
    if family is None or (family == "qwen3" and model_type != "qwen3"):  # Llama, Qwen3-VL: no window in transformers
        if config.get("use_sliding_window") or "sliding_attention" in layer_types:
            raise ValueError(f"config.json: use_sliding_window / sliding_attention layers with model_type '{model_type}' "
                             f"are not supported (its attention has no window in transformers)")
        return 0, ()
    window = config.get("sliding_window", 4096) if config.get("use_sliding_window") else None  # transformers' default
    if not window:
        if "sliding_attention" in layer_types:  # transformers raises "Could not find a `sliding_window`" here
            raise ValueError("config.json: layer_types names sliding_attention layers without use_sliding_window and "
                             "a sliding_window (expected both)")
        return 0, ()
    n = config["num_hidden_layers"]
    if layer_types and len(layer_types) != n:
        raise ValueError(f"config.json: layer_types has {len(layer_types)} entries for num_hidden_layers {n}")
    if not layer_types:
        first = config.get("max_window_layers", DEFAULT_MAX_WINDOW_LAYERS[family])
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    layers = tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
    return (int(window), layers) if layers else (0, ())


QWEN2_5_7B = LLMConfig()
LLAMA3_8B = LLMConfig(
    vocab_size=128256,
    hidden_size=4096,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    intermediate_size=14336,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    qkv_bias=False,
    max_position_embeddings=8192,
)
# Qwen/Qwen3-4B and Qwen/Qwen3-8B, as diffusion text encoders use them (3 stacked layers of their
# hidden sizes = a transformer's joint_attention_dim 7680 / 12288).
QWEN3_4B = LLMConfig(
    vocab_size=151936, hidden_size=2560, num_layers=36, num_heads=32, num_kv_heads=8, intermediate_size=9728,
    rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, qkv_bias=False,
    max_position_embeddings=40960, head_dim=128, qk_norm=True,
)
QWEN3_8B = LLMConfig(
    vocab_size=151936, hidden_size=4096, num_layers=36, num_heads=32, num_kv_heads=8, intermediate_size=12288,
    rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, qkv_bias=False,
    max_position_embeddings=40960, head_dim=128, qk_norm=True,
)

# The language model of Qwen/Qwen3-VL-4B-Instruct (its config.json text_config: Qwen3 layers, interleaved
# M-RoPE sections (24, 20, 20), theta 5e6), as a diffusion text encoder reads a single file without config.json.
QWEN3_VL_4B = LLMConfig(
    vocab_size=151936, hidden_size=2560, num_layers=36, num_heads=32, num_kv_heads=8, intermediate_size=9728,
    rope_theta=5000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, qkv_bias=False,
    max_position_embeddings=262144, head_dim=128, qk_norm=True, mrope_section=(24, 20, 20), mrope_interleaved=True,
)
# Qwen/Qwen3-VL-8B-Instruct's (Qwen3-8B's layers with Qwen3-VL's RoPE; an lm_head of its own).
QWEN3_VL_8B = LLMConfig(
    vocab_size=151936, hidden_size=4096, num_layers=36, num_heads=32, num_kv_heads=8, intermediate_size=12288,
    rope_theta=5000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, qkv_bias=False,
    max_position_embeddings=262144, head_dim=128, qk_norm=True, mrope_section=(24, 20, 20), mrope_interleaved=True,
)

# The language model of Mistral Small 3.1 24B (Mistral3ForConditionalGeneration's text_config), as a
# diffusion text encoder uses it (3 x 5120 stacked layers = a transformer's joint_attention_dim 15360).
MISTRAL_SMALL_3_1 = LLMConfig(
    vocab_size=131072, hidden_size=5120, num_layers=40, num_heads=32, num_kv_heads=8, intermediate_size=32768,
    rope_theta=1000000000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, qkv_bias=False,
    max_position_embeddings=131072, head_dim=128,
)

# google/gemma-2-2b's config.json (a diffusion family's text encoder; sd-scripts' load_gemma2 builds the same):
# 26 layers, every other one (0, 2, ..., 24) with a 4096-token window, scale 256 ** -0.5, softcaps 50 / 30.
GEMMA2_2B = LLMConfig(
    vocab_size=256000, hidden_size=2304, num_layers=26, num_heads=8, num_kv_heads=4, intermediate_size=9216,
    rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, qkv_bias=False, max_position_embeddings=8192,
    head_dim=256, sliding_window=4096, window_layers=tuple(range(0, 26, 2)), hidden_act="gelu_pytorch_tanh",
    gemma_norms=True, scale_embeddings=True, query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
    final_logit_softcapping=30.0,
)
