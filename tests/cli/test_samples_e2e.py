"""``[samples]`` end to end: a headless ``workbench run`` in a subprocess writes a ``sample``
record per prompt at each evaluation to events.jsonl and prints the answers; ``workbench
watch`` of the ended run (its dashboard over the run's files) shows them in the samples
panel; a model that cannot generate is a one-line usage error (exit 2) before anything is
written."""

from __future__ import annotations

import asyncio

from workbench.control.watch import RecordedRun, open_watch
from workbench.widgets.tui import DashboardApp
from workbench.widgets.tui.panels import SamplesPanel
from workbench.widgets.view import answer_text

from support import workbench
from support.dashboard import wait_for
from support.sampling import sample_records

RUN = """\
run_name = "sampled"
[model]
builtin = "tiny-gpt"
[model.options]
n_layer = 1
n_head = 2
n_embd = 32
[data]
builtin = "python-source"
[data.options]
max_chars = 20000
block_size = 32
[training]
output_dir = "out"
max_steps = 20
per_device_train_batch_size = 8
learning_rate = 3e-3
logging_steps = 5
eval_strategy = "steps"
eval_steps = 10
eval_on_start = true
save_strategy = "no"
report_to = "none"
[samples]
prompts = ["def ", "import "]
max_new_tokens = 8
"""

MLP = """\
run_name = "mlp"
[model]
builtin = "mlp"
[data]
builtin = "random-classification"
[training]
output_dir = "out"
max_steps = 5
report_to = "none"
[samples]
prompts = ["hello"]
"""


def test_a_headless_run_records_its_samples_and_watch_shows_them(tmp_path):
    (tmp_path / "run.toml").write_text(RUN)
    run = workbench("run", "run.toml", "--headless", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    out = tmp_path / "out"
    records = sample_records(out)
    assert [(r["step"], r["prompt"]) for r in records] == [(s, p) for s in (0, 10, 20) for p in ("def ", "import ")]
    assert all(r["tokens"] == 8 and len(r["answer"]) >= 1 for r in records)
    printed = [line for line in run.stdout.splitlines() if line.startswith("sample @ step ")]
    assert len(printed) == 6 and printed[0].startswith("sample @ step 0: 'def ' -> ")

    watched = open_watch(out)  # what `workbench watch out` shows once the run has ended
    assert isinstance(watched, RecordedRun)
    seen: dict = {}

    async def main() -> None:
        app = DashboardApp(watched, autostart=False, attached=True)
        async with app.run_test(size=(100, 40)) as pilot:
            panel = app.dashboard.query_one(SamplesPanel)
            await wait_for(pilot, lambda: panel.display and app.dashboard.samples.count == 6, "the samples panel")
            seen["text"] = str(panel.query_one("#samples-text").render())

    asyncio.run(main())
    lines = seen["text"].splitlines()
    by_prompt = {p: [r for r in reversed(records) if r["prompt"] == p] for p in ("def ", "import ")}
    expected = []
    for prompt, rows in by_prompt.items():
        expected += [f"▸ {prompt}"] + [f"  {r['step']:>2}  {answer_text(r['answer'])}" for r in rows]
    assert lines == expected


def test_samples_on_a_model_that_cannot_generate_are_a_usage_error_before_anything_is_written(tmp_path):
    (tmp_path / "run.toml").write_text(MLP)
    run = workbench("run", "run.toml", "--headless", cwd=tmp_path)
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines() == [("workbench: run.toml: samples: MLPClassifier is not a causal LM "
                                                "with generate()")]
    assert not (tmp_path / "out").exists()
