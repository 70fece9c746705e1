"""Out of memory on one rank of several: every rank learns it at the same step and they
recover together (train/oom.py does the recovery itself).

Under DDP a rank that runs out of memory in the middle of a step cannot just redo it: the
other ranks go on to the gradients' all-reduce of the step's last micro-batch and would wait
there for it forever. So the rank that failed

1. writes a flag into the job's rendezvous store (the key-value store every rank already
   talks to; the health watchdog's heartbeats go there too), keyed by step and attempt;
2. *joins* the rest of the step: a one-row forward and backward of each micro-batch it did
   not train, the last one with the gradients' all-reduce, so its collectives (DDP's buffer
   broadcasts and the all-reduce) match the other ranks' one for one;

and every rank, after that all-reduce, reads the flag. The read cannot race: the failed rank
writes the flag before it joins the all-reduce, which no rank leaves before every rank has
joined it. Then each rank drops the step's gradients (the joined ones are junk) and the step is
redone with the micro-batches cut in half, on every rank alike.

Not covered, and re-raised with a line that says so: an out-of-memory error inside the last
micro-batch's backward (some gradient buckets are already in flight; DDP cannot take that
step back), and FSDP / DeepSpeed, whose forward itself holds collectives.

The cost is one store look-up per optimizer step while several DDP ranks train with
``oom_retries`` > 0: about 40 us on an idle host, nothing beside a GPU step. On CPU ranks,
where torch never raises ``OutOfMemoryError`` (its allocator raises a RuntimeError), it is
off unless ``WORKBENCH_OOM_AGREEMENT=1`` (train/oom.py ``oom_flags``). Two CPU ranks on two
otherwise idle cores measured it within the noise (1.03 of the MLP's steps/s with all of run
health off, against 0.99 for health without it); with the same cores also busy with other
work, 0.82 against 0.87 (benchmarks/health_overhead.py --processes 2).
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["OomFlags", "EvalOomFlags", "rendezvous_store"]

_KEY = "workbench/oom/{step}/{attempt}"
_EVAL_KEY = "workbench/eval-oom/{evaluation}"


def rendezvous_store() -> Any:
    """The default process group's key-value store, or None (no group, or another launcher's
    group without one)."""
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store: the caller does without
        return None


class OomFlags:
    """The flag one rank raises when it ran out of memory at a step, read by all of them."""

    def __init__(self, store: Any, rank: int) -> None:
        self.store, self.rank = store, rank

    def raise_flag(self, step: int, attempt: int, phase: str) -> None:
        """This rank ran out of memory in ``phase`` of ``step`` (try ``attempt``); written before
        it joins the step's all-reduce."""
        self.store.set(_KEY.format(step=step, attempt=attempt), json.dumps({"rank": self.rank, "phase": phase}))

    def read(self, step: int, attempt: int) -> dict[str, Any] | None:
        """The rank and phase that ran out of memory at ``step`` (try ``attempt``), or None;
        read after the step's all-reduce."""
        key = _KEY.format(step=step, attempt=attempt)
        if not self.store.check([key]):
            return None
        return json.loads(self.store.get(key))


class EvalOomFlags:
    """The cuts ranks made to their evaluation batches during one evaluation, read by all of
    them once it ends (module docstring: no rank waits on this)."""

    def __init__(self, store: Any, rank: int, world_size: int) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size

    def raise_flag(self, evaluation: int, cut: dict[str, Any]) -> None:
        """This rank cut its batches in ``evaluation`` (the process's count of evaluations, the
        same on every rank): ``cut`` (JSON-able: the split, rows, memory figures). Its own key
        first, then the evaluation's marker, so a reader that sees the marker finds the cut."""
        key = _EVAL_KEY.format(evaluation=evaluation)
        self.store.set(f"{key}/{self.rank}", json.dumps({**cut, "rank": self.rank}))
        self.store.set(key, str(self.rank))

    def read(self, evaluation: int) -> list[dict[str, Any]]:
        """Every rank's cut in ``evaluation`` (rank order), or [] (then it costs one look-up);
        read after the evaluation's last gather. An evaluation that gathered nothing after a cut
        gives no such order: a read may miss it, and the ranks then cut apart, which changes
        no result (each rank's own cut holds)."""
        key = _EVAL_KEY.format(evaluation=evaluation)
        if not self.store.check([key]):
            return []
        keys = [f"{key}/{rank}" for rank in range(self.world_size)]
        return [json.loads(self.store.get(k)) for k in keys if self.store.check([k])]
