"""The learners' Adam: torch.optim.Adam's arithmetic, without importing torch._dynamo."""

import subprocess
import sys

import pytest
import torch

from fedrl.algos.base import Adam


def _pair(seed: int = 0):
    """Parameters small beside the steps (1e-5 vs lr 3e-4), so that a step rounded differently
    shows in the parameters instead of vanishing below their last bit."""
    torch.manual_seed(seed)
    ps = [(torch.randn(*shape) * 1e-5).requires_grad_(True) for shape in ((5, 3), (3,), (2, 2))]
    qs = [p.detach().clone().requires_grad_(True) for p in ps]
    return ps, qs


def _set_grads(ps, qs, it):
    for i, (p, q) in enumerate(zip(ps, qs)):
        if i == 2 and it % 3 == 0:  # a parameter without a gradient this step is left alone
            p.grad = q.grad = None
        else:
            g = torch.randn_like(p) * 10.0 ** (it % 5 - 2)
            p.grad, q.grad = g.clone(), g.clone()


def _steps(ours, theirs, iterations, clear_at=None):
    """Step both optimizers on the same gradients; ``clear_at``: DRPO's reset_actor_optimizer
    (moments and step counts start over) at that iteration."""
    for it in iterations:
        _set_grads(ours.params, theirs.param_groups[0]["params"], it)
        ours.step()
        theirs.step()
        if it == clear_at:
            ours.state.clear()
            theirs.state.clear()


def test_adam_is_bit_identical_to_torch_optim_adam_foreach():
    ps, qs = _pair()
    ours, theirs = Adam(ps, 3e-4), torch.optim.Adam(qs, lr=3e-4, foreach=True)
    _steps(ours, theirs, range(60), clear_at=25)
    for p, q in zip(ps, qs):
        assert torch.equal(p, q)
    mine, ref = ours.state_dict()["state"], theirs.state_dict()["state"]
    assert mine.keys() == ref.keys() == {0, 1, 2}
    for i in ref:
        for k in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(mine[i][k], ref[i][k]), (i, k)


def test_adam_resumes_from_a_state_dict_including_torch_optims():
    ps, qs = _pair()
    a, ref = Adam(ps, 1e-3), torch.optim.Adam(qs, lr=1e-3, foreach=True)
    _steps(a, ref, range(10))
    resumed = Adam([p.detach().clone().requires_grad_(True) for p in ps], 1e-3)
    resumed.load_state_dict(ref.state_dict())  # the layout behaviour-policy checkpoints store
    _steps(resumed, ref, range(10, 20))
    assert all(torch.equal(p, q) for p, q in zip(resumed.params, qs))
    with pytest.raises(ValueError, match="shape"):
        Adam([torch.zeros(4, requires_grad=True)], 1e-3).load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="empty"):
        Adam([], 1e-3)


def test_a_learner_step_does_not_import_the_compiler():
    """torch.optim's optimizers import torch._dynamo when first built (~1.8 s of CPU per agent
    process); a DRPO learner built and stepped here must not."""
    code = ("import sys, numpy as np, torch\n"
            "from fedrl.algos import DRPOConfig\n"
            "from fedrl.federation.round import build_learner\n"
            "from fedrl.algos.base import Batch\n"
            "L = build_learner(DRPOConfig(hidden=(8, 8), batch_size=4), 3, 2, torch.device('cpu'), 0, 0)\n"
            "L.begin_round(L.shared_state())\n"
            "b = Batch(torch.zeros(4, 3), torch.zeros(4, 2), torch.zeros(4), torch.zeros(4, 3), torch.zeros(4), torch.zeros(4))\n"
            "L.update(b)\n"
            "print('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
