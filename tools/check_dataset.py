"""Check a dataset before training on it: per subset the images, their sizes and buckets, and every
problem, each one line naming the file (library/data/check.py says what is an error, a warning, a note).

    python tools/check_dataset.py dataset.toml                         # images, captions, masks, references
    python tools/check_dataset.py --config_file my_run.toml            # its dataset_config, caption tokens
                                                                       # against its text encoder, and the
                                                                       # reference images its model_type takes
    python tools/check_dataset.py dataset.toml --tokenizer t5xxl --max_tokens 512
    python tools/check_dataset.py dataset.toml --strict --json         # exit 1 on any warning too

Caption lengths are counted only with a tokenizer: a training config's (its model_type's text
encoder, the template and limit it applies) or --tokenizer FOLDER (the caption alone, --max_tokens,
default the tokenizer's model_max_length). Every image is decoded whole, as caching will.
The report goes to stdout (--json: one JSON object). Any error (training would stop on it): each
error also as one line on stderr, exit status 1. --strict: warnings count as errors (on stderr too,
exit 1). A config that cannot be read: one line, exit 2.
"""

from __future__ import annotations

import json
import os
import sys

if __package__ in (None, ""):  # run as a script: make `library` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.cli import Parser, check_command_line, one_line, exit_without_collecting  # noqa: E402


def build_parser() -> Parser:
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("dataset_config", nargs="?", default=None, help="dataset TOML (default: the --config_file's)")
    p.add_argument("--config_file", default=None, help="a train_lora.py config: its dataset and text encoder's tokenizer")
    p.add_argument("--tokenizer", default=None, help="a tokenizer folder to count caption tokens with")
    p.add_argument("--max_tokens", type=int, default=None, help="with --tokenizer: tokens the encoder keeps")
    p.add_argument("--strict", action="store_true", help="warnings count as errors: exit 1 on any, one line each on stderr")
    p.add_argument("--json", action="store_true", help="the report as one JSON object")
    return p


# The arguments are checked before the library loads: --help and a bad flag answer at once.
if __name__ == "__main__":
    check_command_line(build_parser)


def training_config(path: str):
    """The training config's arguments (validated as train_lora.py validates them)."""
    from library.training.config import load_config

    args = load_config(["--config_file", path])
    if args.model_type == "llm":
        raise ValueError(f"{path}: model_type llm trains on text files; it has no image dataset to check")
    return args


def token_limit(args, config, family) -> tuple[object, str]:
    """(TokenLimit or None, what the report says about caption tokens); config: the training config's
    arguments and family its model family, if one was given."""
    if config is not None:
        return family.caption_token_limit(config), f"not counted: model_type {family.name}'s text encoder keeps every token"
    if not args.tokenizer:
        return None, "not counted (no tokenizer: pass --config_file or --tokenizer)"
    from transformers import AutoTokenizer

    from library.data.check import TokenLimit

    if not os.path.isdir(args.tokenizer):
        raise ValueError(f"--tokenizer {args.tokenizer}: no such folder")
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True)
    except (ValueError, OSError) as e:  # transformers' line names no folder ("Couldn't instantiate the backend ...")
        raise ValueError(f"--tokenizer {args.tokenizer}: no tokenizer can be loaded from this folder "
                         f"({type(e).__name__}: {e})") from None
    limit = tokenizer.model_max_length if args.max_tokens is None else args.max_tokens
    if limit > 1_000_000:  # transformers' "no limit"
        raise ValueError(f"--tokenizer {args.tokenizer}: the tokenizer sets no model_max_length; pass --max_tokens")
    return TokenLimit(f"{os.path.basename(os.path.normpath(args.tokenizer))} tokenizer", limit,
                      lambda text: len(tokenizer(text, verbose=False).input_ids)), ""


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
        if args.tokenizer and args.config_file:
            raise ValueError("--tokenizer and --config_file both given; the config's text encoder sets the tokenizer")
        if args.max_tokens is not None and not args.tokenizer:
            raise ValueError("--max_tokens needs --tokenizer")
        if args.max_tokens is not None and args.max_tokens < 1:  # 0 read as unset: the tokenizer's limit
            raise ValueError(f"--max_tokens {args.max_tokens}: expected the tokens the encoder keeps, >= 1")
        config = training_config(args.config_file) if args.config_file else None
        dataset = args.dataset_config or (config.dataset_config if config else None)
        if not dataset:
            raise ValueError("no dataset: give a dataset TOML or --config_file (with dataset_config)")
        from library.data.check import check_dataset, report_text
        from library.data.dataset_config import load_dataset_config

        blueprint = load_dataset_config(dataset)
        family = None
        if config is not None:
            from library.models.family import get_family

            family = get_family(config)
            from library.data.dataset_config import check_token_side
            from library.models.registry import spec_of

            # a bucket step the model's tokens do not divide: training refuses it before caching (the check passed it)
            check_token_side(blueprint, family.vae_downsample * family.patch, spec_of(family.name).title)
        limit, why = token_limit(args, config, family)
        takes = (family.name, family.min_controls, family.max_controls, family.takes_layers) if family else None  # as training
        largest = family.largest_image() if family else None  # the bucket training refuses before caching
        report = check_dataset(blueprint, limit, why, takes, vl_size=family.reference_vl_size if family else None,
                               largest=largest, control_bucket=family.control_bucket if family else None,
                               sample_control_bucket=family.sample_control_bucket if family else None)
        if config is not None and family is not None:  # training's refusals of the config's keys against the data
            from library.training.diffusion_checks import check_config_against_data

            check_config_against_data(config, any(s.held_out for s in report.subsets),
                                      any(s.is_reg for d in blueprint.datasets for s in d.subsets))
        if family is not None and family.edits_without_references_warn and report.subsets:  # training's warning too
            from library.data.controls import references_missing

            if said := references_missing([s for d in blueprint.datasets for s in d.subsets], family.name):
                report.subsets[0].add("warning", "reference", f"{dataset}: {said}")
    except (ValueError, OSError) as e:  # ConfigError and CheckpointError are ValueErrors
        print(one_line(e), file=sys.stderr)
        return 2
    if hasattr(sys.stdout, "reconfigure"):  # a file name that is no UTF-8 (refused, but named in other lines too)
        sys.stdout.reconfigure(errors="backslashreplace")  # printed escaped, where a UTF-8 terminal raised
    print(json.dumps(report.to_json(), indent=2) if args.json else report_text(report))
    problems = [p for p in report.problems() if args.strict or p.severity == "error"]
    if problems:  # an error stops training; with --strict a warning fails the check too
        for problem in problems:
            print(problem.line(), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    exit_without_collecting(main)
