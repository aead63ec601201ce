"""The continuous-batching engine (``jaxrl.generate.engine`` via ``Sampler``): HF greedy parity
with per-request limits and refilled slots, samples independent of slots / refill interval /
mesh, log-probs equal a scoring forward, shared prompt prefill, stop strings, weights."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from hf_fixtures import write_case

from jaxrl.generate.sampler import Sampler, SamplingParams, StopStrings
from jaxrl.generate.stop import MATCHED
from jaxrl.models import ModelConfig, Transformer, from_pretrained
from jaxrl.runtime.mesh import make_mesh

GREEDY = SamplingParams(temperature=0.0)
N = 10
PAD = 0
# mixed lengths, a repeated prompt (one shared prefill), per-request limits
HF_PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [4], [5, 6, 7], [100, 3, 77, 200, 9]]
HF_LIMITS = [10, 3, 7, 1, 10]


def _hf_greedy(hf_model, prompt: list[int], eos: int, limit: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf_model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=limit,
        eos_token_id=eos, pad_token_id=PAD,
    )  # fmt: skip
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("case", ["llama", "qwen2", "qwen3"])
def test_greedy_equals_transformers_generate_with_per_request_limits(case, tmp_path):
    """2 slots for 5 requests (refilled as requests stop), a shared prompt, limits 1..10 and an
    eos taken from the first row's third token: token for token HF's greedy output."""
    path, hf_model = write_case(case, tmp_path)
    model = from_pretrained(path, fp32_lm_head=True)
    eos = _hf_greedy(hf_model, HF_PROMPTS[0], eos=model.config.vocab_size - 1, limit=N)[2]
    want = [_hf_greedy(hf_model, p, eos, n) for p, n in zip(HF_PROMPTS, HF_LIMITS, strict=True)]
    sampler = Sampler(model.config, max_new_tokens=N, eos_id=eos, pad_id=PAD, max_slots=2)
    sampler.load_params(model)
    res = sampler.generate(HF_PROMPTS, jax.random.key(0), GREEDY, max_tokens=HF_LIMITS)
    assert [c.tolist() for c in res.completions()] == want
    assert (res.lengths < np.asarray(HF_LIMITS)).any()  # eos stopped a row before its limit
    for b, (c, limit) in enumerate(zip(want, HF_LIMITS, strict=True)):
        assert res.truncated[b] == (len(c) == limit and c[-1] != eos), b
        assert (res.tokens[b, len(c) :] == PAD).all() and (res.logprobs[b, len(c) :] == 0).all()
    assert res.num_steps > max(len(c) for c in want)  # 2 slots: the requests ran in turns


def _random_model(config: ModelConfig, seed: int) -> Transformer:
    """Random weights (std 0.3 so that some rows hit eos early, norm scales 1), on the host."""
    rng = np.random.default_rng(seed)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))

    def fill(path, x):
        if jax.tree_util.keystr(path).endswith("['scale']"):
            return jnp.ones(x.shape, x.dtype)
        return jnp.asarray(0.3 * rng.standard_normal(x.shape), x.dtype)

    return nnx.merge(graphdef, jax.tree.map_with_path(fill, abstract))


V, EOS, G = 32, 3, 4
CONFIG = ModelConfig.tiny(V, num_hidden_layers=1, hidden_size=32, intermediate_size=64)
_rng = np.random.default_rng(0)
PROMPTS = [list(_rng.integers(4, V, size=int(_rng.integers(1, 12)))) for _ in range(16)]
ROWS = [p for p in PROMPTS for _ in range(G)]  # 64 requests, prompt-major (GRPO's layout)
LIMITS = np.minimum(np.exp(_rng.normal(1.5, 0.8, size=len(ROWS))).astype(int) + 1, 24)


@pytest.fixture(scope="module")
def tiny_model():
    return _random_model(CONFIG, 0)


def _sampler(model, **kw) -> Sampler:
    sampler = Sampler(model.config, max_new_tokens=24, eos_id=EOS, pad_id=PAD, **kw)
    sampler.load_params(model)
    return sampler


@pytest.fixture(scope="module")
def wide(tiny_model):
    """64 slots: every request has its own slot from the start."""
    return _sampler(tiny_model, max_slots=64)


@pytest.fixture(scope="module")
def reference(wide):
    """64 requests in 64 slots: the layout the others must reproduce."""
    return wide.generate(ROWS, jax.random.key(5), max_tokens=LIMITS)


def _assert_same(got, want, name):
    np.testing.assert_array_equal(got.tokens, want.tokens, err_msg=name)
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5, err_msg=name)
    np.testing.assert_array_equal(got.lengths, want.lengths, err_msg=name)
    np.testing.assert_array_equal(got.truncated, want.truncated, err_msg=name)


@pytest.mark.parametrize(
    ("name", "kw", "devices"),
    [
        ("4 slots", dict(max_slots=4), 1),
        ("4 slots, refill every 3", dict(max_slots=4, refill_every=3), 1),
        ("8 slots on dp 8, chunked prefill", dict(max_slots=8, prefill_chunk=4), 8),
    ],
)
def test_samples_do_not_depend_on_slots_refill_or_mesh(tiny_model, reference, name, kw, devices):
    assert (~reference.truncated).sum() >= 8 and reference.truncated.sum() >= 8  # both endings
    assert len(set(reference.lengths.tolist())) >= 6  # a mix of lengths
    mesh = make_mesh(devices, devices=jax.devices()[:devices]) if devices > 1 else None
    got = _sampler(tiny_model, mesh=mesh, **kw).generate(ROWS, jax.random.key(5), max_tokens=LIMITS)
    _assert_same(got, reference, name)
    if kw.get("max_slots") == 4:
        assert got.num_steps >= reference.lengths.sum() / 4  # 4 slots did take turns


def test_batch_bucket_padding_and_other_rows_change_no_completion(wide, reference):
    """Request r's completion depends on (key, r, its prompt, its limit) only: 61 rows (padded
    to the 64 bucket), or other prompts in the other rows (no shared prefill), change nothing."""
    sampler = wide
    before = sampler.compiles
    part = sampler.generate(ROWS[:61], jax.random.key(5), max_tokens=LIMITS[:61])
    fields = ("tokens", "logprobs", "lengths", "truncated")
    head = dataclasses.replace(reference, **{f: getattr(reference, f)[:61] for f in fields})
    _assert_same(part, head, "61 rows")
    assert sampler.compiles == before  # 61 rows share the 64 bucket's program
    mixed = [p if r % G == 0 else [4 + r % 20] * (1 + r % 5) for r, p in enumerate(ROWS)]
    other = sampler.generate(mixed, jax.random.key(5), max_tokens=LIMITS)
    keep = np.arange(0, len(ROWS), G)
    np.testing.assert_array_equal(other.tokens[keep], reference.tokens[keep])
    assert (other.tokens != reference.tokens).any()


def test_logprobs_equal_a_scoring_forward(tiny_model):
    """Sampled (T = 0.7, top-k, top-p) log-probs == log_softmax(logits / T) of a full forward of
    prompt + completion at the completion's tokens (fp32, <= 1e-5), with refilled slots."""
    model = _random_model(dataclasses.replace(CONFIG, fp32_lm_head=True), 1)
    sampler = _sampler(model, max_slots=3, refill_every=2)
    t = 0.7
    res = sampler.generate(ROWS[:12], jax.random.key(2), SamplingParams(temperature=t, top_k=20,
                                                                        top_p=0.9))  # fmt: skip
    width = 40  # right padding: a causal forward's earlier positions do not see it
    ids_BT = np.zeros((12, width), np.int32)
    for b, (prompt, completion) in enumerate(zip(ROWS[:12], res.completions(), strict=True)):
        ids_BT[b, : len(prompt) + len(completion)] = [*prompt, *completion]
    graphdef, params = nnx.split(model)
    logits_BTV = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x))(params, ids_BT)
    logits_BTV = np.asarray(logits_BTV, np.float64) / t
    logp_BTV = logits_BTV - np.logaddexp.reduce(logits_BTV, axis=-1, keepdims=True)
    worst = 0.0
    for b, (prompt, completion) in enumerate(zip(ROWS[:12], res.completions(), strict=True)):
        at = np.arange(len(prompt) - 1, len(prompt) + len(completion) - 1)
        want = logp_BTV[b, at, completion]
        worst = max(worst, float(np.abs(res.logprobs[b, : len(completion)] - want).max()))
    assert worst <= 1e-5, worst


