"""``grpo.shared_prompt_packing`` end to end on the tiny GRPO model: the same steps as the
unshared layout (loss, gradient norm, metrics, document and loss-token counts, parameters) from
the same weights, on dp=1 with several micro-batches and on dp=8, with the reference and old
log-prob scorers and the entropy pre-pass; fewer trained tokens. PPO refuses the option."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from test_grpo_e2e import CONFIG, TINY

from jaxrl.config import ConfigError, load_run_config
from jaxrl.data.batching.shared_prompt import PARENT_FIELD
from jaxrl.trainers.grpo import GRPOTrainer

SAME = (
    "loss", "grad_norm", "entropy", "reward", "sampler/logprob_mismatch", "clip_ratio/low_mean",
    "clip_ratio/high_mean", "clip_ratio/region_mean",
)  # fmt: skip
COUNTS = ("num_documents", "num_loss_tokens", "documents_seen")


def _pair(tmp_path, *options: str, shared_tokens: int, plain_tokens: int):
    """Two trainers from the same seed and weights: unshared, and shared."""

    def make(name: str, *extra: str) -> GRPOTrainer:
        cfg = load_run_config(
            CONFIG, [*TINY, f"output_dir={tmp_path / name}", *options, *extra]
        )  # fmt: skip
        return GRPOTrainer(cfg)

    plain = make("plain", f"schedule.max_tokens={plain_tokens}")
    shared = make(
        "shared", f"schedule.max_tokens={shared_tokens}", "grpo.shared_prompt_packing=true"
    )
    return plain, shared


def _check(plain: GRPOTrainer, shared: GRPOTrainer, steps: int, *, rtol: float) -> list:
    rows = []
    for _ in range(steps):
        a, b = plain.step(), shared.step()
        rows.append((a, b))
        for key in SAME + tuple(k for k in ("kl",) if k in a):
            np.testing.assert_allclose(b[key], a[key], rtol=rtol, atol=1e-7, err_msg=key)
        for key in COUNTS:
            assert b[key] == a[key], key
        assert b["batch/tokens_unshared"] == a["num_tokens"]
        assert b["batch/trained_tokens"] == b["num_tokens"] < a["num_tokens"]  # shared prompts
        assert "batch/trained_tokens" not in a
    leaves = [jax.tree.leaves(t.session.state.params) for t in (plain, shared)]
    for x, y in zip(*leaves, strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        assert np.abs(y - x).max() <= rtol * max(np.abs(x).max(), 1.0)
    return rows


def _scored_rows(trainer: GRPOTrainer) -> list:
    """Record (shared layout?, tokens) of each call of the generator's scorer (old / reference
    log-probs)."""
    seen, score = [], trainer.generator.scorer.score

    def spy(params, rows, **kw):
        seen.append((PARENT_FIELD in rows, int((np.asarray(rows["segment_ids"]) > 0).sum())))
        return score(params, rows, **kw)

    trainer.generator.scorer.score = spy
    return seen


@pytest.mark.slow
def test_shared_equals_unshared_on_one_rank_with_micro_batches_and_both_scorers(tmp_path):
    """dp=1: the shared rows cut into several micro-batches (budget 16: groups are split, each
    part with its own prompt copy); β > 0 (reference log-probs) and μ = 2 (old log-probs), GSPO's
    sequence ratio. The old and reference log-probs are scored on shared rows too."""
    options = (
        "mesh.data=1", "grpo.beta=0.1", "grpo.num_iterations=2", "grpo.loss_type=grpo",
        "grpo.importance_sampling_level=sequence", "optimizer.learning_rate=3.0e-3",
    )  # fmt: skip
    plain, shared = _pair(tmp_path, *options, shared_tokens=16, plain_tokens=64)
    assert shared.computes_old_logprobs
    scored = [_scored_rows(t) for t in (plain, shared)]
    rows = _check(plain, shared, 2, rtol=1e-5)
    assert rows[0][1]["num_micro_batches"] > 1
    assert scored[0] and not any(on for on, _ in scored[0])  # old + ref, per generation
    assert len(scored[1]) == len(scored[0]) and all(on for on, _ in scored[1])
    assert sum(n for _, n in scored[1]) < sum(n for _, n in scored[0])


@pytest.mark.slow
def test_shared_equals_unshared_on_eight_ranks_with_the_entropy_prepass(tmp_path):
    """dp=8, 16 completions of 4 prompts: each rank trains one prompt copy with two
    completions; the entropy pre-pass scores the shared rows; dr_grpo."""
    options = (
        "mesh.data=8", "grpo.per_device_train_batch_size=2", "grpo.top_entropy_quantile=0.5",
        "grpo.loss_type=dr_grpo", "optimizer.learning_rate=3.0e-3",
    )  # fmt: skip
    plain, shared = _pair(tmp_path, *options, shared_tokens=32, plain_tokens=32)
    _check(plain, shared, 1, rtol=1e-5)


def test_ppo_refuses_shared_prompts():
    """PPO's config refuses it (the critic reads one document per completion)."""
    with pytest.raises(ConfigError, match=r"^ppo.actor.shared_prompt_packing=True is invalid"):
        load_run_config("configs/ppo_tiny.yaml", ["ppo.actor.shared_prompt_packing=true"])


@pytest.mark.slow
def test_shared_equals_unshared_for_moe_router_replay(tmp_path):
    """A MoE model replaying the sampler's routes: the prompt copy carries the prompt's
    recorded routes (its last token's included), so the step is the unshared one; μ = 2: the
    old log-probs' scoring forward replays them on shared rows too."""
    moe = (
        "model.init={model_type: qwen3_moe, hidden_size: 32, num_hidden_layers: 1, "
        "num_attention_heads: 2, num_key_value_heads: 1, intermediate_size: 64, "
        "num_experts: 4, num_experts_per_tok: 2, moe_intermediate_size: 16}",
        "grpo.router_replay=rollout", "mesh.data=1", "optimizer.learning_rate=3.0e-3",
        "grpo.num_iterations=2",
    )  # fmt: skip
    plain, shared = _pair(tmp_path, *moe, shared_tokens=64, plain_tokens=64)
    scored = [_scored_rows(t) for t in (plain, shared)]
    ((a, b),) = _check(plain, shared, 1, rtol=1e-5)
    (plain_call,), (shared_call,) = scored  # μ = 2: old log-probs, replaying the routes
    assert shared_call[0] and shared_call[1] < plain_call[1]
    assert a["moe/route_disagreement"] == b["moe/route_disagreement"] == 0.0
