"""GRPOConfig resolution and validation (docs/algorithms/grpo.md §1–2, §5; §10 examples 1–8
and 12)."""

import dataclasses
import re
import warnings

import jax.numpy as jnp
import pytest

from jaxrl.config import load_run_config
from jaxrl.config.base import ConfigError, from_dict, to_dict
from jaxrl.config.grpo import GRPOConfig
from jaxrl.losses import policy
from jaxrl.losses.loss_types import GRPO_LOSS_TYPES, IMPORTANCE_SAMPLING_LEVELS


def cfg(**kw):
    return GRPOConfig(**kw)


# ----------------------------------------------------------------- worked examples


def test_example_1_buffer_spans_two_optimizer_steps():
    """b=8, P=1, g=2, S=4 (G=8 by default): B_gen = 8·1·4 = 32 rows = 4 prompts × 8, and old
    log-probs are computed because 2 % (4·μ) ≠ 0 for μ = 1 and μ = 2."""
    c = cfg(per_device_train_batch_size=8, gradient_accumulation_steps=2, steps_per_generation=4)
    assert (c.generation.size, c.generation.steps) == (32, 4)
    assert c.prompts_per_generation == 4
    assert c.needs_old_logprobs is True
    c2 = c.replace(num_iterations=2)
    assert (c2.generation.size, c2.generation.steps, c2.num_iterations) == (32, 4, 2)
    assert c2.needs_old_logprobs is True
    # the same buffer given by its size resolves S = 32 / (8·1) = 4
    by_size = cfg(per_device_train_batch_size=8, gradient_accumulation_steps=2,
                  generation_batch_size=32)  # fmt: skip
    assert (by_size.generation.steps, by_size.needs_old_logprobs) == (4, True)
    # without S the buffer is one optimizer window: S = g = 2, B_gen = 16, on-policy
    plain = cfg(per_device_train_batch_size=8, gradient_accumulation_steps=2)
    assert (plain.generation.steps, plain.generation.size) == (2, 16)
    assert plain.needs_old_logprobs is False


def test_example_2_defaults_from_accumulation():
    c = cfg(per_device_train_batch_size=8, world_size=2, gradient_accumulation_steps=4)
    assert (c.generation.steps, c.generation.size) == (4, 64)
    assert not c.needs_old_logprobs


def test_example_3_generation_batch_given():
    c = cfg(
        generation_batch_size=48, per_device_train_batch_size=8, world_size=2, num_generations=8
    )
    assert c.generation.steps == 3 and c.generation.size == 48
    assert c.prompts_per_generation == 6
    with pytest.raises(ConfigError, match=r"generation_batch_size=48.*num_generations=5"):
        cfg(
            generation_batch_size=48, per_device_train_batch_size=8, world_size=2, num_generations=5
        )


def test_example_4_not_divisible_by_global_batch():
    with pytest.raises(
        ConfigError,
        match=r"generation_batch_size=40.*divisible by the global "
        r"batch size.*16",
    ):
        cfg(generation_batch_size=40, per_device_train_batch_size=8, world_size=2)


@pytest.mark.parametrize("b_gen,steps", [(32, 4), (64, 4), (8, 1), (7, 3)])
def test_example_5_both_set_is_an_error_whatever_the_values(b_gen, steps):
    with pytest.raises(ConfigError, match="can not be both configured at the same time"):
        cfg(per_device_train_batch_size=8, generation_batch_size=b_gen, steps_per_generation=steps)


def test_example_6_group_size_and_auto_find_batch_size():
    with pytest.raises(ConfigError, match="at least 2 generations"):
        cfg(num_generations=1)
    with pytest.raises(ConfigError, match=r"auto_find_batch_size=True.*prompt groups"):
        cfg(auto_find_batch_size=True)