def _stops_reference(strings, token_texts, tokens) -> int | None:
    """Index of the first token whose text completes a stop string (naive text search)."""
    text = ""
    for i, tok in enumerate(tokens):
        before = len(text)
        text += token_texts[tok]
        for s in strings:
            at = text.find(s, max(0, before - len(s) + 1))
            if at >= 0 and at + len(s) > before:
                return i
    return None


def test_stop_string_automaton_matches_a_text_search():
    rng = np.random.default_rng(0)
    texts = ["".join(rng.choice(list("ab\nc"), size=int(rng.integers(1, 4)))) for _ in range(40)]
    strings = ["ab\n", "cc", "\n\n"]
    stop = StopStrings.build(strings, texts)
    for _ in range(300):
        tokens = rng.integers(0, len(texts), size=12)
        state, got = 0, None
        for i, tok in enumerate(tokens):
            state = stop.transitions[state, tok]
            if state == MATCHED:
                got = i
                break
        assert got == _stops_reference(strings, texts, tokens), [texts[t] for t in tokens]


def test_sampled_rows_stop_at_the_first_stop_string_with_exact_truncation(tiny_model):
    texts = [chr(ord("a") + v % 8) + ("\n" if v % 5 == 0 else "") for v in range(V)]
    strings = ["b\n", "dd", "ca"]
    stop = StopStrings.build(strings, texts)
    sampler = _sampler(tiny_model, max_slots=6, stop=stop)
    res = sampler.generate(ROWS[:24], jax.random.key(3), max_tokens=LIMITS[:24])
    ends = {"eos": 0, "stop": 0, "limit": 0}
    for b, c in enumerate(res.completions()):
        c = c.tolist()
        first = _stops_reference(strings, texts, c)
        if res.truncated[b]:
            assert first is None and EOS not in c and len(c) == LIMITS[b]
            ends["limit"] += 1
        elif c[-1] == EOS and (first is None or first == len(c) - 1):
            assert EOS not in c[:-1]
            ends["eos"] += 1
        else:
            assert first == len(c) - 1 and EOS not in c, (c, first)
            ends["stop"] += 1
    assert min(ends.values()) >= 1, ends  # every way of ending occurred


