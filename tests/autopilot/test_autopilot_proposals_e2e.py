"""A dry-run autopilot in one process, its proposal decided from another (issue 28), end to end.

A headless ``workbench run`` trains; an agent script in a process of its own attaches to it
(``workbench.attach``) and runs a dry-run Autopilot, whose proposal goes onto the run; a
RemoteSession in this test process stands in for a dashboard elsewhere: it sees the proposal
and accepts it. The change lands as a live edit whose reason names the proposal (events.jsonl),
and the agent process hears the decision (its decision reads applied). Then ``workbench ctl``
lists a proposal, rejects it, and refuses what it must with one line.
"""

from __future__ import annotations

import json
import subprocess
import sys

from workbench import attach
from workbench.core.event_file import read_events

from support import subprocess_env, wait_until, workbench
from support.headless import headless_run, stop_and_finish

# The agent: one proposal (lr_scale=0.5) once the run is past step 5, then it waits until a
# person has decided it (anywhere) and prints its decisions as JSON.
AGENT = '''
import json, sys, time
import workbench
from workbench.autopilot import Action, Autopilot, Limits

class Once:
    name = "once"
    asked = False

    def observe(self, seen):
        if self.asked or seen.step < 5:
            return None
        self.asked = True
        return Action({"lr_scale": 0.5}, "a test proposal")

run = workbench.attach(sys.argv[1])
pilot = Autopilot(run, Once(), Limits({"lr_scale": (0.5, 0.5)}), dry_run=True, interval=0.05).start()
deadline = time.monotonic() + 150
while time.monotonic() < deadline and not any(d.state in ("applied", "rejected", "failed") for d in pilot.decisions):
    time.sleep(0.05)
pilot.stop()
run.close()
print(json.dumps([{"state": d.state, "published": d.published, "sent": d.sent, "note": d.note}
                  for d in pilot.decisions]))
'''


def test_a_proposal_from_an_agent_process_is_accepted_from_another_client(tmp_path):
    out = tmp_path / "out"
    (tmp_path / "agent.py").write_text(AGENT)
    with headless_run(tmp_path) as run:
        agent = subprocess.Popen([sys.executable, str(tmp_path / "agent.py"), str(out)], cwd=tmp_path,
                                 env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        person = attach(out, client="attach")  # a dashboard elsewhere
        try:
            wait_until(lambda: person.snapshot().proposals or agent.poll() is not None, "the agent's proposal", 180)
            assert agent.poll() is None, agent.communicate()
            (proposal,) = person.snapshot().proposals
            assert (proposal.source, proposal.changes, proposal.state) == ("autopilot/once", {"lr_scale": 0.5},
                                                                         "pending")
            listed = workbench("ctl", out, "proposals", cwd=tmp_path)
            assert listed.returncode == 0, listed.stderr
            assert listed.stdout.startswith("1 pending: step ") and "autopilot/once: lr_scale=0.5: a test proposal" \
                in listed.stdout
            assert person.decide(proposal.id, True, reason="looks right").state in ("accepted", "applied")
            stdout, stderr = agent.communicate(timeout=180)
            assert agent.returncode == 0, stderr
            (decided,) = json.loads(stdout.splitlines()[-1])
            reason = "accepted proposal 1 from autopilot/once: a test proposal; looks right"
            assert decided == {"state": "applied", "published": 1, "sent": reason, "note": "lr_scale=0.5"}

            # workbench ctl decides too (as "ctl"), and refuses with one line what it must.
            second = person.propose({"lr_scale": 2.0}, reason="back up", source="test")
            rejected = workbench("ctl", out, "reject", second, "--reason", "not now", cwd=tmp_path)
            assert rejected.returncode == 0 and rejected.stdout.strip() == "proposal 2 (lr_scale=2) rejected"
            again = workbench("ctl", out, "accept", second, cwd=tmp_path)
            assert again.returncode == 2
            assert again.stderr.strip() == "workbench: ctl accept: decide: proposal 2 was rejected already (by ctl)"
        finally:
            person.close()
            if agent.poll() is None:
                agent.kill()
                agent.communicate()
        told = stop_and_finish(run, out, tmp_path)
    # The run's own console says what its clients proposed and decided, one line each.
    assert "proposal 1 from autopilot/once via a script over the control endpoint (workbench.attach) at step " in told
    assert "accepted proposal 1 (lr_scale=0.5) from an attached dashboard (workbench attach) at step " in told
    assert "rejected proposal 2 (lr_scale=2) from workbench ctl at step " in told
    records = read_events(out)
    (edit,) = [r for r in records if r["event"] == "edit"]
    assert edit["lr_scale"] == 0.5 and edit["reason"] == reason
    decided = [(r["id"], r["state"], r["by"]) for r in records if r["event"] == "proposal_decided"]
    assert decided == [(1, "accepted", "attach"), (1, "applied", "attach"), (2, "rejected", "ctl")]
