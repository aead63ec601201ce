"""KV-cache sampler: HF greedy parity, cache vs full forward, trainer log-probs, sampling rules."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from hf_fixtures import write_case
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxrl.data.batching.packing import pack_sequences
from jaxrl.data.documents import completion_field, prompt_completion_document
from jaxrl.generate import sampling
from jaxrl.generate.decode_layout import decode_mesh, decode_tensor
from jaxrl.generate.dense_decode import decode_step, left_pad, prefill
from jaxrl.generate.sampler import (
    Sampler,
    SamplingParams,
    compact_sizes,
    filter_logits,
    sample_tokens,
)
from jaxrl.generate.sampling import first_argmax, gumbel_max
from jaxrl.models import ModelConfig, Transformer, from_pretrained
from jaxrl.models.sharding import state_shardings
from jaxrl.models.slot_kv_cache import SlotKVCache
from jaxrl.runtime.mesh import make_mesh
from jaxrl.train.forward import micro_batch_logprobs

N = 12  # max_new_tokens of the HF-checkpoint sampler
PAD = 0
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [4], [100, 3, 77, 200, 9]]  # P bucket 8
GREEDY = SamplingParams(temperature=0.0)


def _hf_greedy(hf_model, prompt: list[int], eos: int) -> np.ndarray:
    """transformers' greedy completion of one unpadded prompt (stops after eos)."""
    ids = torch.tensor([prompt])
    out = hf_model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=N,
        eos_token_id=eos,
        pad_token_id=PAD,
    )
    return out[0, len(prompt) :].numpy()


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """A random HF Llama, our fp32-head copy of it, an eos that stops one greedy row at step 3,
    transformers' greedy completions under that eos, and a sampler on that eos."""
    path, hf_model = write_case("llama", tmp_path_factory.mktemp("hf"))
    model = from_pretrained(path, fp32_lm_head=True)
    first = _hf_greedy(hf_model, PROMPTS[0], eos=model.config.vocab_size - 1)
    eos = int(first[2])
    assert eos not in first[:2] and eos != PAD
    expected = [_hf_greedy(hf_model, p, eos) for p in PROMPTS]
    sampler = Sampler(model.config, max_new_tokens=N, eos_id=eos, pad_id=PAD, prompt_buckets=8)
    sampler.load_params(model)
    return model, sampler, eos, expected, path


def _check_stopping(res, eos_ids, pad: int, n: int) -> None:
    """After a row's first eos every token is pad with log-prob 0; lengths/truncated agree."""
    for b in range(res.tokens.shape[0]):
        row, length = res.tokens[b], int(res.lengths[b])
        hits = np.flatnonzero(np.isin(row, eos_ids))
        if res.truncated[b]:
            assert length == n and hits.size == 0, (b, row)
        else:
            assert hits.size and hits[0] == length - 1, (b, row, length)
        assert (row[length:] == pad).all() and (res.logprobs[b, length:] == 0).all()
        assert (res.logprobs[b, :length] < 0).all()


def test_greedy_matches_transformers_generate_for_mixed_prompt_lengths(hf):
    _, sampler, eos, expected, _ = hf
    res = sampler.generate(PROMPTS, jax.random.key(0), GREEDY)
    for b, want in enumerate(expected):
        np.testing.assert_array_equal(res.completions()[b], want, err_msg=f"row {b}")
    assert list(res.lengths) == [len(w) for w in expected]
    assert res.lengths[0] == 3 and not res.truncated[0]  # eos stopped row 0
    assert res.truncated[1:].all() and (res.lengths[1:] == N).all()
    _check_stopping(res, [eos], PAD, N)


def test_every_row_stopped_exits_the_loop_early(hf):
    _, sampler, eos, expected, _ = hf
    res = sampler.generate([PROMPTS[0]] * 4, jax.random.key(0), GREEDY)
    assert res.num_steps == 3 < N and not res.truncated.any()
    assert (res.tokens[:, 3:] == PAD).all() and (res.tokens[:, :3] == expected[0]).all()


