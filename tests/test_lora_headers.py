"""The header entries that name the model a LoRA was trained on, as each trainer spells them: ours and
sd-scripts' ss_base_model_version, modelspec.architecture (sd-scripts' and musubi-tuner's sai_model_spec,
written alone by musubi-tuner), ai-toolkit's ss_base_model_version (its get_base_model_version). Oracle:
the values those trainers' sources write, and merge_lora's answer to an ss_base_model_version header.

Then what else a LoRA's header says: the ranks and alphas a file holds (train_lora.py after network_weights
rebuilt a module, convert_lora), and discrete_flow_shift only where the run's timestep draw read it."""

import json
from types import SimpleNamespace

import pytest
from safetensors.torch import save_file

from library.training.config_schema import SCHEMA
from networks import lora_files as lf
from networks.lora import LoRANetwork
from networks.lora_arch import header_arch
from tools import convert_lora, merge_lora
from tools.lora_common import load_model

WRITTEN = [  # (key, value as written, our architecture)
    ("modelspec.architecture", "flux-1-dev/lora", "flux"),  # sd-scripts
    ("modelspec.architecture", "chroma/lora", "chroma"),  # sd-scripts
    ("modelspec.architecture", "Flux.1-dev/lora", "flux"),  # musubi-tuner (Kontext)
    ("modelspec.architecture", "Flux.2-klein-4b/lora", "flux2"),
    ("modelspec.architecture", "Qwen-Image-Edit-2511/lora", "qwen_image"),
    ("modelspec.architecture", "Z-Image/lora", "zimage"),
    ("modelspec.architecture", "Krea-2/lora", "krea2"),
    ("modelspec.architecture", "Ideogram-4/lora", "ideogram4"),
    ("ss_base_model_version", "flux.1", "flux"),  # ai-toolkit
    ("ss_base_model_version", "flux2_klein_4b", "flux2"),
    ("ss_base_model_version", "qwen_image", "qwen_image"),
    ("ss_base_model_version", "zimage", "zimage"),
    ("ss_base_model_version", "krea2", "krea2"),
    ("ss_base_model_version", "ideogram4", "ideogram4"),
    ("ss_base_model_version", "zimage-turbo", "zimage"),  # ours
    ("ss_base_model_version", "krea2-raw", "krea2"),
]


@pytest.mark.parametrize("key, value, arch", WRITTEN)
def test_the_header_names_the_architecture_in_every_trainers_spelling(key, value, arch):
    """Z-Image's, Krea 2's headers (ours, ai-toolkit's, musubi-tuner's) and musubi-tuner's Ideogram-4 named
    no architecture: their specs listed no model_versions (Ideogram 4: its own spelling only)."""
    assert header_arch({key: value}) == arch


SPELLED = [  # (header value, our architecture): releases in spellings that no model_versions entry lists as such
    ("flux_1-dev", "flux"), ("FLUX-2-dev/lora", "flux2"), ("krea_2-raw", "krea2"), ("Z Image/lora", "zimage"),
    ("qwen_image_2.1", "qwen_image21"), ("Qwen-Image-2512/lora", "qwen_image"), ("qwen_image_2512", "qwen_image"),
]


@pytest.mark.parametrize("value, arch", SPELLED)
def test_the_header_names_the_architecture_by_the_merges_rule_of_spelling(value, arch):
    """header_arch compared the lower-cased header with the families' model_versions as listed, while the merge's
    version check (same_release) read every spelling alike: 'flux_1-dev' named no architecture, 'qwen_image_2.1'
    Qwen-Image's, and Qwen-Image-2.1's prefix 'qwen-image-2' took Qwen-Image-2512's LoRAs. Now both ask
    lora_arch.begins_release, and Qwen-Image-2.1's prefix is its release, qwen-image-2.1."""
    assert header_arch({"ss_base_model_version": value}) == arch


def _merge(tiny_set, tmp_path, capsys, header: dict) -> tuple[int, str]:
    model, family, _ = load_model(tiny_set["flux_bfl"])
    lora = tmp_path / "lora.safetensors"
    LoRANetwork(model, family, rank=2).save(str(lora), metadata=header)
    capsys.readouterr()
    code = merge_lora.main(["--model", tiny_set["flux_bfl"], "--lora", str(lora), "--save_to", str(tmp_path / "m.safetensors")])
    return code, capsys.readouterr().err.strip()


