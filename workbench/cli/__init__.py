"""``workbench run | ctl | attach | watch | checkpoints | init | export | data``: the command line.

One module a job: usage.py (the arguments, ``UsageError``), train.py (``workbench run``),
output_dir.py (what a run may resume from, clear and lock), hangup.py (a closed terminal),
data_view.py (``workbench data``: the train rows as the model sees them).
This module dispatches, and holds the small commands.

Exit codes (core/exit_codes.py): 0 finished; 2 usage or config error (one line on stderr,
nothing written); 1 training failed (a traceback, or one line for a full or read-only disk;
the error record in events.jsonl); 129 the terminal closed; 130 Ctrl-C; 143 SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from workbench.cli.output_dir import owned_output_dir
from workbench.cli.train import check_control, load_run_config, run_command
from workbench.cli.usage import UsageError, make_parser
from workbench.core.exit_codes import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_NO_RUN, EXIT_OK, EXIT_TERMINATED, \
    EXIT_USAGE, OUTCOME_CODES

__all__ = ["main", "UsageError"]


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``workbench`` command; returns the process exit code."""
    parser = make_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    ns = parser.parse_args(argv)
    try:
        if ns.command == "init":
            return _init(ns)
        if ns.command == "checkpoints":
            return _checkpoints(ns)
        if ns.command == "export":
            return _export(ns)
        if ns.command == "ctl":
            from workbench.control.ctl import run_ctl

            return run_ctl(ns.target, ns.action, ns.values, as_json=ns.json, wait=ns.wait, save=not ns.no_save,
                           token=ns.token, reason=ns.reason)
        if ns.command == "attach":
            return _attach(ns)
        if ns.command == "watch":
            return _watch(ns)
        if ns.command == "data":
            from workbench.cli.data_view import run_data_view

            return run_data_view(ns)
        if ns.num_processes is not None and "WORLD_SIZE" not in os.environ:
            return _launch(ns, argv)
        return _finish_rank(run_command(ns))
    except UsageError as exc:
        print(f"workbench: {exc}", file=sys.stderr)
        return _finish_rank(EXIT_USAGE)


def _finish_rank(code: int) -> int:
    """Under ``--num-processes`` rank 0 reports the code to the parent (see launch.py)."""
    from workbench.distributed.launch import report_exit_code

    if "torch.distributed" in sys.modules:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and code in (EXIT_OK, EXIT_INTERRUPTED, EXIT_TERMINATED):
            # All ranks leave together: a rank tearing gloo down while another still talks
            # to it can abort at interpreter exit. Not after a failure: the other ranks may
            # be inside a collective this rank will never join, and the launcher ends them.
            dist.barrier()
            dist.destroy_process_group()
    from workbench.core.world import is_main_process

    return report_exit_code(code, is_main=is_main_process())


def _strip_launch_options(argv: list[str]) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in ("--num-processes", "--accelerate-config"):
            skip = True
            continue
        # The parent has already cleared an --overwrite'd output_dir under its lock.
        if arg.startswith(("--num-processes=", "--accelerate-config=")) or arg == "--overwrite":
            continue
        out.append(arg)
    return out


def _launch(ns: argparse.Namespace, argv: list[str]) -> int:
    """Check the config here (errors stay one line), then start the ranks through Accelerate."""
    from workbench.distributed.launch import launch_ranks

    if ns.num_processes < 1:
        raise UsageError(f"--num-processes: {ns.num_processes} is not a process count; pass 1 or more")
    from workbench.checkpoint.lock import OWNER_ENV

    run = load_run_config(ns)
    check_control(ns, run)
    # The parent holds the output_dir's lock for the whole run; rank 0 recognises it as its own.
    with owned_output_dir(run, ns):
        try:
            return launch_ranks(ns.num_processes, _strip_launch_options(argv), ns.accelerate_config,
                                extra_env={OWNER_ENV: str(os.getpid())})
        except FileNotFoundError as exc:
            raise UsageError(str(exc)) from None


def _init(ns: argparse.Namespace) -> int:
    from workbench.config.loader import starter_config_text

    path = Path(ns.path)
    if path.exists() and not ns.force:
        raise UsageError(f"{path} already exists; choose another path or pass --force to replace it")
    if ns.example and not ns.finetune:
        raise UsageError("--example writes the fine-tuning example's model and data: use it with --finetune")
    if ns.example:
        _check_example_free(path.parent)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(starter_config_text(finetune=ns.finetune, file=path.name), encoding="utf-8")
    if ns.example:
        from workbench.models.tiny_llama import build_workspace

        build_workspace(path.parent, rows=256)
        print(f"wrote a tiny model to {path.parent / 'models' / 'tiny-llama'} and chat data to {path.parent / 'data'}")
    print(f"wrote {path}; run it with: workbench run {path}")
    if ns.finetune:
        print(f"see what it trains on first: workbench data {path} --show 3")
    return EXIT_OK


