"""Caption a folder of images with a vision-language model (Qwen2.5-VL or Qwen3-VL, through
transformers): one caption file per image, beside it, as training reads them.

    python tools/caption_images.py --model Qwen2.5-VL-7B-Instruct --images data/cat --preset sentence --prefix "ohwx cat"
    python tools/caption_images.py --model Qwen3-VL-8B-Instruct --images data --preset tags --batch_size 8 --device cuda
    python tools/caption_images.py --model Qwen3-VL-8B-Instruct --images data --prompt "Describe the lighting." --overwrite
    python tools/caption_images.py --model REPO/text_encoder --processor REPO/processor --images data  # a diffusers repo's Qwen2.5-VL

--model is a Hugging Face model folder (config.json with model_type qwen2_5_vl or qwen3_vl, safetensors
weights); its image processor (preprocessor_config.json), tokenizer and chat template come from the same
folder unless --processor names another. Images are found recursively (.png .jpg .jpeg .webp .bmp; hidden
folders such as .ipynb_checkpoints are skipped, as training skips them); each
gets `<stem>.txt` (--caption_extension), written atomically, so a run stopped at any point leaves whole
captions only; two images that would share a caption file (a.png and a.jpg) are refused before
any caption is written. Existing captions are kept (--skip_existing, the default; an empty caption file counts as
none): running the same command again captions what is left. --overwrite captions everything anew. Ctrl-C finishes the batch in progress,
writes it and stops (a second Ctrl-C stops at once).

Prompts: --preset tags | sentence | detailed, or --prompt TEXT; --prefix (a trigger word) starts every
caption ("ohwx cat, a cat on a sofa"). --max_new_tokens bounds the caption's length in tokens.
Precision: --dtype bf16 (default on CUDA) or fp32 (default on CPU); --quantize stores the language
model's Linears in fp8 (our FP8Linear, any device: fp8 = plain cast, fp8_scaled = block-scaled) or nf4
(bitsandbytes 4-bit, CPU or CUDA; needs widths that are multiples of 64, as released models have); the
vision tower stays in --dtype. Errors (an unreadable image, one whose aspect ratio is over the processor's
200, a folder that is no supported model):
one line, exit status 2, before any caption is written.

Not supported yet: Florence-2 (transformers 5 has its architecture natively, but this tool does not
load it), Qwen2-VL and the MoE Qwen3-VL models.
"""

from __future__ import annotations

import json
import os
import sys
import time

if __package__ in (None, ""):  # run as a script: make `library` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from library.errors import INTERRUPTED  # noqa: E402
from tools.cli import Parser, check_command_line, one_line, exit_without_collecting  # noqa: E402
from library.models.registry import arch_spec  # noqa: E402

# The prompt of each preset: what the model is asked for every image.
PRESETS = {
    "tags": "List what this image shows as short comma-separated tags: subjects, their attributes, actions, setting, "
            "style and medium, most important first. Output only the tags.",
    "sentence": "Describe this image in one sentence.",
    "detailed": "Describe this image in detail in one paragraph of plain prose: the subjects and their appearance, "
                "what they do, the setting, lighting, colors, composition and style.",
}
# config.json model_type -> the transformers class that generates with it.
MODEL_CLASSES = {"qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration", "qwen3_vl": "Qwen3VLForConditionalGeneration"}
# What each model's chat template renders before the user's message when no system message is given
# (used only when neither the tokenizer nor its folder has a chat template).
DEFAULT_SYSTEM = {"qwen2_5_vl": "You are a helpful assistant.", "qwen3_vl": None}
QUANTIZE = ("fp8", "fp8_scaled", "nf4")