def test_example_7_trl_eval_batch_fields_are_removed():
    """TRL's eval batch (example 7) has no counterpart: jaxrl evaluates every
    logging.eval_every steps with logging.eval_samples samples per held-out prompt."""
    for field, value in [("do_eval", True), ("eval_strategy", "steps"),
                         ("per_device_eval_batch_size", 3)]:  # fmt: skip
        with pytest.raises(ConfigError, match=rf"^{field}={value!r} is invalid: removed: .*"
                           "logging.eval_every"):  # fmt: skip
            cfg(**{field: value})
    with pytest.raises(ConfigError, match=r"num_generations_eval=3 .*logging.eval_samples"):
        cfg(num_generations_eval=3)


def test_example_8_group_larger_than_micro_batch():
    c = cfg(per_device_train_batch_size=3, num_generations=6, gradient_accumulation_steps=2)
    assert c.generation.size == 6 and c.generation.steps == 2


# (g, S, μ) → computed?   docs/algorithms/grpo.md §5
OLD_LOGPROB_TABLE = [
    (2, 2, 1, False),
    (2, 4, 1, True),
    (4, 2, 1, False),
    (2, 2, 2, True),
    (4, 2, 2, False),
    (3, 2, 1, True),
]


@pytest.mark.parametrize("g,s,mu,computed", OLD_LOGPROB_TABLE)
def test_example_12_old_logprob_table(g, s, mu, computed):
    c = cfg(
        per_device_train_batch_size=2,
        num_generations=2,
        gradient_accumulation_steps=g,
        steps_per_generation=s,
        num_iterations=mu,
    )
    assert c.needs_old_logprobs is computed


# ----------------------------------------------------------------- resolution rules


def test_scale_rewards_booleans_resolve():
    """The config keeps the value given; the advantages code resolves TRL's booleans."""
    from jaxrl.losses.advantages import resolve_scale_rewards

    assert resolve_scale_rewards(cfg(scale_rewards=True).scale_rewards) == "group"
    assert resolve_scale_rewards(cfg(scale_rewards=False).scale_rewards) == "none"
    assert cfg(scale_rewards="batch").scale_rewards == "batch"
    with pytest.raises(ConfigError, match="scale_rewards='std' is invalid"):
        cfg(scale_rewards="std")


def test_only_steps_per_generation_given():
    c = cfg(per_device_train_batch_size=4, world_size=2, steps_per_generation=3)
    assert c.generation.size == 24


def test_validation_order_follows_spec():
    # Rule 2 (auto_find_batch_size) fires before rule 3 (both set) and rule 6 (G ≥ 2).
    with pytest.raises(ConfigError, match="auto_find_batch_size"):
        cfg(
            auto_find_batch_size=True,
            generation_batch_size=8,
            steps_per_generation=1,
            num_generations=1,
        )
    # Rule 3 before rule 6.
    with pytest.raises(ConfigError, match="both configured"):
        cfg(generation_batch_size=8, steps_per_generation=1, num_generations=1)
    # Rule 5 (B_gen % G) before rule 6 (G ≥ 2) and rule 7 (ranges).
    with pytest.raises(ConfigError, match="divisible by num_generations=3"):
        cfg(per_device_train_batch_size=8, num_generations=3, temperature=0.0)


@pytest.mark.parametrize(
    "field,value",
    [
        ("loss_type", "sapo"),
        ("loss_type", "sapo"),
        ("importance_sampling_level", "seq"),
        ("scale_rewards", "std"),
        ("multi_objective_aggregation", "mean"),
    ],
)
def test_unknown_enumerations_name_supported_values(field, value):
    with pytest.raises(ConfigError, match=rf"{field}='{value}' is invalid: use one of"):
        cfg(**{field: value})


@pytest.mark.parametrize(
    "field,value",
    [
        ("per_device_train_batch_size", 0),
        ("gradient_accumulation_steps", 0),
        ("world_size", 0),
        ("num_iterations", 0),
        ("max_completion_length", 0),
        ("temperature", 0.0),
        ("epsilon", -0.1),
        ("epsilon_high", -0.1),
        ("beta", -1.0),
        ("top_entropy_quantile", 0.0),
        ("top_entropy_quantile", 1.5),
        ("delta", 1.0),
        ("generation_batch_size", 0),
        ("steps_per_generation", 0),
    ],
)
def test_ranges(field, value):
    with pytest.raises(ConfigError, match=rf"{field}={value!r} is invalid"):
        cfg(**{field: value})


