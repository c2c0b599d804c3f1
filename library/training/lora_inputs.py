"""The LoRA files a run reads (network_weights, base_loras), checked from their headers before the
model loads and before caching: a file that is not a LoRA, holds text-encoder modules only, or is
another model's (networks/lora_reader.py check_lora_arch), or whose modules the run's network cannot take
(check_network_fits), stops the run in one line naming the key; network_weights loaded into the run's network
(load_network_weights) and what the saved header says of the ranks and alphas it loaded (loaded_dim_alpha).
network_args against the network type, from the config alone: check_network_settings."""

from __future__ import annotations

from library.errors import ConfigError
from library.lora_spec import parse_lora_spec


def check_lora_inputs(args, arch: str) -> None:
    """Raise ConfigError for the first of network_weights / base_loras that `arch`'s model cannot take, or
    that the run's network cannot read: a LyCORIS file as network_weights of networks.lora (or a LoRA of
    lycoris.kohya), a LyCORIS file as base_loras (merged by tools/merge_lora.py only; one of whole deltas alone,
    LyCORIS' full type, merges as it is)."""
    from library.training.config import where_set
    from networks.factory import network_module_of_file  # torch: not for the config check the web UI runs
    from networks.lora_reader import check_lora_arch, whole_deltas_only

    named = [("network_weights", args.network_weights)] if args.network_weights else []
    named += [("base_loras", parse_lora_spec(entry, "base_loras").path) for entry in getattr(args, "base_loras", None) or []]
    for key, path in named:
        try:
            check_lora_arch(path, arch)
            # base_loras merges a file of whole deltas alone as it is (a LyCORIS full type's too)
            kind = "networks.lora" if key == "base_loras" and whole_deltas_only(path) else network_module_of_file(path)
        except (ValueError, OSError) as e:  # CheckpointError is a ValueError
            raise ConfigError(f"{where_set(args, key)}: key '{key}': {e}") from None
        wanted = (getattr(args, "network_module", None) or "networks.lora") if key == "network_weights" else "networks.lora"
        if kind != wanted:
            raise ConfigError(f"{where_set(args, key)}: key '{key}': {path}: {_KIND[kind]}; " + (
                f"set network_module = \"{kind}\" to load it" if key == "network_weights" else
                "merge it into the checkpoint with tools/merge_lora.py and train on the merged checkpoint"))


def check_network_settings(args, arch: str) -> None:
    """network_args against the network type and the architecture: a ConfigError naming the config. Here, not
    in load_config: the network modules (and LyCORIS) import torch, the web UI's process does not (its config
    check's helper process runs it: diffusion_checks.check_before_caching, llm_task.check_before_loading)."""
    from library.training.config import base_precision, base_precision_key, lora_network_args, where_set
    from networks.factory import check_network_args

    try:
        check_network_args(args.network_module, arch, lora_network_args(args), base_precision(args),
                           base_precision_key(args))
    except ValueError as e:
        raise ConfigError(f"{where_set(args, 'network_args')}: {e}") from None


def check_network_fits(args, arch: str, meta_model) -> None:
    """The run's network built on meta_model() (the model on the meta device: no weights read, seconds) before the
    data is read and the model loads: network_args that only the model can judge (block indices past its blocks, a
    pattern matching no module, a selection of none) are a ConfigError now, not after minutes of caching; and
    network_weights loaded into it as the run loads it later: a module of another rank than the network's
    (network_weights keeps the network's ranks, as sd-scripts does without dim_from_weights), a name no Linear of
    the model has. The load's warnings are the run's. lycoris.kohya: our selection of its targets (lycoris_targets),
    which judges the same args, or the network built when network_weights must load into it. Each of
    base_loras is read onto the model as the merge reads it (a module the model lacks, a `.diff_b` of another shape
    is named now)."""
    import warnings

    from library.training.config import where_set

    model = meta_model()
    try:  # with dim_from_weights the build reads network_weights: its errors are that key's
        network = _network_on_meta(args, arch, model)
    except ValueError as e:  # CheckpointError is a ValueError
        raise ConfigError(f"{where_set(args, 'network_weights')}: key 'network_weights': {e}" if args.dim_from_weights
                          else f"{where_set(args, 'network_args')}: {e}") from None
    _check_base_loras_fit(args, arch, model, where_set(args, "base_loras"))
    if network is None or not args.network_weights or args.dim_from_weights:
        return
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            network.load_weights(args.network_weights, strict=False)
    except (ValueError, OSError) as e:  # CheckpointError is a ValueError
        raise ConfigError(f"{where_set(args, 'network_weights')}: key 'network_weights': {e}") from None