def build_parser() -> Parser:
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="Qwen2.5-VL / Qwen3-VL model folder (Hugging Face layout)")
    p.add_argument("--images", required=True, help="folder of images (searched recursively)")
    p.add_argument("--processor", default=None, help="folder of the image processor, tokenizer and chat template "
                                                     "(default: --model)")
    p.add_argument("--preset", default=None, choices=sorted(PRESETS), help="the prompt (default: sentence)")
    p.add_argument("--prompt", default=None, help="the prompt, instead of a preset")
    p.add_argument("--prefix", default="", help="starts every caption, e.g. a trigger word ('ohwx cat')")
    p.add_argument("--max_new_tokens", type=int, default=128, help="longest caption in tokens (default 128)")
    p.add_argument("--batch_size", type=int, default=1, help="images per generate call (default 1)")
    p.add_argument("--caption_extension", default=".txt", help="caption file extension (default .txt)")
    existing = p.add_mutually_exclusive_group()
    existing.add_argument("--skip_existing", action="store_true", default=True,
                          help="keep the captions that exist (the default): a second run captions the rest")
    existing.add_argument("--overwrite", action="store_true", help="caption every image anew")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    p.add_argument("--dtype", default=None, choices=("bf16", "fp32"), help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--quantize", default=None, choices=QUANTIZE, help="the language model's Linears in fp8 / nf4")
    return p


def check_args(args) -> None:
    if args.prompt is not None and args.preset is not None:  # the preset was dropped without a word
        raise ValueError(f"--prompt and --preset {args.preset}: give one (--prompt replaces the preset's prompt)")
    if args.max_new_tokens < 1 or args.batch_size < 1:
        raise ValueError(f"--max_new_tokens and --batch_size must be >= 1, got {args.max_new_tokens}, {args.batch_size}")
    if not args.caption_extension.startswith("."):
        raise ValueError(f"--caption_extension must start with '.', got {args.caption_extension!r}")
    if is_image_name("x" + args.caption_extension):  # each caption would be written over its image
        raise ValueError(f"--caption_extension {args.caption_extension}: an image extension; captions would replace "
                         f"the images (expected a text extension such as .txt or .caption)")
    if not os.path.isdir(args.images):
        raise ValueError(f"--images {args.images}: " + ("is a file, expected a folder of images"
                                                        if os.path.exists(args.images) else "no such folder"))


# The arguments are checked before torch and the library load (seconds): --help and a bad flag answer at once.
if __name__ == "__main__":
    check_command_line(build_parser)

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from library.data.images import IMAGE_EXTENSIONS, is_image_name, load_rgb, verified_image_size  # noqa: E402
from library.data.tokenizer import folder_chat_template  # noqa: E402
from library.data.vlm_inputs import IMAGE_PLACEHOLDER, check_aspect_ratio, qwen_vl_inputs  # noqa: E402
from library.io import CheckpointError, write_text  # noqa: E402
from library.text_files import read_utf8  # noqa: E402
from tools.devices import device_from_flag  # noqa: E402


# ----------------------------------------------------------------------------------------------
# Which images, which files


def find_images(folder: str) -> list[str]:
    """Every image below `folder`, sorted; each verified readable (one error naming the first that is not)."""
    paths = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".")]  # .ipynb_checkpoints, .Trash-1000: training reads none
        paths += [os.path.join(root, f) for f in files if is_image_name(f)]
    paths.sort()
    if not paths:
        raise ValueError(f"{folder}: no images ({', '.join(IMAGE_EXTENSIONS)}) in it or below it")
    for path in paths:
        verified_image_size(path)
    return paths


def check_decodes(paths: list[str]) -> None:
    """Each image decoded whole, as captioning decodes it (load_rgb): a truncated file, whose header
    find_images verified, or a shape the processor refuses (check_aspect_ratio) is one line naming it
    before the model loads, not a traceback after it."""
    for path in tqdm(paths, unit="img", desc="decoding", dynamic_ncols=True, disable=len(paths) < 100):
        check_aspect_ratio(path, load_rgb(path).size, fix="crop it, or move it out of the folder")


def caption_path(image_path: str, extension: str) -> str:
    return os.path.splitext(image_path)[0] + extension


def check_caption_paths(paths: list[str], extension: str) -> None:
    """Two images that would share one caption file (a.png and a.jpg -> a.txt: the second caption would
    replace the first, and training refuses the pair), or a folder where a caption file goes: one line
    naming them, before the model loads."""
    owners: dict[str, str] = {}
    for path in paths:
        target = caption_path(path, extension)
        if target in owners:
            raise ValueError(f"{owners[target]} and {os.path.basename(path)}: both would be captioned in {target} "
                             f"(training refuses images that share a name, too): rename one")
        if os.path.isdir(target):
            raise ValueError(f"{target}: a folder where the caption of {os.path.basename(path)} goes: rename it")
        owners[target] = path