@jax.jit
def _teacher_forced_logits(params, graphdef, tokens_BP, lengths_B, completion_BN):
    """Next-token logits [B, N + 1, V] from prefill, then one cached step per forced token."""
    model = nnx.merge(graphdef, params)
    n = completion_BN.shape[1]
    logits_BV, cache = prefill(model, tokens_BP, lengths_B, tokens_BP.shape[1] + n)

    def step(cache, i):
        out_BV, cache = decode_step(model, completion_BN[:, i], lengths_B + i, cache)
        return cache, out_BV

    _, rest_NBV = lax.scan(step, cache, jnp.arange(n))
    return jnp.concatenate([logits_BV[:, None], rest_NBV.swapaxes(0, 1)], axis=1)


@jax.jit
def _full_logits(params, graphdef, ids_BT, segment_ids_BT):
    return nnx.merge(graphdef, params)(ids_BT, segment_ids=segment_ids_BT)


def test_cached_decode_logits_equal_full_forward_at_every_step(hf):
    model, sampler, _, _, _ = hf
    res = sampler.generate(PROMPTS, jax.random.key(3), SamplingParams(temperature=1.0))
    tokens_BP, lengths_B = left_pad(PROMPTS, pad_id=PAD, length=8)
    graphdef, params = nnx.split(model)
    got_BNV = np.asarray(_teacher_forced_logits(params, graphdef, tokens_BP, lengths_B, res.tokens))
    # the no-cache reference: each prompt + all N forced tokens, right-padded (segment 0)
    ids_BT = np.zeros((len(PROMPTS), 8 + N), np.int32)
    segment_ids_BT = np.zeros_like(ids_BT)
    for b, prompt in enumerate(PROMPTS):
        ids_BT[b, : len(prompt) + N] = np.concatenate([prompt, res.tokens[b]])
        segment_ids_BT[b, : len(prompt) + N] = 1
    full_BTV = np.asarray(_full_logits(params, graphdef, ids_BT, segment_ids_BT))
    worst = 0.0
    for b, prompt in enumerate(PROMPTS):
        want_NV = full_BTV[b, len(prompt) - 1 : len(prompt) + N]
        worst = max(worst, float(np.abs(got_BNV[b] - want_NV).max()))
    assert worst <= 1e-5, f"max |cached - full| logit diff {worst:.2e}"


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_sampler_logprobs_equal_trainer_logprobs_on_packed_rows(hf, param_dtype):
    """Acceptance (fp32 head): sampler log-probs == micro_batch_logprobs at completion tokens.

    bf16: the trainer's model is loaded in bf16, the sampler gets the fp32 weights through
    load_params, which casts them to its bf16 config.
    """
    model, sampler, eos, _, path = hf
    if param_dtype == "bfloat16":
        config = dataclasses.replace(model.config, param_dtype=param_dtype, dtype=None)
        sampler = Sampler(config, max_new_tokens=N, eos_id=eos, pad_id=PAD, prompt_buckets=8)
        sampler.load_params(model)
        model = from_pretrained(path, param_dtype=param_dtype, fp32_lm_head=True)
    temperature = 0.7
    sampling = SamplingParams(temperature=temperature, top_k=50, top_p=0.95)
    res = sampler.generate(PROMPTS, jax.random.key(4), sampling)
    docs = [
        prompt_completion_document(p, c) for p, c in zip(PROMPTS, res.completions(), strict=True)
    ]
    seqs, masks = [ids for ids, _ in docs], [mask for _, mask in docs]
    logps = [
        completion_field(len(p), res.logprobs[b, : res.lengths[b]]) for b, p in enumerate(PROMPTS)
    ]
    batch = pack_sequences(seqs, row_len=32, loss_masks=masks, token_fields={"old_logp": logps})
    mb = {k: jnp.asarray(getattr(batch, k)[0]) for k in ("tokens", "segment_ids", "targets")}
    graphdef, params = nnx.split(model)
    logp_KT, _ = jax.jit(
        lambda p, mb: micro_batch_logprobs(nnx.merge(graphdef, p), mb, temperature=temperature)
    )(params, mb)
    on = batch.loss_mask[0] > 0
    assert on.sum() == res.lengths.sum()
    diff = np.abs(np.asarray(logp_KT)[on] - batch.token_fields["old_logp"][0][on]).max()
    assert diff <= 1e-5, f"max |sampler - trainer| log-prob diff {diff:.2e}"