def test_merge_reads_modelspec_architecture_where_ss_base_model_version_is_absent(tiny_set, tmp_path, capsys):
    """merge_lora's version check read ss_base_model_version only: a FLUX.1-named LoRA whose modelspec.architecture
    said Qwen-Image merged silently (with ss_base_model_version 'qwen-image': merged, warned 'the same architecture,
    another release'), and 'flux-1-schnell/lora' into FLUX.1-dev said nothing. Now the header's architecture comes
    from the families' model_versions, either key refuses the first in the same line, and both warn for the second;
    ai-toolkit's 'flux.1' (a prefix of flux1-dev once spelled alike) warned 'another release' and now passes."""
    lines = {}
    for key, value in (("ss_base_model_version", "qwen-image"), ("modelspec.architecture", "Qwen-Image/lora")):
        code, err = _merge(tiny_set, tmp_path, capsys, {key: value})
        assert code == 2 and "\n" not in err, err
        lines[key] = err.replace(f"{key} '{value}'", "HEADER")
    assert lines["ss_base_model_version"] == lines["modelspec.architecture"]
    assert lines["modelspec.architecture"] == (
        f"error: {tmp_path / 'lora.safetensors'}: a Qwen-Image LoRA (HEADER) and the base {tiny_set['flux_bfl']} is "
        f"FLUX.1 ('flux1-dev'): its deltas were learned on other weights; merge it into a Qwen-Image checkpoint")
    for key, value in (("ss_base_model_version", "flux1-schnell"), ("modelspec.architecture", "flux-1-schnell/lora")):
        code, err = _merge(tiny_set, tmp_path, capsys, {key: value})
        said = f"warning: {tmp_path / 'lora.safetensors'}: trained on '{value}' ({key}), merged into 'flux1-dev'"
        assert code == 0 and said in err, err
    code, err = _merge(tiny_set, tmp_path, capsys, {"ss_base_model_version": "flux.1"})
    assert code == 0 and "warning" not in err, err


# ----------------------------------------------------------------------------------------------
# The rest of the header: ranks and alphas, the flow shift (FLUX.1 files: tests/conftest.py flux_loras)


def header_of_run(task_facts: dict, **args) -> dict:
    """The LoRA header train_lora.py writes for a run with these settings and its task's facts."""
    from types import SimpleNamespace

    from library.training.saves import lora_metadata

    args = SimpleNamespace(**{"network_module": "networks.lora", "network_dim": 4, "network_alpha": 2.0, "network_args": [], "network_dropout": None, "config_file": None, "model_type": "flux",
                              "pretrained_model_name_or_path": "base.safetensors", "mixed_precision": "bf16",
                              "optimizer_type": "AdamW", "optimizer_args": [], "learning_rate": 1e-4, "lr_scheduler": "constant",
                              "discrete_flow_shift": 3.0, "guidance_scale": 1.0, "seed": 0, "output_name": "x",
                              "gradient_accumulation_steps": 1, **args})
    facts = {"base_model_version": "flux1", "base_precision": "bf16", "resolution": "64x64", "batch_size": 1,
             "timestep_sampling": "flux_shift", "dataset": [], **task_facts}
    return lora_metadata(args, SimpleNamespace(metadata=lambda: facts, batches_per_epoch=lambda: 1), 1, 1, 1, 1, 0.0)


def test_the_modelspec_keys_name_the_release_and_an_unnamed_one_warns_and_saves_without_them(recwarn):
    """The release's ModelSpec names come from its family's spec (sd-scripts' flux-1/lora for a FLUX.1 it does not
    tell apart); a release no entry names (a contributor's miss) still saves, with one warning and no modelspec
    keys; an LLM's PEFT adapter carries none (no peer writes ModelSpec for one)."""
    header = header_of_run({})
    assert (header["modelspec.architecture"], header["modelspec.title"], header["modelspec.resolution"]) == (
        "flux-1/lora", "x", "64x64") and not recwarn
    assert not any(k.startswith("modelspec.") for k in header_of_run({"base_model_version": "flux9-dev"}))
    assert [str(w.message) for w in recwarn] == ["flux's spec.py: modelspec names no release 'flux9-dev'; the LoRA's "
                                                 "header has no modelspec.* keys"]
    assert not any(k.startswith("modelspec.") for k in header_of_run({"base_model_version": "llm-2x64"}, model_type="llm"))


