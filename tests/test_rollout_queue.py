"""GRPO's row container: each row's document built once with its batch, served in the generation
buffer's order, kept pending across a docs_per_step cut, released when trained on, and resumed
exactly from its JSON state."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxrl.config import GRPOConfig
from jaxrl.rollout.buffer import GenerationBuffer
from jaxrl.rollout.rollout_queue import RolloutBatch, RolloutQueue


def _batch(n: int, *, seed: int, mask_truncated: bool = False, logps: bool = False):
    """``n`` rows of random prompts (2-4 tokens) and completions (1-3 tokens)."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, 20, rng.integers(2, 5)).astype(np.int32) for _ in range(n)]
    completions = [rng.integers(3, 20, rng.integers(1, 4)).astype(np.int32) for _ in range(n)]
    sampler = [-rng.random(len(c)).astype(np.float32) for c in completions]
    rewards = rng.random((n, 2))
    rewards[0, 1] = np.nan  # unscored
    old = [-rng.random(len(c)).astype(np.float32) for c in completions] if logps else None
    return RolloutBatch.build(
        prompts,
        completions,
        sampler,
        rng.random(n) < 0.5,
        rewards,
        rng.standard_normal(n).astype(np.float32),
        mask_truncated=mask_truncated,
        old_logp=old,
    )


def test_documents_are_prompt_plus_completion_with_token_aligned_fields():
    batch = _batch(6, seed=0, mask_truncated=True, logps=True)
    for i in range(len(batch)):
        p, c = batch.prompt_ids[i], batch.completion_ids[i]
        np.testing.assert_array_equal(batch.sequences[i], np.r_[p, c])
        assert batch.sequences[i].dtype == np.int32 and batch.loss_masks[i].dtype == np.float32
        on = 0.0 if batch.truncated[i] else 1.0  # mask_truncated_completions
        np.testing.assert_array_equal(batch.loss_masks[i], np.r_[np.zeros(len(p)), [on] * len(c)])
        for name in ("sampler_logp", "old_logp"):
            field = batch.token_fields[name][i]
            assert field.dtype == np.float32 and np.all(field[: len(p)] == 0)
            np.testing.assert_array_equal(field[len(p) :], getattr(batch, name)[i])
    assert batch.ref_logp is None and "ref_logp" not in batch.token_fields
    np.testing.assert_array_equal(batch.completion_lengths, [len(c) for c in batch.completion_ids])


def test_rows_and_log_probs_must_match():
    with pytest.raises(ValueError, match="give one per prompt"):
        RolloutBatch.build(
            [np.ones(2)], [], [], np.zeros(1), np.zeros((1, 1)), np.zeros(1), mask_truncated=False
        )
    with pytest.raises(ValueError, match="row 0: 2 completion tokens but 1 sampler log-probs"):
        RolloutBatch.build(
            [np.ones(2)], [np.ones(2)], [np.zeros(1)], np.zeros(1), np.zeros((1, 1)), np.zeros(1),
            mask_truncated=False,
        )  # fmt: skip


def test_batch_json_round_trip_is_exact():
    batch = _batch(5, seed=1, mask_truncated=True, logps=True)
    again = RolloutBatch.from_json(json.loads(json.dumps(batch.to_json())))
    for name in ("sequences", "loss_masks"):
        for a, b in zip(getattr(batch, name), getattr(again, name), strict=True):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(a, b)
    for name, values in batch.token_fields.items():
        for a, b in zip(values, again.token_fields[name], strict=True):
            np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(batch.rewards, again.rewards)  # NaN stays NaN
    np.testing.assert_array_equal(batch.advantages, again.advantages)
    np.testing.assert_array_equal(batch.truncated, again.truncated)


def _config() -> GRPOConfig:
    return GRPOConfig(
        num_generations=2, per_device_train_batch_size=2, world_size=2,
        gradient_accumulation_steps=1, steps_per_generation=2, num_iterations=2,
    )  # fmt: skip


def test_queue_serves_the_buffer_order_and_builds_no_document_twice():
    """The queue serves exactly the (generation, row) chunks a bare generation buffer with the
    same seed serves, and a window's documents are the batch's own arrays (built once)."""
    cfg = _config()
    queue, buffer = RolloutQueue(cfg, seed=4), GenerationBuffer(cfg, seed=4)
    b_gen = cfg.generation.size
    for k in range(8):
        assert queue.needs_generation == buffer.needs_generation
        if queue.needs_generation:
            queue.load(_batch(b_gen, seed=k))
            buffer.load({"row": np.arange(b_gen), "generation": np.asarray(queue.current_id)})
        queue.serve()
        expected = [(int(c["generation"]), int(r)) for c in buffer.serve() for r in c["row"]]
        window = queue.window()
        assert window.rows == expected
        for d, (g, r) in enumerate(window.rows):
            batch = queue.batches[g]
            assert window.sequences[d] is batch.sequences[r]
            assert window.loss_masks[d] is batch.loss_masks[r]
            assert window.token_fields["sampler_logp"][d] is batch.token_fields["sampler_logp"][r]
            assert window.advantages[d] == batch.advantages[r]
        queue.done(window, [])
        assert len(queue) == 0 and set(queue.batches) == {queue.current_id}


def test_rows_left_by_a_step_stay_pending_and_keep_their_batch():
    queue = RolloutQueue(_config(), seed=0)
    first = _batch(8, seed=0)
    queue.submit(first)
    window = queue.window()
    assert len(window) == 8 and "old_logp" not in window.token_fields
    queue.done(window, [5, 6])  # a docs_per_step cut trained on six
    assert list(queue.pending) == [(0, 5), (0, 6)] and set(queue.batches) == {0}
    queue.submit(_batch(4, seed=1, logps=True))
    window = queue.window()
    assert window.rows[:2] == [(0, 5), (0, 6)] and len(window) == 6
    assert "old_logp" not in window.token_fields  # present only when every batch has it
    assert [b is first for b in queue.batches_of(window, [0, 1])] == [True]
    queue.done(window, [])
    assert not queue.batches  # nothing refers to either batch any more


def test_state_dict_round_trip_through_json_resumes_exactly():
    cfg = _config()

    def run(queue, start, n):
        out = []
        for k in range(start, start + n):
            if queue.needs_generation:
                queue.load(_batch(cfg.generation.size, seed=k))
            queue.serve()
            window = queue.window()
            out.append((window.rows, [s.tolist() for s in window.sequences]))
            queue.done(window, list(range(len(window)))[-1:])  # one row left each step
        return out

    straight = run(RolloutQueue(cfg, seed=2), 0, 9)
    queue = RolloutQueue(cfg, seed=2)
    first = run(queue, 0, 3)  # stop mid-buffer with a row pending
    state = json.loads(json.dumps(queue.state_dict()))
    again = RolloutQueue(cfg, seed=2)
    again.load_state_dict(state)
    assert first + run(again, 3, 6) == straight