def _check_base_loras_fit(args, arch: str, model, where: str) -> None:
    """Each base_loras file read onto the meta `model` as merge_base_loras reads it, before caching rather than
    at the merge after it: a module the model lacks (a LoRA of a model with more blocks) is a ConfigError."""
    import warnings

    import torch

    from library.training.base_loras import base_lora_specs
    from networks.lora import LoRANetwork
    from networks.lora_reader import merge_whole_deltas, whole_deltas_only

    for spec in base_lora_specs(getattr(args, "base_loras", None) or []):
        try:  # fork_rng: building the modules draws initial weights (the file's replace them), not the run's draws
            with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the merge says them
                if not whole_deltas_only(spec.path):
                    LoRANetwork.from_weights(model, arch, spec.path)
            # its .diff / .diff_b: names and shapes, on meta (an fp8 run merges them before it quantizes)
            merge_whole_deltas(model, arch, spec.path, spec.ratio, codes_merge_before=True)
        except (ValueError, OSError) as e:  # CheckpointError is a ValueError
            raise ConfigError(f"{where}: key 'base_loras': {e}") from None


def _network_on_meta(args, arch: str, model):
    """The run's network on the meta `model`; lycoris.kohya without network_weights: None, once lycoris_targets has
    judged the selection args on it (with them, the network their file loads into: its shapes follow the args)."""
    import torch

    from library.training.config import lora_network_args, network_modules_from
    from networks.factory import build_network

    network_args = lora_network_args(args)
    if (args.network_module or "networks.lora") == "lycoris.kohya" and not args.network_weights:
        from networks.lycoris_network import lycoris_targets

        lycoris_targets(model, arch, args.network_dim, network_args)
        return None
    with torch.device("meta"):
        return build_network(args.network_module, model, arch, args.network_dim, args.network_alpha,
                             network_args=network_args, modules_from=network_modules_from(args))


_KIND = {"networks.lora": "a down/up LoRA file (network_module networks.lora)",
         "lycoris.kohya": "a LyCORIS file (LoKr / LoHa / ...; network_module lycoris.kohya)"}


def load_network_weights(network, args) -> tuple[str, dict[str, str]]:
    """network_weights into the run's network: (the log line, loaded_dim_alpha). A network built with
    dim_from_weights holds the file's modules with their weights already (build_network's modules_from): the
    file is not read a second time."""
    if args.dim_from_weights:
        said = f"{len(network.lora_modules())} LoRA modules at the file's ranks and alphas (dim_from_weights)"
    else:
        said = network.describe_loaded(network.load_weights(args.network_weights, strict=False))
    return f"network_weights: {said}", loaded_dim_alpha(network, args)


def loaded_dim_alpha(network, args) -> dict[str, str]:
    """{network_dim, network_alpha: the header's value} where the network after network_weights holds other
    ranks or alphas than the config's, so the header says what the file holds: the file's alphas win (as in
    sd-scripts), and a module whose rank a fused <-> split conversion set is rebuilt at it. One value where
    the modules share it, else "Dynamic" (networks/lora_files.py dim_and_alpha). {}: the config's are the
    network's."""
    from networks.lora_files import dim_and_alpha

    state = network.state_dict()
    ranks = [t.shape[0] for k, t in state.items() if k.endswith(".lora_down.weight")]
    alphas = [float(t) for k, t in state.items() if k.endswith(".alpha")]
    configured = (args.network_dim, float(args.network_alpha or args.network_dim))
    said = dim_and_alpha(ranks or [configured[0]], alphas or [configured[1]])
    return {key: value for key, value, own in zip(("network_dim", "network_alpha"), said, dim_and_alpha(*zip(configured)))
            if value != own}
