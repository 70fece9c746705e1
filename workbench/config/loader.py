"""TOML config files -> :class:`RunConfig`, validated before any work starts.

A run is described by one TOML file (``run_name``, ``[model]``, ``[data]``, ``[training]``,
``[hooks]``, ``[guard]``, ``[samples]``; the README's "Config files and the CLI"). Everything a user can get wrong in it -- unknown keys,
wrong types, impossible argument combinations, references that do not import -- is found
here, before a model is built or a file is read, and reported as one :class:`ConfigError`
line that names the file, the line and the key: ``x.toml:7: training.learnig_rate: unknown
key (did you mean learning_rate?)``. References and relative paths resolve against the
config file's folder first (then the working directory), and :func:`dump_config` records the
resolved, absolute form so ``output_dir/config.toml`` reproduces the run from anywhere.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import importlib
import importlib.resources
import importlib.util
import inspect
import os
import re
import tomllib
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ConfigDict, TypeAdapter, ValidationError

from workbench.config.data_table import DATA_KEYS, DataSpec, DataTableChecks, optional_registry
from workbench.config.errors import ConfigError, Key
from workbench.config.overrides import apply_overrides, parse_override, parse_overrides  # noqa: F401 - part of this module's API
from workbench.config.refs import RefError, resolve_ref
from workbench.config.samples_table import samples_table
from workbench.config.toml_lines import decode_error, describe_type, find_lines, kind_of, line_of, toml_repr, tomlable
from workbench.core.args.training import ArgumentError, TrainingArguments
from workbench.distributed.health import HEALTH_FIELDS, Health
from workbench.guard.settings import GUARD_FIELDS, Guard
from workbench.train.samples import Samples
from workbench.models.adapters import PEFT_MISSING, lora_keys, module_names_of_folder, unmatched_targets

__all__ = [
    "ConfigError", "DataSpec", "ModelSpec", "RunConfig", "config_from_dict", "dump_config",
    "load_config", "parse_override", "parse_overrides", "check_training_overrides", "starter_config_text",
    "write_resolved_config",
]

TOP_KEYS = ("run_name", "model", "data", "training", "hooks", "guard", "samples", "health")
MODEL_KEYS = ("builtin", "factory", "pretrained", "options", "peft")
HOOK_KEYS = ("compute_loss_func", "compute_metrics", "preprocess_logits_for_metrics",
             "model_init", "data_collator", "callbacks")
_MODEL_KINDS = ("builtin", "factory", "pretrained")
# Common short names difflib cannot match to the HF field a user meant.
_TRAINING_ALIASES = {"lr": "learning_rate", "epochs": "num_train_epochs", "bs": "per_device_train_batch_size",
                     "batch_size": "per_device_train_batch_size", "train_batch_size": "per_device_train_batch_size",
                     "eval_batch_size": "per_device_eval_batch_size"}
@dataclass(frozen=True)
class ModelSpec:
    """Which model to build: exactly one of ``builtin`` / ``factory`` / ``pretrained``.

    ``factory`` keeps the reference as written; ``factory_fn`` is the callable it resolved
    to. ``pretrained`` is an absolute local folder. ``options`` are keyword arguments for
    the builtin model or the factory. ``peft`` is the ``[model.peft]`` table (a peft
    ``LoraConfig``'s keywords): the pretrained model is trained through a LoRA adapter.
    """

    builtin: str | None = None
    factory: str | None = None
    pretrained: str | None = None
    options: dict = field(default_factory=dict)
    peft: dict | None = None
    factory_fn: Callable[..., Any] | None = field(default=None, compare=False, repr=False)



@dataclass
class RunConfig:
    """A validated run description: what to build, how to train it, and what to record.

    ``hooks`` holds the resolved objects (callables; ``callbacks`` a list of classes or
    instances), ``hook_refs`` the ``"module:attribute"`` strings as written, and ``raw`` the
    config data with overrides applied and paths made absolute -- what :func:`dump_config`
    writes so a run can be repeated exactly.
    """

    path: Path | None
    run_name: str | None
    model: ModelSpec
    data: DataSpec
    training: TrainingArguments
    hooks: dict[str, Any] = field(default_factory=dict)
    hook_refs: dict[str, Any] = field(default_factory=dict)
    raw: dict = field(default_factory=dict)
    guard: Guard | None = None  # the [guard] table; None when the config has none (off)
    samples: Samples | None = None  # the [samples] table: answers to fixed prompts as it trains; None: none
    health: Health | None = None  # the [health] table: hangs, stragglers, MFU peak, OOM retries; None: defaults


# -- public entry points ---------------------------------------------------------------


def load_config(path: str | Path, overrides: Sequence[str] | Mapping[str, Any] | None = None,
                *, args_cls: type[TrainingArguments] = TrainingArguments) -> RunConfig:
    """Read, override and validate the config file at ``path``; raise ConfigError on any problem.

    ``overrides`` are ``"section.key=value"`` strings (as from ``--set``) or a mapping of
    dotted keys to values; a value of None in a mapping removes the key (back to the default).
    ``args_cls`` lets a TrainingArguments subclass accept its extra fields.
    """
    source, file = str(path), Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError("config file not found", path=source) from None
    except UnicodeDecodeError:
        raise ConfigError("config file is not UTF-8 text", path=source) from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file ({exc.strerror or exc})", path=source) from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        message, line = decode_error(exc)
        raise ConfigError(f"invalid TOML: {message}", path=source, line=line) from None
    data, origins = apply_overrides(data, overrides)
    config = _Loader(source, file.absolute().parent, find_lines(text), origins, args_cls).build(data)
    config.path = file.absolute()
    return config


def config_from_dict(data: Mapping[str, Any], *, base_dir: str | Path, source: str = "<dict>",
                     args_cls: type[TrainingArguments] = TrainingArguments) -> RunConfig:
    """Validate already-parsed config ``data``; relative paths and refs resolve against ``base_dir``.

    Errors carry ``source`` as their location (no line numbers: there is no text).
    """
    return _Loader(source, Path(base_dir).absolute(), {}, {}, args_cls).build(copy.deepcopy(dict(data)))


def check_training_overrides(overrides: Mapping[str, Any], *,
                             args_cls: type[TrainingArguments] = TrainingArguments) -> dict[str, Any]:
    """Check the names and value types of TrainingArguments overrides as a config file's
    ``[training]`` table is checked (unknown names with a "did you mean", no text where a
    number belongs); returns them validated. Combinations are left to ``args_cls`` itself.
    Raises ConfigError (a ValueError) with one line.
    """
    loader = _Loader("", Path.cwd(), {}, {}, args_cls)
    names = [f.name for f in dataclasses.fields(args_cls) if f.init]
    hints = _field_hints(args_cls)
    checked = {}
    for name, value in overrides.items():
        name = str(name).removeprefix("training.")
        if name not in names:
            raise loader.unknown(("training", name), names, f"not a field of {args_cls.__name__}")
        checked[name] = loader.check_type(("training", name), value, hints.get(name, Any))
    return checked


def dump_config(run_config: RunConfig) -> str:
    """TOML text of the resolved config (absolute paths, overrides applied) that repeats the run."""
    import tomli_w

    header = "# Resolved workbench config of this run (absolute paths, overrides applied).\n"
    return header + tomli_w.dumps(tomlable(run_config.raw))


def write_resolved_config(run_config: RunConfig, output_dir: str | Path) -> Path:
    """Write :func:`dump_config` to ``output_dir/config.toml`` (atomically) and return its path."""
    target = Path(output_dir) / "config.toml"
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(".config.toml.tmp")
    tmp.write_text(dump_config(run_config), encoding="utf-8")
    os.replace(tmp, target)
    return target


def starter_config_text(finetune: bool = False, file: str | None = None) -> str:
    """The commented starter config that ``workbench init`` writes; it runs as is.

    Its header names its ``file`` (``workbench run FILE``), and its run name and output_dir
    derive from the file's name (``runs/my-run`` for my-run.toml), so a starter never trains
    into the demo's ``runs/tiny-gpt`` or another starter's folder. ``finetune``: the LoRA
    fine-tuning config (a pretrained folder, chat data, samples, the guard).
    """
    template = "templates/finetune.toml" if finetune else "templates/starter.toml"
    text = importlib.resources.files("workbench").joinpath(template).read_text("utf-8")
    file = file or ("finetune.toml" if finetune else "workbench.toml")
    # Kept to what a TOML string and a folder name take as they are.
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(file).stem).strip("-.") or "run"
    for key in ("run_name", "output_dir"):  # the comments stay in their column when the name fits
        line = next((ln for ln in text.splitlines() if ln.startswith(f"{key} = ") and "{pad}" in ln), None)
        if line is not None:
            width = len(line.split("{pad}")[0].replace("{name}", name))
            text = text.replace(line, line.replace("{pad}", " " * max(38 - width, 1)))
    return text.replace("{file}", file).replace("{name}", name)


# -- small helpers --------------------------------------------------------------------


@functools.lru_cache(maxsize=256)
def _cached_adapter(tp: Any) -> TypeAdapter:
    return TypeAdapter(tp)


def _adapter(tp: Any) -> TypeAdapter | None:
    """A pydantic validator for ``tp``; None for a type pydantic cannot check (left to the class)."""
    for make in (_cached_adapter, TypeAdapter,
                 lambda t: TypeAdapter(t, config=ConfigDict(arbitrary_types_allowed=True))):
        try:
            return make(tp)
        except Exception:  # unhashable hint, or no schema for it: try the next way
            continue
    return None


def _coerced(given: Any, result: Any) -> bool:
    """Whether lax validation turned a string or bool into a number/bool (which we refuse)."""
    if isinstance(given, str):
        return isinstance(result, (bool, int, float))
    if isinstance(given, bool):
        return not isinstance(result, bool)
    if isinstance(given, (int, float)):
        return isinstance(result, bool)
    if isinstance(given, (list, tuple)) and isinstance(result, (list, tuple)):
        return any(_coerced(a, b) for a, b in zip(given, result))
    if isinstance(given, dict) and isinstance(result, dict):
        return any(_coerced(v, result.get(k)) for k, v in given.items())
    return False


def _type_hints(obj: Any) -> dict[str, Any]:
    """Parameter hints of a function or a class's __init__; {} when they cannot be resolved."""
    try:
        return typing.get_type_hints(obj.__init__ if isinstance(obj, type) else obj)
    except Exception:  # unresolvable forward references: skip type checks, never crash
        return {}


def _field_hints(cls: type) -> dict[str, Any]:
    """Field hints of a dataclass, each class's names resolved in its own module."""
    hints: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):  # a subclass with a bad annotation keeps its bases' hints
        try:
            hints.update(typing.get_type_hints(klass))
        except Exception:
            pass
    return hints