def test_same_key_same_samples_other_key_other_samples(hf):
    _, sampler, _, _, _ = hf
    hot = SamplingParams(temperature=1.5)
    a = sampler.generate(PROMPTS, jax.random.key(7), hot)
    b = sampler.generate(PROMPTS, jax.random.key(7), hot)
    c = sampler.generate(PROMPTS, jax.random.key(8), hot)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.logprobs, b.logprobs)
    assert (a.tokens != c.tokens).mean() > 0.5


@pytest.mark.parametrize(
    "sampling", [SamplingParams(top_k=1), SamplingParams(top_p=1e-6)], ids=["top_k_1", "top_p_0"]
)
def test_degenerate_filters_equal_greedy(hf, sampling):
    _, sampler, _, _, _ = hf
    greedy = sampler.generate(PROMPTS, jax.random.key(0), GREEDY)
    res = sampler.generate(PROMPTS, jax.random.key(9), sampling)  # temperature 1
    np.testing.assert_array_equal(res.tokens, greedy.tokens)
    np.testing.assert_allclose(res.logprobs, greedy.logprobs, atol=1e-6)


_sample_tokens = jax.jit(sample_tokens)
PROBS = np.array([0.3, 0.2, 0.15, 0.12, 0.1, 0.08, 0.04, 0.01])


@pytest.mark.parametrize(
    ("top_k", "top_p", "kept"),
    [(3, 1.0, 3), (0, 0.6, 3), (4, 0.7, 3), (0, 0.5, 2), (2, 0.99, 2), (0, 1.0, 8)],
)
def test_filtered_sampling_frequencies_match_renormalised_probabilities(top_k, top_p, kept):
    logits_V = np.log(PROBS).astype(np.float32) + 1.0
    want = np.zeros_like(PROBS)
    want[:kept] = PROBS[:kept] / PROBS[:kept].sum()
    filtered = np.asarray(filter_logits(jnp.asarray(logits_V[None]), top_k, top_p))[0]
    assert np.isfinite(filtered).sum() == kept
    draws = 40_000
    logits_BV = jnp.broadcast_to(jnp.asarray(logits_V), (draws, PROBS.size))
    tokens_B, logp_B = _sample_tokens(
        jax.random.key(0), logits_BV, jnp.float32(1.0), jnp.int32(top_k), jnp.float32(top_p)
    )
    freq = np.bincount(np.asarray(tokens_B), minlength=PROBS.size) / draws
    assert (freq[kept:] == 0).all()
    np.testing.assert_allclose(freq, want, atol=0.012)  # ~5 sigma at 40k draws
    # the reported log-prob is the unfiltered full-vocabulary one
    np.testing.assert_allclose(np.asarray(logp_B), np.log(PROBS)[np.asarray(tokens_B)], atol=1e-6)


