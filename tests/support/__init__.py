"""What many test files share, one copy each.

The package root holds what most tests need: tiny runs and models (:mod:`support.runs`),
polling with a deadline (:mod:`support.waiting`), real Sessions to steer
(:mod:`support.sessions`) and workbench in a subprocess (:mod:`support.processes`). Topic
modules hold one kind of run each: ``checkpointing`` (the checkpoint tests' TinyGPT),
``small`` (the Trainer's own tests), ``eval_lm`` (a language model whose predictions mean
something untrained), ``lm`` (the Session tests' run), ``guarded`` (the guard's regression),
``steering`` (callbacks that pause, stop and record), ``syncs`` (host-sync counting),
``dashboard`` (Pilot over a real run), ``headless`` (``workbench run --headless`` under
``workbench ctl``), ``launched`` (runs signalled from outside), ``configs``, ``damage`` and
``notebooks``.

Fixtures (``sessions``, ``checks``, one torch thread) live in ``tests/conftest.py``.
"""

from support.processes import (
                               REPO,
                               Spawned,
                               free_port,
                               listening_socket,
                               outcome,
                               start_workbench,
                               subprocess_env,
                               workbench,
)
from support.runs import (
                               StopAt,
                               assert_same_weights,
                               checkpoint_steps,
                               hf_logs,
                               make_args,
                               tiny_bert,
                               tiny_gpt,
                               token_rows,
                               weights,
)
from support.sessions import (
                               Slow,
                               finish,
                               finished_run,
                               make_session,
                               make_trainer,
                               raw,
                               read_lines,
                               restarted,
                               running,
                               stop_all,
)
from support.waiting import DEADLINE, poll_until, wait_until

__all__ = ["DEADLINE", "REPO", "Slow", "Spawned", "StopAt", "assert_same_weights", "checkpoint_steps", "finish",
           "finished_run", "free_port", "hf_logs", "listening_socket", "make_args", "make_session", "make_trainer",
           "outcome", "poll_until", "raw", "read_lines", "restarted", "running", "start_workbench", "stop_all",
           "subprocess_env", "tiny_bert", "tiny_gpt", "token_rows", "wait_until", "weights", "workbench"]
