"""The inspect screen: a look inside the paused model.

Per-layer parameter and gradient norms, update ratios, NaN/Inf counts, the current learning
rates, the last batch's shapes and memory details; for causal LMs, a prompt box that samples
from the paused model. The reading runs in a worker thread (it reads every tensor), and the
run is paused first, so it reads a model that is not changing underneath.
"""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Input, Static
from textual.worker import Worker, WorkerState

from workbench.door.callers import calling_as
from workbench.door.protocol import MemoryUsage, Status
from workbench.widgets.view import GRADS_FREED, fmt_bytes, fmt_lr, fmt_number

__all__ = ["InspectScreen", "inspect_summary", "memory_line"]


def inspect_summary(report: dict[str, Any]) -> list[str]:
    """Header lines: step, learning rates, batch shapes, NaN/Inf totals (Textual markup)."""
    layers = report.get("layers", [])
    nan = sum(r["nan"] for r in layers)
    inf = sum(r["inf"] for r in layers)
    lrs = ", ".join(fmt_lr(lr) for lr in report.get("learning_rates", [])) or "-"
    shapes = ", ".join(f"{k} {tuple(v)}" for k, v in report.get("batch_shapes", {}).items()) or "-"
    params = sum(_numel(r["shape"]) for r in layers)
    frozen = sum(_numel(r["shape"]) for r in layers if not r.get("trainable", True))
    counted = (f"{params:,} parameters ({params - frozen:,} trained, {frozen:,} frozen)" if frozen
               else f"{params:,} parameters")
    bad = f"[bold red]NaN {nan}  Inf {inf}[/]" if nan or inf else "[green]no NaN/Inf[/]"
    return [
        f"step {report.get('step', '?')} · {len(layers)} tensors · {counted} · {bad}",
        f"learning rates: {lrs}",
        f"last batch: {shapes}",
    ]


def _numel(shape: Any) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def memory_line(report: MemoryUsage | None, host: bool = True) -> str:
    """Every figure of a memory reading in two lines: the model's tensors, then device and host."""
    if report is None:
        return "memory: -"
    frozen = getattr(report, "frozen_parameters", 0) or 0
    split = f" ({fmt_bytes(report.parameters - frozen)} trained, {fmt_bytes(frozen)} frozen)" if frozen else ""
    grads = fmt_bytes(report.gradients) if report.gradients or report.parameters == frozen else GRADS_FREED
    first = (f"memory: parameters {fmt_bytes(report.parameters)}{split} · gradients {grads}"
             f" · optimizer state {fmt_bytes(report.optimizer_state)}")
    if report.device_allocated is not None:
        second = (f"{report.device_type}: allocated {fmt_bytes(report.device_allocated)} · reserved "
                  f"{fmt_bytes(report.device_reserved)} · peak {fmt_bytes(report.device_peak)}")
    else:
        second = f"{report.device_type}: no allocator counters"
    if host:
        second += f" · host RSS {fmt_bytes(report.host_rss)} (peak {fmt_bytes(report.host_peak)})"
    return f"{first}\n{second}"