# -- the validator ---------------------------------------------------------------------


class _Loader(DataTableChecks):
    """Validates one config's data; knows where each key was written (file line or --set)."""

    def __init__(self, source: str, base_dir: Path, lines: dict[Key, int], origins: dict[Key, str],
                 args_cls: type[TrainingArguments]) -> None:
        self.source, self.base_dir, self.lines, self.origins = source, base_dir, lines, origins
        self.args_cls = args_cls

    def error(self, key: Key, message: str) -> ConfigError:
        name = ".".join(key) or None
        for set_key, text in self.origins.items():  # the key lies inside an overridden value
            if key[:len(set_key)] == set_key:
                return ConfigError(message, path=f"--set {text}", key=name)
        if key and key not in self.lines:  # not in the file, but an override created below it
            for set_key, text in self.origins.items():
                if set_key[:len(key)] == key:
                    return ConfigError(message, path=f"--set {text}", key=name)
        return ConfigError(message, path=self.source, line=line_of(self.lines, key), key=name)

    def unknown(self, key: Key, allowed: Sequence[str], what: str | None = None) -> ConfigError:
        close = difflib.get_close_matches(key[-1], list(allowed), n=1, cutoff=0.6)
        if key[:1] == ("training",) and _TRAINING_ALIASES.get(key[-1]) in allowed:
            close = [_TRAINING_ALIASES[key[-1]]]
        if close:
            return self.error(key, f"unknown key (did you mean {close[0]}?)")
        return self.error(key, f"unknown key ({what or 'expected one of: ' + ', '.join(allowed)})")

    def table(self, key: Key, value: Any, allowed: Sequence[str] | None = None) -> dict:
        if not isinstance(value, dict):
            raise self.error(key, f"expected a table, got {toml_repr(value)} ({kind_of(value)})")
        for name in value if allowed is not None else ():
            if name not in allowed:
                raise self.unknown(key + (name,), allowed)
        return value

    def check_type(self, key: Key, value: Any, hint: Any) -> Any:
        """Validate ``value`` against ``hint`` (pydantic, lax, but no str/bool -> number)."""
        adapter = _adapter(hint)
        if adapter is None:
            return value
        try:
            result = adapter.validate_python(value)
        except (ValidationError, TypeError):
            result = ok = False
        else:
            ok = not _coerced(value, result)
        if ok:
            return result
        message = f"expected {describe_type(hint)}, got {toml_repr(value)} ({kind_of(value)})"
        if isinstance(value, str):
            try:
                literal = tomllib.loads(f"v = {value}")["v"]
                self.check_type(key, literal, hint)
                if not isinstance(literal, str):
                    message += f"; write {key[-1]} = {value.strip()}"
            except (tomllib.TOMLDecodeError, ConfigError):
                pass
        raise self.error(key, message)

    def path(self, value: str) -> str:
        """``value`` as an absolute path, relative ones taken from the config's folder."""
        return os.path.normpath(os.path.join(self.base_dir, os.path.expanduser(value)))

    def string(self, key: Key, value: Any) -> str:
        if not isinstance(value, str) or not value:
            raise self.error(key, f"expected a non-empty string, got {toml_repr(value)} ({kind_of(value)})")
        return value

    # -- sections ------------------------------------------------------------------------

    def build(self, data: dict) -> RunConfig:
        self.table((), data, TOP_KEYS)
        missing = [name for name in ("model", "data") if name not in data]
        if missing:
            tables = ", ".join(f"[{name}]" for name in missing)
            raise self.error((), f"missing required table{'s' if len(missing) > 1 else ''} {tables}; "
                                 "run 'workbench init' for a starter config")
        run_name = data.get("run_name")
        if run_name is not None:
            self.string(("run_name",), run_name)
        model, raw_model = self.model(self.table(("model",), data["model"], MODEL_KEYS))
        data_spec, raw_data = self.data(self.table(("data",), data["data"], DATA_KEYS))
        training, raw_training = self.training(self.table(("training",), data.get("training", {})), run_name)
        hooks, refs, raw_hooks = self.hooks(self.table(("hooks",), data.get("hooks", {}), HOOK_KEYS))
        guard = self.guard(self.table(("guard",), data["guard"], GUARD_FIELDS)) if "guard" in data else None
        samples = samples_table(self, data["samples"]) if "samples" in data else None
        health = self.settings("health", Health, data["health"], HEALTH_FIELDS) if "health" in data else None
        raw = {"run_name": run_name, "model": raw_model, "data": raw_data, "training": raw_training}
        raw = {k: v for k, v in raw.items() if v is not None}
        if raw_hooks:
            raw["hooks"] = raw_hooks
        if guard is not None:
            raw["guard"] = copy.deepcopy(data["guard"])
        if samples is not None:
            raw["samples"] = copy.deepcopy(data["samples"])
        if health is not None:
            raw["health"] = copy.deepcopy(data["health"])
        return RunConfig(path=None, run_name=run_name, model=model, data=data_spec, training=training,
                         hooks=hooks, hook_refs=refs, raw=raw, guard=guard,
                         samples=samples, health=health)

    def model(self, table: dict) -> tuple[ModelSpec, dict]:
        kinds = [name for name in _MODEL_KINDS if name in table]
        if len(kinds) != 1:
            found = f" ({' and '.join(kinds)} are both set)" if kinds else ""
            raise self.error(("model",) + tuple(kinds[1:2]),
                             f"set exactly one of builtin, factory, pretrained{found}")
        kind = kinds[0]
        value = self.string(("model", kind), table[kind])
        options = self.table(("model", "options"), table.get("options", {}))
        raw, factory_fn = copy.deepcopy(table), None
        if kind == "builtin":
            registry = optional_registry("workbench.models", "BUILTIN_MODELS")
            if registry is not None:
                self.builtin_name(("model", "builtin"), value, registry, "model")
                self.options(("model", "options"), options, registry[value])
        elif kind == "factory":
            factory_fn, raw["factory"] = self.resolve(("model", "factory"), value, need_callable=True)
            self.options(("model", "options"), options, factory_fn)
        else:
            folder = self.path(value)
            if not os.path.isdir(folder):
                raise self.error(("model", "pretrained"), f"folder {value!r} does not exist; downloading "
                                 "from the Hub is not supported, point to a local folder")
            raw["pretrained"] = value = folder
        peft = self.peft(table["peft"], value if kind == "pretrained" else None) if "peft" in table else None
        spec = ModelSpec(**{kind: value}, options=dict(options), peft=peft, factory_fn=factory_fn)
        return spec, raw

    def peft(self, table: Any, pretrained: str | None) -> dict:
        """Check ``[model.peft]``: peft installed, LoraConfig's keys and types, a pretrained
        folder to adapt, and ``target_modules`` that each name a module of that model."""
        key = ("model", "peft")
        self.table(key, table)
        if pretrained is None:
            raise self.error(key, 'needs model.pretrained (a LoRA adapter trains on a pretrained model\'s '
                             'folder): set pretrained = "DIR" in [model]')
        if importlib.util.find_spec("peft") is None:
            raise self.error(key, PEFT_MISSING)
        from peft import LoraConfig

        allowed = lora_keys()
        hints = _field_hints(LoraConfig)
        checked = {}
        for name, value in table.items():
            if name not in allowed:
                raise self.unknown(key + (name,), allowed, "not a field of peft's LoraConfig")
            checked[name] = self.check_type(key + (name,), value, hints.get(name, Any))
        if checked.get("r", 1) < 1:  # peft refuses it only once it builds the layers
            raise self.error(key + ("r",), f"the adapter's rank must be 1 or more, got {checked['r']}")
        try:
            LoraConfig(**checked)
        except (TypeError, ValueError) as exc:
            raise self.error(key, f"peft's LoraConfig refused it: {str(exc).strip().splitlines()[0]}") from None
        names = module_names_of_folder(pretrained)
        unmatched = unmatched_targets(checked.get("target_modules"), names or [])
        if names is not None and unmatched:
            leaves = sorted({n.rsplit(".", 1)[-1] for n in names})
            raise self.error(key + ("target_modules",), f"{unmatched[0]!r} names no module of the model in "
                             f"{pretrained} (its modules end in: {', '.join(leaves[:12])})")
        return checked

    def builtin_name(self, key: Key, name: str, registry: Mapping[str, Any], what: str) -> None:
        if name not in registry:
            close = difflib.get_close_matches(name, list(registry), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise self.error(key, f"unknown builtin {what} {name!r}{hint}; available: {', '.join(sorted(registry))}")

    def options(self, key: Key, options: dict, fn: Callable, common: Callable | None = None) -> None:
        """Check option names (and annotated types) against ``fn``'s signature.

        ``common`` adds the keyword-only options a shared loader offers every builtin.
        """
        try:
            params = list(inspect.signature(fn).parameters.values())
            params += [p for p in inspect.signature(common).parameters.values()
                       if p.kind is p.KEYWORD_ONLY] if common else []
        except (TypeError, ValueError):
            return
        if any(p.kind is p.VAR_KEYWORD for p in params):
            return  # takes anything: nothing to check
        accepted = list(dict.fromkeys(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)))
        hints = {**(_type_hints(common) if common else {}), **_type_hints(fn)}
        for name, value in options.items():
            if name not in accepted:
                raise self.unknown(key + (name,), accepted, "accepted options: " + ", ".join(accepted))
            if name in hints:
                self.check_type(key + (name,), value, hints[name])

    def training(self, table: dict, run_name: str | None) -> tuple[TrainingArguments, dict]:
        fields = [f.name for f in dataclasses.fields(self.args_cls) if f.init]
        hints = _field_hints(self.args_cls)
        kwargs = {}
        for name, value in table.items():
            if name not in fields:
                raise self.unknown(("training", name), fields, f"not a field of {self.args_cls.__name__}")
            kwargs[name] = self.check_type(("training", name), value, hints.get(name, Any))
        raw = copy.deepcopy(table)
        raw["output_dir"] = kwargs["output_dir"] = self.path(kwargs.get("output_dir") or "trainer_output")
        if isinstance(kwargs.get("resume_from_checkpoint"), str):
            raw["resume_from_checkpoint"] = kwargs["resume_from_checkpoint"] = self.path(kwargs["resume_from_checkpoint"])
        if run_name is not None and kwargs.get("run_name") is None:
            kwargs["run_name"] = run_name
        try:
            return self.args_cls(**kwargs), raw
        except ArgumentError as exc:
            raise self.error(("training", exc.key) if exc.key else ("training",), exc.reason) from None
        except (TypeError, ValueError) as exc:
            raise self.error(("training",), str(exc)) from None

    def guard(self, table: dict) -> Guard:
        """The ``[guard]`` table as a :class:`Guard`; its own checks, located at the key."""
        return self.settings("guard", Guard, table, GUARD_FIELDS)

    def settings(self, name: str, cls: type, table: Any, fields: Sequence[str]) -> Any:
        """A settings table (``[guard]``, ``[health]``) as ``cls``: known keys, their types, then
        the class's own checks, each problem located at its key."""
        hints = _field_hints(cls)
        self.table((name,), table, fields)
        kwargs = {key: self.check_type((name, key), value, hints[key]) for key, value in table.items()}
        try:
            return cls(**kwargs)
        except ArgumentError as exc:
            raise self.error((name, exc.key) if exc.key else (name,), exc.reason) from None

    def hooks(self, table: dict) -> tuple[dict, dict, dict]:
        resolved, refs, raw = {}, {}, {}
        for name, value in table.items():
            key = ("hooks", name)
            if name == "callbacks":
                if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                    raise self.error(key, f'expected a list of "module:attribute" strings, got '
                                     f"{toml_repr(value)} ({kind_of(value)})")
                pairs = [self.resolve(key, ref, need_callable=False) for ref in value]
                for (obj, _), ref in zip(pairs, value):
                    if inspect.isroutine(obj) or inspect.ismodule(obj) or not any(a.startswith("on_") for a in dir(obj)):
                        raise self.error(key, f"{ref!r} is not a callback (a TrainerCallback class or instance)")
                resolved[name], raw[name] = [p[0] for p in pairs], [p[1] for p in pairs]
            else:
                if not isinstance(value, str):
                    raise self.error(key, f'expected a "module:attribute" string, got {toml_repr(value)} ({kind_of(value)})')
                resolved[name], raw[name] = self.resolve(key, value, need_callable=True)
            refs[name] = copy.copy(value)
        return resolved, refs, raw

    # -- references ----------------------------------------------------------------------

    def resolve(self, key: Key, ref: str, *, need_callable: bool) -> tuple[Any, str]:
        """:func:`workbench.config.refs.resolve_ref` against the config's folder, errors located at ``key``."""
        try:
            return resolve_ref(ref, self.base_dir, need_callable=need_callable)
        except RefError as exc:
            raise self.error(key, str(exc)) from None