def test_valid_range_edges_accepted():
    c = cfg(top_entropy_quantile=1.0, delta=1.5, epsilon=0.0, beta=0.0)
    assert c.delta == 1.5
    assert cfg(top_entropy_quantile=0.2).top_entropy_quantile == 0.2


@pytest.mark.parametrize("loss_type", ["bnpo", "dr_grpo", "dapo"])
def test_sequence_level_with_token_summing_loss_warns(loss_type):
    with pytest.warns(UserWarning, match="weights sequences by their length"):
        cfg(importance_sampling_level="sequence", loss_type=loss_type)


@pytest.mark.parametrize("loss_type", ["grpo", "seq_mean_token_sum"])
def test_sequence_level_per_sequence_losses_do_not_warn(loss_type):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg(importance_sampling_level="sequence", loss_type=loss_type)
        cfg(importance_sampling_level="token", loss_type="dapo")


# ----------------------------------------------------------------- plumbing


def test_defaults_are_trl_defaults():
    c = cfg()
    assert (c.per_device_train_batch_size, c.gradient_accumulation_steps, c.num_generations) == (
        8,
        1,
        8,
    )
    assert (c.loss_type, c.importance_sampling_level, c.scale_rewards) == ("dapo", "token", "group")
    assert (c.epsilon, c.epsilon_high, c.delta, c.beta) == (0.2, None, None, 0.0)
    assert (c.max_completion_length, c.temperature, c.top_entropy_quantile) == (512, 1.0, 1.0)
    assert (c.generation.size, c.generation.steps) == (8, 1)