def test_gumbel_max_draws_what_jax_random_categorical_draws():
    """The engine's draw is ``jax.random.categorical`` token for token (the recorded runs'
    random stream), with one key per row and with one key for the batch; ``first_argmax`` is
    ``jnp.argmax``, ties (first index) and NaN (first NaN) included."""
    rng = np.random.default_rng(0)
    z_BV = jnp.asarray(3 * rng.standard_normal((96, 1000)), jnp.float32)
    z_BV = z_BV.at[:8, 500:].set(-jnp.inf)  # filtered-out tokens, as top-k / top-p leave them
    for seed in range(4):
        keys_B = jax.random.split(jax.random.key(seed), z_BV.shape[0])
        np.testing.assert_array_equal(
            jax.jit(gumbel_max)(keys_B, z_BV), jax.vmap(jax.random.categorical)(keys_B, z_BV)
        )
        key = jax.random.key(seed)
        np.testing.assert_array_equal(
            jax.jit(gumbel_max)(key, z_BV), jax.random.categorical(key, z_BV, axis=-1)
        )
    x_BV = jnp.asarray([[1.0, 3.0, 3.0, 0.0], [2.0, np.nan, 5.0, np.nan], [-np.inf] * 4])
    np.testing.assert_array_equal(first_argmax(x_BV), jnp.argmax(x_BV, axis=-1))


def test_threefry_noise_is_jax_random_gumbel_bit_for_bit():
    """The written-out threefry Gumbel noise is ``jax.random.gumbel``'s, bit for bit: per-row
    keys (the engine's, vmapped), one key over 1-3-D shapes, called directly and inside a jit;
    keys or dtypes it does not reproduce take ``jax.random.gumbel`` itself."""
    keys_B = jax.random.split(jax.random.key(7), 5)
    for shape in ((5, 1001), (5, 3, 7)):
        want = jax.vmap(lambda k, s=shape[1:]: jax.random.gumbel(k, s, jnp.float32))(keys_B)
        np.testing.assert_array_equal(sampling._threefry_gumbel_f32(keys_B, shape), want)
    key = jax.random.key(3)
    for shape in ((7, 13), (5,), (2, 3, 4)):
        want = jax.random.gumbel(key, shape, jnp.float32)
        np.testing.assert_array_equal(sampling._threefry_gumbel_f32(key, shape), want)
        np.testing.assert_array_equal(
            jax.jit(sampling._threefry_gumbel_f32, static_argnums=1)(key, shape), want
        )
    z_BV = jnp.zeros((4, 9), jnp.float32)
    assert sampling._fast_gumbel_applies(jax.random.split(key, 4), z_BV)
    assert not sampling._fast_gumbel_applies(
        jax.random.split(jax.random.key(0, impl="rbg"), 4), z_BV
    )
    assert not sampling._fast_gumbel_applies(key, z_BV.astype(jnp.bfloat16))
    rbg_B = jax.random.split(jax.random.key(1, impl="rbg"), 4)
    z_BV = jnp.asarray(np.random.default_rng(0).standard_normal((4, 9)), jnp.float32)
    np.testing.assert_array_equal(
        jax.jit(gumbel_max)(rbg_B, z_BV), jax.vmap(jax.random.categorical)(rbg_B, z_BV)
    )


def test_temperature_reshapes_the_sampling_distribution():
    logits_V = np.log(PROBS).astype(np.float32)
    draws, freqs = 40_000, {}
    logits_BV = jnp.broadcast_to(jnp.asarray(logits_V), (draws, PROBS.size))
    for t in (0.5, 2.0):
        tokens_B, logp_B = _sample_tokens(
            jax.random.key(1), logits_BV, jnp.float32(t), jnp.int32(0), jnp.float32(1.0)
        )
        want = np.exp(logits_V / t) / np.exp(logits_V / t).sum()
        freqs[t] = np.bincount(np.asarray(tokens_B), minlength=PROBS.size) / draws
        np.testing.assert_allclose(freqs[t], want, atol=0.012)
        np.testing.assert_allclose(np.asarray(logp_B), np.log(want)[np.asarray(tokens_B)], 1e-5)
    assert np.abs(freqs[0.5] - freqs[2.0]).max() > 0.1


def _random_model(config: ModelConfig, seed: int) -> Transformer:
    """Random weights (std 0.02, norm scales 1) filled on the host: no per-op compiles."""
    rng = np.random.default_rng(seed)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))

    def fill(path, x):
        if jax.tree_util.keystr(path).endswith("['scale']"):
            return jnp.ones(x.shape, x.dtype)
        return jnp.asarray(0.02 * rng.standard_normal(x.shape), x.dtype)

    return nnx.merge(graphdef, jax.tree.map_with_path(fill, abstract))


