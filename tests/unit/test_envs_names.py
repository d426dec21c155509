"""Environment names as files and datasets made elsewhere spell them."""

import pytest

from fedrl.envs import env_info


@pytest.mark.parametrize("name,key", [
    ("Walker2d-v5", "walker2d"), ("Walker2d-v4", "walker2d"), ("walker2d-medium-v2", "walker2d"),
    ("mujoco/walker2d/medium-v0", "walker2d"), ("mujoco/ant/expert-v0", "ant"), ("Hopper-v4", "hopper"),
    ("halfcheetah-medium-replay-v2", "halfcheetah"),
])
def test_env_names_from_gymnasium_d4rl_and_minari(name, key):
    assert env_info(name).key == key


def test_an_unknown_name_lists_the_choices():
    with pytest.raises(ValueError, match="known: Hopper-v5"):
        env_info("mujoco/pendulum/medium-v0")


def test_data_info_scores_a_walker2d_file_made_elsewhere(tmp_path, capsys):
    """A D4RL-format Walker2d file whose metadata names its env the Minari way gets its score."""
    import json

    import numpy as np

    from fedrl.cli import main
    from fedrl.data.d4rl import RawDataset, write_d4rl
    from fedrl.envs.scores import normalized_score

    n, rng = 40, np.random.default_rng(0)
    term = np.zeros(n, bool)
    term[19] = term[39] = True
    raw = RawDataset(observations=rng.normal(size=(n, 17)).astype(np.float32),
                     actions=rng.uniform(-1, 1, (n, 6)).astype(np.float32),
                     rewards=np.full(n, 50.0, np.float32), terminals=term, timeouts=np.zeros(n, bool))
    path = write_d4rl(tmp_path / "elsewhere.hdf5", raw, {"env_id": "mujoco/walker2d/medium-v0"})
    assert main(["data", "info", str(path)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["env_id"] == "Walker2d-v5" and info["episodes"] == 2
    assert info["score_mean"] == pytest.approx(normalized_score("walker2d", 1000.0))


def test_cli_output_into_a_closed_pipe_ends_quietly(random_dataset):
    """``fedrl data info FILE | head -1``: when the reader has gone, the command stops without a
    traceback, with the status of a process that wrote into a closed pipe (128 + SIGPIPE)."""
    import os
    import subprocess
    import sys

    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before anything is written
    try:
        proc = subprocess.run([sys.executable, "-c", "import sys; from fedrl.cli import main; sys.exit(main())",
                               "data", "info", str(random_dataset)],
                              stdout=write_end, stderr=subprocess.PIPE, timeout=120, check=False)
    finally:
        os.close(write_end)
    err = proc.stderr.decode()
    assert proc.returncode == 141, err
    assert "Traceback" not in err and "BrokenPipe" not in err and "Exception ignored" not in err