def is_captioned(image_path: str, extension: str) -> bool:
    """Whether the image has a caption file with text in it: an empty one (a placeholder another tool
    made) is no caption, and training refuses it (library/data/image_folders.read_caption)."""
    path = caption_path(image_path, extension)
    if not os.path.exists(path):
        return False
    try:
        return bool(read_utf8(path, "caption file").strip())
    except ValueError:  # not UTF-8: a person's text, kept (training names it)
        return True


def final_caption(generated: str, prefix: str) -> str:
    """The model's text on one line (a caption file is one line), after the prefix; "" when it said nothing."""
    text = " ".join(generated.split())
    return f"{prefix}, {text}" if prefix and text else text


# ----------------------------------------------------------------------------------------------
# The model


class Captioner:
    """caption(images, prompt) -> one generated text per PIL image (greedy, max_new_tokens)."""

    def __init__(self, model, image_processor, tokenizer, kind: str, max_new_tokens: int):
        self.model, self.image_processor, self.tokenizer = model.eval(), image_processor, tokenizer
        self.template, self.system = folder_chat_template(tokenizer), DEFAULT_SYSTEM[kind]
        self.max_new_tokens = max_new_tokens

    def chat_text(self, prompt: str) -> str:
        """The chat the model answers: one user message holding the image, then the prompt."""
        if self.template:
            messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
            return self.tokenizer.apply_chat_template(messages, chat_template=self.template, tokenize=False,
                                                      add_generation_prompt=True)
        system = f"<|im_start|>system\n{self.system}<|im_end|>\n" if self.system else ""
        return f"{system}<|im_start|>user\n{IMAGE_PLACEHOLDER}{prompt}<|im_end|>\n<|im_start|>assistant\n"

    def inputs(self, images: list, prompt: str) -> dict[str, torch.Tensor]:
        """The processor's inputs for the batch, padded on the left (generation continues each row at its end)."""
        text = self.chat_text(prompt)
        return qwen_vl_inputs([text] * len(images), [[img] for img in images], self.image_processor, self.tokenizer,
                              padding_side="left")

    @torch.no_grad()
    def caption(self, images: list, prompt: str) -> list[str]:
        inputs = self.inputs(images, prompt)
        device = self.model.get_input_embeddings().weight.device
        inputs = {k: v.to(device) for k, v in inputs.items()}
        inputs["pixel_values"] = inputs["pixel_values"].to(self.model.model.visual.dtype)  # float32 -> the tower's
        out = self.model.generate(**inputs, max_new_tokens=self.max_new_tokens, do_sample=False,
                                  pad_token_id=self.tokenizer.pad_token_id)
        return self.tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


def model_kind(path: str) -> str:
    """config.json's model_type, one of MODEL_CLASSES."""
    config_file = os.path.join(path, "config.json")
    if not os.path.exists(path):  # a model name where a downloaded folder belongs
        raise CheckpointError(f"{path}: no such folder; --model is a downloaded Qwen2.5-VL or Qwen3-VL model folder "
                              f"(Hugging Face layout)")
    if not os.path.isfile(config_file):
        raise CheckpointError(f"{path}: no config.json; expected a Qwen2.5-VL or Qwen3-VL model folder (Hugging Face layout)")
    with open(config_file) as f:
        kind = json.load(f).get("model_type")
    if kind not in MODEL_CLASSES:
        raise CheckpointError(f"{config_file}: model_type {kind!r} is not a supported captioner; expected one of "
                              f"{', '.join(MODEL_CLASSES)}")
    return kind