class InspectScreen(Screen):
    """Statistics of the paused model, read once when the screen opens (r reads again)."""

    BINDINGS = [
        Binding("escape", "app.pop_screen", "back"),
        Binding("r", "reload", "read again"),
        Binding("question_mark", "app.help", "help", key_display="?"),
    ]

    def __init__(self, frozen: bool = False) -> None:
        super().__init__(id="inspect")
        self.frozen = frozen
        self.report: dict[str, Any] | None = None

    def compose(self) -> ComposeResult:
        yield Static("pausing the run…", id="inspect-summary")
        yield Static("", id="inspect-memory")
        yield DataTable(id="layers", cursor_type="row", zebra_stripes=True)
        with Vertical(id="sampling"):
            yield Input(placeholder="prompt, then enter: a sample from the paused model", id="prompt", compact=True)
            yield Static("", id="sample")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        table = self.query_one("#layers", DataTable)
        table.border_title = "layers (norms; update = the optimizer's next step / weight norm)"
        for label in ("tensor", "shape", "param", "grad", "update", "nan/inf"):
            table.add_column(label, key=label)
        self.query_one("#sampling").border_title = "sample"
        self.query_one("#sampling").display = False
        self.action_reload()

    # -- reading -----------------------------------------------------------------------------------

    def action_reload(self) -> None:
        """Pause (if needed) and read the model's statistics in a worker thread."""
        self.query_one("#inspect-summary", Static).update("pausing the run and reading the model…")
        self._read()

    @work(thread=True, exclusive=True, group="inspect", exit_on_error=False)
    def _read(self) -> tuple[dict[str, Any], MemoryUsage, bool]:
        session = self.app.session
        if session.status in (Status.RUNNING, Status.PAUSING, Status.EVALUATING, Status.SAVING):
            session.pause(wait=True)  # a blocking wait: this is a worker thread, not the UI
        report = session.inspect()
        memory = session.memory()
        return report, memory, bool(report.get("can_sample"))

    @work(thread=True, exclusive=True, group="sample", exit_on_error=False)
    def _sample(self, prompt: str) -> str:
        # A refusal (the run was resumed meanwhile) names the dashboard's key, not a Python call.
        with calling_as("dashboard"):
            return self.app.session.sample(prompt, max_new_tokens=80)

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        worker = event.worker
        if event.state == WorkerState.ERROR:
            target = "#sample" if worker.group == "sample" else "#inspect-summary"
            self.query_one(target, Static).update(Text(f"{type(worker.error).__name__}: {worker.error}", style="red"))
        elif event.state == WorkerState.SUCCESS and worker.group == "inspect":
            self.show_report(*worker.result)
        elif event.state == WorkerState.SUCCESS and worker.group == "sample":
            prompt = self.query_one("#prompt", Input).value
            text = Text(prompt, style="bold")
            text.append(worker.result)
            self.query_one("#sample", Static).update(text)

    def show_report(self, report: dict[str, Any], memory: MemoryUsage | None, can_sample: bool) -> None:
        """Fill the table and the side panel from an ``inspect()`` report."""
        self.report = report
        self.query_one("#inspect-summary", Static).update("\n".join(inspect_summary(report)))
        table = self.query_one("#layers", DataTable)
        table.clear()
        layers = report.get("layers", [])
        # Between steps there are no gradients to measure (the loop frees them): said, not "-".
        freed = bool(layers) and all(r.get("grad_norm") is None for r in layers if r.get("trainable", True))
        table.border_title = (f"layers (grad: {GRADS_FREED}; update = the optimizer's next step / weight norm)"
                              if freed else "layers (norms; update = the optimizer's next step / weight norm)")
        for row in layers:
            bad = row["nan"] + row["inf"]
            trained = row.get("trainable", True)
            if not trained:
                grad = Text("frozen", style="dim", justify="right")
            elif freed:
                grad = Text("freed", style="dim", justify="right")
            else:
                grad = Text(fmt_number(row["grad_norm"]), justify="right")
            table.add_row(
                Text(row["name"], style="" if trained else "dim"),
                "×".join(str(d) for d in row["shape"]),
                Text(fmt_number(row["param_norm"]), justify="right"),
                grad,
                Text(fmt_number(row["update_ratio"], 3), justify="right"),
                Text(f"{row['nan']}/{row['inf']}", style="bold red" if bad else "dim"),
                key=row["name"],
            )
        self.query_one("#inspect-memory", Static).update(memory_line(memory, host=not self.frozen))
        self.query_one("#sampling").display = can_sample
        if can_sample:
            self.query_one("#prompt", Input).focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.value.strip():
            self.query_one("#sample", Static).update(Text("sampling…", style="dim"))
            self._sample(event.value)
