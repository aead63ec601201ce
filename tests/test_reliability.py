"""Finite or stop: non-finite numbers never enter a config, never train on silently, and never
reach a file as invalid JSON."""

from __future__ import annotations

import gc
import json

import jax
import jax.numpy as jnp
import pytest

from jaxrl.config import ConfigError, load_run_config
from jaxrl.train.run_io.metrics import json_safe
from jaxrl.trainers.session import NonFiniteError
from jaxrl.trainers.sft import SFTTrainer

SMALL = [
    "model.init={hidden_size: 32, num_hidden_layers: 1, num_attention_heads: 2, "
    "num_key_value_heads: 1, intermediate_size: 64}",
    "sft.per_device_train_batch_size=16",
    "task.eval_size=8",
    "logging.progress=false",
]


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("optimizer.learning_rate=.inf", "optimizer.learning_rate"),
        ("optimizer.learning_rate=.nan", "optimizer.learning_rate"),
        ("optimizer.max_grad_norm=-.inf", "optimizer.max_grad_norm"),
        ("optimizer.learning_rate=inf", "optimizer.learning_rate"),  # the string form
        ("optimizer.eps=0", "optimizer.eps"),
        ("optimizer.eps=-1e-8", "optimizer.eps"),
        ("optimizer.max_nonfinite_steps=0", "optimizer.max_nonfinite_steps"),
        ("warm_start.target=.nan", "warm_start.target"),
    ],
)
def test_config_rejects_non_finite_numbers_and_bad_eps(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_run_config("configs/sft_tiny.yaml", [override])


def test_non_finite_steps_are_counted_then_stop_the_run(tmp_path):
    cfg = load_run_config(
        "configs/sft_tiny.yaml",
        [*SMALL, f"output_dir={tmp_path}", "mesh.data=1", "max_steps=10"],
    )
    trainer = SFTTrainer(cfg)
    state = trainer.session.state
    poisoned = jax.tree.map(lambda p: p * jnp.nan, state.params)  # e.g. NaN weights
    trainer.session.state = state.replace(params=poisoned)
    with pytest.raises(NonFiniteError, match=r"steps 1-3 .*max_nonfinite_steps=3"):
        trainer.run()
    trainer.session.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line, parse_constant=_reject) for line in lines]  # strict JSON
    assert [r["nonfinite_steps"] for r in rows] == [1, 2, 3]
    assert all(r["update_skipped"] and r["loss"] is None for r in rows)
    assert trainer.session.checkpointer.latest_step() is None  # nothing non-finite was saved


def test_summaries_and_rows_are_strict_json():
    value = {"loss": float("nan"), "x": [1.0, float("inf")], "y": {"z": -float("inf")}}
    text = json.dumps(json_safe(value), allow_nan=False)
    assert json.loads(text) == {"loss": None, "x": [1.0, None], "y": {"z": None}}


def _reject(name: str):
    raise ValueError(f"not strict JSON: {name}")


def test_an_infinite_reward_names_the_function_and_the_row():
    import numpy as np

    from jaxrl.rollout.rewards.compute import score_completions

    def shaped(prompts, completions, **_):
        return [1.0, float("-inf"), None]

    with pytest.raises(ValueError, match=r"'shaped' returned -inf for row 1: .*finite"):
        score_completions([shaped], ["a", "b", "c"], ["x", "y", "z"])
    ok = score_completions(
        [lambda prompts, completions, **_: [1.0, None, float("nan")]], *[["a"] * 3] * 2
    )
    assert ok[0, 0] == 1.0 and np.isnan(ok[1:, 0]).all()  # None / NaN: unscored, allowed


def test_nan_weights_in_a_model_directory_are_named(tmp_path):
    import numpy as np
    from safetensors.numpy import load_file, save_file

    from jaxrl.models.hf import from_pretrained, save_pretrained
    from jaxrl.models.model_config import ModelConfig
    from jaxrl.models.transformer import Transformer

    model = Transformer(ModelConfig.tiny(16, hidden_size=16, intermediate_size=32), rngs=_rngs())
    save_pretrained(model, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].copy()
    tensors[name].flat[3] = np.nan
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=rf"tensor {name} holds 1 non-finite values"):
        from_pretrained(tmp_path)


# A failed orbax restore leaves callbacks for its closed event loop; collecting them here keeps
# the "Event loop is closed" noise inside these tests instead of a later one.
_ORBAX_NOISE = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@_ORBAX_NOISE
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, capsys):
    sets = [*SMALL, f"output_dir={tmp_path}", "mesh.data=1", "checkpoint.every=1"]
    SFTTrainer(load_run_config("configs/sft_tiny.yaml", [*sets, "max_steps=2"])).run()
    files = [p for p in (tmp_path / "checkpoints" / "2").rglob("*") if p.is_file()]
    for f in files:  # truncate every file of the newest checkpoint
        if f.stat().st_size > 16:
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    trainer = SFTTrainer(load_run_config("configs/sft_tiny.yaml", [*sets, "max_steps=3"]))
    host = trainer.session.resume({})
    assert host is not None and trainer.session.step == 1  # step 2 was damaged: step 1 used
    trainer.session.close()
    gc.collect()
    err = " ".join(capsys.readouterr().err.split())  # rich wraps long lines
    assert "checkpoint step 2: unreadable" in err and "resumed from step 1" in err