def test_training_comment_and_the_metadata_keys_are_written_as_sd_scripts_writes_them():
    """sd-scripts' training_comment (ss_training_comment) and metadata_* (ModelSpec's title, author, description,
    license, tags, usage hint, trigger phrase: what LoRA managers show) had no key here; the converters dropped
    them, and the header said output_name as the title and none of the rest."""
    texts = {"training_comment": "v2, more images", "metadata_title": "Zxq Star", "metadata_author": "me",
             "metadata_description": "a purple star", "metadata_license": "CC-BY-4.0", "metadata_tags": "star,purple",
             "metadata_usage_hint": "say zxq", "metadata_trigger_phrase": "zxq"}
    header = header_of_run({}, **texts)
    assert header["ss_training_comment"] == "v2, more images" and header["modelspec.title"] == "Zxq Star"
    assert {k: header[f"modelspec.{k}"] for k in ("author", "description", "license", "tags", "usage_hint",
                                                     "trigger_phrase")} == {
        "author": "me", "description": "a purple star", "license": "CC-BY-4.0", "tags": "star,purple",
        "usage_hint": "say zxq", "trigger_phrase": "zxq"}
    unset = header_of_run({}, **dict.fromkeys(texts))
    assert unset["modelspec.title"] == "x" and not {"ss_training_comment", "modelspec.author"} & set(unset)
    # every metadata_* key of the config reaches the header: one added to the schema alone would be read and lost
    assert {k for k in SCHEMA if k.startswith("metadata_")} | {"training_comment"} == set(texts)


def test_network_dropout_is_written_as_sd_scripts_writes_it():
    """sd-scripts writes ss_network_dropout beside the `dropout` in its ss_network_args; ours wrote only the latter."""
    header = header_of_run({}, network_dropout=0.1)
    assert header["ss_network_dropout"] == "0.1" and json.loads(header["ss_network_args"])["dropout"] == 0.1
    assert "ss_network_dropout" not in header_of_run({})


def test_the_header_after_network_weights_rebuilt_a_module_says_the_ranks_the_file_holds(flux_loras):
    """network_weights rebuilt qkv / linear1 at ranks 12 / 16 beside rank-4 modules: the header said
    ss_network_dim 4 (the config's) and alpha 12 (one rebuilt module's); now "Dynamic" for both, as
    sd-scripts' resize_lora.py writes for per-module ranks."""
    from library.training.lora_inputs import loaded_dim_alpha

    path, _ = flux_loras["cases"]["diffusers q / k / v with their own downs"]
    net = LoRANetwork(flux_loras["model"], "flux", rank=4, alpha=2)
    net.load_weights(path, strict=False)
    args = {"network_dim": 4, "network_alpha": 2.0}
    header = header_of_run(loaded_dim_alpha(net, SimpleNamespace(**args)), **args)
    assert (header["ss_network_dim"], header["ss_network_alpha"]) == ("Dynamic", "Dynamic")
    ours = LoRANetwork(flux_loras["model"], "flux", rank=4, alpha=8)
    ours.load_weights(flux_loras["cases"]["kohya (ours)"][0], strict=False)  # the config's rank, the file's alpha (2) wins
    assert loaded_dim_alpha(ours, SimpleNamespace(network_dim=4, network_alpha=8.0)) == {"network_alpha": "2"}


def test_convert_lora_header_says_the_ranks_and_alphas_it_wrote(flux_loras, tmp_path):
    """q / k / v with their own rank-4 downs join into one rank-12 qkv (--to kohya): the header kept the
    source's ss_network_dim 4; --alpha 1 kept ss_network_alpha 2. Now what the file holds."""
    tensors, metadata, _ = lf.read_lora_tensors(flux_loras["cases"]["diffusers q / k / v with their own downs"][0])
    save_file(tensors, str(tmp_path / "split.safetensors"), {**metadata, "ss_network_dim": "4", "ss_network_alpha": "2"})
    convert_lora.convert_lora(str(tmp_path / "split.safetensors"), str(tmp_path / "k.safetensors"), "kohya")
    convert_lora.convert_lora(flux_loras["cases"]["kohya (ours)"][0], str(tmp_path / "a.safetensors"), "kohya", alpha=1.0)
    meta = {name: load_file_metadata(str(tmp_path / f"{name}.safetensors")) for name in ("k", "a")}
    assert (meta["k"]["ss_network_dim"], meta["k"]["ss_network_alpha"]) == ("Dynamic", "Dynamic")
    assert (meta["a"]["ss_network_dim"], meta["a"]["ss_network_alpha"]) == ("4", "1")


def load_file_metadata(path: str) -> dict:
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        return f.metadata()


def data_sha256(path) -> str:
    """ModelSpec's hash_sha256 of a safetensors file: "0x" + the sha256 of every byte after its header."""
    import hashlib

    with open(path, "rb") as f:
        f.seek(8 + int.from_bytes(f.read(8), "little"))
        return "0x" + hashlib.sha256(f.read()).hexdigest()


