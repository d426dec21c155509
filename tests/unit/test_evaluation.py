"""MuJoCo rollouts, normalised scores, env layouts."""

import threading

import pytest
import torch

from fedrl.algos.nets import TanhGaussianPolicy
from fedrl.envs import env_info
from fedrl.envs.evaluation import evaluate
from fedrl.envs.scores import normalized_score


def test_d4rl_reference_constants():
    assert normalized_score("hopper", 3234.3) == pytest.approx(100.0)
    assert normalized_score("Hopper-v5", -20.272305) == pytest.approx(0.0)
    assert normalized_score("walker2d-medium-v2", 1.629008 + (4592.3 - 1.629008) / 2) == pytest.approx(50.0)
    assert normalized_score("halfcheetah", 12135.0) == pytest.approx(100.0)
    assert normalized_score("ant", -325.6) == pytest.approx(0.0)


def test_env_lookup_and_layouts():
    assert env_info("hopper-medium-replay-v2").gym_id == "Hopper-v5"
    assert env_info("Walker2d-v5").obs_dim == 17
    assert env_info("ant").gym_kwargs(105) == {}
    # what this project trains and makes for Ant: the 27 dims D4RL's files informed a learner with
    assert env_info("ant").obs_dim == 27 and env_info("ant").gym_kwargs() == {"include_cfrc_ext_in_observation": False}
    assert env_info("ant").gym_kwargs(27) == {"include_cfrc_ext_in_observation": False}
    with pytest.raises(ValueError, match="mujoco-py's 111-dim layout"):
        env_info("ant").gym_kwargs(111)
    with pytest.raises(ValueError, match="unknown environment 'pong'.*Hopper-v5"):
        env_info("pong")


def test_evaluate_runs_exact_episode_count_deterministically():
    torch.manual_seed(0)
    pol = TanhGaussianPolicy(11, 3, (16, 16))
    r1 = evaluate(pol, "Hopper-v5", episodes=7, seed=3, num_envs=3)
    r2 = evaluate(pol, "Hopper-v5", episodes=7, seed=3, num_envs=3)
    assert len(r1.returns) == 7 and r1.returns == r2.returns
    assert r1.score_mean == pytest.approx(normalized_score("hopper", r1.return_mean))
    assert r1.env_steps >= sum(r1.lengths) / 3


def test_evaluate_uses_the_policy_normaliser():
    torch.manual_seed(0)
    pol = TanhGaussianPolicy(11, 3, (16, 16))
    base = evaluate(pol, "Hopper-v5", episodes=2, seed=0)
    pol.set_normalizer(torch.full((11,), 5.0), torch.full((11,), 0.01))
    assert evaluate(pol, "Hopper-v5", episodes=2, seed=0).returns != base.returns


@pytest.mark.parametrize("env, obs_dim", [("HalfCheetah-v5", 17), ("Walker2d-v5", 17),
                                          ("Ant-v5", 105), ("Ant-v5", 27)])
def test_other_tasks_roll_out(env, obs_dim):
    info = env_info(env)
    pol = TanhGaussianPolicy(obs_dim, info.act_dim, (8,))
    r = evaluate(pol, env, episodes=1, seed=0, max_episode_steps=20)
    assert len(r.returns) == 1 and r.lengths[0] <= 20


_BUILD_HALFCHEETAH = """
import logging, sys
logging.basicConfig(level=logging.DEBUG, stream=sys.stdout, format="%(name)s %(levelname)s %(message)s")
import mujoco
if sys.argv[1] == "own":
    seen = []
    mujoco.set_mju_user_warning(seen.append)
from fedrl.envs.evaluation import make_vec_env
make_vec_env("HalfCheetah-v5", 2).close()
if sys.argv[1] == "own":
    print("own handler saw", len(seen))
"""


@pytest.mark.parametrize("handler", ["ours", "own"])
def test_mujoco_warnings_go_to_logging_not_to_a_file_in_the_working_directory(tmp_path, handler):
    """gymnasium's HalfCheetah model makes MuJoCo warn on every build; left alone MuJoCo prints it
    and writes MUJOCO_LOG.TXT into the user's folder. A handler the user set first is kept."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", _BUILD_HALFCHEETAH, handler], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stderr
    assert list(tmp_path.iterdir()) == []  # no MUJOCO_LOG.TXT
    assert "settotalmass" not in out.stderr
    if handler == "ours":
        assert "fedrl.mujoco DEBUG MuJoCo: compiler attribute 'settotalmass' is deprecated" in out.stdout
    else:
        assert "own handler saw 2" in out.stdout and "fedrl.mujoco" not in out.stdout


def test_an_unexpected_mujoco_warning_is_logged_as_a_warning(caplog):
    from fedrl.envs import _mujoco_warning

    with caplog.at_level("DEBUG", logger="fedrl.mujoco"):
        _mujoco_warning("Nan, Inf or huge value in QACC at DOF 0. The simulation is unstable.")
        _mujoco_warning("compiler attribute 'settotalmass' is deprecated and will be removed")
    assert [(r.levelname, r.getMessage().split(",")[0]) for r in caplog.records] == [
        ("WARNING", "MuJoCo: Nan"), ("DEBUG", "MuJoCo: compiler attribute 'settotalmass' is deprecated and will be removed")]


def test_a_rollout_keeps_numpys_blas_to_one_thread():
    """The rollout's batched products are tiny, and OpenBLAS's worker threads spun between
    them: another thread of the process burned about as much CPU as the rollout itself (a core
    taken from the agents on a small machine). Now no other thread of the process does."""
    import os

    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: BLAS runs no worker threads")

    def ticks() -> dict[str, int]:
        out = {}
        for t in os.listdir("/proc/self/task"):
            try:
                f = open(f"/proc/self/task/{t}/stat").read().rsplit(")", 1)[1].split()
            except OSError:  # the thread ended
                continue
            out[t] = int(f[11]) + int(f[12])
        return out

    info = env_info("Hopper-v5")
    torch.manual_seed(0)
    pol = TanhGaussianPolicy(info.obs_dim, info.act_dim)
    evaluate(pol, "Hopper-v5", 10, seed=0, num_envs=10, max_episode_steps=100)  # BLAS threads started
    before = ticks()
    evaluate(pol, "Hopper-v5", 40, seed=1, num_envs=10, max_episode_steps=200)
    after = ticks()
    used = {t: after[t] - before.get(t, 0) for t in after}
    main = str(threading.get_native_id())
    others = sum(v for t, v in used.items() if t != main)
    assert used[main] >= 20, used  # the rollout ran long enough to tell
    assert others < 0.2 * used[main], used
