"""What a Trainer's checkpoint holds, written and read back: weights (safetensors, sharded
when large), optimizer, schedule, scaler, RNG streams, trainer_state.json, and workbench's
own extras. The files go into the store's atomic publish (store.py); nothing is unpickled
beyond ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import copy
import json
import logging
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from workbench.core.run import Run
from workbench.checkpoint.state_dicts import (
    capture_model_state,
    is_fsdp,
    capture_optimizer_state,
    host_copy,
    load_model_state,
    load_optimizer_state,
    nested_nbytes,
    unique_state,
)
from workbench.checkpoint.store import WEIGHTS, WEIGHTS_INDEX, CheckpointStore
from workbench.core.state import WORKBENCH_STATE_NAME
from workbench.core.rng import PENDING_KEY, capture_rng, numpy_safe_globals, restore_rng
from workbench.core.trainer_utils import PREFIX_CHECKPOINT_DIR, unwrap_model
from workbench.models.adapters import ADAPTER_WEIGHTS, is_peft_model, load_adapter_state


log = logging.getLogger("transformers.trainer")  # HF's Trainer gives these warnings there too

SHARD_BYTES = 5 * 1024**3  # weights above this are split into shards, as transformers does

__all__ = [
    "CheckpointContents",
    "save_checkpoint",
    "load_training_state",
    "load_best_model",
    "save_model_files",
    "load_model_files",
    "model_saved_by_override",
    "rng_state_file",
    "weights_misfit",
]



def save_model_files(model: torch.nn.Module, directory: Path, processing_class: Any = None,
                     max_shard_bytes: int | None = None, state: dict[str, torch.Tensor] | None = None) -> None:
    """Weights as safetensors (HF models through save_pretrained), plus the processing class.

    ``state`` is the weights to write (host copies taken earlier, or gathered from FSDP);
    by default the model's own. Weights above ``max_shard_bytes`` (default 5 GB) are split
    into ``model-0000i-of-0000n.safetensors`` files with ``model.safetensors.index.json``,
    the layout transformers reads.
    """
    directory.mkdir(parents=True, exist_ok=True)
    if hasattr(model, "save_pretrained") and hasattr(model, "config") and not isinstance(model.config, dict):
        extra = {"state_dict": state} if state is not None else {}
        model.save_pretrained(directory, safe_serialization=True, **extra)
    else:
        from safetensors.torch import save_file

        limit = max_shard_bytes or SHARD_BYTES
        if state is None:
            state = unique_state(model)
        shards: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        for name, tensor in state.items():
            nbytes = tensor.numel() * tensor.element_size()
            if shards[-1] and size + nbytes > limit:
                shards.append({})
                size = 0
            shards[-1][name] = tensor
            size += nbytes
        if len(shards) == 1:
            save_file(shards[0], str(directory / WEIGHTS), metadata={"format": "pt"})
        else:
            weight_map = {}
            for i, shard in enumerate(shards, 1):
                file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(directory / file), metadata={"format": "pt"})
                weight_map.update({name: file for name in shard})
            total = sum(t.numel() * t.element_size() for t in state.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (directory / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2), encoding="utf-8")
    if processing_class is not None and hasattr(processing_class, "save_pretrained"):
        processing_class.save_pretrained(directory)


@dataclass
class CheckpointContents:
    """Everything a checkpoint holds, as host copies: taking it is the only part of a save
    that must happen at the step boundary; writing can follow later (or elsewhere)."""

    step: int
    model: torch.nn.Module | None  # None: an overriding Trainer.save_model wrote the weights
    processing_class: Any
    weights: dict[str, torch.Tensor] | None  # None on ranks other than 0
    optimizer: dict[str, Any] | None
    scheduler: dict[str, Any] | None
    scaler: dict[str, Any] | None
    rng: dict[str, Any] | None  # single process; with several each rank writes its own
    trainer_state: str
    workbench_state: str
    training_args: str
    arguments: Any  # the TrainingArguments object, pickled into training_args.bin as HF does

    @classmethod
    def capture(cls, run: Run, with_model: bool = True) -> "CheckpointContents":
        """Copy the run's state to host memory (a collective under FSDP: every rank calls it).

        ``with_model=False`` leaves the weights (and processing class) out, for a checkpoint
        whose model files the Trainer's own ``save_model`` writes.
        """
        args, acc = run.args, run.accelerator
        main = acc.is_main_process
        weights = capture_model_state(run) if with_model else None
        full = not args.save_only_model
        optimizer = capture_optimizer_state(run) if full else None
        scheduler = host_copy(run.lr_scheduler.state_dict()) if full and main else None
        if optimizer is not None and scheduler is not None:
            optimizer, scheduler = _hf_group_layout(run, optimizer, scheduler)
        scaler = getattr(acc, "scaler", None)
        return cls(
            step=run.state.global_step,
            model=unwrap_model(run.model) if with_model else None,
            processing_class=run.processing_class,
            weights=weights,
            optimizer=optimizer,
            scheduler=scheduler,
            scaler=host_copy(scaler.state_dict()) if full and main and scaler is not None else None,
            rng=run_rng(run) if full and acc.num_processes == 1 else None,
            trainer_state=run.state.to_json_string(),
            workbench_state=run.workbench_state.to_json_string(),
            training_args=args.to_json_string() + "\n",
            arguments=copy.copy(args),
        )

    def nbytes(self) -> int:
        """About how many bytes :meth:`write` puts on disk (the tensors; the rest is small)."""
        return sum(nested_nbytes(part) for part in (self.weights, self.optimizer, self.scheduler, self.scaler, self.rng)) \
            + len(self.trainer_state) + len(self.workbench_state) + len(self.training_args)

    def write(self, directory: Path) -> None:
        """Write the files of the checkpoint into ``directory`` (rank 0's part)."""
        if self.model is not None:
            save_model_files(self.model, directory, self.processing_class, state=self.weights)
        for name, value in (("optimizer.pt", self.optimizer), ("scheduler.pt", self.scheduler),
                            ("scaler.pt", self.scaler), ("rng_state.pth", self.rng)):
            if value is not None:
                torch.save(value, directory / name)
        (directory / "trainer_state.json").write_text(self.trainer_state, encoding="utf-8")
        (directory / WORKBENCH_STATE_NAME).write_text(self.workbench_state, encoding="utf-8")
        # For the tools that read it (HF writes it); workbench itself reads training_args.json.
        torch.save(self.arguments, directory / "training_args.bin")
        (directory / "training_args.json").write_text(self.training_args, encoding="utf-8")


def _hf_group_layout(run: Run, optimizer: dict[str, Any],
                     scheduler: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Optimizer and schedule states in transformers' two-group layout (decay, then no decay).

    Without weight decay the Trainer trains one group (models/param_groups.py says why); the
    parameters are in the same order, so the saved state is cut in two where HF's groups
    part, and transformers' Trainer can resume from it. workbench loads either layout.
    """
    from workbench.models.param_groups import decay_parameter_names

    live = getattr(run.optimizer, "optimizer", run.optimizer)
    if is_fsdp(run) or len(live.param_groups) != 1 or len(optimizer.get("param_groups", [])) != 1:
        return optimizer, scheduler
    model = unwrap_model(run.model)
    decay = decay_parameter_names(model)
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    order = [p for name, p in named if name in decay] + [p for name, p in named if name not in decay]
    if [id(p) for p in live.param_groups[0]["params"]] != [id(p) for p in order]:
        return optimizer, scheduler  # a user's own grouping: kept as it is
    split = sum(1 for name, _ in named if name in decay)
    group = optimizer["param_groups"][0]
    groups = [{**group, "params": group["params"][:split]},
              {**group, "params": group["params"][split:], "weight_decay": 0.0}]
    return {**optimizer, "param_groups": groups}, _fit_groups(scheduler, 2)


def model_saved_by_override(run: Run) -> bool:
    """Whether the Trainer's class overrides ``save_model`` (checked at each save, not per step).

    The rule for a checkpoint's model files, as HF's ``_save_checkpoint`` (which calls
    ``self.save_model(output_dir, _internal_call=True)``): an overriding ``save_model`` is
    called with the checkpoint's temporary folder (renamed to ``checkpoint-<step>`` once
    sealed), on every process, at the step boundary, and writes them. The built-in
    ``save_model`` is not called: the checkpoint writes the same files
    itself, from host copies taken at the boundary, so ``save_async`` can write them later.
    """
    # The class that defines save_model, found without importing the Trainer (the store
    # sits below it in the import graph).
    owner = next((c for c in type(run).__mro__ if "save_model" in vars(c)), None)
    return owner is not None and owner.__module__ != "workbench.train.trainer"


def save_checkpoint(run: Run, folder: Path | None = None) -> Path | None:
    """Write ``checkpoint-<global_step>`` for the run's current state, then rotate.

    The model files come from an overriding ``Trainer.save_model`` if there is one
    (``model_saved_by_override`` gives the rule); ``training_args.json`` and the rest are
    always written here, so a resume can compare arguments whatever the override wrote.
    The time the run is blocked here is the ledger's "save" (an async write's is not).

    ``folder``: write into that folder instead of the run's output_dir, at once (never in
    the background) and without naming a best checkpoint: a fork's variant saved on purpose
    (train/fork_save.py), whose state lives only until the run is put back at its pause.
    """
    ledger = getattr(run, "ledger", None)
    if ledger is None:
        return _save_checkpoint(run, folder)
    with ledger.during("save"):
        return _save_checkpoint(run, folder)


def _save_checkpoint(run: Run, folder: Path | None = None) -> Path | None:
    args, state, acc = run.args, run.state, run.accelerator
    step = state.global_step
    run_dir = folder if folder is not None else run._get_output_dir(trial=None)  # HF's override point
    store = CheckpointStore(run_dir)
    name = f"{PREFIX_CHECKPOINT_DIR}-{step}"
    if state.best_global_step == step and folder is None:
        state.best_model_checkpoint = str(Path(run_dir) / name)
    run.store_flos()  # as HF: the work so far is in the checkpoint's total_flos
    state.stateful_callbacks = run.callback_handler.export_states(run.control)
    if run.loop is not None:  # a save at a boundary of a train() under way
        run.loop.prepare_save()  # the unlogged loss, the guard's records, the position
    else:
        run.workbench_state.loss_window = None
    custom_model_save = model_saved_by_override(run)
    contents = CheckpointContents.capture(run, with_model=not custom_model_save)

    keep = {Path(state.best_model_checkpoint).name} if state.best_model_checkpoint else set()
    writer = run.checkpoint_writer

    size = contents.nbytes()  # what a failure for want of space reports

    def publish(tmp: Path | None = None) -> Path:
        path = (store.publish(step, contents.write, size) if tmp is None
                else store.seal(step, tmp, contents.write, size))
        store.rotate(args.save_total_limit, keep=keep)
        return path

    path = None
    tmp = None
    if acc.num_processes > 1 or custom_model_save:
        # Every rank writes its own RNG streams (and takes part in save_model) into the folder
        # rank 0 opened; rank 0 adds the rest and publishes only after all of them have
        # written (the manifest covers all).
        if acc.is_main_process:
            writer.wait()  # the previous save owns the output directory until it has published
            tmp = store.begin(step, size)
        acc.wait_for_everyone()
        if custom_model_save:
            run.save_model(str(store.temporary(step)), _internal_call=True)
        if acc.num_processes > 1 and not args.save_only_model:
            torch.save(run_rng(run, all_devices=True), store.temporary(step) / f"rng_state_{acc.process_index}.pth")
        acc.wait_for_everyone()
    if acc.is_main_process:
        if args.save_async and folder is None:
            writer.submit(lambda: publish(tmp))
            path = store.root / name  # where it will be once published
        else:
            writer.wait()
            path = publish(tmp)
    acc.wait_for_everyone()
    return path


def _load(path: Path) -> Any:
    # Only tensors and plain containers: a pickle that would run code is refused.
    try:
        with numpy_safe_globals():  # HF's rng_state.pth holds NumPy's state as an array
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        lines = [ln.strip() for ln in str(exc).splitlines() if "GLOBAL" in ln or "global" in ln.lower()]
        detail = lines[-1] if lines else str(exc).splitlines()[0]
        raise ValueError(f"{path}: refused to load: the file holds more than tensors and plain containers "
                         f"(torch.load weights_only=True: {detail}); it was not unpickled") from exc


def _read_weights(model: torch.nn.Module, checkpoint: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = []
    if (checkpoint / WEIGHTS).is_file():
        files = [checkpoint / WEIGHTS]
    elif (checkpoint / WEIGHTS_INDEX).is_file():
        index = json.loads((checkpoint / WEIGHTS_INDEX).read_text(encoding="utf-8"))
        files = [checkpoint / f for f in sorted(set(index["weight_map"].values()))]
    if files:
        state: dict[str, torch.Tensor] = {}
        for file in files:
            state.update(load_file(str(file)))
        return state
    if hasattr(model, "from_pretrained") and (checkpoint / "config.json").is_file():
        return type(model).from_pretrained(checkpoint).state_dict()
    raise ValueError(f"{checkpoint} has no {WEIGHTS}")


def _tied_aliases(model: torch.nn.Module) -> set[str]:
    """The second names of tied weights: stored once, so expected to be missing from a file."""
    seen: set[int] = set()
    aliases = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            aliases.add(name)
        seen.add(id(param))
    return aliases


def _adapter_misfit(model: torch.nn.Module, checkpoint: Path) -> str | None:
    """weights_misfit for the adapter side: an adapter checkpoint needs a PEFT model whose
    adapter tensors it names with the same shapes, and a PEFT model needs an adapter."""
    from safetensors import safe_open

    from workbench.models.adapters import adapter_state

    has_adapter = (checkpoint / ADAPTER_WEIGHTS).is_file()
    if has_adapter != is_peft_model(model):
        return ("it holds a LoRA adapter and this run's model has none (set [model.peft] as when it was saved)"
                if has_adapter else "this run trains a LoRA adapter and it holds full weights (remove [model.peft])")
    with safe_open(str(checkpoint / ADAPTER_WEIGHTS), framework="pt") as f:
        saved = {key: list(f.get_slice(key).get_shape()) for key in f.keys()}
    adapter_name = getattr(model, "active_adapter", "default")
    here = {name.replace(f".{adapter_name}", ""): list(p.shape) for name, p in adapter_state(model, copy=False).items()}
    if set(here) != set(saved) or any(saved[name] != shape for name, shape in here.items()):
        differ = sorted(set(here) ^ set(saved)) or sorted(n for n in here if saved[n] != here[n])
        return f"its adapter does not fit this run's [model.peft] (first difference: {differ[0]})"
    return None


def weights_misfit(model: torch.nn.Module, checkpoint: Path) -> str | None:
    """Why ``checkpoint``'s weights would not load into ``model`` (names or shapes), read from
    the safetensors headers alone (nothing is loaded); None when they fit, or when there is
    no safetensors file to read (a save_pretrained folder of another layout loads or fails
    on its own)."""
    from safetensors import safe_open

    if is_peft_model(model) or (checkpoint / ADAPTER_WEIGHTS).is_file():
        return _adapter_misfit(model, checkpoint)
    if (checkpoint / WEIGHTS).is_file():
        files = [checkpoint / WEIGHTS]
    elif (checkpoint / WEIGHTS_INDEX).is_file():
        index = json.loads((checkpoint / WEIGHTS_INDEX).read_text(encoding="utf-8"))
        files = [checkpoint / f for f in sorted(set(index["weight_map"].values()))]
    else:
        return None
    saved: dict[str, list[int]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            saved.update({key: list(f.get_slice(key).get_shape()) for key in f.keys()})
    here = {name: list(value.shape) for name, value in model.state_dict().items()}
    missing = sorted(set(here) - set(saved) - _tied_aliases(model))
    unexpected = sorted(set(saved) - set(here))
    if missing or unexpected:
        return (f"its weights do not fit this model (missing: {', '.join(missing[:3]) or 'none'}; "
                f"not in the model: {', '.join(unexpected[:3]) or 'none'})")
    for name, shape in here.items():
        if name in saved and saved[name] != shape:
            return f"its weights do not fit this model ({name} is {saved[name]} there, {shape} here)"
    return None


def _check_fit(model: torch.nn.Module, checkpoint: Path, missing: list[str], unexpected: list[str]) -> None:
    aliases = _tied_aliases(model)
    if unexpected or set(missing) - aliases:
        raise ValueError(f"{checkpoint}: weights do not fit the model (missing: {sorted(set(missing) - aliases)[:5]}, "
                         f"unexpected: {sorted(unexpected)[:5]})")


def load_model_files(model: torch.nn.Module, checkpoint: Path) -> None:
    """Load the weights saved in ``checkpoint`` into a plain (unwrapped) model."""
    if is_peft_model(model):
        load_adapter_state(model, checkpoint)
        return
    missing, unexpected = model.load_state_dict(_read_weights(model, checkpoint), strict=False)
    _check_fit(model, checkpoint, list(missing), list(unexpected))


def _load_weights(run: Run, checkpoint: Path) -> None:
    model = unwrap_model(run.model)
    if is_peft_model(model) and not is_fsdp(run):  # the adapter alone: the base is the pretrained folder's
        problem = _adapter_misfit(model, checkpoint)
        if problem:
            raise ValueError(f"{checkpoint}: {problem}")
        load_adapter_state(model, checkpoint)
        return
    missing, unexpected = load_model_state(run, _read_weights(model, checkpoint))
    _check_fit(model, checkpoint, missing, unexpected)


def _fit_groups(scheduler_state: dict[str, Any], groups: int) -> dict[str, Any]:
    """A schedule saved for another number of parameter groups (see state_dicts.regroup),
    with its per-group lists cut or repeated to ``groups`` entries."""
    out = dict(scheduler_state)
    for key in ("base_lrs", "_last_lr", "lr_lambdas", "min_lrs"):
        values = out.get(key)
        if isinstance(values, list) and values and len(values) != groups:
            out[key] = (values + [values[-1]] * groups)[:groups]
    return out


def run_rng(run: Run, all_devices: bool = False) -> dict[str, Any]:
    """The RNG states for a checkpoint (rng.capture_rng), with the streams of the batches the
    training loop has collated but not trained yet (rng.CollationRng)."""
    state = capture_rng(all_devices)
    pending = run.loop.pending_batches() if run.loop is not None else []
    if pending:
        state[PENDING_KEY] = pending
    return state


def load_training_state(run: Run, checkpoint: Path) -> list[dict[str, Any]]:
    """Restore weights, optimizer, schedule, RNG, TrainerState (and callbacks), and workbench's
    own state (``run.workbench_state``) from ``checkpoint``.

    Returns the random streams of the batches the saving run had collated but not trained, for
    the loop to collate them again from (rng.CollationRng.replay); empty when there are none.
    """
    from workbench.core.state import TrainerState, WorkbenchState

    acc = run.accelerator
    _load_weights(run, checkpoint)
    if (checkpoint / "optimizer.pt").is_file():
        load_optimizer_state(run, _load(checkpoint / "optimizer.pt"))
        run.lr_scheduler.load_state_dict(_fit_groups(_load(checkpoint / "scheduler.pt"),
                                                         len(run.optimizer.param_groups)))
        if (checkpoint / "scaler.pt").is_file() and getattr(acc, "scaler", None) is not None:
            acc.scaler.load_state_dict(_load(checkpoint / "scaler.pt"))
    loaded = TrainerState.load_from_json(str(checkpoint / "trainer_state.json"))
    loaded.is_local_process_zero = run.state.is_local_process_zero
    loaded.is_world_process_zero = run.state.is_world_process_zero
    run.state = loaded
    run.workbench_state = WorkbenchState.load(checkpoint)
    if run.args.restore_callback_states_from_checkpoint:
        run.control = run.callback_handler.restore_states(loaded.stateful_callbacks, run.control)
        # The saving run's stop flag was why it stopped: a resumed run would otherwise end
        # after one step (HF restores it as is; no one wants that).
        run.control._new_training()
    rng = rng_state_file(checkpoint, acc.process_index, acc.num_processes)
    if rng is None:
        return []
    streams = _load(rng)
    restore_rng(streams)
    return list(streams.get(PENDING_KEY, []))


def rng_state_file(checkpoint: Path, rank: int, num_processes: int) -> Path | None:
    """This rank's RNG file: its own ``rng_state_<rank>.pth``, else the single-process one.

    A run resumed on fewer or more processes than saved it restores what exists (rank 0's
    streams on one process) and warns that the random draws differ from the original run.
    """
    own = checkpoint / f"rng_state_{rank}.pth"
    single = checkpoint / "rng_state.pth"
    saved_ranks = len(list(checkpoint.glob("rng_state_*.pth")))
    if saved_ranks and saved_ranks != num_processes or (not saved_ranks and num_processes > 1 and single.is_file()):
        if rank == 0:
            log.warning("%s was saved by %d process(es) and resumes on %d: data order and losses carry on, "
                        "but random draws (dropout) differ from the original run", checkpoint.name,
                        saved_ranks or 1, num_processes)
    for path in (own, single, checkpoint / "rng_state_0.pth"):
        if path.is_file():
            return path
    return None


def load_best_model(run: Run) -> None:
    """Load the weights of ``state.best_model_checkpoint`` into the model (load_best_model_at_end)."""
    path = Path(run.state.best_model_checkpoint)
    if not path.is_dir():
        log.warning("Could not locate the best model at %s: keeping the final weights (with several nodes, "
                    "set save_on_each_node)", path)
        return
    _load_weights(run, path)