def _check_example_free(root: Path) -> None:
    """The example's files must not exist yet (nothing a user has is overwritten), and
    building the model and tokenizer needs transformers."""
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        raise UsageError("--example builds a transformers model: pip install 'workbench[peft]'")
    for rel in ("models/tiny-llama", "data/chat.jsonl", "data/chat_eval.jsonl", "data/completions.jsonl"):
        if (root / rel).exists():
            raise UsageError(f"{root / rel} already exists; the example would overwrite it (move it, or leave "
                             "out --example and point the config at your own model and data)")


def _export(ns: argparse.Namespace) -> int:
    from workbench.checkpoint.export import ExportError, export_checkpoint

    try:
        done = export_checkpoint(ns.checkpoint, ns.out, merge=ns.merge)
    except ExportError as exc:
        raise UsageError(str(exc)) from None
    how = {"merged": "the adapter merged into its base model", "adapter": f"a LoRA adapter of {done.base}",
           "full": "the model's weights"}[done.kind]
    loader = "PeftModel.from_pretrained(base, OUT)" if done.kind == "adapter" else "from_pretrained(OUT)"
    print(f"exported {how} to {done.path} ({len(done.files)} files); load it with transformers' {loader}")
    return EXIT_OK


def _checkpoints(ns: argparse.Namespace) -> int:
    from workbench.checkpoint.listing import json_rows, table_lines, verified_rows
    from workbench.checkpoint.store import CheckpointStore

    root = Path(ns.output_dir)
    if not root.is_dir():
        raise UsageError(f"{root} is not a directory; pass a run's output_dir")
    if ns.reseal is not None:
        return _reseal(CheckpointStore(root), ns.reseal)
    rows = verified_rows(CheckpointStore(root), quick=ns.quick)
    if ns.json:
        print(json.dumps(json_rows(rows, quick=ns.quick), indent=2))
    elif not rows:
        print(f"no checkpoints in {root}")
    else:
        print("\n".join(table_lines(rows, quick=ns.quick)))
    return EXIT_OK


def _reseal(store, name: str) -> int:
    from workbench.checkpoint.listing import reseal_lines

    try:
        print("\n".join(reseal_lines(store, name)))
    except ValueError as exc:
        raise UsageError(f"--reseal: {exc}") from None
    return EXIT_OK


def _attach(ns: argparse.Namespace) -> int:
    """The dashboard on a live run elsewhere; q detaches (the run goes on)."""
    from workbench.control.client import attach
    from workbench.control.discovery import NoLiveRun

    try:
        session = attach(ns.target, token=ns.token, client="attach")
    except NoLiveRun as exc:
        print(f"workbench: {exc}", file=sys.stderr)
        return EXIT_NO_RUN
    except PermissionError as exc:
        raise UsageError(str(exc)) from None
    from workbench.widgets.tui import run_dashboard

    try:
        outcome = run_dashboard(session, handle_signals=False, attached=True)
    finally:
        session.close()
    if outcome == "detached":
        print(f"workbench: detached; the run goes on ({ns.target})")
        return EXIT_OK
    if outcome == "crashed":
        print(f"workbench: the dashboard failed (see above); the run goes on ({ns.target})", file=sys.stderr)
        return EXIT_FAILED
    note = session.end_note()
    if note:
        print(f"workbench: {note}")
    return OUTCOME_CODES.get(outcome, EXIT_OK)


def _watch(ns: argparse.Namespace) -> int:
    """A run read-only: live (attached, no steering) or from its files once it has ended."""
    from workbench.control.watch import open_watch

    try:
        session = open_watch(ns.output_dir)
    except (FileNotFoundError, NotADirectoryError) as exc:
        raise UsageError(str(exc)) from None
    if not sys.stdout.isatty():  # a pipe or a file: the run in plain lines, not the dashboard's escape codes
        from workbench.control.watch import text_summary

        try:
            print("\n".join(text_summary(session)))
        finally:
            session.close()
        return EXIT_OK
    from workbench.widgets.tui import run_dashboard

    try:
        outcome = run_dashboard(session, handle_signals=False, attached=True, read_only=True)
    finally:
        session.close()
    if outcome == "crashed":  # the watching failed, not the run
        print(f"workbench: watch failed (see above); the run is not affected ({ns.output_dir})", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
