"""The rules of an sd-scripts script of its own (one that takes no --model_type: its spec's SdScriptsModels lists
no `models` and says the model it trains): sd_scripts.RULES, the first script's, less the arguments its parser
lacks, with its own arguments' rules from the spec's fields (model files, parser defaults, tokenizer lengths,
arguments ours reads nothing of or does not carry, fp8, block swap, a draw of its own). sd_scripts.py builds each
such script's rules here; the keys of train_network's parser keep RULES' rules (their "does not read it either"
lines name this script's models). No torch."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from library.models.registry import spec_of
from library.models.spec import SdScriptsModels, load_symbol
from library.training.peers import sd_scripts_models as models
from library.training.peers.rules import (
    DROPPED, KEPT, NOT_CARRIED, RENAMED, Rule, Translation, custom, ignored, is_off, is_true, same,
)
from library.training.peers.sd_scripts_defaults import note, text_encoder_lr_zero, their


def rules_of(script: str, first_rules: dict[str, Rule]) -> dict[str, Rule]:
    """`script`'s rules: the first script's (`first_rules`) less what its parser lacks, plus its own arguments'."""
    entry = models.entry(script)
    first_ignored, own_ignored = models.ignored_text(models.first_script()), models.ignored_text(script)
    rules = {key: replace(rule, why=rule.why.replace(first_ignored, own_ignored))
             for key, rule in first_rules.items() if key not in entry.lacks}
    rules.update({key: Rule("renamed", ours=ours) for key, ours in entry.files.items()})
    rules.update({key: same() for key in entry.same_args})
    rules.update({key: custom(_token_length) for key in entry.token_lengths})
    rules.update({key: ignored(why) for key, why in entry.ignored_args.items()})
    rules.update({key: custom(_refused) for key in entry.refused_args})
    rules.update({key: custom(_fp8_switch) for key in entry.fp8_args})
    rules.update({"fp8_base": custom(_fp8_base), "fp8_base_unet": custom(_fp8_base),
                  "blocks_to_swap": custom(_blocks_to_swap), "network_train_unet_only": custom(_unet_only),
                  "text_encoder_lr": custom(_text_encoder_lr)})
    rules.update({key: custom(_own_draw) for key in entry.draw_args})
    if entry.huber_not_ours:
        rules["loss_type"] = custom(_loss_not_huber)
        rules.update(dict.fromkeys(("huber_c", "huber_scale", "huber_schedule"),
                                   ignored("read only by loss_type huber / smooth_l1, not carried on this model")))
    return rules


def _loss_not_huber(t: Translation, key: str, value: Any) -> None:
    """loss_type on a model whose loss is not ours' velocity loss (the spec's huber_not_ours): l2 only."""
    if value == "l2":
        t.set(key, value, key, value)
    else:
        t.refuse(key, value, entry_of(t).huber_not_ours if value in ("huber", "smooth_l1") else "ours: l2, huber")


def entry_of(t: Translation) -> SdScriptsModels:
    return models.entry(models.script_of(t.config["model_type"]))


def title(t: Translation) -> str:
    return spec_of(t.config["model_type"]).title


def _token_length(t: Translation, key: str, value: Any) -> None:
    """A tokenizer's max length: ours encodes at its pipeline's count always."""
    count = entry_of(t).token_lengths[key]
    if int(value) == count:
        t.drop(key, value, f"ours encodes at most {count} tokens too, as the pipeline")
    else:
        cut = "sd-scripts cuts them, ours does not" if int(value) < count else "ours cuts them, sd-scripts does not"
        t.refuse(key, value, f"ours encodes at most {count} tokens, as the pipeline: of a caption's tokens past "
                             f"{min(int(value), count)}, {cut}")


def _refused(t: Translation, key: str, value: Any) -> None:
    if is_off(value):
        t.drop(key, value, "empty" if value in ("", None, []) else "off")
    else:
        t.refuse(key, value, entry_of(t).refused_args[key])


def _own_draw(t: Translation, key: str, value: Any) -> None:
    """An argument of its own draw (the spec's draw_args): the lines its `draw` hook says for it, read with the
    draw's other arguments (the config's values, else its script's defaults); a carried line sets ours' keys."""
    entry = entry_of(t)
    lines = load_symbol(entry.draw)({name: their(t, name) for name in entry.draw_args})
    for line_key, (verdict, text, ours) in lines.items():
        if line_key != key and not line_key.startswith(key + " ("):
            continue
        if verdict not in (KEPT, RENAMED):
            (t.drop if verdict == DROPPED else t.refuse)(line_key, value, text)
            continue
        first = len(t.lines)
        for name, ours_value in ours.items():  # one line; t.set names a key two arguments set apart
            t.set(name, ours_value, line_key, value, verdict)
        del t.lines[first + 1:]
        note(t, text)


def _fp8_switch(t: Translation, key: str, value: Any) -> None:
    """Its own fp8 switch (fp8_scaled, fp8_vl): on, ours' precision key it names."""
    if not is_true(value):
        t.drop(key, value, "off")
        return
    ours, _, precision = entry_of(t).fp8_args[key].partition("=")
    t.set(ours, precision, key, value, RENAMED)
    note(t, f'{ours} = "{precision}"')


def base_fp8_switch(t: Translation) -> str:
    """Its own fp8 switch that is on and sets base_precision ("": none), which its script takes over fp8_base."""
    return next((k for k, ours in entry_of(t).fp8_args.items()
                 if ours.startswith("base_precision=") and is_true(t.given.get(k))), "")


