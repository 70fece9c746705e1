"""TrainingArguments as HF parses them, end to end: a script written like transformers' examples
(HfArgumentParser) launched on two processes.
"""

from __future__ import annotations

import json

import pytest

transformers = pytest.importorskip("transformers", reason="these tests compare with transformers (the test extra)")


from support import REPO

RANKS_SCRIPT = """\
import json, sys, time
from pathlib import Path
import transformers
if sys.argv[1] == "hf":
    from transformers import TrainingArguments
else:
    from workbench import TrainingArguments
(args,) = transformers.HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(
    args=["--output_dir", sys.argv[2], "--save_on_each_node"], look_for_args_file=False)
out = Path(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)
order = out / "order.txt"
for local in (True, False):
    with args.main_process_first(local=local, desc="dataset map"):
        with order.open("a") as f:
            f.write(f"{local} {args.process_index} in\\n")
        time.sleep(0.5 if args.process_index == 0 else 0)
        with order.open("a") as f:
            f.write(f"{local} {args.process_index} out\\n")
facts = dict(world_size=args.world_size, process_index=args.process_index, local=args.local_process_index,
             mode=args.parallel_mode.value, should_log=args.should_log, should_save=args.should_save,
             level=args.get_process_log_level())
(out / f"facts_{args.process_index}.json").write_text(json.dumps(facts))
"""


def test_process_members_and_main_process_first_on_two_ranks_as_transformers(tmp_path):
    import os
    import subprocess

    from workbench.distributed.launch import launcher_command

    script = tmp_path / "ranks.py"
    script.write_text(RANKS_SCRIPT)
    repo = REPO
    seen = {}
    for impl in ("hf", "wb"):
        out = tmp_path / impl
        command, env = launcher_command(2, [str(script), impl, str(out)])
        env = {**env, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
        result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
        assert result.returncode == 0, result.stderr[-2000:]
        lines = (out / "order.txt").read_text().splitlines()
        for local in ("True", "False"):  # in each block rank 0 goes in and out before rank 1 goes in
            block = [line.split(" ", 1)[1] for line in lines if line.startswith(local)]
            assert block == ["0 in", "0 out", "1 in", "1 out"], (impl, lines)
        seen[impl] = [json.loads((out / f"facts_{r}.json").read_text()) for r in (0, 1)]
    assert seen["wb"] == seen["hf"]
    assert [f["world_size"] for f in seen["wb"]] == [2, 2] and seen["wb"][0]["mode"] == "distributed"
    assert os.path.exists(tmp_path / "wb" / "facts_1.json")
