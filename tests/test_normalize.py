"""The normalisation table: loss type → mode → (numerator, denominator), against a float64 loop
and docs/algorithms/grpo.md §8 (example 15 of §10)."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.losses.loss_types import GRPO_LOSS_MODES, GRPO_LOSS_TYPES, TOKEN_SUMMING_LOSS_TYPES
from jaxrl.losses.normalize import (
    documents_present,
    finalize,
    num_documents,
    pair_terms,
    token_terms,
)

TOKEN_MODES = ("token", "sequence", "document", "constant")
S, MAX_LEN = 5, 13


def _batch(seed=0):
    """Two rows of 1..3 documents (one fully masked), padding at the end, random losses."""
    seg = np.array([[1, 1, 1, 2, 2, 3, 3, 3, 0, 0], [1, 1, 1, 1, 2, 2, 2, 0, 0, 0]], np.int32)
    mask = np.array([[0, 1, 1, 0, 0, 1, 0, 1, 0, 0], [1, 1, 0, 1, 0, 1, 1, 0, 0, 0]], np.float32)
    loss = np.random.default_rng(seed).normal(size=seg.shape).astype(np.float32)
    return loss, mask, seg


def _loop(loss, mask, seg, mode):
    """float64 loop over documents: the module docstring's table."""
    num = den_tokens = 0.0
    n_seq = 0
    for b in range(seg.shape[0]):
        for d in sorted(set(seg[b].tolist()) - {0}):
            n_seq += 1
            sel = (seg[b] == d) & (mask[b] > 0)
            total = float(np.sum(loss[b][sel].astype(np.float64)))
            n_d = int(sel.sum())
            num += total / max(n_d, 1) if mode == "sequence" else total
            den_tokens += n_d
    den = {"token": den_tokens, "sequence": n_seq, "document": n_seq, "constant": n_seq * MAX_LEN}
    return num, den[mode]


# docs/algorithms/grpo.md §10 example 15 (ℓ_t = −A, max_completion_length 4): document 1 has 2
# loss tokens and A = +1, document 2 has 4 and A = −1, so Σ mℓ = −2 + 4 = 2 over 6 tokens and 2
# documents; a third document with no loss token adds nothing but counts as a sequence.
# loss_type → (numerator, denominator) by hand, without and with the fully masked document.
EXAMPLE_15 = {
    "grpo": ((-1.0 + 1.0, 2.0), (0.0, 3.0)),  # Σ_d per-document token means / N_seq
    "bnpo": ((2.0, 6.0), (2.0, 6.0)),  # Σ mℓ / Σ m
    "dapo": ((2.0, 6.0), (2.0, 6.0)),  # Σ mℓ / Σ m
    "dr_grpo": ((2.0, 2.0 * 4), (2.0, 3.0 * 4)),  # Σ mℓ / (N_seq · max_completion_length)
    "seq_mean_token_sum": ((2.0, 2.0), (2.0, 3.0)),  # Σ mℓ / N_seq
    "cispo": ((2.0, 6.0), (2.0, 6.0)),  # Σ mℓ / Σ m
}


@pytest.mark.parametrize("masked_document", [False, True])
@pytest.mark.parametrize("loss_type", GRPO_LOSS_TYPES)
def test_every_grpo_loss_type_normalises_example_15(loss_type, masked_document):
    """Each loss type's mode gives the documented numerator and divisor: one row, documents of 3
    and 5 tokens (prompt token first, loss on the rest), then optionally a 3-token document with
    no loss token, then padding."""
    seg = [1, 1, 1, 2, 2, 2, 2, 2] + ([3, 3, 3] if masked_document else []) + [0, 0]
    mask = [0, 1, 1, 0, 1, 1, 1, 1] + ([0, 0, 0] if masked_document else []) + [0, 0]
    adv = {1: 1.0, 2: -1.0, 3: 5.0, 0: 7.0}  # masked and padding values must not count
    loss = np.array([[-adv[d] for d in seg]], np.float32)
    num, den = token_terms(
        loss,
        np.array([mask], np.float32),
        np.array([seg], np.int32),
        mode=GRPO_LOSS_MODES[loss_type],
        num_segments=4,
        max_len=4,
    )
    assert (float(num), float(den)) == EXAMPLE_15[loss_type][masked_document]
    # the example's step values: grpo 0, bnpo = dapo 1/3, dr_grpo 0.25 (seq_mean_token_sum 1)
    want = {"grpo": 0.0, "bnpo": 1 / 3, "dapo": 1 / 3, "dr_grpo": 0.25, "seq_mean_token_sum": 1.0}
    want["cispo"] = 1 / 3
    if not masked_document:
        assert float(finalize(num, den)) == pytest.approx(want[loss_type], rel=1e-6)


