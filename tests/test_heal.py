"""Healing after a SIGKILL, real processes (issue 27): survivors never wait out the link deadline for a
peer whose process is gone, and after a kill and restart every lockstep member ends bit-identical.
"""
from __future__ import annotations

import pytest

from tests.test_launch_e2e import launch

QUICK = ("--nodes", "4", "--no-metrics", "--timeout", "300")


@pytest.mark.slow  # (open, issue 27: one CI run saw a 30.3 s step, a race the hang-ups do not cover yet)
@pytest.mark.timeout(400)
def test_survivors_of_a_sigkill_under_allreduce_never_wait_out_the_link_deadline(tmp_path):
    """A killed node's connections are refused at once: the survivors' longest step stays far under
    the default link deadline (10 s), whichever moment of a ring round the kill hits."""
    report = launch(tmp_path, *QUICK, "--algorithm", "allreduce", "--steps", "160", "--kill", "1@60")
    assert report["config"]["link_deadline"] == 10.0
    survivors = [n for n in report["nodes"] if n["rank"] != 1]
    assert all(n["outcome"] == "done" for n in survivors)
    longest = max(n["max_step_seconds"] for n in survivors)
    # waiting out the deadline takes >= 10 s; a busy machine's slow step, a few seconds at most
    assert longest < 0.6 * report["config"]["link_deadline"], f"a survivor's step took {longest:.2f} s: it waited " \
                                                               "for the dead node"


@pytest.mark.slow  # 40-50 s each
@pytest.mark.timeout(500)
@pytest.mark.parametrize("algorithm,steps,what", [("allreduce", 600, "model and optimizer state"),
                                                   ("pipesgd", 600, "model and optimizer state"),
                                                   ("diloco", 3000, "anchor")])
def test_after_a_kill_and_restart_every_member_ends_bit_identical(tmp_path, algorithm, steps, what):
    """`--kill 1@100 --restart 1@150`: the restarted node rejoins at a view switch, whose average
    (model and optimizer state; DiLoCo's anchor at its next outer sync) makes all four members
    bit-identical again, and the end of the run keeps them so (docs/faults.md)."""
    report = launch(tmp_path, *QUICK, "--algorithm", algorithm, "--steps", str(steps), "--kill", "1@100",
                    "--restart", "1@150")
    restarted = next(n for n in report["nodes"] if n["rank"] == 1)
    assert restarted["outcome"] == "done" and restarted["rejoined"], restarted
    identical = next(v for v in report["verdicts"] if v["name"] == "identical")
    assert identical["ok"] and identical["detail"].startswith(f"{what} bit-identical on 4"), identical
    assert sorted(identical["figures"]["digests"]) == ["0", "1", "2", "3"] and identical["figures"]["groups"] == 1
    assert report["cluster"]["consensus_distance"] == 0.0