def test_tools_write_the_modelspec_hash_of_the_tensors_they_wrote(tiny_set, tmp_path):
    """A header's modelspec.hash_sha256 (a metadata editor's, SwarmUI's; SwarmUI shows and records it as the model's
    hash) passed through resize_lora, combine_loras, convert_lora and merge_lora unchanged (a rank-8 LoRA resized to 4:
    the header said 0x23a2..., its tensors are 0x905c...). Now the tools' LoRAs carry their tensors' hash, a merge none."""
    from safetensors.torch import load_file

    from tools import combine_loras, resize_lora

    model, family, _ = load_model(tiny_set["flux_bfl"])
    LoRANetwork(model, family, rank=4).save(str(tmp_path / "a.safetensors"))
    meta = {**load_file_metadata(str(tmp_path / "a.safetensors")), lf.MODELSPEC_HASH: data_sha256(tmp_path / "a.safetensors")}
    save_file(load_file(str(tmp_path / "a.safetensors")), str(tmp_path / "in.safetensors"), meta)
    src = str(tmp_path / "in.safetensors")
    assert resize_lora.main(["--lora", src, "--save_to", str(tmp_path / "r.safetensors"), "--new_rank", "2"]) == 0
    assert combine_loras.main(["--lora", src, src, "--save_to", str(tmp_path / "c.safetensors")]) == 0
    assert convert_lora.main([src, str(tmp_path / "d.safetensors"), "--to", "diffusers"]) == 0
    for name in ("r", "c", "d"):
        written = load_file_metadata(str(tmp_path / f"{name}.safetensors"))
        assert written[lf.MODELSPEC_HASH] == data_sha256(tmp_path / f"{name}.safetensors") != meta[lf.MODELSPEC_HASH], name
        assert written[lf.MODELSPEC_HASH] == "0x" + written["sshs_model_hash"]
    base = load_file(tiny_set["flux_bfl"])
    save_file(base, str(tmp_path / "base.safetensors"), {lf.MODELSPEC_HASH: "0x" + "ab" * 32})
    assert merge_lora.main(["--model", str(tmp_path / "base.safetensors"), "--lora", src,
                            "--save_to", str(tmp_path / "m.safetensors")]) == 0
    assert lf.MODELSPEC_HASH not in load_file_metadata(str(tmp_path / "m.safetensors"))


@pytest.mark.parametrize("sampling, written", [("shift", "3.0"), ("flux_shift", None), ("sigmoid", None), ("uniform", None)])
def test_the_header_names_discrete_flow_shift_only_where_the_timestep_draw_read_it(sampling, written):
    """flow_matching.sample_sigmas reads discrete_flow_shift for timestep_sampling = "shift" alone; the header
    said ss_discrete_flow_shift 3.0 for every run (a flux_shift run's own mu, not 3.0, shifted its draws)."""
    assert header_of_run({"timestep_sampling": sampling}).get("ss_discrete_flow_shift") == written


def test_total_batch_size_counts_each_datasets_own_images_where_two_share_their_subsets():
    """Two [[datasets]] over one folder (two resolutions) have equal subsets: each counted the other's images, so a
    3-image dataset of batch 4 said 4 (its batch is its 3 images) until 2026-11-27."""
    from types import SimpleNamespace

    from library.data.dataset_config import parse_dataset_config
    from library.training.diffusion_task import DiffusionTask

    subset = {"image_dir": "/data/a", "class_tokens": "x"}
    blueprint = parse_dataset_config({"datasets": [{"resolution": 64, "batch_size": 4, "subsets": [subset]},
                                                   {"resolution": 48, "batch_size": 4, "subsets": [subset]}]}, source="d.toml")
    items = [SimpleNamespace(dataset_index=i, subset=blueprint.datasets[i].subsets[0]) for i in (0, 1) for _ in range(3)]
    task = SimpleNamespace(accelerator=SimpleNamespace(num_processes=1), args=SimpleNamespace(gradient_accumulation_steps=1),
                           dataset=SimpleNamespace(items=items, entries=list(range(6))), blueprint=blueprint)
    assert DiffusionTask._total_batch_size(task) == "3"