def _fp8_base(t: Translation, key: str, value: Any) -> None:
    why = entry_of(t).fp8_base_off
    if is_true(value) and base_fp8_switch(t):
        t.drop(key, value, f"{base_fp8_switch(t)} is set: sd-scripts ignores {key} then (its assert_extra_args)")
        return
    if not is_true(value) or why:
        t.drop(key, value, why if is_true(value) and why else "off")
        return
    t.set("base_precision", "fp8", key, value, RENAMED)
    note(t, 'base_precision = "fp8" (the plain cast, as sd-scripts; "fp8_scaled" is ours with per-block scales)')


def _blocks_to_swap(t: Translation, key: str, value: Any) -> None:
    """A model of one block kind: sd-scripts' N swaps N blocks, as ours; of double and single blocks: N // 2
    double and twice the rest single (swap_two_kinds)."""
    count = 0 if is_off(value) else int(value)  # "": sd-scripts' `if args.blocks_to_swap` too
    if count <= 0:
        t.drop(key, value, "off")
    elif not entry_of(t).one_block_kind:
        swap_two_kinds(t, key, value, count)
    else:
        t.set(key, count, key, value)
        note(t, f"blocks_to_swap = {count} (blocks of one kind: its {count}, as ours); tools/plan_memory.py says what "
                f"fits")


def swap_two_kinds(t: Translation, key: str, value: Any, count: int) -> None:
    """sd-scripts swaps N // 2 double blocks and twice the rest in single blocks; ours the last N blocks in
    order (single blocks first), each counting one: the same number of blocks, fewer bytes."""
    double = count // 2
    single = 2 * (count - double)
    t.set("blocks_to_swap", double + single, key, value, RENAMED)
    note(t, f"blocks_to_swap = {double + single}: sd-scripts' {count} swaps {double} double and {single} single "
            f"blocks; ours the last {double + single} (single first, fewer bytes): tools/plan_memory.py says what fits")


def caches_text(t: Translation) -> bool:
    """It caches the text encoder's outputs (cache_text_encoder_outputs_to_disk turns the cache on there)."""
    return is_true(their(t, "cache_text_encoder_outputs")) or is_true(their(t, "cache_text_encoder_outputs_to_disk"))


def stops_on_cached_text_lora(t: Translation) -> bool:
    """It caches the text encoder's outputs and its script then stops unless network_train_unet_only (its
    assert_extra_args); a script that trains the text encoder's LoRA on them anyway says so (text_lora_when_cached)."""
    return caches_text(t) and not entry_of(t).text_lora_when_cached


def _unet_only(t: Translation, key: str, value: Any) -> None:
    """Off, its LoRA module trains a LoRA of the text encoder beside the transformer's, unless its rate is 0 (or its
    script stops: stops_on_cached_text_lora)."""
    if is_true(value):
        t.drop(key, value, "ours trains the transformer's LoRA only")
    elif not entry_of(t).makes_text_lora:
        t.drop(key, value, f"{entry_of(t).lora_module} makes no text encoder LoRA: sd-scripts trains the "
                           f"transformer's LoRA only too")
    elif stops_on_cached_text_lora(t):
        t.drop(key, value, "sd-scripts stops without it when caching the text encoder's outputs (its "
                           "assert_extra_args); ours trains the transformer's LoRA only")
    elif text_encoder_lr_zero(t):
        t.drop(key, value, "text_encoder_lr 0: sd-scripts trains the transformer's LoRA only too")
    else:
        t.refuse(key, value, f"sd-scripts then trains a LoRA of {title(t)}'s text encoder too; ours trains the "
                             f"transformer's only")


def trains_text_encoder(t: Translation) -> bool:
    return entry_of(t).makes_text_lora and not (is_true(their(t, "network_train_unet_only"))
                                                or stops_on_cached_text_lora(t) or text_encoder_lr_zero(t))


def _text_encoder_lr(t: Translation, key: str, value: Any) -> None:
    if trains_text_encoder(t):
        t.refuse(key, value, "the text encoder LoRA's rate: ours trains no text encoder LoRA")
    else:
        t.drop(key, value, "no text encoder LoRA is trained")


def lora_arg_verdict(t: Translation, name: str, text: str) -> tuple[str, str] | None:
    """(verdict, why) of a network_arg only this script's LoRA module reads (None: sd_scripts' rules read it): a
    switch as ours' item (why: the whole item), include_patterns not carried."""
    entry = entry_of(t)
    if name in entry.lora_switches:
        if text.strip().lower() != "true":  # its create_network: .lower() == "true"
            return DROPPED, "off"
        rank = their(t, "network_dim")
        return RENAMED, entry.lora_switches[name].format(network_dim=4 if rank is None else int(rank))
    if name == "include_patterns":
        return (NOT_CARRIED, "it trains an excluded module at network_dim; ours trains a type of its default "
                               "exclusions by that type's rank key (train_modulation, in_dims, <type>_dim)")
    if name == "loraplus_text_encoder_lr_ratio":
        return ((NOT_CARRIED, "the text encoder LoRA's: not trained here") if trains_text_encoder(t) else
                (DROPPED, "no text encoder LoRA is trained"))
    return None


def own_lora_args(t: Translation, given: dict[str, str]) -> tuple[list[str], dict[str, tuple[str, str]]] | None:
    """Its LoRA module's network_args as ours' items, and a (verdict, why) for each of `given` it read, by the spec's
    lora_args (None: it has none, or dim_from_weights takes the network from the file's modules)."""
    hook = entry_of(t).lora_args
    if not hook or is_true(their(t, "dim_from_weights")):
        return None
    rank = their(t, "network_dim")
    return load_symbol(hook)(given, 4 if rank is None else int(rank))
