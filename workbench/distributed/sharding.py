"""``fsdp``, ``fsdp_config`` and ``deepspeed`` arguments -> Accelerate plugins.

The arguments keep the Trainer's meanings: ``fsdp`` is a space-separated option string
("full_shard auto_wrap", "shard_grad_op offload", ...), ``fsdp_config`` a dict or JSON
file of plugin settings (the ``fsdp_`` prefix is optional, as in HF), ``deepspeed`` a
DeepSpeed config dict or JSON path. Anything this build cannot honour is an
``ArgumentError`` naming the key and the accepted values.
"""

from __future__ import annotations

from typing import Any

from workbench.core.args.training import FSDP_SHARDING, ArgumentError, TrainingArguments

__all__ = ["accelerator_plugins"]

# fsdp_config keys passed to FullyShardedDataParallelPlugin under the same name.
_PLUGIN_KEYS = ("fsdp_version", "backward_prefetch", "forward_prefetch", "use_orig_params", "sync_module_states",
                "cpu_ram_efficient_loading", "activation_checkpointing", "limit_all_gathers", "state_dict_type",
                "reshard_after_forward", "min_num_params", "transformer_cls_names_to_wrap")
_ALIASES = {"transformer_layer_cls_to_wrap": "transformer_cls_names_to_wrap"}
_IGNORED = ("xla", "xla_fsdp_v2", "xla_fsdp_grad_ckpt", "xla_fsdp_settings")  # TPU-only settings


def _fsdp_plugin(args: TrainingArguments):
    from accelerate.utils import FullyShardedDataParallelPlugin

    options = args.fsdp  # checked and split by TrainingArguments
    config = {}
    for key, value in dict(args.fsdp_config or {}).items():
        name = key[len("fsdp_"):] if key.startswith("fsdp_") and key != "fsdp_version" else key
        name = _ALIASES.get(name, name)
        if name in _IGNORED:
            continue
        if name not in _PLUGIN_KEYS:
            raise ArgumentError("fsdp_config", f"unknown key {key!r}; accepted: {', '.join(_PLUGIN_KEYS)}")
        config[name] = value
    if isinstance(config.get("transformer_cls_names_to_wrap"), str):
        config["transformer_cls_names_to_wrap"] = [config["transformer_cls_names_to_wrap"]]
    version = int(config.get("fsdp_version", 1))
    strategy = next((o for o in options if o in FSDP_SHARDING), "full_shard")
    if version == 2:
        if strategy not in ("full_shard", "shard_grad_op"):
            raise ArgumentError("fsdp", f"{strategy} needs fsdp_version 1; FSDP2 shards fully (full_shard) or "
                                        "keeps parameters gathered after forward (shard_grad_op)")
        config.setdefault("reshard_after_forward", strategy == "full_shard")
    else:
        config["sharding_strategy"] = strategy.upper()
    if "offload" in options:
        config["cpu_offload"] = True
    if "auto_wrap" in options:
        config["auto_wrap_policy"] = ("transformer_based_wrap" if config.get("transformer_cls_names_to_wrap")
                                      else "size_based_wrap")
    config.setdefault("state_dict_type", "FULL_STATE_DICT")
    return FullyShardedDataParallelPlugin(**config)


def _deepspeed_plugin(args: TrainingArguments):
    from accelerate.utils import DeepSpeedPlugin  # TrainingArguments checked that deepspeed is installed

    return DeepSpeedPlugin(hf_ds_config=args.deepspeed)


def accelerator_plugins(args: TrainingArguments) -> dict[str, Any]:
    """Keyword arguments for ``Accelerator``: the FSDP or DeepSpeed plugin the arguments ask for."""
    if args.deepspeed:
        return {"deepspeed_plugin": _deepspeed_plugin(args)}
    if args.fsdp:
        return {"fsdp_plugin": _fsdp_plugin(args)}
    return {}
