"""``fedrl up``'s line per round: what it says, and what it says only when it applies."""

from fedrl.cli.launcher import round_line
from fedrl.federation.runconfig import RunConfig


def _round(agents=("agent-0", "agent-1", "agent-2"), eval=None, privacy=None):
    r = {"round": 2, "version": 2, "seconds": 12.34, "agents": [{"agent": a} for a in agents],
         "metrics": {"critic_td": 1.5, "actor_total": 9.0}}
    if eval:
        r["eval"] = eval
    if privacy:
        r["privacy"] = privacy
    return r


def test_a_full_round_names_no_agent_count_and_no_privacy():
    line = round_line(_round(eval={"return_mean": 812.4, "return_std": 20.1, "score_mean": 25.6, "score_std": 0.6}),
                      RunConfig(agents=3, rounds=5))
    assert line.startswith("round   2/5  return    812.4 ±   20.1  score   25.6")
    assert "critic_td=1.5" in line and "actor_total" not in line and line.endswith("[12.3s]")
    assert "agents" not in line and "epsilon" not in line and "clip" not in line


def test_a_round_closed_with_fewer_agents_says_how_many():
    # a quorum at the deadline, or the survivors of secure aggregation
    line = round_line(_round(agents=["agent-0", "agent-2"]), RunConfig(agents=3, rounds=5))
    assert "2 of 3 agents" in line


def test_privacy_spent_and_the_clipping_norm_show_when_recorded():
    line = round_line(_round(privacy={"epsilon": 4.2, "delta": 1e-6, "clip": 0.05, "clip_next": 0.0568}),
                      RunConfig(agents=3, rounds=5, dp_delta=1e-6))
    assert "epsilon 4.2 (delta 1e-06)" in line and "clip 0.05 -> 0.0568" in line


def test_a_secure_round_says_how_many_agents_survived_even_all():
    run = RunConfig(agents=3, rounds=5, secagg_threshold=2)
    assert "3 of 3 agents survived" in round_line(_round(), run)
    assert "2 of 3 agents survived" in round_line(_round(agents=["agent-0", "agent-2"]), run)


def test_the_run_line_says_when_updates_are_private():
    from fedrl.cli.launcher import private_rounds

    assert private_rounds(RunConfig(agents=3)) == ""
    said = private_rounds(RunConfig(agents=3, secagg_threshold=2, dp_clip=1.0, dp_noise=1.1, dp_epsilon_budget=8))
    assert "secure aggregation" in said and "any 2 of 3 agents" in said
    assert "clip 1, noise multiplier 1.1, budget epsilon 8 at delta 1e-05" in said
    assert "adaptive clipping from 1 to the 0.5 quantile" in private_rounds(
        RunConfig(agents=3, dp_clip=1.0, dp_clip_quantile=0.5))


def test_a_round_closed_event_becomes_the_record_simulate_writes():
    """ROUND_CLOSED's metrics go under ``metrics``, DP's under ``privacy`` (named as simulate names
    them), the survivors of secure aggregation under ``secure_aggregation``; nothing is named a loss
    that is not one."""
    from fedrl.cli.launcher import flat_row, round_record
    from tests import source

    e = {"round": 3, "version": 3, "seconds": 1.5, "agents": ["agent-0", "agent-1"],
         "metrics": {"critic_td": 2.0, "clipped": 0.5, "update_norm": 0.3, "privacy_epsilon": 7.0, "dp_clip": 0.1,
                     "dp_unclipped_fraction": 0.5, "dp_clip_next": 0.11}}
    run = RunConfig(agents=3, rounds=5, dp_clip=0.1, dp_noise=1.1, dp_clip_quantile=0.5, dp_count_noise=1.0,
                    secagg_threshold=2)
    rec = round_record(e, run)
    source.check_round_record(rec, "up")
    assert rec["metrics"] == {"critic_td": 2.0, "clipped": 0.5, "update_norm": 0.3}
    assert {k: rec["privacy"][k] for k in ("epsilon", "clip", "clip_next", "unclipped_fraction", "clipped_fraction")} == \
        {"epsilon": 7.0, "clip": 0.1, "clip_next": 0.11, "unclipped_fraction": 0.5, "clipped_fraction": 0.5}
    assert rec["secure_aggregation"] == {"threshold": 2, "agents": 3, "survivors": 2, "dropped": 1}
    assert not any(k.startswith("loss_") for k in flat_row(rec))
    assert flat_row(rec)["privacy_epsilon"] == 7.0 and flat_row(rec)["agents"] == 2


def test_the_last_line_says_when_the_final_score_is_not_the_last_rounds():
    """A last version the evaluator could not evaluate leaves an earlier round's score as the
    run's final one: the line says which round it is."""
    from fedrl.cli.launcher import scores_said

    best, last = {"round": 3, "score_mean": 40.0}, {"round": 4, "score_mean": 31.0}
    assert scores_said(best, last, 4) == "best score 40.0 (round 3), final 31.0; "
    assert scores_said(best, last, 5) == "best score 40.0 (round 3), final 31.0 (round 4, the last evaluated); "
    assert scores_said(None, None, 5) == ""