@pytest.fixture(scope="module")
def tiny():
    """A 1-layer model over 16 tokens whose near-uniform logits hit the eos set often."""
    config = ModelConfig.tiny(16, num_hidden_layers=1, hidden_size=32, intermediate_size=64)
    model = _random_model(config, 0)
    sampler = Sampler(config, max_new_tokens=16, eos_id=(3, 7), pad_id=1, prompt_buckets=(8, 16))
    sampler.load_params(model)
    return model, sampler


def test_sampled_rows_stop_at_their_first_eos(tiny):
    _, sampler = tiny
    prompts = [[2 + b % 5] * (1 + b % 6) for b in range(8)]
    res = sampler.generate(prompts, jax.random.key(0))
    _check_stopping(res, [3, 7], pad=1, n=16)
    assert (~res.truncated).sum() >= 2 and (res.lengths < 16).any()
    assert res.num_steps == res.lengths.max()


def test_compiles_once_per_batch_group_and_prompt_bucket(tiny):
    """One program per (requests bucket, distinct-prompts bucket, P bucket): prompt contents,
    lengths within the bucket, sampling parameters and per-request limits are traced."""
    _, sampler = tiny
    sampler.generate([[2, 4], [3], [5]], jax.random.key(0))
    sampler.generate([[2, 4]] * 3, jax.random.key(0))  # one distinct prompt: a group bucket of 1
    before = sampler.compiles
    for n, seed in ((1, 1), (5, 2), (8, 3)):
        sampler.generate([[2] * n, [4], [5, 6]], jax.random.key(seed))
        sampler.generate([[2] * n] * 3, jax.random.key(seed), SamplingParams(top_p=0.5))
        sampler.generate([[2] * n] * 3, jax.random.key(seed), GREEDY, max_tokens=[1, 5, 16])
    assert sampler.compiles == before
    sampler.generate([[2] * 9] * 3, jax.random.key(0))  # P bucket 16
    sampler.generate([[2] * 12] * 3, jax.random.key(1))
    assert sampler.compiles == before + 1


def test_batch_sizes_share_a_bucket_and_padding_changes_no_completion(tiny):
    from jaxrl.generate.sampler import batch_bucket

    assert [batch_bucket(b) for b in (1, 2, 3, 4, 5, 7, 9, 13, 60, 64, 65)] == [
        1, 2, 3, 4, 6, 8, 12, 16, 64, 64, 96,
    ]  # fmt: skip
    _, sampler = tiny
    prompts = [[2, 4], [5], [6, 7, 8], [4, 4], [2], [3, 5]]
    full = sampler.generate(prompts, jax.random.key(0))  # a bucket of 6
    before = sampler.compiles
    part = sampler.generate(prompts[:5], jax.random.key(0))  # 5 rows, padded to 6
    assert sampler.compiles == before
    np.testing.assert_array_equal(part.tokens, full.tokens[:5])
    np.testing.assert_array_equal(part.logprobs, full.logprobs[:5])


