"""The ``workbench`` command line: its subcommands and arguments, and the one error type a
user can fix by changing them (``UsageError``: one line on stderr, exit 2)."""

from __future__ import annotations

import argparse

__all__ = ["UsageError", "make_parser"]


class UsageError(Exception):
    """A problem the user can fix by changing the command line or the files."""


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="workbench", description="See and steer PyTorch training runs.")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="train from a config file")
    run.add_argument("config", help="path to a TOML config (see 'workbench init')")
    run.add_argument("--headless", action="store_true", help="print progress lines instead of the dashboard")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config key, e.g. --set training.learning_rate=1e-4 (repeatable)")
    run.add_argument("--resume", nargs="?", const=True, default=None, metavar="CHECKPOINT",
                     help="resume from CHECKPOINT, or from the newest complete checkpoint in output_dir")
    run.add_argument("--overwrite", action="store_true",
                     help="start over in an output_dir that already holds checkpoints (deletes them)")
    run.add_argument("--num-processes", type=int, default=None, metavar="N",
                     help="train on N processes through Accelerate's launcher (one per GPU, or CPU ranks)")
    run.add_argument("--accelerate-config", default=None, metavar="FILE",
                     help="an 'accelerate config' file for --num-processes (default: accelerate's own default)")

    run.add_argument("--no-control", action="store_true",
                     help="serve no control endpoint (workbench ctl / attach cannot reach this run)")
    run.add_argument("--control-port", type=int, default=None, metavar="N",
                     help="serve the control endpoint on TCP port N (0: any free port; a token is required) "
                          "instead of a Unix socket")
    run.add_argument("--control-host", default=None, metavar="ADDRESS",
                     help="the address --control-port binds (default 127.0.0.1; name another only on a "
                          "trusted network)")

    from workbench.control.ctl_commands import ctl_epilog

    ctl = sub.add_parser("ctl", help="steer a live run: status, pause, resume, save, eval, stop, set, checkpoints, "
                                         "proposals, accept, reject, fork, keep, save_variant, discard",
                         description="Send one command to a live run (workbench ctl OUTDIR COMMAND [ARGS]).",
                         epilog=ctl_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    ctl.add_argument("target", metavar="OUTDIR|HOST:PORT")
    ctl.add_argument("action", metavar="COMMAND", help="one of the commands below")
    ctl.add_argument("values", nargs="*", metavar="ARGS",
                     help="set: KEY=VALUE ...; checkpoints: list, delete NAME, resume_from NAME [KEY=VALUE ...], "
                          "branch NAME NEWDIR [KEY=VALUE ...]; accept, reject: a proposal's number; fork: STEPS "
                          "then one variant an argument (a: 'b: learning_rate=1e-3'); keep NAME; "
                          "save_variant NAME [FOLDER]")
    ctl.add_argument("--json", action="store_true", help="print the reply as JSON (for scripts and tools)")
    ctl.add_argument("--wait", action="store_true", help="pause: return once the run is paused")
    ctl.add_argument("--no-save", action="store_true",
                     help="stop, checkpoints branch: stop the run without its final checkpoint")
    ctl.add_argument("--token", default=None, help="the TCP endpoint's token (read from control.json for an OUTDIR)")
    ctl.add_argument("--reason", default=None, metavar="TEXT",
                     help="set, accept, reject, keep, save_variant: why (kept with the edit or decision in "
                          "events.jsonl)")

    attach = sub.add_parser("attach", help="open the dashboard on a live run elsewhere (q detaches)")
    attach.add_argument("target", metavar="OUTDIR|HOST:PORT")
    attach.add_argument("--token", default=None, help="the TCP endpoint's token")

    data = sub.add_parser("data", help="a config's train rows as the model sees them, trained tokens marked "
                                       "(writes nothing)")
    data.add_argument("config", help="path to a TOML config")
    data.add_argument("--show", type=int, default=3, metavar="N", help="how many rows to print (default 3)")
    data.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                      help="override a config key, e.g. --set data.max_length=64 (repeatable)")

    watch = sub.add_parser("watch", help="a finished or live run, read-only")
    watch.add_argument("output_dir")

    ckpt = sub.add_parser("checkpoints", help="list the checkpoints of an output directory")
    ckpt.add_argument("output_dir")
    ckpt.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ckpt.add_argument("--quick", action="store_true",
                      help="check each checkpoint's file sizes only, not its sha256 hashes (fast on large "
                           "checkpoints; the state column then says the hashes were not checked)")
    ckpt.add_argument("--reseal", metavar="NAME", default=None,
                      help="accept a checkpoint's files as they are now (e.g. resharded weights): list what "
                           "differs from its manifest, then rewrite the manifest")

    init = sub.add_parser("init", help="write a commented starter config that runs as is")
    init.add_argument("path", nargs="?", default="workbench.toml")
    init.add_argument("--force", action="store_true", help="overwrite an existing file")
    init.add_argument("--finetune", action="store_true",
                      help="a config for LoRA fine-tuning of a pretrained model on chat data, with samples "
                           "and the guard")
    init.add_argument("--example", action="store_true",
                      help="with --finetune: also write a tiny local model (models/tiny-llama) and chat data "
                           "(data/*.jsonl) next to the config, so it runs as is without a download")

    export = sub.add_parser("export", help="a checkpoint as a model folder that transformers' from_pretrained loads")
    export.add_argument("checkpoint", help="a checkpoint folder (OUTPUT_DIR/checkpoint-N) or a save_model folder")
    export.add_argument("out", help="the folder to write (must not exist, or be empty)")
    export.add_argument("--merge", action="store_true",
                        help="merge a LoRA adapter into its base model's weights (no peft needed to load it)")
    return parser


