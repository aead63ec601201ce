"""Shared-prompt packing (``jaxrl.data.batching.shared_prompt``): the host layout against the
unshared one (``step_plan.plan_device_batch``), unit splitting, budgets and errors, and every
GRPO loss type on a shared micro-batch against the same documents unshared."""

from __future__ import annotations

import types

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.data.batching.packing import PackingError
from jaxrl.data.batching.shared_prompt import plan_shared_batch, prompt_units
from jaxrl.data.batching.step_plan import plan_device_batch
from jaxrl.data.documents import completion_field, prompt_completion_document
from jaxrl.losses.loss_types import GRPO_LOSS_TYPES
from jaxrl.losses.normalize import num_documents
from jaxrl.losses.policy import policy_loss_terms
from jaxrl.losses.sampler_correction import sampler_weights


def _schedule(max_tokens=64, docs_per_step=0):
    return types.SimpleNamespace(
        max_tokens=max_tokens,
        packing="ffd",
        balance="cost",
        docs_per_step=docs_per_step,
        micro_batch_buckets=(),
    )


def _docs(groups=2, per_group=4, seed=0, prompt_len=6):
    """``groups`` prompts × ``per_group`` completions as GRPO builds them: prompt + completion,
    loss on the completion, sampler log-probs 0 on the prompt."""
    rng = np.random.default_rng(seed)
    seqs, masks, logps, plens = [], [], [], []
    for g in range(groups):
        prompt = rng.integers(3, 50, prompt_len + g)
        for _ in range(per_group):
            completion = rng.integers(3, 50, int(rng.integers(1, 6)))
            ids, mask = prompt_completion_document(prompt, completion)
            mask[-1] = float(rng.random() < 0.5)  # some completion tokens without loss
            seqs.append(ids)
            masks.append(mask)
            logps.append(completion_field(len(prompt), rng.normal(size=len(completion))))
            plens.append(len(prompt))
    adv = rng.normal(size=len(seqs)).astype(np.float32)
    return dict(
        sequences=seqs,
        loss_masks=masks,
        token_fields={"sampler_logp": logps},
        doc_fields={"advantage": adv},
    ), plens


def _plans(docs, plens, *, ranks=1, schedule=None, keys=None):
    schedule = schedule or _schedule()
    ids = range(len(plens))
    keys = [0] * len(plens) if keys is None else keys
    shared = plan_shared_batch(
        ids, prompt_lengths=plens, group_keys=keys, ranks=ranks, schedule=schedule, **docs
    )
    lengths = [len(s) for s in docs["sequences"]]
    plain = plan_device_batch(ids, lengths=lengths, ranks=ranks, schedule=schedule, **docs)
    return shared, plain


def _completion_parts(batch, plens):
    """Per document: the values of the positions P-1.. (what predicts its completion)."""
    a = batch.arrays
    out = {}
    for r, m, s in zip(*np.nonzero(a["doc_sample_index"] >= 0), strict=True):
        d = int(a["doc_sample_index"][r, m, s])
        on = a["segment_ids"][r, m] == s
        pos = a["positions"][r, m][on]
        keep = pos >= plens[d] - 1
        fields = ("tokens", "targets", "positions", "loss_mask", "sampler_logp")
        out[d] = {k: a[k][r, m][on][keep] for k in fields}
        out[d]["advantage"] = a["advantage"][r, m, s]
    return out


def test_layout_carries_each_completion_part_exactly_and_prompts_once():
    docs, plens = _docs()
    # a field the forward reads on the prompt too (like a MoE route): value i+1 is token i's
    docs["token_fields"]["moe_x"] = [
        np.r_[0.0, s[:-1]].astype(np.float32) for s in docs["sequences"]
    ]
    shared, plain = _plans(docs, plens)
    a = shared.arrays
    mine, theirs = _completion_parts(shared, plens), _completion_parts(plain, plens)
    assert sorted(mine) == sorted(theirs) == list(range(8))
    for d in theirs:
        for k, v in theirs[d].items():
            np.testing.assert_array_equal(mine[d][k], v, err_msg=f"doc {d} {k}")
    # counts: documents, loss tokens, ids; fewer tokens
    assert shared.num_documents == plain.num_documents == 8
    assert shared.packed.num_loss_tokens.sum() == plain.packed.num_loss_tokens.sum()
    assert shared.packed.num_docs.sum() == 8
    assert shared.used == plain.used == list(range(8)) and shared.returned == []
    unshared = sum(len(s) for s in docs["sequences"])
    # each group: its prompt less one token once, then (copied last token + completion) each
    assert shared.packed.trained_tokens == unshared - 4 * 6 - 4 * 7 + (6 - 1) + (7 - 1) + 8
    assert shared.packed.tokens_unshared == unshared
    assert shared.packed.num_tokens.sum() == shared.packed.trained_tokens
    # one prompt segment per group: positions 0..P-2, no loss, no document, parent of its B's
    seg, par, idx = a["segment_ids"][0, 0], a["parent_ids"][0, 0], a["doc_sample_index"][0, 0]
    prompts = sorted(set(par[par > 0].tolist()))
    assert len(prompts) == 2
    for s in prompts:
        on = seg == s
        assert idx[s] == -1 and a["advantage"][0, 0, s] == 0
        assert a["loss_mask"][0, 0][on].sum() == 0 and (par[on] == 0).all()
        assert a["positions"][0, 0][on].tolist() == list(range(on.sum()))
        # token t's value at position t, the prompt's last copied token included
        np.testing.assert_array_equal(a["moe_x"][0, 0][on], a["tokens"][0, 0][on])
        children = sorted(set(seg[par == s].tolist()))
        assert len(children) == 4 and all(a["positions"][0, 0][seg == c][0] == on.sum()
                                          for c in children)  # fmt: skip
    assert int(num_documents(jnp.asarray(seg[None]), jnp.asarray(par[None]))[0]) == 8