def test_compacted_steps_generate_what_steps_over_every_slot_generate(tiny):
    """Once the live slots fit a quarter or a half of the slots, steps run only those
    (``engine._compacted``, then a loop of its own): the same tokens, lengths, truncation and
    decode steps as steps over every slot, log-probs to float rounding, one program either way,
    sampled and greedy, with refills (16 and 32 slots) and with every request admitted at once
    (0); the engine counts the steps that ran compacted (``EngineResult.compacted_steps``)."""
    model, _ = tiny
    assert compact_sizes(16) == (8,) and compact_sizes(32) == (8, 16)
    assert compact_sizes(64) == (16, 32) and compact_sizes(8) == ()
    assert compact_sizes(64, ranks=2) == ()  # slots split over devices: never gathered
    rng = np.random.default_rng(3)
    limits = np.clip(np.exp(rng.normal(np.log(4), 1.0, 40)).round(), 1, 16).astype(np.int32)
    prompts = [rng.integers(2, 16, size=n).tolist() for n in rng.integers(1, 12, size=40)]
    for slots in (16, 32, 0):
        out, memory = {}, {}
        for compact in (False, True):
            sampler = Sampler(model.config, max_new_tokens=16, eos_id=(3, 7), pad_id=1,
                              max_slots=slots, compact_slots=compact)  # fmt: skip
            sampler.load_params(model)
            for params in (SamplingParams(), GREEDY):
                key = jax.random.key(5)
                out[compact, params] = sampler.generate(prompts, key, params, max_tokens=limits)
            assert sampler.compiles == 1
            geometry = sampler.cache_geometry(40, 40, 11)
            shape = sampler.engine_shape(geometry.slots, geometry.cache_length, 0)
            assert shape.compact == (compact_sizes(geometry.slots) if compact else ())
            memory[compact] = sampler.memory_bytes(40, 40, 11)
        # the first gather's copy (the largest smaller size) lives beside the full slot cache
        largest = compact_sizes(geometry.slots)[-1]
        extra = SlotKVCache.nbytes(model.config, largest, geometry.cache_length, 1)
        assert memory[True] == memory[False] + extra
        for params in (SamplingParams(), GREEDY):
            full, compacted = out[False, params], out[True, params]
            for field in ("tokens", "lengths", "truncated"):
                np.testing.assert_array_equal(getattr(compacted, field), getattr(full, field))
            assert compacted.num_steps == full.num_steps
            # the compacted loops did run (a counter in the engine's result), and only with
            # compaction on: the equalities above compare two programs, not one twice
            assert 0 < compacted.compacted_steps < compacted.num_steps
            assert full.compacted_steps == 0
            np.testing.assert_allclose(compacted.logprobs, full.logprobs, atol=2e-6)
            assert (full.lengths < limits).any() and (full.lengths == limits).any()


def test_load_params_copies_and_casts_and_is_required(tiny):
    model, _ = tiny
    config = model.config
    fresh = Sampler(config, max_new_tokens=4, eos_id=3, pad_id=1)
    with pytest.raises(RuntimeError, match="load_params"):
        fresh.generate([[2]], jax.random.key(0))
    bf16 = Sampler(
        dataclasses.replace(config, param_dtype="bfloat16", dtype=None),
        max_new_tokens=4,
        eos_id=3,
        pad_id=1,
    )
    bf16.load_params(nnx.state(model, nnx.Param))
    for got, src in zip(
        jax.tree.leaves(bf16._params), jax.tree.leaves(nnx.state(model)), strict=True
    ):
        assert got.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(got), np.asarray(src.astype(jnp.bfloat16)))
    # a trainer that donates (deletes) its buffers must not invalidate the sampler's copy
    donor = _random_model(config, 1)
    fresh.load_params(donor)
    for leaf in jax.tree.leaves(nnx.state(donor)):
        leaf.delete()
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(fresh._params))
    other = nnx.eval_shape(
        lambda: Transformer(dataclasses.replace(config, num_hidden_layers=2), rngs=nnx.Rngs(0))
    )
    with pytest.raises(ValueError, match="architecture"):
        fresh.load_params(other)
    wide = nnx.eval_shape(
        lambda: Transformer(dataclasses.replace(config, intermediate_size=96), rngs=nnx.Rngs(0))
    )
    with pytest.raises(ValueError, match="shape"):
        fresh.load_params(wide)


