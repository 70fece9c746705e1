"""A guarded run with two corrupt rows, in the dashboard: the README's capture, reproducible.

    python examples/guard_capture.py runs/guard-demo docs/guard-dashboard.svg

A linear regression trains on 512 rows, two of which are broken the way real data breaks:
row 41's target is NaN (a failed join), row 300's target is 100x too large (a unit error).
The guard skips the NaN step and rolls back the spike (back to the newest in-memory
snapshot, with the data moved past the bad batch). The dashboard runs headless
(``App.run_test``) until the run finishes, then saves an SVG screenshot; the ``guard``
lines of the run's events.jsonl are printed. Everything is seeded and runs on the CPU, so
the same steps go bad every time (``frozen=True`` keeps wall-clock figures out of the picture).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset

from workbench import Guard, Session, Trainer, TrainingArguments
from workbench.widgets.tui import DashboardApp

ROWS, FEATURES = 512, 16
NAN_ROW, SPIKE_ROW = 41, 300
GUARD = Guard(nonfinite="skip", spike="rollback", spike_factor=10.0, window=8, snapshot_every=10,
              rollback_skip=2)


class CorruptRegression(Dataset):
    """Noisy linear targets; ``NAN_ROW``'s target is NaN and ``SPIKE_ROW``'s 100x too large."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(ROWS, FEATURES, generator=gen)
        self.y = self.x @ torch.randn(FEATURES, 1, generator=gen) + 0.3 * torch.randn(ROWS, 1, generator=gen)
        self.y[NAN_ROW] = float("nan")
        self.y[SPIKE_ROW] *= 100.0

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "labels": self.y[i]}


class Linear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.lin = nn.Linear(FEATURES, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        out = self.lin(x)
        return {"loss": ((out - labels) ** 2).mean(), "logits": out}


def guarded_session(output_dir: str | Path) -> Session:
    """The demo run: 120 steps of 8 rows, logged every 2 steps, guarded by ``GUARD``."""
    args = TrainingArguments(str(output_dir), max_steps=120, per_device_train_batch_size=8, learning_rate=0.02,
                             lr_scheduler_type="cosine", warmup_steps=10, logging_steps=2, save_strategy="no",
                             report_to="none", disable_tqdm=True, seed=7, run_name="guard-demo")
    trainer = Trainer(model=Linear(), args=args, train_dataset=CorruptRegression())
    return Session(trainer, guard=GUARD, control=False)


def capture(output_dir: str | Path, svg: str | Path, size: tuple[int, int] = (110, 34)) -> list[dict]:
    """Run the demo under the dashboard, save its screenshot to ``svg``; the guard events."""
    session = guarded_session(output_dir)
    app = DashboardApp(session, frozen=True)
    svg = Path(svg)

    async def main() -> None:
        async with app.run_test(size=size) as pilot:
            deadline = time.monotonic() + 300
            while session.status != "finished" or not app.dashboard.query_one("#loss-chart").plotted.get(
                    "interventions"):
                if time.monotonic() > deadline or session.status in ("failed", "stopped"):
                    raise RuntimeError(f"the demo run did not finish: {session.status}")
                await pilot.pause(0.05)
            await pilot.pause(0.5)  # the last snapshot and events reach every panel
            svg.parent.mkdir(parents=True, exist_ok=True)
            app.save_screenshot(filename=svg.name, path=str(svg.parent))

    with contextlib.redirect_stdout(io.StringIO()):  # the Trainer prints its logs when tqdm is off
        asyncio.run(main())
    events = Path(output_dir) / "events.jsonl"
    return [e for e in map(json.loads, events.read_text().splitlines()) if e["event"] == "guard"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output_dir", help="the run's output_dir (a fresh one)")
    parser.add_argument("svg", help="where the screenshot goes, e.g. docs/guard-dashboard.svg")
    options = parser.parse_args()
    for event in capture(options.output_dir, options.svg):
        print(json.dumps(event))


if __name__ == "__main__":
    main()