def test_a_resume_onto_another_model_is_refused_before_any_restore(tmp_path, capsys):
    """The previous run's config.json names the change; orbax never reads a checkpoint (its
    shape errors used to come first, one "unreadable ... trying an older one" per step)."""
    from jaxrl.cli import main

    sets = [*SMALL, f"output_dir={tmp_path}", "mesh.data=1", "checkpoint.every=1"]
    args = lambda items: [a for s in items for a in ("--set", s)]
    assert main(["train", "configs/sft_tiny.yaml", *args([*sets, "max_steps=2"])]) == 0
    capsys.readouterr()
    bigger = SMALL[0].replace("intermediate_size: 64", "intermediate_size: 96")
    for _ in range(2):  # a refused run leaves the previous run's config.json for the next try
        code = main(["train", "configs/sft_tiny.yaml", *args([*sets, bigger, "max_steps=3"])])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2, err
        assert len(err) == 1, err
        assert "model.init.intermediate_size: 64 -> 96" in err[0], err
        assert "checkpoint.resume=false" in err[0] and "unreadable" not in err[0], err
    assert json.loads((tmp_path / "config.json").read_text())["max_steps"] == 2


def _rngs():
    from flax import nnx

    return nnx.Rngs(0)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "is empty"),
        ("seed: 1\nmax_steps: 3\nseed: 2\n", r"key 'seed' appears twice .*lines 1 and 3"),
        ("optimizer:\n  eps: 1e-8\n  eps: 1e-6\n", "key 'eps' appears twice"),
    ],
)
def test_empty_and_duplicate_key_configs_are_errors(tmp_path, text, message):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_run_config(path)


def test_an_empty_output_dir_is_an_error():
    with pytest.raises(ConfigError, match="output_dir=None"):
        load_run_config("configs/sft_tiny.yaml", ["output_dir="])
    with pytest.raises(ConfigError, match="output_dir"):
        load_run_config("configs/sft_tiny.yaml", ["output_dir=' '"])


def test_micro_batch_buckets_set_the_slot_count(tmp_path):
    cfg = load_run_config(
        "configs/sft_tiny.yaml",
        [*SMALL, f"output_dir={tmp_path}", "mesh.data=1", "schedule.max_tokens=64",
         "schedule.micro_batch_buckets=[3, 12]"],
    )  # fmt: skip
    trainer = SFTTrainer(cfg)
    batch = trainer.next_batch()
    trainer.session.close()
    assert (
        batch.arrays["tokens"].shape[1] in (3, 12)
        and batch.rounds <= batch.arrays["tokens"].shape[1]
    )


def test_max_steps_at_the_checkpoint_says_there_is_nothing_to_train(tmp_path, capsys):
    sets = [*SMALL, f"output_dir={tmp_path}", "mesh.data=1"]
    SFTTrainer(load_run_config("configs/sft_tiny.yaml", [*sets, "max_steps=2"])).run()
    summary = SFTTrainer(load_run_config("configs/sft_tiny.yaml", [*sets, "max_steps=1"])).run()
    assert summary["steps"] == 2  # nothing trained, nothing pretended
    err = " ".join(capsys.readouterr().err.split())  # rich wraps long lines
    assert "nothing left to train; raise max_steps" in err


def test_a_model_vocabulary_smaller_than_the_tokenizer_is_an_error(tmp_path):
    from jaxrl.models.hf import save_pretrained
    from jaxrl.models.model_config import ModelConfig
    from jaxrl.models.transformer import Transformer

    small = Transformer(ModelConfig.tiny(10, hidden_size=16, intermediate_size=32), rngs=_rngs())
    save_pretrained(small, tmp_path / "model")
    cfg = load_run_config(
        "configs/sft_tiny.yaml",
        [
            *SMALL,
            f"output_dir={tmp_path / 'run'}",
            "mesh.data=1",
            f"model.path={tmp_path / 'model'}",
        ],
    )
    with pytest.raises(ConfigError, match="tokenizer has 19 tokens .* vocabulary of 10"):
        SFTTrainer(cfg)


@pytest.mark.parametrize("bad", [10**6, -5])
def test_train_on_rollouts_rejects_token_ids_outside_the_vocabulary(tmp_path, bad):
    from jaxrl.trainers.grpo import GRPOTrainer

    cfg = load_run_config(
        "configs/grpo_tiny.yaml",
        [*SMALL, f"output_dir={tmp_path}", "mesh.data=1", "warm_start.steps=0",
         "grpo.num_generations=2", "grpo.per_device_train_batch_size=2",
         "logging.eval_samples=0", "task.eval_size=2"],
    )  # fmt: skip
    trainer = GRPOTrainer(cfg)
    with pytest.raises(ValueError, match=r"completion_tokens\[1\] holds ids outside \[0, 19\)"):
        trainer.train_on_rollouts(
            [[1, 2], [1, 2]], [[3, 4], [3, bad]], [[0.0, 0.0]] * 2, [1.0, 0.0]
        )
    trainer.session.close()


@pytest.mark.parametrize("value", [float("inf"), -float("inf"), -1e30, 5.0])
def test_a_reference_cache_of_impossible_log_probs_is_rejected(tmp_path, value):
    import numpy as np
    from test_ref_cache import IDENTITY as identity  # max_length 16

    from jaxrl.train.ref_cache import ReferenceCache, ReferenceCacheError

    cache = ReferenceCache(np.full(4, -3.0), np.full(4, -4.0), identity)
    path = cache.save(tmp_path)
    assert ReferenceCache.load(path, identity).num_rows == 4
    cache.chosen[2] = value  # as a damaged or hand-edited file would hold
    path = cache.save(tmp_path)
    with pytest.raises(ReferenceCacheError, match="not log-probabilities"):
        ReferenceCache.load(path, identity)
