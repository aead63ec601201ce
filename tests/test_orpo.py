"""ORPO (``dpo.loss_type: orpo``): the odds-ratio term and chosen NLL against float64 and
against TRL's formulas, and its step equal across layouts (docs/losses.md)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.config import ConfigError, DPOConfig, load_run_config
from jaxrl.losses.dpo import dpo_loss, dpo_loss_terms, target_mask
from jaxrl.losses.normalize import finalize
from jaxrl.losses.orpo import log1mexp
from jaxrl.runtime.mesh import use_devices
from jaxrl.trainers.check import compare, one_step
from jaxrl.trainers.dpo import orpo_nll_weight

IGNORE = -100
BETA = 0.25


def _rows(pairs, seed):
    """One packed row per list of pairs ((prompt, chosen, rejected) lengths): tokens as
    segment ids, target-aligned mask, random log-probs; and the per-pair token index sets."""
    rng = np.random.default_rng(seed)
    T = max(sum(2 * p + c + r for p, c, r in row) for row in pairs) + 3
    seg = np.zeros((len(pairs), T), np.int32)
    labels = np.full((len(pairs), T), IGNORE, np.int64)
    for b, row in enumerate(pairs):
        t, d = 0, 1
        for p, c, r in row:
            for n in (c, r):
                seg[b, t : t + p + n] = d
                labels[b, t + p : t + p + n] = 5
                t, d = t + p + n, d + 1
    mask = np.asarray(target_mask(jnp.asarray(labels), jnp.asarray(seg)), np.float32)
    logp = -rng.uniform(0.05, 1.5, size=seg.shape).astype(np.float32)
    return seg, mask, logp


def _float64(seg, mask, logp, beta):
    """ORPO in float64 loops: mean NLL over every chosen loss token of the batch + the mean over
    pairs of −β logσ(log_odds); and its gradient with respect to the token log-probs."""
    lp = logp.astype(np.float64)
    pairs = []  # (chosen positions, rejected positions)
    for b in range(seg.shape[0]):
        for d in range(1, seg[b].max() + 1, 2):
            on = lambda k, b=b: [
                (b, t) for t in range(seg.shape[1]) if seg[b, t] == k and mask[b, t]
            ]  # noqa: E501
            pairs.append((on(d), on(d + 1)))
    n_tok = sum(len(c) for c, _ in pairs)
    n_pairs = len(pairs)
    loss, grad = 0.0, np.zeros_like(lp)
    for c, r in pairs:
        mc, mr = np.mean([lp[i] for i in c]), np.mean([lp[i] for i in r])
        lo = (mc - mr) - (np.log1p(-np.exp(mc)) - np.log1p(-np.exp(mr)))
        loss += -np.sum([lp[i] for i in c]) / n_tok - beta * np.log(1 / (1 + np.exp(-lo))) / n_pairs
        s = -beta * (1 - 1 / (1 + np.exp(-lo))) / n_pairs  # ∂/∂lo
        for i in c:
            grad[i] += -1 / n_tok + s / (1 - np.exp(mc)) / len(c)
        for i in r:
            grad[i] += -s / (1 - np.exp(mr)) / len(r)
    return loss, grad, n_pairs / n_tok


def test_log1mexp_both_branches_float64():
    x = np.array([-40.0, -5.0, -0.7, -0.69, -0.3, -1e-4], np.float32)
    x64 = x.astype(np.float64)
    want = np.where(x64 < -0.69, np.log1p(-np.exp(x64)), np.log(-np.expm1(x64)))
    np.testing.assert_allclose(np.asarray(log1mexp(jnp.asarray(x))), want, rtol=1e-6)
    g = jax.vmap(jax.grad(log1mexp))(jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(g), -1 / np.expm1(-x.astype(np.float64)), rtol=1e-5)


def test_orpo_value_and_gradient_match_float64():
    """Two rows (uneven prompts and responses), three pairs: the micro-batch's Σ/Σ with the step
    constant nll_weight = N_pairs / N_chosen_tokens equals the float64 two-mean loss."""
    seg, mask, logp = _rows([[(3, 4, 2), (1, 6, 5)], [(5, 2, 7)]], seed=0)
    want, want_grad, weight = _float64(seg, mask, logp, BETA)

    def loss(x):
        t = dpo_loss_terms(x, mask, seg, None, None, num_segments=6, beta=BETA,
                           loss_type="orpo", nll_weight=jnp.float32(weight))  # fmt: skip
        return finalize(t.numerator, t.denominator), t

    (value, terms), grad = jax.value_and_grad(loss, has_aux=True)(jnp.asarray(logp))
    np.testing.assert_allclose(float(value), want, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-5, atol=1e-8)
    assert float(terms.denominator) == 3.0
    nll_sum, nll_count = (float(x) for x in terms.metrics["nll_loss"])
    assert nll_count == 4 + 6 + 2  # the chosen responses' tokens
    assert nll_count == pytest.approx(3 / weight)
    chosen = np.isin(seg, [1, 3]) & (mask > 0)  # chosen documents: odd segment ids
    np.testing.assert_allclose(nll_sum, -logp[chosen].sum(), rtol=1e-6)


def test_orpo_matches_trl_formula_one_device_one_micro_batch():
    """TRL 1.16 ``ORPOTrainer`` (experimental/orpo), written out in torch: NLL = CrossEntropy over
    the chosen rows (prompt tokens included: TRL's labels there are the input ids), minus
    mean(β logσ(log_odds)) from per-token mean log-probs. With one-token prompts the first token
    is never a target, so TRL's NLL covers exactly the response tokens, as jaxrl's does."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    V, prompts = 11, [1, 1, 1]
    lens = [(4, 3), (2, 6), (5, 5)]  # (chosen, rejected) response lengths
    docs = []  # (tokens, n_prompt) in order c0, r0, c1, r1, ...
    for (c, r), p in zip(lens, prompts, strict=True):
        prompt = rng.integers(1, V, size=p)
        for n in (c, r):
            docs.append((np.concatenate([prompt, rng.integers(1, V, size=n)]), p))
    T = max(len(t) for t, _ in docs)
    logits = rng.normal(size=(len(docs), T, V)).astype(np.float32)

    # TRL: chosen rows first, then rejected, right-padded
    order = list(range(0, len(docs), 2)) + list(range(1, len(docs), 2))
    ids = np.zeros((len(docs), T), np.int64)
    att = np.zeros((len(docs), T), np.int64)
    lab = np.full((len(docs), T), IGNORE, np.int64)
    for i, k in enumerate(order):
        toks, p = docs[k]
        ids[i, : len(toks)], att[i, : len(toks)] = toks, 1
        lab[i, p : len(toks)] = toks[p:]
    x = torch.tensor(logits[order], requires_grad=True)
    n = len(lens)
    nll_labels = torch.where(torch.tensor(att) == 1, torch.tensor(ids), IGNORE)
    nll = torch.nn.functional.cross_entropy(
        x[:n, :-1].reshape(-1, V), nll_labels[:n, 1:].reshape(-1), ignore_index=IGNORE
    )
    labels = torch.tensor(lab)[:, 1:]
    m = labels != IGNORE
    per_tok = torch.gather(x[:, :-1].log_softmax(-1), 2, labels.clamp(min=0)[..., None])[..., 0]
    mean_logps = (per_tok * m).sum(-1) / m.sum(-1)
    pc, pr = mean_logps[:n], mean_logps[n:]

    def trl_log1mexp(v):
        return torch.where(v < -0.6931471805599453, torch.log1p(-torch.exp(v)),
                           torch.log(-torch.expm1(v)))  # fmt: skip

    log_odds = (pc - pr) - (trl_log1mexp(pc) - trl_log1mexp(pr))
    trl_loss = nll - (BETA * torch.nn.functional.logsigmoid(log_odds)).mean()
    trl_loss.backward()
    trl_loss = trl_loss.detach()
    trl_grad = np.empty_like(logits)
    trl_grad[order] = x.grad.numpy()

    # jaxrl: the pairs packed in one row, chosen then rejected
    row = np.concatenate([t for t, _ in docs])
    seg = np.concatenate([np.full(len(t), d + 1) for d, (t, _) in enumerate(docs)])
    lab_row = np.concatenate([np.r_[np.full(p, IGNORE), t[p:]] for t, p in docs])
    packed_logits = np.concatenate([logits[d, : len(t)] for d, (t, _) in enumerate(docs)])
    seg, lab_row = jnp.asarray(seg[None], jnp.int32), jnp.asarray(lab_row[None])
    mask = target_mask(lab_row, seg).astype(jnp.float32)
    targets = jnp.asarray(np.roll(row, -1)[None])
    weight = orpo_nll_weight(range(n), [np.r_[np.zeros(p), np.ones(len(t) - p)] for t, p in docs])

    def loss(z):
        lp = jnp.take_along_axis(jax.nn.log_softmax(z, -1), targets[..., None], -1)[..., 0]
        t = dpo_loss_terms(lp, mask, seg, None, None, num_segments=len(docs) + 1, beta=BETA,
                           loss_type="orpo", nll_weight=jnp.float32(weight))  # fmt: skip
        return finalize(t.numerator, t.denominator)

    value, grad = jax.value_and_grad(loss)(jnp.asarray(packed_logits[None]))
    np.testing.assert_allclose(float(value), trl_loss.item(), rtol=1e-6)
    want = np.concatenate([trl_grad[d, : len(t)] for d, (t, _) in enumerate(docs)])
    np.testing.assert_allclose(np.asarray(grad[0]), want, rtol=1e-4, atol=1e-7)


def test_orpo_config_and_loss_api():
    c = DPOConfig(loss_type="orpo")
    assert not c.needs_reference and c.uses_mean_logps
    with pytest.raises(ConfigError, match="normalize='token'.*set normalize=pair"):
        DPOConfig(loss_type="orpo", normalize="token")
    with pytest.raises(ConfigError, match="label_smoothing"):
        DPOConfig(loss_type="orpo", label_smoothing=0.1)
    pc, pr = jnp.array([-0.2, -1.0]), jnp.array([-0.9, -0.3])
    lo = (pc - pr) - (jnp.log1p(-jnp.exp(pc)) - jnp.log1p(-jnp.exp(pr)))
    np.testing.assert_allclose(
        np.asarray(dpo_loss(pc, pr, None, None, beta=BETA, loss_type="orpo")),
        np.asarray(-BETA * jax.nn.log_sigmoid(lo)),
        rtol=1e-6,
    )
    with pytest.raises(ValueError, match="nll_weight"):
        dpo_loss_terms(jnp.zeros((1, 4)), jnp.ones((1, 4)), jnp.ones((1, 4), jnp.int32), None,
                       None, num_segments=3, loss_type="orpo")  # fmt: skip


# ----------------------------------------------------------------- the trainer's step, layouts

ORPO = [
    "warm_start.steps=0",
    "dpo.loss_type=orpo",
    "dpo.beta=0.1",
    "optimizer.learning_rate=1e-3",
    "optimizer.warmup_steps=0",
    # Adam's first step is lr·g/(|g| + ε): with ε = 1e-8 a gradient entry near 0 turns its fp32
    # rounding (~1e-10) into ~1e-5 of parameter (measured: 1.2e-4 relative on one entry while
    # loss and grad norm were bit-equal). ε = 1e-3 keeps the update a function of the gradient.
    "optimizer.eps=1e-3",
    "task.train_size=64",
    "task.eval_size=8",
    "model.init={hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 4, "
    "num_key_value_heads: 2, intermediate_size: 64}",
]
LAYOUTS = {  # name → (overrides, devices); 16 pairs per step in every layout
    "dp1_1mb": (["mesh.data=1", "dpo.per_device_train_batch_size=16",
                 "schedule.max_tokens=1024"], 1),
    "dp1_4mb": (["mesh.data=1", "dpo.per_device_train_batch_size=4",
                 "dpo.gradient_accumulation_steps=4", "schedule.max_tokens=96"], 1),
    "dp8": (["mesh.data=8", "dpo.per_device_train_batch_size=2", "schedule.max_tokens=48"], 8),
    "d2f2t2": (["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2",
                "dpo.per_device_train_batch_size=4", "schedule.max_tokens=64"], 8),
}  # fmt: skip


@pytest.mark.slow
def test_orpo_step_is_the_same_in_every_layout(tmp_path):
    """dp=1 in one and in several micro-batches, dp=8, (data 2, fsdp 2, tensor 2): the same 16
    pairs give the same loss, grad norm and updated parameters (≤ 1e-6 relative)."""
    outcomes = {}
    for name, (sets, devices) in LAYOUTS.items():
        sets = [*ORPO, *sets, f"output_dir={tmp_path / name}"]
        cfg = load_run_config("configs/dpo_tiny.yaml", sets)
        with use_devices(jax.devices()[:devices]):
            outcomes[name] = one_step(cfg)
    ref = outcomes["dp1_1mb"]
    assert ref.row["num_micro_batches"] == 1
    assert outcomes["dp1_4mb"].row["num_micro_batches"] >= 4
    assert ref.row["nll_loss"] > 0 and ref.row["denominator"] == 16
    for name, out in outcomes.items():
        diffs = compare(out, ref)
        assert max(diffs.values()) <= 1e-6, (name, diffs)