def test_invalid_settings_are_named():
    config = ModelConfig.tiny(16, num_hidden_layers=1)
    with pytest.raises(ValueError, match="eos_id"):
        Sampler(config, max_new_tokens=4, eos_id=16, pad_id=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        Sampler(config, max_new_tokens=0, eos_id=1, pad_id=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)


# ------------------------------------------------------------------ on a mesh

MESH_PROMPTS = [[2 + b % 5] * (1 + b % 6) for b in range(12)]  # 12 rows: not a multiple of 8


def _on_shards(params, mesh):
    """Parameters placed by the package's rule table (embed → fsdp; heads, mlp, … → tensor)."""
    return jax.device_put(params, state_shardings(params, mesh))


@pytest.fixture(scope="module")
def mesh_samplers(tiny):
    """The tiny model's sampler on one device, on dp = 8 and on data × fsdp × tensor = 2×2×2
    with parameters sharded over fsdp and tensor (4 row ranks)."""
    model, _ = tiny
    params = nnx.state(model, nnx.Param)
    out = {}
    fsdp8 = make_mesh(1, 8, 1)
    for name, mesh, placed in [
        ("1 device", make_mesh(1, devices=jax.devices()[:1]), params),
        ("dp 8", make_mesh(8), params),
        ("2x2x2", make_mesh(2, 2, 2), _on_shards(params, make_mesh(2, 2, 2))),
        # ZeRO-3 trainer weights (fsdp=8) decoded in groups of 2 tensor-parallel devices
        ("fsdp 8 -> decode t2", decode_mesh(fsdp8, 2), _on_shards(params, fsdp8)),
    ]:
        sampler = Sampler(
            model.config, max_new_tokens=16, eos_id=(3, 7), pad_id=1, prompt_buckets=(8, 16),
            mesh=mesh,
        )  # fmt: skip
        sampler.load_params(placed, copy=False)
        out[name] = sampler
    return out


def test_decode_layout_reshards_zero3_weights_once_per_sync(mesh_samplers):
    """Weights split over fsdp=8 land in the decode layout (data=4, tensor=2: heads over
    tensor, nothing over fsdp), a copy even when asked for none; a data-parallel sampler reads
    replicated weights in place."""
    sampler = mesh_samplers["fsdp 8 -> decode t2"]
    assert dict(sampler.mesh.shape) == {"data": 4, "fsdp": 1, "tensor": 2}
    q = sampler._params["layers"][0]["attn"]["q_kernel"][...]
    assert q.sharding.spec == P(None, "tensor", None) and sampler.weights.copied
    assert all("fsdp" not in str(x.sharding.spec) for x in jax.tree.leaves(sampler._params))
    assert not mesh_samplers["dp 8"].weights.copied  # already in its layout: no copy


def test_decode_tensor_picks_the_fewest_devices_that_hold_the_weights():
    qwen = dict(vocab_size=152064, model_type="qwen2", dtype="bfloat16", attention_bias=True)
    shapes = {  # hidden, layers, heads, kv heads, intermediate → t at a 20 GB budget
        "7b": ((3584, 28, 28, 4, 18944), 1),
        "32b": ((5120, 64, 40, 8, 27648), 4),
        "72b": ((8192, 80, 64, 8, 29568), 8),
    }
    for name, ((d, n, h, k, f), want) in shapes.items():
        config = ModelConfig(
            hidden_size=d, num_hidden_layers=n, num_attention_heads=h, num_key_value_heads=k,
            intermediate_size=f, **qwen,
        )  # fmt: skip
        assert decode_tensor(config, 64, 0, 20.0) == want, name
    assert decode_tensor(config, 64, 2, 20.0) == 2  # as configured
    with pytest.raises(ValueError, match="rollout.tensor_parallel=3"):
        decode_tensor(config, 64, 3, 20.0)


@pytest.mark.parametrize(
    "sampling",
    [SamplingParams(temperature=1.0), GREEDY, SamplingParams(temperature=0.8, top_k=5, top_p=0.9)],
    ids=["t1", "greedy", "filtered"],
)
def test_every_mesh_samples_the_same_completions(tiny, mesh_samplers, sampling):
    """Rows are split over the batch axes (12 → 16 rows on 8 ranks), the random bits are a
    function of (key, row, token) only: the same tokens and log-probs on every mesh."""
    _, unsharded = tiny
    want = unsharded.generate(MESH_PROMPTS, jax.random.key(11), sampling)
    assert (~want.truncated).sum() >= 2 and want.truncated.any()  # rows stop at different steps
    for name, sampler in mesh_samplers.items():
        got = sampler.generate(MESH_PROMPTS, jax.random.key(11), sampling)
        np.testing.assert_array_equal(got.tokens, want.tokens, err_msg=name)
        np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5, err_msg=name)
        np.testing.assert_array_equal(got.lengths, want.lengths, err_msg=name)
        np.testing.assert_array_equal(got.truncated, want.truncated, err_msg=name)
        np.testing.assert_array_equal(got.prompt_lengths, want.prompt_lengths, err_msg=name)
        assert got.num_steps == want.num_steps, name  # padding rows never prolong the loop