def test_frozen_and_replace_re_resolves():
    """B_gen and S are plain fields holding the resolved values after construction (the public
    API's attributes, as TRL's); the config remembers what was given, so ``replace`` resolves
    them again from the new fields and ``to_dict`` writes what was given. ``dataclasses.replace``
    would pass both resolved values back: TRL's rule refuses that, naming ``replace``."""
    c = cfg(per_device_train_batch_size=4, gradient_accumulation_steps=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.num_generations = 4  # type: ignore[misc]
    assert (c.generation_batch_size, c.steps_per_generation) == (8, 2)  # resolved: S = g
    assert type(c.generation_batch_size) is int and type(c.steps_per_generation) is int
    assert "generation_batch_size" in {f.name for f in dataclasses.fields(c)}
    assert not any(hasattr(type(c), n) and hasattr(getattr(type(c), n), "__get__")
                   for n in ("generation_batch_size", "steps_per_generation"))  # fmt: skip
    given = (c.given("generation_batch_size"), c.given("steps_per_generation"))
    assert given == (None, None)
    c2 = c.replace(per_device_train_batch_size=8)
    assert c2.generation.size == c2.generation_batch_size == 16  # derived again, not carried
    by_size = cfg(per_device_train_batch_size=4, generation_batch_size=16)
    assert by_size.replace(per_device_train_batch_size=8).steps_per_generation == 2  # B_gen kept
    with pytest.raises(ConfigError, match=r"can not be both configured.*use its replace\(\)"):
        dataclasses.replace(c, per_device_train_batch_size=8)
    assert to_dict(c)["generation_batch_size"] is None
    assert from_dict(GRPOConfig, to_dict(c)) == c


def test_from_yaml_dict():
    c = from_dict(
        GRPOConfig,
        {
            "scale_rewards": False,
            "generation_batch_size": 16,
            "num_generations": 4,
            "reward_weights": [1, 0.5],
        },
    )
    assert c.scale_rewards is False and c.generation.steps == 2  # as given: False = "none"
    assert c.reward_weights == (1.0, 0.5)


def test_config_accepts_exactly_the_policy_loss_types():
    """The config validates against the list the loss code uses, so a type it accepts runs."""
    zeros_BT, seg_BT, adv_BS = jnp.zeros((1, 3)), jnp.ones((1, 3), jnp.int32), jnp.zeros((1, 2))
    for loss_type in GRPO_LOSS_TYPES:
        kw = {"epsilon_high": 5.0} if loss_type == "cispo" else {}  # CISPO's weight cap
        assert GRPOConfig(loss_type=loss_type, **kw).loss_type == loss_type
        policy.policy_loss_terms(
            zeros_BT, None, None, adv_BS, zeros_BT, seg_BT, loss_type=loss_type, **kw
        )
    choices = ", ".join(map(repr, GRPO_LOSS_TYPES))
    with pytest.raises(ConfigError, match=rf"loss_type='sapo' is invalid: use one of {choices}"):
        GRPOConfig(loss_type="sapo")
    with pytest.raises(ValueError, match="loss_type='sapo' is invalid"):
        policy.policy_loss_terms(zeros_BT, None, None, adv_BS, zeros_BT, seg_BT, loss_type="sapo")
    for level in IMPORTANCE_SAMPLING_LEVELS:
        c = GRPOConfig(loss_type="grpo", importance_sampling_level=level)
        assert c.importance_sampling_level == level


@pytest.mark.parametrize(
    "key, fix",
    [
        ("learning_rate", "set optimizer.learning_rate (the SFT warm start's own is warm_start."),
        ("warmup_steps", "set optimizer.warmup_steps"),
        ("lr_scheduler_type", "set optimizer.decay"),
    ],
)
def test_the_grpo_stage_schedule_keys_point_to_the_optimizer(key, fix):
    """The learning-rate schedule has one home, ``optimizer``: grpo's keys for it are errors
    naming it, from Python and from a config file."""
    with pytest.raises(ConfigError, match=rf"^{key}=.* is invalid: moved: .*{re.escape(fix)}"):
        GRPOConfig(**{key: 1})
    from jaxrl.config import load_run_config

    with pytest.raises(ConfigError, match=rf"^grpo\.{key}=.*{re.escape(fix)}"):
        load_run_config("configs/grpo_tiny.yaml", [f"grpo.{key}=1"])


def test_an_unknown_world_size_defers_what_needs_it():
    """world_size=None (a run's section before its mesh is known): S = g and every check that
    needs no P hold at construction; B_gen and the checks on it wait for for_world_size(P)."""
    c = cfg(world_size=None, per_device_train_batch_size=1, num_generations=8)
    assert (c.generation.size, c.generation.steps) == (None, 1)
    resolved = c.for_world_size(8)
    assert (resolved.world_size, resolved.generation.size) == (8, 8)
    assert resolved.for_world_size(8) is resolved
    with pytest.raises(ConfigError, match=r"generation_batch_size=2 .*num_generations=8"):
        c.for_world_size(2)
    given = cfg(world_size=None, generation_batch_size=40, per_device_train_batch_size=8)
    assert given.generation.steps is None
    with pytest.raises(ConfigError, match=r"generation_batch_size=40.*global batch size.*16"):
        given.for_world_size(2)
    with pytest.raises(ConfigError, match="both configured"):  # needs no P: fails at once
        cfg(world_size=None, generation_batch_size=8, steps_per_generation=1)


def test_use_bias_correction_kl_default_and_kl_in_reward_conflict():
    """jaxrl keeps plain k3 by default (docs/algorithms/grpo.md §7); the option weights the
    loss's KL term, so it cannot go with the KL in the reward."""
    assert GRPOConfig().use_bias_correction_kl is False
    assert cfg(beta=0.04, use_bias_correction_kl=True).use_bias_correction_kl is True
    with pytest.raises(ConfigError, match="use_bias_correction_kl=True.*kl_in_reward"):
        cfg(beta=0.04, advantage_estimator="reinforce_pp", kl_in_reward=True,
            use_bias_correction_kl=True)  # fmt: skip


def test_stop_on_zero_spread_needs_a_step_count():
    with pytest.raises(ConfigError, match="grpo.stop_on_zero_spread"):
        load_run_config("configs/grpo_tiny.yaml", ["grpo.stop_on_zero_spread=true",
                                                   "grpo.zero_spread_steps=0"])  # fmt: skip
    with pytest.raises(ConfigError, match="grpo.zero_spread_steps"):
        load_run_config("configs/grpo_tiny.yaml", ["grpo.zero_spread_steps=-1"])