def test_groups_split_to_the_budget_and_down_to_the_unshared_schedule():
    docs, plens = _docs(groups=1, per_group=8, prompt_len=8)
    units = prompt_units(
        range(8), prompt_lengths=plens, group_keys=[0] * 8, max_tokens=24, **_seqs(docs)
    )
    assert [i for u in units for i in u] == list(range(8)) and len(units) > 1
    for u in units:  # each unit has its own prompt copy and fits the budget
        assert 7 + sum(len(docs["sequences"][i]) - 7 for i in u) <= 24
    shared, plain = _plans(docs, plens, schedule=_schedule(24))
    assert shared.arrays["tokens"].shape[-1] <= 24
    assert sorted(i for r in shared.micro_batches for mb in r for i in mb) == list(range(8))
    # 8 ranks, 8 documents: one document per unit, exactly the unshared layout
    shared, plain = _plans(docs, plens, ranks=8, schedule=_schedule(24))
    assert shared.micro_batches == plain.micro_batches
    for k, v in plain.arrays.items():
        np.testing.assert_array_equal(shared.arrays[k], v, err_msg=k)
    assert not shared.arrays["parent_ids"].any()


def _seqs(docs):
    return {"sequences": docs["sequences"], "loss_masks": docs["loss_masks"],
            "token_fields": docs["token_fields"]}  # fmt: skip


def test_units_need_the_same_prompt_key_no_prompt_loss_and_equal_prompt_fields():
    docs, plens = _docs(groups=1, per_group=4)
    docs["loss_masks"][1][2] = 1.0  # a loss on the prompt: trained alone
    docs["token_fields"]["sampler_logp"][2][0] = 0.5  # a different prompt field: alone
    units = prompt_units(
        range(4), prompt_lengths=plens, group_keys=[0, 0, 0, 1], max_tokens=64, **_seqs(docs)
    )
    assert units == [[0], [1], [2], [3]]


def test_docs_per_step_counts_documents_and_a_long_document_keeps_its_error():
    docs, plens = _docs(groups=4, per_group=4)
    shared, _ = _plans(docs, plens, schedule=_schedule(40, docs_per_step=5))
    assert shared.num_documents >= 5 and shared.num_documents < 16
    assert sorted(shared.used + shared.returned) == list(range(16))
    assert shared.num_documents == len(shared.used) == int(shared.packed.num_docs.sum())
    docs, plens = _docs(groups=1, per_group=2, prompt_len=30)
    with pytest.raises(PackingError, match=r"sample \d has \d+ tokens > row length T=32"):
        _plans(docs, plens, schedule=_schedule(32))


@pytest.mark.parametrize("loss_type", GRPO_LOSS_TYPES)
def test_every_loss_type_gives_the_unshared_terms(loss_type):
    """The same per-position values (a function of the document and position) on the shared
    and the unshared rows: numerator, denominator and every metric agree; the prompt segment
    adds nothing and makes no NaN. GSPO's sequence ratio, the entropy gate, the KL and the
    sampler correction included."""
    docs, plens = _docs(seed=1)
    shared, plain = _plans(docs, plens)
    rng = np.random.default_rng(2)
    table = rng.normal(-1.0, 0.3, size=(8, 64)).astype(np.float32)

    def terms(batch, level):
        rows = ("tokens", "segment_ids", "positions", "loss_mask", "sampler_logp",
                "advantage", "doc_sample_index", "parent_ids")  # fmt: skip
        a = {k: batch.arrays[k] for k in rows if k in batch.arrays}
        a = {k: jnp.asarray(v.reshape(-1, v.shape[-1])) for k, v in a.items()}  # every row
        seg, idx = np.asarray(a["segment_ids"]), np.asarray(a["doc_sample_index"])
        doc = np.take_along_axis(idx, seg, axis=1)
        pos = np.asarray(a["positions"])
        lp = np.where(doc >= 0, table[np.maximum(doc, 0), pos], np.nan)  # NaN off documents
        lp = jnp.asarray(lp, jnp.float32)
        kw = dict(epsilon_high=1.25) if loss_type == "cispo" else {}
        weight, wm = sampler_weights(
            lp - 0.05, a["sampler_logp"], a["loss_mask"], a["segment_ids"],
            num_segments=a["advantage"].shape[-1], mode="sequence_truncate", cap=2.0,
        )  # fmt: skip
        t = policy_loss_terms(
            lp, lp - 0.1, lp + 0.2, a["advantage"], a["loss_mask"], a["segment_ids"],
            jnp.abs(lp), loss_type=loss_type, importance_sampling_level=level, beta=0.1,
            max_completion_length=8, entropy_threshold=jnp.float32(1.0), is_weight_BT=weight,
            parent_ids_BT=a.get("parent_ids"), **kw,
        )  # fmt: skip
        return {"num": t.numerator, "den": t.denominator, **t.metrics, **wm}

    for level in ("token", "sequence"):
        mine, theirs = terms(shared, level), terms(plain, level)
        assert set(mine) == set(theirs)
        for k in theirs:
            np.testing.assert_allclose(
                np.asarray(mine[k], np.float64), np.asarray(theirs[k], np.float64),
                rtol=1e-5, err_msg=f"{level} {k}",
            )  # fmt: skip
            assert np.all(np.isfinite(np.asarray(mine[k]))), k
