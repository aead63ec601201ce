"""DPOConfig validation."""

import pytest

from jaxrl.config.base import ConfigError, from_dict
from jaxrl.config.dpo import DPOConfig
from jaxrl.losses import dpo as dpo_losses


def test_defaults_follow_trl():
    c = DPOConfig()
    assert (c.beta, c.loss_type, c.label_smoothing, c.simpo_gamma) == (0.1, "sigmoid", 0.0, 0.3)
    assert (c.normalize, c.per_device_train_batch_size, c.gradient_accumulation_steps) == (
        "pair",
        8,
        1,
    )
    assert (c.max_length, c.precompute_ref_log_probs, c.reference_cache_dir) == (1024, True, None)
    assert c.pairs_per_step == 8


@pytest.mark.parametrize("beta", [0.0, -0.1])
def test_beta_positive(beta):
    with pytest.raises(ConfigError, match=rf"beta={beta!r} is invalid: use a value > 0"):
        DPOConfig(beta=beta)


def test_unknown_loss_type_lists_choices():
    with pytest.raises(ConfigError, match=r"loss_type='kto' is invalid: use one of .*'simpo'"):
        DPOConfig(loss_type="kto")


@pytest.mark.parametrize("eps", [0.5, 0.7, -0.01])
def test_label_smoothing_range(eps):
    with pytest.raises(ConfigError, match=r"label_smoothing=.* \[0, 0.5\)"):
        DPOConfig(label_smoothing=eps)


@pytest.mark.parametrize("loss_type", ["ipo", "hinge"])
def test_label_smoothing_only_where_it_means_something(loss_type):
    with pytest.raises(ConfigError, match=rf"label_smoothing=0.1.*loss_type='{loss_type}'"):
        DPOConfig(loss_type=loss_type, label_smoothing=0.1)
    assert DPOConfig(loss_type=loss_type).label_smoothing == 0.0


@pytest.mark.parametrize(
    "loss_type", ["sigmoid", "dpo", "sigmoid_norm", "dpo_norm", "simpo", "wpo", "robust"]
)
def test_label_smoothing_accepted(loss_type):
    assert DPOConfig(loss_type=loss_type, label_smoothing=0.1).label_smoothing == 0.1


def test_normalize_choices():
    assert DPOConfig(normalize="token").normalize == "token"
    with pytest.raises(
        ConfigError, match=r"normalize='mean' is invalid: use one of 'pair', 'token'"
    ):
        DPOConfig(normalize="mean")


@pytest.mark.parametrize(
    "field",
    ["per_device_train_batch_size", "gradient_accumulation_steps", "world_size", "max_length"],
)
def test_positive_ints(field):
    with pytest.raises(ConfigError, match=rf"{field}=0 is invalid"):
        DPOConfig(**{field: 0})


def test_derived_properties():
    assert DPOConfig(loss_type="dpo").canonical_loss_type == "sigmoid"
    assert DPOConfig(loss_type="dpo_norm").canonical_loss_type == "sigmoid_norm"
    assert DPOConfig(loss_type="ipo").canonical_loss_type == "ipo"
    means = {t for t in dpo_losses.LOSS_TYPES if DPOConfig(loss_type=t).uses_mean_logps}
    assert means == {"sigmoid_norm", "dpo_norm", "ipo", "simpo", "orpo"}
    assert not DPOConfig(loss_type="simpo").needs_reference
    assert DPOConfig(loss_type="wpo").needs_reference
    assert (
        DPOConfig(
            per_device_train_batch_size=2, gradient_accumulation_steps=3, world_size=4
        ).pairs_per_step
        == 24
    )


def test_config_accepts_exactly_the_loss_module_types():
    """The config validates against the lists the loss code uses: every type it accepts (with
    or without label smoothing) passes the loss's own check, and both agree on mean log-probs."""
    for t in dpo_losses.LOSS_TYPES:
        assert DPOConfig(loss_type=t).uses_mean_logps == dpo_losses.uses_mean_logps(t)
        dpo_losses.check_loss_type(t)
        smooths = t in dpo_losses.SMOOTHING_LOSS_TYPES
        if smooths:
            assert DPOConfig(loss_type=t, label_smoothing=0.1).label_smoothing == 0.1
            dpo_losses.check_loss_type(t, 0.1)
        else:
            with pytest.raises(ConfigError, match="label_smoothing=0.1"):
                DPOConfig(loss_type=t, label_smoothing=0.1)
            with pytest.raises(ValueError, match="label_smoothing=0.1"):
                dpo_losses.check_loss_type(t, 0.1)
    choices = ", ".join(map(repr, dpo_losses.LOSS_TYPES))
    with pytest.raises(ConfigError, match=rf"loss_type='kto' is invalid: use one of {choices}"):
        DPOConfig(loss_type="kto")
    with pytest.raises(ValueError, match="loss_type='kto' is invalid"):
        dpo_losses.check_loss_type("kto")


def test_from_yaml_dict_and_unknown_key():
    c = from_dict(DPOConfig, {"beta": 5, "loss_type": "dpo_norm"})
    assert c.beta == 5.0 and isinstance(c.beta, float)
    with pytest.raises(ConfigError, match="did you mean 'label_smoothing'"):
        from_dict(DPOConfig, {"label_smoothin": 0.1})
