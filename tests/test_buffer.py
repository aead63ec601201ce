"""Prompt order, generation buffer and optimizer windows with TRL GRPOTrainer's semantics
(docs/algorithms/grpo.md §3–5, §10 examples 9–12), checked against TRL's ``RepeatSampler``
stream and accelerate's sharding, written out independently below."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxrl.config import GRPOConfig
from jaxrl.rollout.buffer import (
    GenerationBuffer,
    PromptSampler,
    rank_rows,
    repeat_sampler_indices,
    shuffle_batch,
    split_batch,
)


def _config(**kw) -> GRPOConfig:
    kw.setdefault("num_generations", 2)
    return GRPOConfig(**kw)


def _simulate(cfg: GRPOConfig, num_prompts: int, num_micro_steps: int, *, seed: int = 0):
    """Run the prompt sampler + buffer for ``num_micro_steps``; every row carries its prompt
    index, generation id and global row.

    Returns (served, generations): served[k][p] is rank p's chunk at micro-step k;
    generations[n] = (micro-step of generation n, its B_gen prompt indices).
    """
    sampler = PromptSampler(
        num_prompts,
        prompts_per_generation=cfg.prompts_per_generation,
        num_generations=cfg.num_generations,
        shuffle=cfg.shuffle_dataset,
        seed=seed,
    )
    buffer = GenerationBuffer(cfg, seed=seed)
    served, generations = [], []
    for k in range(num_micro_steps):
        if buffer.needs_generation:
            prompts = sampler.next_generation()
            n = len(generations)
            generations.append((k, prompts))
            buffer.load(
                {
                    "prompt": prompts,
                    "row": np.arange(len(prompts)),
                    "generation": np.asarray(n),
                    "old_logp": None,
                }
            )
        served.append(buffer.serve())
    return served, generations


def _trl_epoch_stream(order, *, batch_size: int, mini_repeat_count: int, repeat_count: int):
    """TRL ``RepeatSampler`` over one epoch's prompt order, written out from
    docs/algorithms/grpo.md §3: cut ``order`` into chunks of ``batch_size`` prompts, drop an
    incomplete last chunk, emit each chunk ``repeat_count`` times with every index repeated
    ``mini_repeat_count`` times in a row."""
    order = [int(i) for i in order]
    stream = []
    for c in range(len(order) // batch_size):
        chunk = order[c * batch_size : (c + 1) * batch_size]
        for _ in range(repeat_count):
            for i in chunk:
                stream += [i] * mini_repeat_count
    return stream


def _epoch_order(cfg: GRPOConfig, num_prompts: int, seed: int, epoch: int):
    """The order an epoch walks the prompts in: the identity without shuffling, else the seeded
    permutation of ``(seed, epoch)`` (what a resumed run must be able to redraw)."""
    if not cfg.shuffle_dataset:
        return range(num_prompts)
    return np.random.default_rng([seed, epoch]).permutation(num_prompts)


def _trl_rank_batches(cfg: GRPOConfig, num_prompts: int, epochs: int, *, seed: int = 0):
    """TRL + accelerate: the sampler's stream in dataloader batches of b·S indices, batch i to
    rank i % P (accelerate's ``BatchSamplerShard``); rank p reads one batch per micro-step.

    Returns per rank the list of its per-micro-step dataloader batches, and the per-epoch streams.
    """
    b, P, S, G = (cfg.per_device_train_batch_size, cfg.world_size, cfg.generation.steps,
                  cfg.num_generations)  # fmt: skip
    streams = [
        _trl_epoch_stream(
            _epoch_order(cfg, num_prompts, seed, e),
            batch_size=b * P * S // G,  # unique prompts per generation, B_gen / G
            mini_repeat_count=G,
            repeat_count=cfg.num_iterations * S,
        )
        for e in range(epochs)
    ]
    stream = [i for s in streams for i in s]
    batches = [stream[i : i + b * S] for i in range(0, len(stream), b * S)]
    return [batches[p::P] for p in range(P)], streams


# -- example 10: RepeatSampler -------------------------------------------------------------------


def test_repeat_sampler_example_10_shuffled_length_and_repeats():
    x = repeat_sampler_indices(7, mini_repeat_count=2, batch_size=3, repeat_count=2, seed=3)
    assert len(x) == 24  # one of 7 items dropped
    assert x[0:6] == x[6:12] and x[12:18] == x[18:24]
    assert all(x[i] == x[i + 1] for i in range(0, 24, 2))
    assert len(set(x)) == 6 and x[0:6] != x[12:18]


def test_repeat_sampler_example_10_without_shuffle():
    x = repeat_sampler_indices(7, mini_repeat_count=2, batch_size=1, repeat_count=1, shuffle=False)
    assert x == [i for i in range(7) for _ in range(2)]


@pytest.mark.parametrize(
    ("kw", "num_prompts"),
    [
        (dict(per_device_train_batch_size=3, world_size=2, gradient_accumulation_steps=2,
              steps_per_generation=4), 29),
        (dict(per_device_train_batch_size=2, world_size=4, num_generations=4,
              gradient_accumulation_steps=3, num_iterations=2), 11),
        (dict(per_device_train_batch_size=6, num_generations=4, gradient_accumulation_steps=3,
              steps_per_generation=4, num_iterations=2, shuffle_dataset=False), 17),
    ],
)  # fmt: skip
def test_prompts_and_ranks_match_trl_stream_under_accelerate_sharding(kw, num_prompts):
    """Which rank generates which prompts, generation after generation, across epochs."""
    cfg = _config(**kw)
    period = cfg.generation.steps * cfg.num_iterations
    epochs = 3
    per_epoch = (num_prompts // cfg.prompts_per_generation) * period
    served, gens = _simulate(cfg, num_prompts, epochs * per_epoch, seed=5)
    trl, streams = _trl_rank_batches(cfg, num_prompts, epochs, seed=5)
    for e, stream in enumerate(streams):  # the materialised reference stream agrees
        assert stream == repeat_sampler_indices(
            num_prompts,
            mini_repeat_count=cfg.num_generations,
            batch_size=cfg.prompts_per_generation,
            repeat_count=cfg.num_iterations * cfg.generation.steps,
            shuffle=cfg.shuffle_dataset,
            seed=5,
            epoch=e,
        )
    assert len(gens) == epochs * per_epoch // period
    for n, (k, prompts) in enumerate(gens):
        assert k == n * period  # TRL generates at k % (S·μ) == 0
        for p in range(cfg.world_size):
            rows = rank_rows(
                p,
                per_device_batch=cfg.per_device_train_batch_size,
                steps_per_generation=cfg.generation.steps,
            )
            assert list(prompts[rows]) == trl[p][k]
            # the repeats TRL's dataloader consumes in between are copies of the same batch
            assert all(trl[p][k + j] == trl[p][k] for j in range(period))
    # rank p's served rows are exactly its slice of the generation, permuted
    for k, chunks in enumerate(served):
        for p, chunk in enumerate(chunks):
            assert set(chunk["prompt"]) <= set(trl[p][k - k % period])


# -- example 11: split and shuffle ---------------------------------------------------------------


def test_split_example_11():
    batch = {"x": np.arange(6), "y": np.arange(12).reshape(6, 2), "s": np.asarray(7.0), "n": None}
    chunks = split_batch(batch, 3)
    for i, c in enumerate(chunks):
        np.testing.assert_array_equal(c["x"], np.arange(6)[2 * i : 2 * i + 2])
        np.testing.assert_array_equal(c["y"], batch["y"][2 * i : 2 * i + 2])
        assert c["s"] == 7.0 and np.ndim(c["s"]) == 0
        assert c["n"] is None
    with pytest.raises(ValueError, match="equal chunks"):
        split_batch(batch, 4)


def test_shuffle_example_11_one_permutation_for_every_field():
    batch = {"x": np.arange(10), "y": np.arange(10) * 10.0, "s": np.asarray(3), "n": None}
    out = shuffle_batch(batch, np.random.default_rng(0))
    assert not np.array_equal(out["x"], batch["x"])
    np.testing.assert_array_equal(out["y"], out["x"] * 10.0)
    assert sorted(out["x"]) == list(range(10))
    assert out["s"] == 3 and out["n"] is None


# -- example 9 and the timelines ------------------------------------------------------------------


def test_example_9_buffer_serves_eight_micro_steps_and_epochs_drop_five_prompts():
    """docs/algorithms/grpo.md §10 example 9: g=3, S=4, G=4, b=6, μ=2, no shuffle, 17 prompts."""
    cfg = _config(
        gradient_accumulation_steps=3,
        steps_per_generation=4,
        num_generations=4,
        per_device_train_batch_size=6,
        num_iterations=2,
        shuffle_dataset=False,
    )
    assert cfg.generation.size == 24 and cfg.prompts_per_generation == 6
    served, gens = _simulate(cfg, 17, 49)
    # one buffer per 8 micro-steps; 3 epochs of 2 chunks end exactly at micro-step 48 (= 16
    # optimizer steps of 3), where epoch 4 starts again from prompt 0
    assert [k for k, _ in gens] == [0, 8, 16, 24, 32, 40, 48]
    chunk_a = [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5]
    chunk_b = [6, 6, 6, 6, 7, 7, 7, 7, 8, 8, 8, 8, 9, 9, 9, 9, 10, 10, 10, 10, 11, 11, 11, 11]
    assert [p.tolist() for _, p in gens] == [chunk_a, chunk_b, chunk_a, chunk_b, chunk_a, chunk_b,
                                             chunk_a]  # fmt: skip
    # prompts 12..16 (the incomplete chunk) are never generated from
    assert not set(np.concatenate([p for _, p in gens]).tolist()) & {12, 13, 14, 15, 16}
    for n in range(6):
        k0 = 8 * n
        chunks = [served[k][0] for k in range(k0, k0 + 8)]
        assert all(len(c["row"]) == 6 and int(c["generation"]) == n for c in chunks)
        # pass 1 (micro-steps k0..k0+3) serves every one of the 24 rows once, the batch's prompts
        rows = np.concatenate([c["row"] for c in chunks[:4]])
        assert sorted(rows.tolist()) == list(range(24))
        prompts = sorted(np.concatenate([c["prompt"] for c in chunks[:4]]).tolist())
        assert prompts == (chunk_a if n % 2 == 0 else chunk_b)
        # pass 2 (k0+4..k0+7) repeats pass 1 chunk for chunk, in the same order
        for first, second in zip(chunks[:4], chunks[4:], strict=True):
            np.testing.assert_array_equal(second["row"], first["row"])
            np.testing.assert_array_equal(second["prompt"], first["prompt"])


def test_timeline_p2_b3_g2_s4():
    """docs/algorithms/grpo.md §4 timeline (P=2, b=3, G=2, g=2, S=4 → B_gen = 24, 12 prompts):
    micro-steps 0–3 serve chunks 0–3 of one buffer, the optimizer steps after micro-steps 1 and
    3, so chunks 2–3 are served after an update (off-policy); micro-step 4 regenerates."""
    cfg = _config(
        per_device_train_batch_size=3, world_size=2, gradient_accumulation_steps=2,
        steps_per_generation=4,
    )  # fmt: skip
    assert cfg.generation.size == 24 and cfg.prompts_per_generation == 12
    served, gens = _simulate(cfg, 100, 8)
    assert [k for k, _ in gens] == [0, 4]
    orders = []
    for n, (k0, prompts) in enumerate(gens):
        per_rank = []
        for p in range(2):
            chunks = [served[k][p] for k in range(k0, k0 + 4)]
            for c in chunks:
                assert len(c["row"]) == 3 and int(c["generation"]) == n
                np.testing.assert_array_equal(c["prompt"], prompts[c["row"]])  # rows stay whole
            # the 4 chunks split rank p's 12 rows of the generation, each served once
            rows = np.concatenate([c["row"] for c in chunks])
            assert sorted(rows.tolist()) == list(range(12 * p, 12 * p + 12))
            per_rank.append(rows - 12 * p)
        np.testing.assert_array_equal(per_rank[0], per_rank[1])  # one permutation, every rank
        orders.append(per_rank[0].tolist())
    assert orders[0] != list(range(12)) and orders[0] != orders[1]  # drawn anew per buffer
    updates = (1, 3, 5, 7)  # the optimizer steps after these micro-steps (g = 2)
    for k, chunks in enumerate(served):
        generated_at = gens[int(chunks[0]["generation"])][0]
        off_policy = any(generated_at <= u < k for u in updates)
        assert off_policy == (k in (2, 3, 6, 7))
    assert cfg.needs_old_logprobs  # example 1


def test_example_1_and_2_buffer_periods():
    cfg = _config(per_device_train_batch_size=8, gradient_accumulation_steps=2,
                  steps_per_generation=4)  # fmt: skip
    assert cfg.generation.size == 32
    assert [k for k, _ in _simulate(cfg, 200, 16)[1]] == [0, 4, 8, 12]  # 2 optimizer steps each
    cfg2 = cfg.replace(num_iterations=2)
    assert [k for k, _ in _simulate(cfg2, 200, 16)[1]] == [0, 8]  # 4 optimizer steps each
    cfg3 = _config(per_device_train_batch_size=8, world_size=2, gradient_accumulation_steps=4)
    assert cfg3.generation.steps == 4 and cfg3.generation.size == 64
    assert [k for k, _ in _simulate(cfg3, 200, 8)[1]] == [0, 4]
    assert not cfg3.needs_old_logprobs


# -- example 12: old log-probs iff a buffered row is served after an update -----------------------


@pytest.mark.parametrize(
    ("g", "s", "mu", "computed"),
    [(2, 2, 1, False), (2, 4, 1, True), (4, 2, 1, False), (2, 2, 2, True), (4, 2, 2, False),
     (3, 2, 1, True)],
)  # fmt: skip
def test_example_12_old_logprob_table_matches_buffer_mechanics(g, s, mu, computed):
    cfg = _config(
        per_device_train_batch_size=2, gradient_accumulation_steps=g, steps_per_generation=s,
        num_iterations=mu,
    )  # fmt: skip
    assert cfg.needs_old_logprobs is computed
    served, gens = _simulate(cfg, 50, 12 * g * s * mu)
    generated_in = {n: k // g for n, (k, _) in enumerate(gens)}  # window of each generation
    off_policy = any(
        k // g != generated_in[int(chunks[0]["generation"])] for k, chunks in enumerate(served)
    )
    assert off_policy is computed


# -- checkpointed state ----------------------------------------------------------------------------


def test_state_dict_round_trip_through_json_resumes_exactly():
    cfg = _config(per_device_train_batch_size=3, world_size=2, gradient_accumulation_steps=2,
                  steps_per_generation=4, num_iterations=2)  # fmt: skip

    def make():
        return (
            PromptSampler(30, prompts_per_generation=12, num_generations=2, seed=1),
            GenerationBuffer(cfg, seed=1),
        )

    def run(sampler, buffer, n):
        out = []
        for _ in range(n):
            if buffer.needs_generation:
                prompts = sampler.next_generation()
                buffer.load({"prompt": prompts, "adv": np.linspace(-1, 1, 24, dtype=np.float32),
                             "gen": np.asarray(sampler.generations), "none": None})  # fmt: skip
            out.append([(c["prompt"].tolist(), c["adv"].tolist(), int(c["gen"])) for c in
                        buffer.serve()])  # fmt: skip
        return out

    straight = run(*make(), 40)
    sampler, buffer = make()
    first = run(sampler, buffer, 11)  # stop mid-buffer and mid-epoch
    state = json.loads(json.dumps({"s": sampler.state_dict(), "b": buffer.state_dict()}))
    sampler2, buffer2 = make()
    sampler2.load_state_dict(state["s"])
    buffer2.load_state_dict(state["b"])
    assert first + run(sampler2, buffer2, 29) == straight
    assert buffer2.state_dict()["chunks"][0][0]["none"] is None


def test_errors_name_the_problem():
    cfg = _config(per_device_train_batch_size=4)
    buffer = GenerationBuffer(cfg)
    with pytest.raises(RuntimeError, match="empty"):
        buffer.serve()
    with pytest.raises(ValueError, match="rows"):
        buffer.load({"x": np.arange(6)})
    with pytest.raises(ValueError, match="distinct prompts"):
        PromptSampler(3, prompts_per_generation=4, num_generations=2)