@pytest.mark.parametrize("loss_type", TOKEN_SUMMING_LOSS_TYPES)
def test_token_summing_loss_types_sum_tokens(loss_type):
    """The types the config warns about with sequence-level ratios: the numerator is the plain
    token sum, so a 4-token document weighs twice a 2-token one (grpo's would give 1 + 1)."""
    seg = np.array([[1, 1, 2, 2, 2, 2]], np.int32)
    ones = np.ones((1, 6), np.float32)
    mode = GRPO_LOSS_MODES[loss_type]
    num, _ = token_terms(ones, ones, seg, mode=mode, num_segments=3, max_len=8)
    assert float(num) == 6.0


@pytest.mark.parametrize("mode", TOKEN_MODES)
def test_token_terms_match_float64_loop(mode):
    loss, mask, seg = _batch()
    num, den = token_terms(loss, mask, seg, mode=mode, num_segments=S, max_len=MAX_LEN)
    want_num, want_den = _loop(loss, mask, seg, mode)
    assert float(num) == pytest.approx(want_num, rel=1e-6, abs=1e-6)
    assert float(den) == want_den


def test_document_count_includes_fully_masked_documents():
    _, mask, seg = _batch()
    mask[1, seg[1] == 2] = 0.0  # row 1, document 2: no loss token left
    present = documents_present(jnp.asarray(seg), S)
    assert np.asarray(present).sum(axis=1).tolist() == [3, 2]
    assert np.asarray(num_documents(jnp.asarray(seg))).tolist() == [3, 2]
    for mode in ("sequence", "document"):
        _, den = token_terms(np.ones_like(mask), mask, seg, mode=mode, num_segments=S)
        assert float(den) == 5.0
    _, den = token_terms(np.ones_like(mask), mask, seg, mode="constant", num_segments=S, max_len=7)
    assert float(den) == 35.0


@pytest.mark.parametrize("mode", TOKEN_MODES)
def test_masked_inf_and_nan_reach_neither_value_nor_gradient(mode):
    loss, mask, seg = _batch(1)
    on = (mask > 0) & (seg > 0)
    poisoned = np.where(
        on, loss, np.where(np.arange(loss.size).reshape(loss.shape) % 2, np.nan, np.inf)
    )
    f = lambda x: token_terms(x, mask, seg, mode=mode, num_segments=S, max_len=MAX_LEN)
    clean, dirty = f(jnp.asarray(loss)), f(jnp.asarray(poisoned.astype(np.float32)))
    assert [float(x) for x in clean] == [float(x) for x in dirty]
    grad = np.asarray(jax.grad(lambda x: f(x)[0])(jnp.asarray(poisoned.astype(np.float32))))
    assert np.all(np.isfinite(grad)) and np.all(grad[~on] == 0.0)


@pytest.mark.parametrize("mode", TOKEN_MODES)
def test_padding_a_row_changes_no_bit(mode):
    """Long rows, so a flat reduction would regroup its partial sums when the row grows."""
    rng = np.random.default_rng(3)
    seg = np.zeros((3, 160), np.int32)
    mask = np.zeros((3, 160), np.float32)
    for b in range(3):
        t = 0
        for d in range(1, S):
            n = int(rng.integers(2, 40))
            seg[b, t : t + n], mask[b, t + 1 : t + n] = d, 1.0
            t += n
    loss = rng.normal(size=seg.shape).astype(np.float32)
    pad = lambda x, n: np.concatenate([x, np.zeros((x.shape[0], n), x.dtype)], axis=1)
    f = lambda lo, m, s: token_terms(lo, m, s, mode=mode, num_segments=S, max_len=MAX_LEN)
    short = [np.asarray(x).tobytes() for x in f(loss, mask, seg)]
    for n in (1, 7, 53, 300):
        long = [np.asarray(x).tobytes() for x in f(pad(loss, n), pad(mask, n), pad(seg, n))]
        assert long == short


def test_mode_errors():
    loss, mask, seg = _batch()
    with pytest.raises(ValueError, match="mode='pair'"):
        token_terms(loss, mask, seg, mode="pair", num_segments=S)
    with pytest.raises(ValueError, match="mode='mean'"):
        token_terms(loss, mask, seg, mode="mean", num_segments=S)
    with pytest.raises(ValueError, match="needs max_len"):
        token_terms(loss, mask, seg, mode="constant", num_segments=S)
    with pytest.raises(ValueError, match="normalize='mean' is invalid"):
        pair_terms(jnp.zeros((1, 2)), jnp.ones((1, 2)), jnp.ones((1, 2)), "mean")


def test_pair_terms():
    losses = jnp.array([[1.0, jnp.nan, 3.0]])
    valid = jnp.array([[1, 0, 1]])
    tokens = jnp.array([[4, 100, 2]])
    assert [float(x) for x in pair_terms(losses, valid, tokens, "pair")] == [4.0, 2.0]
    assert [float(x) for x in pair_terms(losses, valid, tokens, "token")] == [10.0, 6.0]


def test_config_and_loss_names_import_without_jax():
    """The CLI reads the config before jax is imported (to size the CPU host-device count)."""
    code = (
        "import sys, jaxrl, jaxrl.config, jaxrl.losses, jaxrl.losses.loss_types; "
        "jaxrl.config.GRPOConfig(); jaxrl.config.DPOConfig(); "
        "assert 'jax' not in sys.modules, 'jax imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
