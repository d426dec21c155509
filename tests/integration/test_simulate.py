"""The in-process federation end to end: outputs, determinism, baselines, a learning check."""

import dataclasses
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from fedrl.algos import BCConfig, DRPOConfig
from fedrl.federation.simulate import SimConfig, run
from tests import source

TINY_DRPO = DRPOConfig(hidden=(16, 16), batch_size=16, cql_n_actions=2)
TINY_BC = BCConfig(hidden=(16, 16), batch_size=16)


def tiny(dataset, **kw):
    base = dict(datasets=(str(dataset),), agents=2, trajectories=2, rounds=2, local_steps=3,
                eval_episodes=2, device="cpu", drpo=TINY_DRPO, bc=TINY_BC)
    return SimConfig(**{**base, **kw})


@pytest.mark.slow(reason="fedrl simulate as a process, with evaluation episodes")
def test_cli_writes_a_complete_run_folder(tmp_path, random_dataset):
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "fedrl.cli", "simulate", "--dataset", str(random_dataset),
         "--agents", "2", "--trajectories", "2", "--rounds", "2", "--local-steps", "3",
         "--eval-episodes", "2", "--hidden", "16", "16", "--batch-size", "16", "--device", "cpu",
         "--out", str(out)],
        capture_output=True, text=True, timeout=120, env=os.environ.copy())
    assert proc.returncode == 0, proc.stderr
    assert "round   1/2" in proc.stderr and "round   2/2" in proc.stderr  # progress while it runs
    assert json.loads(proc.stdout.strip().splitlines()[-1])["out"] == str(out)
    rounds = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [1, 2]
    assert all(len(r["agents"]) == 2 and len(r["eval"]["returns"]) == 2 for r in rounds)
    assert {"critic_td", "cql_penalty", "reg_data", "reg_global"} <= set(rounds[0]["agents"][0])
    for r in rounds:  # the schema fedrl up writes too, as documented; metrics: the agents' means
        source.check_round_record(r, "simulate")
        assert r["version"] == r["round"]
        assert r["metrics"]["critic_td"] == pytest.approx(sum(a["critic_td"] for a in r["agents"]) / 2)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final"]["return_mean"] == rounds[-1]["eval"]["return_mean"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["algorithm_hparams"]["lambda2"] == 0.2 and len(cfg["shards"]) == 2
    assert (out / "learning_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    weights = load_file(out / "global_policy.safetensors")
    assert "policy.head.weight" in weights and "policy.obs_mean" in weights
    # the saved policy evaluates itself (env and sizes from the file) and matches the run's last eval
    ev = subprocess.run([sys.executable, "-m", "fedrl.cli", "evaluate", str(out / "global_policy.safetensors"),
                         "--episodes", "2", "--seed", "0", "--json"], capture_output=True, text=True, timeout=120)
    assert ev.returncode == 0, ev.stderr
    assert json.loads(ev.stdout)["env_id"] == "Hopper-v5" and len(json.loads(ev.stdout)["returns"]) == 2
    # several files (a glob over runs): each in turn, one JSON line each; a bad one is named first
    policy = str(out / "global_policy.safetensors")
    two = subprocess.run([*ev.args[:4], policy, policy, *ev.args[5:]], capture_output=True, text=True, timeout=120)
    lines = [json.loads(x) for x in two.stdout.splitlines()]
    assert two.returncode == 0 and [x.pop("policy") for x in lines] == [policy, policy]
    one = json.loads(ev.stdout)
    assert one.pop("policy") == policy
    assert [x["returns"] for x in lines] == [one["returns"]] * 2  # the same rollouts: same policy, same seed
    bad = subprocess.run([*ev.args[:4], policy, str(tmp_path / "gone.safetensors"), *ev.args[5:]],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "gone.safetensors" in bad.stderr and bad.stdout == "", bad.stderr
    # The same command again does not write over this run.
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    again = subprocess.run(proc.args, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and f"{out} already holds a run (config.json, rounds.jsonl, summary.json)" \
        in again.stderr, again.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_cli_bad_input_exits_2_with_a_named_problem(tmp_path):
    missing = tmp_path / "nope.hdf5"
    proc = subprocess.run([sys.executable, "-m", "fedrl.cli", "simulate", "--dataset", str(missing),
                           "--out", str(tmp_path / "o")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and str(missing) in proc.stderr and "Traceback" not in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "fedrl.cli", "simulate", "--agents", "0"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--agents: must be >= 1, got 0" in proc.stderr
    # refused before anything trains or is written (it used to fail after round 1's training)
    out = tmp_path / "t"
    proc = subprocess.run([sys.executable, "-m", "fedrl.cli", "simulate", "--aggregation", "trimmed-mean",
                           "--trim-fraction", "0.7", "--out", str(out)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--trim-fraction: must be in [0, 0.5), got 0.7" in proc.stderr, proc.stderr
    assert not out.exists()


def test_same_seed_same_global_weights(tmp_path, random_dataset):
    run(tiny(random_dataset, eval_episodes=0), tmp_path / "a", log=lambda m: None)
    run(tiny(random_dataset, eval_episodes=0), tmp_path / "b", log=lambda m: None)
    run(tiny(random_dataset, eval_episodes=0, seed=1), tmp_path / "c", log=lambda m: None)
    a, b, c = (load_file(tmp_path / x / "global_policy.safetensors") for x in "abc")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)


def test_global_policy_is_the_average_of_agent_policies(tmp_path, random_dataset):
    # One round, weighting by samples, compared against an independent re-computation.
    from fedrl.common.device import derive_seed
    from fedrl.data.d4rl import to_transitions
    from fedrl.data.normalize import agent_normalizers
    from fedrl.data.partition import ShardSource, partition
    from fedrl.data.registry import load
    from fedrl.federation.round import SEED_SHARDS, LocalTrainer, initial_global_state

    cfg = tiny(random_dataset, rounds=1, eval_episodes=0, weighting="samples")
    run(cfg, tmp_path / "r", log=lambda m: None)
    raw = load(str(random_dataset))
    shards = partition([ShardSource(raw.source, to_transitions(raw), 2)], 2, derive_seed(0, SEED_SHARDS))
    norms = agent_normalizers("pooled", [s.transitions.obs for s in shards])
    g0 = initial_global_state(TINY_DRPO, 11, 3, 0, *norms[0], False)
    res = [LocalTrainer(s.agent, TINY_DRPO, s.transitions, *n, 0, torch.device("cpu")).train_round(g0, 3)
           for s, n in zip(shards, norms)]
    n0, n1 = res[0].num_samples, res[1].num_samples
    got = load_file(tmp_path / "r" / "global_policy.safetensors")
    for k in got:
        exp = (n0 * res[0].state[k].double() + n1 * res[1].state[k].double()) / (n0 + n1)
        assert torch.allclose(got[k].double(), exp, atol=1e-6), k


def test_cql_baseline_reports_spread_over_agents(tmp_path, random_dataset):
    s = run(tiny(random_dataset, algo="cql", agents=3, rounds=1), tmp_path / "c", log=lambda m: None)
    rec = json.loads((tmp_path / "c" / "rounds.jsonl").read_text())
    ev = rec["eval"]
    assert ev["spread_over"] == "agents" and len(ev["per_agent"]) == 3
    means = [e["return_mean"] for e in ev["per_agent"]]
    assert ev["return_mean"] == pytest.approx(np.mean(means)) and ev["return_std"] == pytest.approx(np.std(means))
    assert s["final"]["return_mean"] == pytest.approx(ev["return_mean"])


def test_heterogeneous_sources_and_federated_critics(tmp_path, random_dataset, stand_dataset):
    cfg = tiny(random_dataset, datasets=(f"{random_dataset}:2", f"{stand_dataset}:1"),
               federate="policy+critic", rounds=1, eval_episodes=0)
    run(cfg, tmp_path / "h", log=lambda m: None)
    shards = json.loads((tmp_path / "h" / "config.json").read_text())["shards"]
    assert [sh["source"] for sh in shards] == [str(random_dataset)] * 2 + [str(stand_dataset)]


def test_local_normalisation_global_normaliser_is_the_agents_average(tmp_path, random_dataset):
    run(tiny(random_dataset, obs_norm="local", rounds=1, eval_episodes=0), tmp_path / "n", log=lambda m: None)
    from fedrl.data.d4rl import to_transitions
    from fedrl.data.registry import load
    cfg = json.loads((tmp_path / "n" / "config.json").read_text())
    tr = to_transitions(load(str(random_dataset)))
    means = [tr.of_episodes(np.array(sh["episodes"])).obs.mean(0) for sh in cfg["shards"]]
    got = load_file(tmp_path / "n" / "global_policy.safetensors")["policy.obs_mean"].numpy()
    assert np.allclose(got, np.mean(means, axis=0), atol=1e-4)


@pytest.mark.parametrize("seed,threads", [(0, 1), (1, 2)])
def test_fed_bc_learns_towards_the_behaviour_return(tmp_path, dart_stand_dataset, seed, threads):
    """Learning check: BC of a PD 'stand' controller (return ~1000) lifts the global policy far
    above the untrained policy (~20-50). Fails if the BC update or FedAvg is broken. Two seeds
    and both thread counts: the outcome must not hang on one lucky floating-point path."""
    bc = BCConfig(hidden=(64, 64), batch_size=64, lr=3e-3)
    cfg = tiny(dart_stand_dataset, algo="fed-bc", agents=2, trajectories=4, rounds=3, local_steps=300,
               eval_episodes=2, bc=bc, seed=seed)
    n = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        before = run(tiny(dart_stand_dataset, algo="fed-bc", rounds=1, local_steps=0, bc=bc, seed=seed),
                     tmp_path / "b0", log=lambda m: None)["final"]["return_mean"]
        after = run(cfg, tmp_path / "b1", log=lambda m: None)["best"]["return_mean"]
    finally:
        torch.set_num_threads(n)
    assert before < 100, before
    assert after > before + 500, (before, after)


def test_dataset_of_the_wrong_width_for_the_env_names_the_file(tmp_path, random_dataset):
    from fedrl.data.errors import DatasetError
    with pytest.raises(DatasetError, match="observations have 11 dims.*Walker2d-v5") as e:
        run(tiny(random_dataset, env="Walker2d-v5"), tmp_path / "w", log=lambda m: None)
    assert str(random_dataset) in str(e.value)


class _Killed(Exception):
    pass


@pytest.mark.parametrize("algo,engine", [("drpo", "per-agent"), ("cql", "per-agent"), ("fed-bc", "per-agent"),
                                         ("drpo", "batched"), ("cql", "batched"), ("fed-bc", "batched")])
def test_an_interrupted_run_resumes_from_its_last_round_exactly(tmp_path, random_dataset, algo, engine):
    """Killed after round 2 of 3 (its checkpoint on disk, nothing after it), then run again on
    the same folder: the same rounds and the same final policy, bit for bit, as the run that was
    never stopped; rounds 1-2 are not trained again. Either engine."""
    cfg = tiny(random_dataset, algo=algo, rounds=3)
    whole = run(cfg, tmp_path / "whole", log=lambda m: None, checkpoint=True, engine=engine)
    cut = tmp_path / "cut"
    with pytest.raises(_Killed):
        run(cfg, cut, log=_raise_on("round   2/3"), checkpoint=True, engine=engine)
    assert (cut / "checkpoint.safetensors").exists() and not (cut / "summary.json").exists()
    other = "batched" if engine == "per-agent" else "per-agent"
    with pytest.raises(ValueError, match=f"checkpoint of the {engine} engine"):
        run(cfg, cut, log=lambda m: None, checkpoint=True, engine=other)
    logs = []
    resumed = run(cfg, cut, log=logs.append, checkpoint=True, engine=engine)
    assert any(m.startswith("resuming") and m.endswith("after round 2 of 3") for m in logs), logs
    assert sum("round   3/3" in m for m in logs) == 1 and not any("round   2/3" in m for m in logs)
    assert resumed["curve"] == whole["curve"]

    def losses(d):
        rs = [json.loads(x) for x in (d / "rounds.jsonl").read_text().splitlines()]
        return [(r["round"], [{k: v for k, v in a.items() if k != "seconds"} for a in r["agents"]]) for r in rs]

    assert losses(cut) == losses(tmp_path / "whole") and [r for r, _ in losses(cut)] == [1, 2, 3]
    a, b = load_file(tmp_path / "whole" / "global_policy.safetensors"), load_file(cut / "global_policy.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not (cut / "checkpoint.safetensors").exists()  # a finished run keeps its results, not its state
    (cut / "checkpoint.safetensors").write_bytes(b"x")
    with pytest.raises(ValueError, match="finished run"):
        run(cfg, cut, log=lambda m: None, checkpoint=True, engine=engine)


def _raise_on(text):
    def log(m):
        if text in m:
            raise _Killed

    return log


def _count_rounds_and_kill_at(monkeypatch, call: int | None):
    """LocalTrainer.train_round counted; the ``call``-th one (1-based) raises _Killed before it trains."""
    from fedrl.federation import round as round_mod

    real, calls = round_mod.LocalTrainer.train_round, []

    def train_round(self, *a, **k):
        calls.append(self.agent)
        if len(calls) == call:
            raise _Killed
        return real(self, *a, **k)

    monkeypatch.setattr(round_mod.LocalTrainer, "train_round", train_round)
    return calls


@pytest.mark.parametrize("algo", ["drpo", "cql"])
@pytest.mark.parametrize("kill_at, trained_before", [(2, [0]), (6, [0, 1])])
def test_a_run_stopped_mid_round_trains_only_the_agents_that_had_not_finished(
        tmp_path, random_dataset, monkeypatch, algo, kill_at, trained_before):
    """3 agents x 3 rounds, stopped as an agent starts its local round (in round 1, before any
    round's checkpoint; in round 2): the agents that had finished that round are not trained
    again, and the run ends with the same rounds and policy, bit for bit, as one never stopped."""
    from fedrl.federation.checkpoint import AGENTS_IN_ROUND, has_checkpoint

    cfg = tiny(random_dataset, algo=algo, agents=3, rounds=3)
    whole = run(cfg, tmp_path / "whole", log=lambda m: None, checkpoint=True)
    cut = tmp_path / "cut"
    _count_rounds_and_kill_at(monkeypatch, kill_at)
    with pytest.raises(_Killed):
        run(cfg, cut, log=lambda m: None, checkpoint=True)
    stopped_in = 1 + (kill_at - 1) // 3
    assert sorted(p.name for p in (cut / AGENTS_IN_ROUND).iterdir()) == [f"agent-{i}.safetensors" for i in trained_before]
    assert has_checkpoint(cut) and (cut / "checkpoint.safetensors").exists() == (stopped_in > 1)
    calls, logs = _count_rounds_and_kill_at(monkeypatch, None), []
    resumed = run(cfg, cut, log=logs.append, checkpoint=True)
    assert calls[:3 - len(trained_before)] == [i for i in range(3) if i not in trained_before]
    assert len(calls) == 3 * (4 - stopped_in) - len(trained_before)  # no finished agent trained again
    agents = ", ".join(str(i + 1) for i in trained_before)
    assert any(m.endswith(f"after round {stopped_in - 1} of 3; agents {agents} of round {stopped_in} already trained")
               for m in logs), logs
    assert resumed["curve"] == whole["curve"]

    def losses(d):
        rs = [json.loads(x) for x in (d / "rounds.jsonl").read_text().splitlines()]
        return [(r["round"], [{k: v for k, v in a.items() if k != "seconds"} for a in r["agents"]]) for r in rs]

    assert losses(cut) == losses(tmp_path / "whole")
    a, b = load_file(tmp_path / "whole" / "global_policy.safetensors"), load_file(cut / "global_policy.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not (cut / AGENTS_IN_ROUND).exists() and not has_checkpoint(cut)


def test_agents_files_of_a_round_already_checkpointed_are_not_taken_again(tmp_path, random_dataset, monkeypatch):
    """Stopped between round 1's checkpoint and the removal of its agents' files: the resumed run
    trains all three agents in round 2 (the files hold round 1's) and matches the whole run."""
    from fedrl.federation import checkpoint, simulate

    cfg = tiny(random_dataset, agents=3, rounds=2)
    whole = run(cfg, tmp_path / "whole", log=lambda m: None, checkpoint=True)

    def stop(out):
        raise _Killed

    monkeypatch.setattr(simulate, "clear_agent_checkpoints", stop)
    cut = tmp_path / "cut"
    with pytest.raises(_Killed):
        run(cfg, cut, log=lambda m: None, checkpoint=True)
    assert len(list((cut / checkpoint.AGENTS_IN_ROUND).iterdir())) == 3
    monkeypatch.undo()
    calls = _count_rounds_and_kill_at(monkeypatch, None)
    resumed = run(cfg, cut, log=lambda m: None, checkpoint=True)
    assert calls == [0, 1, 2] and resumed["curve"] == whole["curve"]
    a, b = load_file(tmp_path / "whole" / "global_policy.safetensors"), load_file(cut / "global_policy.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_refuses_an_agents_file_of_other_settings(tmp_path, random_dataset, monkeypatch):
    _count_rounds_and_kill_at(monkeypatch, 2)
    with pytest.raises(_Killed):
        run(tiny(random_dataset, rounds=2), tmp_path, log=lambda m: None, checkpoint=True)
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"agent-0.safetensors is a checkpoint of another configuration .*local_steps"):
        run(tiny(random_dataset, rounds=2, local_steps=4), tmp_path, log=lambda m: None, checkpoint=True)


def test_resume_refuses_a_checkpoint_of_other_settings(tmp_path, random_dataset):
    cfg = tiny(random_dataset, rounds=2)
    with pytest.raises(_Killed):
        run(cfg, tmp_path, log=_raise_on("round   2/2"), checkpoint=True)
    with pytest.raises(ValueError, match="another configuration .*local_steps"):
        run(tiny(random_dataset, rounds=2, local_steps=4), tmp_path, log=lambda m: None, checkpoint=True)
    with pytest.raises(ValueError, match=r"another configuration \(differs in drpo.lambda2\)"):
        run(tiny(random_dataset, rounds=2, drpo=dataclasses.replace(TINY_DRPO, lambda2=1.0)), tmp_path,
            log=lambda m: None, checkpoint=True)


def test_resume_refuses_data_other_than_the_run_started_on(tmp_path, random_dataset):
    """Each machine makes its dataset again: a run stopped on one and resumed on another, whose
    file came out with other rewards in the same episodes, stops instead of mixing the two."""
    import shutil

    import h5py

    data = tmp_path / "data.hdf5"
    shutil.copy(random_dataset, data)
    cfg = tiny(data, rounds=2)
    out = tmp_path / "run"
    with pytest.raises(_Killed):
        run(cfg, out, log=_raise_on("round   2/2"), checkpoint=True)
    recorded = json.loads((out / "config.json").read_text())["shards"]
    assert all(len(sh["sha256"]) == 64 for sh in recorded)
    with h5py.File(data, "r+") as f:
        f["rewards"][...] = f["rewards"][...] + 1.0  # other rewards: the episodes and row counts stay
    with pytest.raises(ValueError, match=r"this run started on other data \(agent\(s\) 0, 1:"):
        run(cfg, out, log=lambda m: None, checkpoint=True)
    shutil.copy(random_dataset, data)  # the data as it was: the run continues
    assert run(cfg, out, log=lambda m: None, checkpoint=True)["final"] is not None


def test_a_run_recorded_before_shards_had_a_digest_resumes_on_the_same_episodes(tmp_path, random_dataset):
    cfg = tiny(random_dataset, rounds=2)
    out = tmp_path / "run"
    with pytest.raises(_Killed):
        run(cfg, out, log=_raise_on("round   2/2"), checkpoint=True)
    old = json.loads((out / "config.json").read_text())
    for sh in old["shards"]:
        del sh["sha256"]
    other = json.loads(json.dumps(old))
    other["shards"][1]["episodes"][0] += 1  # a split the data no longer gives
    (out / "config.json").write_text(json.dumps(other))
    with pytest.raises(ValueError, match=r"this run started on other data \(agent\(s\) 1:"):
        run(cfg, out, log=lambda m: None, checkpoint=True)
    (out / "config.json").write_text(json.dumps(old))
    assert run(cfg, out, log=lambda m: None, checkpoint=True)["final"] is not None


def _record_rounds(monkeypatch):
    """Wrap LocalTrainer.train_round: per call, the state it was given, the policy the learner
    held at its first local step, and the state it returned."""
    from fedrl.federation import round as round_mod

    calls = []
    orig = round_mod.LocalTrainer.train_round

    def train_round(self, global_state, steps, stop=None, copy=True):
        first = {}
        upd = self.learner.update

        def update(batch):
            if not first:
                first.update({k: v.detach().clone() for k, v in self.learner.policy.state_dict().items()})
            return upd(batch)

        self.learner.update = update
        try:
            res = orig(self, global_state, steps, stop, copy)
        finally:
            del self.learner.update
        calls.append({"agent": self.agent, "given": {k: v.clone() for k, v in global_state.items()},
                      "first": first, "returned": {k: v.clone() for k, v in res.state.items()}})
        return res

    monkeypatch.setattr(round_mod.LocalTrainer, "train_round", train_round)
    return calls


@pytest.mark.parametrize("algo", ["drpo", "fed-cql", "fed-bc"])
def test_each_round_starts_every_agent_from_the_average_of_the_last(tmp_path, random_dataset, monkeypatch, algo):
    calls = _record_rounds(monkeypatch)
    run(tiny(random_dataset, algo=algo, rounds=2), tmp_path, log=lambda m: None)
    r1, r2 = calls[:2], calls[2:]
    assert [c["agent"] for c in calls] == [0, 1, 0, 1]
    for c in calls:  # local training starts from the state it was given (begin_round adopted it)
        assert all(torch.equal(c["first"][k], c["given"][f"policy.{k}"]) for k in c["first"])
    assert not torch.equal(r1[0]["returned"]["policy.head.weight"], r1[1]["returned"]["policy.head.weight"])
    for c in r2:  # FedAvg (uniform) of round 1's policies
        for k, v in c["given"].items():
            torch.testing.assert_close(v, (r1[0]["returned"][k] + r1[1]["returned"][k]) / 2)


def test_agents_alone_continue_from_their_own_policies(tmp_path, random_dataset, monkeypatch):
    """The CQL baseline: no averaging; each agent's round 2 starts where its round 1 ended."""
    calls = _record_rounds(monkeypatch)
    run(tiny(random_dataset, algo="cql", rounds=2), tmp_path, log=lambda m: None)
    r1, r2 = calls[:2], calls[2:]
    for a in range(2):
        assert all(torch.equal(r2[a]["given"][k], r1[a]["returned"][k]) for k in r1[a]["returned"])
    assert not torch.equal(r2[0]["given"]["policy.head.weight"], r2[1]["given"]["policy.head.weight"])


def test_cli_checkpoint_continues_a_stopped_run(tmp_path, random_dataset):
    """`fedrl simulate --checkpoint`: a folder a stopped run left (its checkpoint) is continued by
    the same command, not refused; without the flag, or once finished, it is refused."""
    out = tmp_path / "run"
    with pytest.raises(_Killed):
        run(tiny(random_dataset, rounds=3, drpo=DRPOConfig(hidden=(16, 16), batch_size=16),
                 bc=BCConfig(hidden=(16, 16), batch_size=16)), out, log=_raise_on("round   1/3"), checkpoint=True)
    args = [sys.executable, "-m", "fedrl.cli", "simulate", "--dataset", str(random_dataset), "--agents", "2",
            "--trajectories", "2", "--rounds", "3", "--local-steps", "3", "--eval-episodes", "2", "--hidden", "16",
            "16", "--batch-size", "16", "--device", "cpu", "--out", str(out)]
    refused = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "already holds a run" in refused.stderr
    done = subprocess.run(args + ["--checkpoint"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "after round 1 of 3" in done.stderr and "round   1/3" not in done.stderr and "round   3/3" in done.stderr
    assert [json.loads(x)["round"] for x in (out / "rounds.jsonl").read_text().splitlines()] == [1, 2, 3]
    again = subprocess.run(args + ["--checkpoint"], capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "already holds a run" in again.stderr


@pytest.mark.parametrize("algo", ["drpo", "cql"])
def test_agents_in_parallel_threads_compute_what_one_at_a_time_does(tmp_path, random_dataset, algo):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the benchmarks run
    try:
        cfg = tiny(random_dataset, algo=algo, agents=3)
        one = run(cfg, tmp_path / "one", log=lambda m: None)
        par = run(cfg, tmp_path / "par", log=lambda m: None, parallel_agents=3)
    finally:
        torch.set_num_threads(threads)
    assert one["curve"] == par["curve"]
    a, b = load_file(tmp_path / "one" / "global_policy.safetensors"), load_file(tmp_path / "par" / "global_policy.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="parallel agents must be >= 1"):
        run(cfg, tmp_path / "zero", log=lambda m: None, parallel_agents=0)


def test_learning_curve_has_integer_rounds_a_full_title_and_references(tmp_path):
    import matplotlib.pyplot as plt

    from fedrl.ops import plotting

    seen = {}
    real_savefig = plt.Figure.savefig

    def savefig(fig, *a, **k):
        ax = fig.axes[0]
        seen["ticks"] = [t for t in ax.get_xticks() if 1 <= t <= 3]
        seen["title"] = ax.get_title()
        seen["labels"] = [line.get_label() for line in ax.get_lines()]
        seen["ylim"] = ax.get_ylim()
        seen["notes"] = [t.get_text() for t in ax.texts]
        return real_savefig(fig, *a, **k)

    def draw(curve, data_return):
        try:
            plt.Figure.savefig = savefig
            plotting.learning_curve(curve, tmp_path / "c.png", "drpo on hopper-medium-v2: 3 agents x 100 local steps",
                                    "hopper", data_return=data_return)
        finally:
            plt.Figure.savefig = real_savefig
        return dict(seen)

    got = draw([{"round": r, "return_mean": 1100.0 * r, "return_std": 5.0} for r in (1, 2, 3)], 1234.5)
    assert all(float(t).is_integer() for t in got["ticks"]) and got["ticks"]
    assert got["title"] == "drpo on hopper-medium-v2: 3 agents x 100 local steps"
    assert "the agents' data (1234)" in got["labels"] or "the agents' data (1235)" in got["labels"]
    assert any(label.startswith("D4RL expert") for label in got["labels"])  # 3234: on the axis
    assert any(n.startswith("D4RL random -20 below, off scale") for n in got["notes"]), got["notes"]
    # early rounds of a weak run: the axis is the run's and its data's, the expert noted off scale
    got = draw([{"round": r, "return_mean": v, "return_std": 2.0} for r, v in ((1, 11.0), (2, 7.0), (3, 27.0))], 40.0)
    lo, hi = got["ylim"]
    assert lo < 5.0 and 40.0 < hi < 60.0, got["ylim"]
    assert not any(label.startswith("D4RL expert") for label in got["labels"])
    assert any(n.startswith("D4RL expert 3234 above, off scale") for n in got["notes"]), got["notes"]
    assert plotting.episode_return_mean([1.0, 2.0, 3.0, 4.0], [7, 7, 9, 9]) == 5.0


@pytest.mark.parametrize("algo", ["drpo", "fed-cql", "fed-bc", "cql"])
def test_the_batched_engine_runs_the_federation_round_by_round(tmp_path, random_dataset, monkeypatch, algo):
    """The batched engine: agents start from their per-agent engine's initial weights, each round
    starts every agent from the FedAvg of the last (the CQL baseline: from its own last policy),
    the agents' updates differ, and the run is reproducible from its seed, bit for bit."""
    from fedrl.federation import round as round_mod

    calls = []
    real = round_mod.BatchedTrainer.train_round

    def train_round(self, states, steps, progress=None):
        res = real(self, states, steps, progress)
        calls.append(([{k: v.clone() for k, v in st.items()} for st in states], [r.state for r in res]))
        return res

    monkeypatch.setattr(round_mod.BatchedTrainer, "train_round", train_round)
    cfg = tiny(random_dataset, algo=algo, rounds=2, agents=3)
    seen = []
    a = run(cfg, tmp_path / "a", log=lambda m: None, engine="batched", on_round=lambda r, g: seen.append(g))
    (given1, ret1), (given2, _) = calls
    assert not torch.equal(ret1[0]["policy.head.weight"], ret1[1]["policy.head.weight"])
    if algo == "cql":
        for i in range(3):
            assert all(torch.equal(given2[i][k], ret1[i][k]) for k in ret1[i])
    else:
        for k, v in given2[0].items():  # FedAvg (uniform, the default weighting) of round 1's updates
            torch.testing.assert_close(v.double(), sum(st[k].double() for st in ret1) / 3, rtol=1e-6, atol=1e-7)
            assert all(torch.equal(st[k], v) for st in given2)
        assert len(seen) == 2
    b = run(cfg, tmp_path / "b", log=lambda m: None, engine="batched")
    assert a["curve"] == b["curve"]
    pa, pb = load_file(tmp_path / "a" / "global_policy.safetensors"), load_file(tmp_path / "b" / "global_policy.safetensors")
    assert all(torch.equal(pa[k], pb[k]) for k in pa)


def test_the_batched_engine_starts_each_agent_from_its_per_agent_weights(tmp_path, random_dataset, monkeypatch):
    """Agent i's critics in the batch at the first step are those its LocalTrainer builds."""
    from fedrl.federation import round as round_mod

    built = {}
    real_batched, real_local = round_mod.BatchedTrainer.__init__, round_mod.LocalTrainer.__init__

    def batched_init(self, *a, **k):
        real_batched(self, *a, **k)
        built["batched"] = [self.learner.member_critic(i) for i in range(self.learner.members)]

    def local_init(self, *a, **k):
        real_local(self, *a, **k)
        built.setdefault("local", []).append({k: v.detach().clone() for k, v in self.learner.critic.state_dict().items()})

    monkeypatch.setattr(round_mod.BatchedTrainer, "__init__", batched_init)
    monkeypatch.setattr(round_mod.LocalTrainer, "__init__", local_init)
    cfg = tiny(random_dataset, rounds=1, local_steps=0 + 1, eval_episodes=0)
    run(cfg, tmp_path / "b", log=lambda m: None, engine="batched")
    run(cfg, tmp_path / "p", log=lambda m: None, engine="per-agent")
    for mine, theirs in zip(built["batched"], built["local"]):
        assert all(torch.equal(mine[k], theirs[k]) for k in theirs)


def test_engine_choice_is_checked_and_auto_keeps_the_cpu_per_agent(tmp_path, random_dataset):
    from fedrl.federation.simulate import resolve_engine

    assert resolve_engine("auto", torch.device("cpu")) == "per-agent"
    assert resolve_engine("auto", torch.device("cuda")) == "batched"
    with pytest.raises(ValueError, match="--engine"):
        resolve_engine("fast", torch.device("cpu"))
    with pytest.raises(ValueError, match="parallel-agents"):
        run(tiny(random_dataset), tmp_path, log=lambda m: None, engine="batched", parallel_agents=2)


def test_differential_privacy_reports_its_epsilon_each_round_and_stops_at_its_budget(tmp_path, random_dataset):
    """Each round's record holds the epsilon spent so far (rising), the clipping it did, and the
    run stops, saying why, before the round that would exceed its budget."""
    from fedrl.federation.privacy import epsilon

    cfg = SimConfig(algo="fed-bc", datasets=(str(random_dataset),), agents=3, trajectories=2, rounds=5, local_steps=5,
                    eval_episodes=0, device="cpu", bc=BCConfig(hidden=(16, 16), batch_size=16, lr=1e-2), dp_clip=0.01,
                    dp_noise=1.0, dp_epsilon_budget=epsilon(1.0, 3, 1e-5) + 1e-9)
    logs = []
    summary = run(cfg, tmp_path / "dp", log=logs.append)
    rows = [json.loads(x) for x in (tmp_path / "dp" / "rounds.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3]  # the 4th would exceed the budget
    eps = [r["privacy"]["epsilon"] for r in rows]
    assert eps == sorted(eps) and eps[-1] == pytest.approx(epsilon(1.0, 3, 1e-5))
    assert all(r["privacy"]["clipped_fraction"] == 1.0 for r in rows)  # a clip of 0.01 cuts every update
    for r in rows:
        source.check_round_record(r, "simulate")
    assert summary["stopped"].startswith("privacy budget: round 4 would spend epsilon")
    assert summary["privacy"]["rounds"] == 3 and any("epsilon" in m for m in logs)


def test_adaptive_clipping_moves_the_norm_each_round_and_a_resume_continues_it(tmp_path, random_dataset):
    """The norm starts far below every update's (so it must grow: an agent that clipped to it
    itself would make every update fit and shrink it), each round clips to the norm the round
    before moved it to, and a run killed after round 1 resumes at that norm, not the first."""
    cfg = tiny(random_dataset, algo="fed-bc", agents=3, rounds=3, eval_episodes=0, dp_clip=1e-4,
               dp_clip_quantile=0.5, dp_clip_lr=0.5)

    def clips(out):
        rows = [json.loads(x)["privacy"] for x in (out / "rounds.jsonl").read_text().splitlines()]
        return [(r["clip"], r["unclipped_fraction"], r["clip_next"]) for r in rows]

    run(cfg, tmp_path / "whole", log=lambda m: None)
    whole = clips(tmp_path / "whole")
    assert whole[0] == (1e-4, 0.0, pytest.approx(1e-4 * math.exp(0.25)))
    assert all(b[0] == a[2] for a, b in zip(whole, whole[1:]))
    assert [f for _, f, _ in whole] == [0.0, 0.0, 0.0]  # every real update is far past the norm: it grows
    first = json.loads((tmp_path / "whole" / "rounds.jsonl").read_text().splitlines()[0])["privacy"]
    assert "clipped_fraction" not in first  # the agents clipped nothing themselves: no share of theirs to report
    with pytest.raises(_Killed):
        run(cfg, tmp_path / "cut", log=_raise_on("round   1/3"), checkpoint=True)
    run(cfg, tmp_path / "cut", log=lambda m: None, checkpoint=True)
    assert clips(tmp_path / "cut") == whole


def test_a_checkpoint_from_before_an_option_existed_resumes(tmp_path, random_dataset):
    """A run checkpointed by an older version of the code has no entry for options added since
    (the verdict cells' checkpoints predate dp_*): it resumes, those options at their defaults;
    one that recorded another value for an option is still refused."""
    from safetensors.torch import load_file as load, save_file
    from safetensors import safe_open

    cfg = tiny(random_dataset, algo="fed-bc", rounds=2)
    cut = tmp_path / "cut"
    with pytest.raises(_Killed):
        run(cfg, cut, log=_raise_on("round   1/2"), checkpoint=True)
    ck = cut / "checkpoint.safetensors"
    with safe_open(str(ck), "pt") as f:
        meta = json.loads(f.metadata()["fedrl_checkpoint"])
    tensors = load(str(ck))
    for k in ("dp_clip", "dp_noise", "dp_delta", "dp_epsilon_budget"):
        del meta["sim"][k]  # as the code before them wrote it
    save_file(tensors, str(ck), {"fedrl_checkpoint": json.dumps(meta)})
    logs = []
    run(cfg, cut, log=logs.append, checkpoint=True)
    assert any(m.startswith("resuming") for m in logs)
    with pytest.raises(_Killed):
        run(cfg, tmp_path / "cut2", log=_raise_on("round   1/2"), checkpoint=True)
    with pytest.raises(ValueError, match="differs in dp_clip"):
        run(dataclasses.replace(cfg, dp_clip=1.0), tmp_path / "cut2", log=lambda m: None, checkpoint=True)