def load_captioner(path: str, processor: str | None, dtype: torch.dtype, quantize: str | None, device: torch.device,
                   max_new_tokens: int) -> Captioner:
    import transformers
    from transformers import AutoTokenizer, Qwen2VLImageProcessor

    kind, processor = model_kind(path), processor or path
    if not os.path.isfile(os.path.join(processor, "preprocessor_config.json")):
        raise CheckpointError(f"{processor}: no preprocessor_config.json (the image processor); pass --processor FOLDER")
    options = {"dtype": dtype, "local_files_only": True, "use_safetensors": True}
    if quantize == "nf4":
        options.update(quantization_config=nf4_config(dtype), device_map={"": str(device)})
    model = getattr(transformers, MODEL_CLASSES[kind]).from_pretrained(path, **options)
    if quantize in ("fp8", "fp8_scaled"):
        from library.precision.fp8 import quantize_module

        quantize_module(model.model.language_model, quantize, arch_spec("llm").fp8)  # lm_head and the vision tower stay in dtype
    if quantize != "nf4":
        model.to(device)
    image_processor = Qwen2VLImageProcessor.from_pretrained(processor, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(processor, local_files_only=True)
    return Captioner(model, image_processor, tokenizer, kind, max_new_tokens)


def nf4_config(dtype: torch.dtype):
    """bitsandbytes 4-bit NF4 for the language model; the vision tower and lm_head keep `dtype`."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype,
                              llm_int8_skip_modules=["model.visual", "lm_head"])


# ----------------------------------------------------------------------------------------------
# The run


def caption_images(captioner: Captioner, paths: list[str], prompt: str, prefix: str, extension: str,
                   batch_size: int, stop_requested=lambda: False) -> dict[str, int]:
    """Caption `paths` batch by batch, each caption file written atomically as soon as its batch is done.
    stop_requested() is asked after each batch (Ctrl-C). Returns counts: written, empty (the model said
    nothing: no file written), left (not reached)."""
    counts = {"written": 0, "empty": 0, "left": len(paths)}
    with tqdm(total=len(paths), unit="img", desc="captioning", dynamic_ncols=True) as bar:
        for start in range(0, len(paths), batch_size):
            batch = paths[start : start + batch_size]
            texts = captioner.caption([load_rgb(p) for p in batch], prompt)
            for path, text in zip(batch, texts):
                caption = final_caption(text, prefix)
                if caption:
                    write_text(caption_path(path, extension), caption + "\n")
                counts["written" if caption else "empty"] += 1
                counts["left"] -= 1
            bar.update(len(batch))
            if stop_requested():
                break
    return counts


def main(argv=None) -> int:
    from train_lora import Interrupts

    try:
        args = build_parser().parse_args(argv)
        check_args(args)
        device = device_from_flag(args.device)
        images = find_images(args.images)
        check_caption_paths(images, args.caption_extension)
        todo = images if args.overwrite else [p for p in images if not is_captioned(p, args.caption_extension)]
        print(f"{len(images)} images, {len(images) - len(todo)} already captioned, {len(todo)} to caption")
        if not todo:
            return 0
        check_decodes(todo)
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
        captioner = load_captioner(args.model, args.processor, dtype, args.quantize, device, args.max_new_tokens)
    except (ValueError, OSError) as e:  # CheckpointError is a ValueError
        print(one_line(e), file=sys.stderr)
        return 2
    interrupts, started = Interrupts(), time.time()
    try:
        counts = caption_images(captioner, todo, args.prompt or PRESETS[args.preset or "sentence"], args.prefix,
                                args.caption_extension, args.batch_size, lambda: interrupts.requested is not None)
    except KeyboardInterrupt:  # a second Ctrl-C: the files written so far are whole; the rest waits
        print("interrupted: the captions written so far are kept; run the same command again to caption the rest",
              file=sys.stderr)
        return INTERRUPTED
    finally:
        interrupts.close()
    done = counts["written"] + counts["empty"]
    print(f"captioned {done} images in {time.time() - started:.1f} s ({done / max(time.time() - started, 1e-9):.2f} "
          f"images/s): {counts['written']} written, {counts['empty']} empty (the model gave no text; no file written)")
    if counts["left"]:
        print(f"{interrupts.requested}: stopped with {counts['left']} images left; run the same command again to "
              f"caption them", file=sys.stderr)
        return INTERRUPTED
    return 0


if __name__ == "__main__":
    exit_without_collecting(main)