def test_mesh_sampler_keeps_the_parameters_sharding_and_compiles_once(mesh_samplers):
    sampler = mesh_samplers["2x2x2"]
    specs = {leaf.sharding.spec for leaf in jax.tree.leaves(sampler._params)}
    assert P("fsdp", "tensor") in specs  # copied where they lie, not gathered
    assert all(leaf.sharding.mesh == sampler.mesh for leaf in jax.tree.leaves(sampler._params))
    sampler.generate(MESH_PROMPTS, jax.random.key(0))  # 12 rows on 4 row ranks
    before = sampler.compiles
    sampler.generate(MESH_PROMPTS[:9], jax.random.key(1), GREEDY)  # padded to 12: same program
    sampler.generate(MESH_PROMPTS[:11], jax.random.key(2))
    assert sampler.compiles == before
    sampler.generate(MESH_PROMPTS[:3], jax.random.key(3))  # padded to 4 rows
    assert sampler.compiles == before + 1


def test_a_tensor_parallel_degree_that_does_not_divide_the_devices_is_a_config_error():
    """Caught when the config is read (before an SFT warm start would run), naming the field."""
    from jaxrl.config import ConfigError, load_run_config

    with pytest.raises(ConfigError, match=r"^rollout\.tensor_parallel=3 is invalid: .*8 gen"):
        load_run_config("configs/grpo_tiny.yaml", ["mesh.data=8", "rollout.tensor_parallel=3"])
    ok = load_run_config("configs/grpo_tiny.yaml", ["mesh.data=8", "rollout.tensor_parallel=4"])
    assert ok.rollout.tensor_parallel == 4


@pytest.mark.parametrize("mesh_shape", [None, (2, 2, 2)])
def test_precompile_compiles_the_program_generate_then_runs(tiny, mesh_shape):
    """``precompile`` before the weights are loaded (the trainer's start) compiles, on the
    background thread, the very program the call runs: the call traces and compiles nothing,
    and its completions are the ones a sampler without it gives."""
    model, plain = tiny
    mesh = None if mesh_shape is None else make_mesh(*mesh_shape)
    params = nnx.state(model, nnx.Param)
    if mesh is not None:
        params = _on_shards(params, mesh)
    sampler = Sampler(
        model.config, max_new_tokens=16, eos_id=(3, 7), pad_id=1, prompt_buckets=(8, 16),
        mesh=mesh,
    )  # fmt: skip
    prompts = [[2, 4, 5]] * 3 + [[6, 2]] * 3
    sampler.precompile(prompts, key=jax.random.key(0))
    sampler.load_params(params)
    sampler.generate(prompts, jax.random.key(1))  # waits for the background compile
    assert sampler.compiles == 1 and sampler._precompiled.compiled == 1
    sampler.precompile(prompts)  # that program exists: nothing is queued
    sampler.precompile([[2, 3]] * 3 + [[4]] * 3)  # same buckets, other prompts: same program
    res = sampler.generate(prompts, jax.random.key(2))
    assert sampler.compiles == 1 and sampler._precompiled.compiled == 1
    ref = plain.generate(prompts, jax.random.key(2))
    np.testing.assert_array_equal(res.tokens, ref.tokens)
    np.testing.assert_array_equal(res.logprobs, ref.logprobs)