def test_no_copy_weights_are_the_trainers_arrays_and_donation_is_caught(tiny_model, reference):
    params = jax.tree.map(jnp.copy, nnx.state(tiny_model, nnx.Param))
    sampler = Sampler(CONFIG, max_new_tokens=24, eos_id=EOS, pad_id=PAD, copy_params=False)
    sampler.load_params(params)
    leaves = jax.tree.leaves(params)
    assert all(a is b for a, b in zip(jax.tree.leaves(sampler._params), leaves, strict=True))
    got = sampler.generate(ROWS[:4], jax.random.key(5), max_tokens=LIMITS[:4])
    np.testing.assert_array_equal(got.tokens, reference.tokens[:4])
    for leaf in leaves:  # what a train step's donation does
        leaf.delete()
    with pytest.raises(RuntimeError, match="load_params"):
        sampler.generate(ROWS[:4], jax.random.key(1))
    bf16 = Sampler(dataclasses.replace(CONFIG, dtype="bfloat16"), max_new_tokens=4, eos_id=EOS,
                   pad_id=PAD, copy_params=False)  # fmt: skip
    bf16.load_params(tiny_model)  # fp32 weights, bf16 compute: one cast per leaf
    assert {x.dtype for x in jax.tree.leaves(bf16._params)} == {jnp.dtype("bfloat16")}


def test_invalid_requests_are_named(tiny_model):
    sampler = _sampler(tiny_model)
    with pytest.raises(ValueError, match="max_tokens"):
        sampler.generate(ROWS[:2], jax.random.key(0), max_tokens=[1, 25])
    with pytest.raises(ValueError, match="max_slots"):
        Sampler(CONFIG, max_new_tokens=4, eos_id=EOS, pad_id=PAD, max_slots=-1)
    with pytest.raises(ValueError, match="stop strings"):
        StopStrings.build([""], ["a"])


def test_grpo_run_reruns_bit_for_bit_and_slot_count_changes_no_completion(tmp_path):
    """``jaxrl train`` GRPO (the tiny config, 2 steps, greedy held-out eval): a rerun writes the
    same metrics bit for bit; ``rollout.max_slots=4`` (refilled slots) samples the same
    completions, so rewards and lengths are equal and the losses equal up to float rounding."""
    from test_grpo_e2e import CONFIG, TINY

    from jaxrl.cli import main
    from jaxrl.train.run_io.metrics import read_metrics, reproducible

    def run(name: str, *sets: str) -> list[dict]:
        args = ["train", CONFIG, "--set", f"output_dir={tmp_path / name}"]
        for o in (*TINY, "max_steps=2", "logging.eval_samples=0", *sets):
            args += ["--set", o]
        assert main(args) == 0
        return [reproducible(r) for r in read_metrics(tmp_path / name / "metrics.jsonl")]

    first, again = run("a"), run("b")
    assert first == again
    assert "eval/accuracy" in first[-1]
    four = run("slots", "rollout.max_slots=4")
    for a, b in zip(first, four, strict=True):
        for key in ("reward", "completions/mean_length", "num_tokens", "eval/accuracy"):
            assert a.get(key) == b.get(key), key
        np.testing.assert_allclose(b["loss"], a["loss"], rtol=1e-5, atol=1e-7)