def test_total_batch_size_counts_the_repeats_batches_are_cut_from():
    """Old: 1 image x num_repeats 4 at batch_size 4 trains 4 entries a step and the header said 1 (the cap
    counted images; batches are cut from the epoch's entries, repeats included, as sd-scripts' are)."""
    from types import SimpleNamespace

    from library.data.dataset_config import parse_dataset_config
    from library.training.diffusion_task import DiffusionTask

    subset = {"image_dir": "/data/a", "class_tokens": "x", "num_repeats": 4}
    blueprint = parse_dataset_config({"datasets": [{"resolution": 64, "batch_size": 4, "subsets": [subset]}]},
                                     source="d.toml")
    items = [SimpleNamespace(dataset_index=0, subset=blueprint.datasets[0].subsets[0])]
    task = SimpleNamespace(accelerator=SimpleNamespace(num_processes=1), args=SimpleNamespace(gradient_accumulation_steps=2),
                           dataset=SimpleNamespace(items=items, entries=[0, 0, 0, 0]), blueprint=blueprint)
    assert DiffusionTask._total_batch_size(task) == "8"


def test_folder_facts_are_sd_scripts_dataset_dirs_tag_frequency_and_image_counts():
    """sd-scripts writes ss_dataset_dirs / ss_tag_frequency / ss_num_train_images / ss_num_reg_images (A1111's
    LoRA page and Civitai show the trained tags from them); we wrote none until 2026-11-28. Its semantics: tags
    split on ",", stripped, lowercased, counted per folder basename over the captions as written (reg folders
    too; a folder in two datasets counted once); dirs are the training folders, a repeat named "name (2)"."""
    from types import SimpleNamespace

    from library.data.dataset_config import parse_dataset_config
    from library.training.diffusion_task import DiffusionTask

    train, reg = {"image_dir": "/data/me/cat", "num_repeats": 3}, {"image_dir": "/data/reg", "is_reg": True, "num_repeats": 1}
    blueprint = parse_dataset_config({"datasets": [{"resolution": 64, "subsets": [train, reg, {**train, "num_repeats": 2}]},
                                                   {"resolution": 48, "subsets": [train]}]}, source="d.toml")
    captions = {(0, 0): ["Cat, sitting", "cat,  on a mat ,"], (0, 1): ["a cat"], (0, 2): ["Cat, sitting", "cat,  on a mat ,"],
                (1, 0): ["cat, sitting", "cat, on a mat"]}
    items = [SimpleNamespace(dataset_index=d, subset_index=s, caption=c) for (d, s), cs in captions.items() for c in cs]
    facts = DiffusionTask._folder_facts(SimpleNamespace(blueprint=blueprint, dataset=SimpleNamespace(items=items)))
    assert facts["tag_frequency"] == {"cat": {"cat": 4, "sitting": 2, "on a mat": 2}, "reg": {"a cat": 1}}
    assert facts["dataset_dirs"] == {"cat": {"n_repeats": 3, "img_count": 2}, "cat (2)": {"n_repeats": 2, "img_count": 2},
                                     "cat (3)": {"n_repeats": 3, "img_count": 2}}
    assert (facts["num_train_images"], facts["num_reg_images"]) == (2 * 3 + 2 * 2 + 2 * 3, 1)
    meta = header_of_run(facts)
    assert json.loads(meta["ss_tag_frequency"]) == facts["tag_frequency"] and meta["ss_num_train_images"] == "16"
    assert json.loads(meta["ss_dataset_dirs"])["cat (2)"] == {"n_repeats": 2, "img_count": 2}
    assert meta["ss_num_reg_images"] == "1" and meta["ss_num_batches_per_epoch"] == "1"


def test_tag_frequency_counts_the_captions_without_the_subsets_prefix_and_suffix():
    """caption_prefix / caption_suffix joined the first and last tags ("ohwx 1girl", "smile masterpiece"):
    sd-scripts counts read_caption's text and joins them later, in process_caption."""
    from types import SimpleNamespace

    from library.data.dataset_config import parse_dataset_config
    from library.data.image_folders import read_caption
    from library.training.diffusion_task import DiffusionTask

    blueprint = parse_dataset_config({"datasets": [{"resolution": 64, "subsets": [
        {"image_dir": "/data/imgs", "class_tokens": "ohwx girl", "caption_prefix": "ohwx", "caption_suffix": "masterpiece"}]}]},
        source="d.toml")
    subset = blueprint.datasets[0].subsets[0]
    joined = [" ".join(("ohwx", c, "masterpiece")) for c in ("1girl, red hair, smile", "1girl, blue eyes")]
    joined.append(read_caption("/data/imgs/no_caption_file.png", subset))  # class_tokens, joined too
    items = [SimpleNamespace(dataset_index=0, subset_index=0, caption=c) for c in joined]
    facts = DiffusionTask._folder_facts(SimpleNamespace(blueprint=blueprint, dataset=SimpleNamespace(items=items)))
    assert facts["tag_frequency"] == {"imgs": {"1girl": 2, "red hair": 1, "smile": 1, "blue eyes": 1, "ohwx girl": 1}}
