"""The options a service run and an in-process run share: declared once, checked the same way."""

import dataclasses

import pytest

from fedrl.algos import BCConfig, DRPOConfig
from fedrl.federation.options import FederationOptions
from fedrl.federation.runconfig import ConfigError, RunConfig, parse_run_config
from fedrl.federation.simulate import SimConfig

SHARED = [f.name for f in dataclasses.fields(FederationOptions)]

# (option, a value both paths must refuse, what the message says after the option's name)
BAD = [
    ("algo", "ppo", "'ppo' is not one of"),
    ("agents", 0, "must be >= 1, got 0"),
    ("rounds", 0, "must be >= 1, got 0"),
    ("local_steps", -1, "must be >= 0, got -1"),
    ("eval_episodes", -1, "must be >= 0, got -1"),
    ("seed", -3, "must be >= 0, got -3"),
    ("obs_norm", "zscore", "'zscore' is not one of pooled, local, none"),
    ("weighting", "size", "'size' is not one of uniform, samples"),
    ("aggregation", "mean", "'mean' is not one of fedavg, median, trimmed-mean"),
    ("trim_fraction", 0.5, "must be in [0, 0.5), got 0.5"),
    ("trim_fraction", -0.1, "must be in [0, 0.5), got -0.1"),
    ("federate", "critic", "'critic' is not one of policy, policy+critic"),
]


def test_both_configs_have_every_shared_option_with_its_type():
    for cls in (RunConfig, SimConfig):
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for base in dataclasses.fields(FederationOptions):
            assert base.name in fields, (cls.__name__, base.name)
            assert fields[base.name].type == base.type, (cls.__name__, base.name)


@pytest.mark.parametrize("name,value,says", BAD, ids=[f"{n}={v}" for n, v, _ in BAD])
def test_a_bad_shared_option_is_refused_on_both_paths_naming_it(name, value, says):
    with pytest.raises(ConfigError) as service:
        parse_run_config({name: value})
    assert str(service.value).startswith(f"{name}: ") and says in str(service.value)
    with pytest.raises(ValueError) as sim:
        SimConfig(**{name: value})
    flag = "--" + name.replace("_", "-")
    assert str(sim.value).startswith(f"{flag}: ") and says in str(sim.value)


def test_nan_trim_fraction_and_a_critic_for_bc_are_refused():
    with pytest.raises(ValueError, match=r"--trim-fraction: must be in \[0, 0.5\), got nan"):
        SimConfig(trim_fraction=float("nan"))
    with pytest.raises(ValueError, match="--federate: policy\\+critic needs a critic; fed-bc has none"):
        SimConfig(algo="fed-bc", federate="policy+critic")
    with pytest.raises(ConfigError, match="federate: policy\\+critic needs a critic; fed-bc has none"):
        parse_run_config({"algo": "fed-bc", "federate": "policy+critic"})


def test_each_path_keeps_its_own_algorithms_and_defaults():
    assert SimConfig(algo="cql").algo == "cql"  # the independent baseline runs in process only
    with pytest.raises(ValueError, match="algo: 'cql' is not one of drpo, fed-cql, fed-bc"):
        RunConfig(algo="cql")
    # simulate defaults to the paper's scale, a service run to a small one
    assert (SimConfig().agents, SimConfig().rounds, SimConfig().local_steps) == (10, 20, 1000)
    assert (RunConfig().agents, RunConfig().rounds, RunConfig().local_steps) == (2, 5, 50)


def test_a_run_config_built_in_code_is_checked_too():
    # not only JSON through parse_run_config: a RunConfig object cannot hold a bad run
    with pytest.raises(ValueError, match=r"min_agents: 3 exceeds agents \(2\)"):
        RunConfig(agents=2, min_agents=3)
    with pytest.raises(ValueError, match="round_timeout: must be > 0 seconds"):
        RunConfig(round_timeout=float("nan"))
    cfg = RunConfig(agents=3, aggregation="trimmed-mean", trim_fraction=0.34)
    assert parse_run_config(cfg.to_json()) == cfg


@pytest.mark.parametrize("field,value,says", [
    ("target_entropy", "abc", "drpo: target_entropy: expected float | None"),
    ("target_entropy", [1, 2], "drpo: target_entropy: expected float | None"),
    ("target_entropy", float("nan"), "drpo: target_entropy: expected float | None"),
    ("target_entropy", float("inf"), "drpo: target_entropy: expected float | None"),
    ("log_std_min", 3.0, "drpo: log_std_min \\(3.0\\) must be below log_std_max"),
    ("action_clip_eps", 0.0, "drpo: action_clip_eps must be in"),
    ("alpha_lr", float("nan"), "drpo.alpha_lr: expected a finite number"),
])
def test_every_algorithm_field_is_typed_finite_and_consistent(field, value, says):
    """A run config's algorithm settings are refused naming the field, whatever their type or
    value, before any run starts (NaN, strings and lists where a number belongs, crossed bounds)."""
    with pytest.raises(ConfigError, match=says):
        parse_run_config({"drpo": {field: value}})
    assert parse_run_config({"drpo": {"target_entropy": None}}).drpo.target_entropy is None
    assert parse_run_config({"drpo": {"target_entropy": -2}}).drpo.target_entropy == -2.0


def test_configs_built_in_code_are_typed_too():
    for bad in ({"batch_size": 2.5}, {"auto_alpha": 1}, {"hidden": (256, True)}, {"gamma": float("nan")}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            DRPOConfig(**bad)
    with pytest.raises(ValueError, match="log_std_min"):
        BCConfig(log_std_min=2.0, log_std_max=2.0)


@pytest.mark.parametrize("text,says", [
    ('{"drpo": ' + "[" * 50_000 + "]" * 50_000 + "}", "nests too deeply"),
    ('{"seed": ' + "9" * 5000 + "}", "not valid JSON"),
])
def test_absurd_json_is_a_specific_refusal(text, says):
    with pytest.raises(ConfigError, match=says):
        parse_run_config(text)
