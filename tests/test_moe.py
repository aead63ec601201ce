"""Qwen3-MoE (jaxrl/models/moe/, docs/moe.md) against transformers' Qwen3MoeForCausalLM.

A tiny random checkpoint (8 experts, top-2, 2 layers) written by transformers: fp32 logits
within 1e-4 on unpacked and packed rows, scanned and unrolled; greedy decoding equal to
``generate``; the export round trip; the grouped matmul against a float64 one-hot reference;
expert LoRA merged equal to the adapted forward; routes recorded by decode equal a forward's.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from jaxrl.generate.sampler import Sampler, SamplingParams
from jaxrl.models import hf
from jaxrl.models.kv_cache import KVCache
from jaxrl.models.lora import merge, with_adapters
from jaxrl.models.model_config import LoraSpec, ModelConfig
from jaxrl.models.moe.grouped import ExpertWeights, experts, route

transformers.utils.logging.set_verbosity_error()

TINY_MOE = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    max_position_embeddings=64,
)


def write_moe_checkpoint(path, seed: int = 0, **overrides) -> None:
    """A random Qwen3MoeForCausalLM saved by transformers; weights at std 0.15 (routers 0.5) so
    the routing is far from uniform and every expert is used."""
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(
        transformers.Qwen3MoeConfig(**{**TINY_MOE, **overrides})
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.5 if name.endswith("mlp.gate.weight") else 0.15)
    model.save_pretrained(path)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3moe")
    write_moe_checkpoint(path)
    return path


def _hf_logits(path, ids_BT) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        return model(torch.tensor(np.asarray(ids_BT))).logits.numpy()


IDS = np.random.default_rng(0).integers(0, 96, size=(2, 12))


@pytest.mark.parametrize("scan", [False, True])
def test_logits_match_transformers_unpacked_and_packed(ckpt, scan):
    model = hf.from_pretrained(ckpt, scan_layers=scan)
    ref = _hf_logits(ckpt, IDS)
    np.testing.assert_allclose(np.asarray(model(IDS)), ref, atol=1e-4, rtol=0)
    # packed: both rows in one (documents 1 and 2), positions restart per document
    seg = np.repeat([[1, 2]], 12, axis=1)
    packed = np.asarray(model(IDS.reshape(1, -1), segment_ids=seg))[0]
    np.testing.assert_allclose(packed, ref.reshape(-1, ref.shape[-1]), atol=1e-4, rtol=0)


def test_dense_and_sparse_layers_mixed_match_transformers(tmp_path):
    write_moe_checkpoint(tmp_path, seed=1, num_hidden_layers=3, mlp_only_layers=[1])
    model = hf.from_pretrained(tmp_path)
    assert model.config.moe_layers == (0, 2)
    np.testing.assert_allclose(np.asarray(model(IDS)), _hf_logits(tmp_path, IDS), atol=1e-4)
    with pytest.raises(ValueError, match="scan_layers"):
        hf.from_pretrained(tmp_path, scan_layers=True)


def test_greedy_decoding_equals_transformers_generate(ckpt):
    model = hf.from_pretrained(ckpt)
    prompts = [IDS[0, :5].tolist(), IDS[1, :3].tolist()]
    sampler = Sampler(
        model.config,
        max_new_tokens=8,
        eos_id=95,
        pad_id=0,
        sampling=SamplingParams(temperature=0.0),
    )
    sampler.load_params(model)
    ours = [c.tolist() for c in sampler.generate(prompts, jax.random.key(0)).completions()]
    ref = transformers.AutoModelForCausalLM.from_pretrained(ckpt).eval()
    theirs = []
    for p in prompts:
        x = torch.tensor([p])
        y = ref.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=8,
                         eos_token_id=95, pad_token_id=0)  # fmt: skip
        theirs.append(y[0, len(p) :].tolist())
    assert ours == theirs


@pytest.mark.parametrize("scan", [False, True])
def test_export_round_trip(ckpt, tmp_path, scan):
    model = hf.from_pretrained(ckpt, scan_layers=scan)
    hf.save_pretrained(model, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["architectures"] == ["Qwen3MoeForCausalLM"]
    assert (written["num_experts"], written["num_experts_per_tok"]) == (8, 2)
    np.testing.assert_allclose(_hf_logits(tmp_path, IDS), _hf_logits(ckpt, IDS), atol=1e-6)
    again = hf.from_pretrained(tmp_path, scan_layers=scan)
    np.testing.assert_array_equal(np.asarray(again(IDS)), np.asarray(model(IDS)))
    other = hf.from_pretrained(tmp_path, scan_layers=not scan)  # the files serve both layouts
    np.testing.assert_allclose(np.asarray(other(IDS)), np.asarray(model(IDS)), atol=1e-5)


def test_grouped_matmul_equals_dense_one_hot_reference_float64():
    rng = np.random.default_rng(1)
    n, d, f, e, k = 37, 16, 8, 8, 3
    x = rng.normal(size=(n, d)).astype(np.float32)
    router = rng.normal(size=(d, e)).astype(np.float32)
    gate, up = (rng.normal(size=(e, d, f)).astype(np.float32) * 0.3 for _ in range(2))
    down = rng.normal(size=(e, f, d)).astype(np.float32) * 0.3
    routing = route(jnp.asarray(x), jnp.asarray(router), k, norm_topk_prob=True)
    out = np.asarray(experts(jnp.asarray(x), routing, ExpertWeights(gate, up, down)))
    # float64: softmax, top-k by sorting, every expert on every token, one-hot combination
    x64, r64 = x.astype(np.float64), router.astype(np.float64)
    logits = x64 @ r64
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    top = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(probs, top, -1)
    w /= w.sum(-1, keepdims=True)
    combine = np.zeros((n, e))
    np.put_along_axis(combine, top, w, -1)
    g = np.einsum("nd,edf->enf", x64, gate.astype(np.float64))
    u = np.einsum("nd,edf->enf", x64, up.astype(np.float64))
    y = np.einsum("enf,efd->end", g / (1 + np.exp(-g)) * u, down.astype(np.float64))
    ref = np.einsum("end,ne->nd", y, combine)
    np.testing.assert_array_equal(np.asarray(routing.ids_NK), top)
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=1e-5)
    # a sharded view of the experts adds up to the whole: partial sums of [0, 4) and [4, 8)
    halves = [
        experts(jnp.asarray(x), routing, ExpertWeights(gate[s], up[s], down[s]), (s.start, 4))
        for s in (slice(0, 4), slice(4, 8))
    ]
    np.testing.assert_allclose(np.asarray(halves[0] + halves[1]), out, atol=1e-6)


def test_expert_lora_merges_to_the_adapted_forward(ckpt):
    model = hf.from_pretrained(ckpt)
    adapted = with_adapters(
        model, LoraSpec(rank=2, alpha=4.0, target_modules=("q_proj", "gate_proj", "down_proj"))
    )
    moe = adapted.layers[0].mlp
    assert moe.expert_gate_lora.lora_a.shape == (8, 32, 2)
    assert moe.expert_up_lora is None
    np.testing.assert_array_equal(np.asarray(adapted(IDS)), np.asarray(model(IDS)))  # B = 0
    for layer in adapted.layers:  # non-zero B: the adapters now change the output
        for lora in (layer.mlp.expert_gate_lora, layer.mlp.expert_down_lora, layer.attn.q_lora):
            lora.lora_b[...] = 0.3 * jax.random.normal(jax.random.key(2), lora.lora_b.shape)
    out = np.asarray(adapted(IDS))
    assert np.abs(out - np.asarray(model(IDS))).max() > 1e-3
    np.testing.assert_allclose(np.asarray(merge(adapted)(IDS)), out, atol=2e-5)


def test_decode_records_the_routes_of_a_forward(ckpt):
    model = hf.from_pretrained(ckpt, scan_layers=True)
    _, trace = model.routed_hidden_states(IDS)
    cache = KVCache.empty(model.config, 2, 16)
    pos = np.broadcast_to(np.arange(12), IDS.shape)
    _, cache, routes = model.routed_decode(IDS[:, :7], pos[:, :7], np.ones((2, 7), np.int32), cache)
    _, _, step = model.routed_decode(IDS[:, 7:], pos[:, 7:], np.ones((2, 5), np.int32), cache)
    np.testing.assert_array_equal(np.concatenate([routes, step], 1), trace.routes_BTLK)
    # replaying a forward's own routes changes no bit
    hidden, _ = model.routed_hidden_states(IDS)
    replayed, again = model.routed_hidden_states(IDS, replay_routes=trace.routes_BTLK)
    np.testing.assert_array_equal(np.asarray(replayed), np.asarray(hidden))
    np.testing.assert_array_equal(np.asarray(again.routes_BTLK), np.asarray(trace.routes_BTLK))


def test_moe_config_errors_name_the_field():
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelConfig.tiny(32, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=5,
                         moe_intermediate_size=8)  # fmt: skip
    with pytest.raises(ValueError, match="num_experts"):
        ModelConfig.tiny(32, num_experts=4)


def test_sampler_records_the_routes_a_scoring_forward_takes(ckpt):
    """The engine's recorded routes (prefill for the prompt, one decode step per fed completion
    token) equal a teacher-forced forward's on prompt + completion; the last token is -1."""
    model = hf.from_pretrained(ckpt, scan_layers=True)
    prompts = [IDS[0, :5].tolist(), IDS[1, :3].tolist(), IDS[0, :5].tolist()]
    sampler = Sampler(model.config, max_new_tokens=6, eos_id=95, pad_id=0, prefill_chunk=4)
    sampler.load_params(model)
    result = sampler.generate(prompts, jax.random.key(1))
    assert result.routes is not None
    for prompt, completion, routes in zip(
        prompts, result.completions(), result.routes, strict=True
    ):
        ids = np.asarray([prompt + completion.tolist()])
        assert routes.shape == (ids.shape[1], 2, 2)
        _, trace = model.routed_hidden_states(ids)
        np.testing.assert_array_equal(routes[:-1], np.asarray(trace.routes_BTLK)[0, :-1])
        assert (routes[-1] == -1).all()
    # 20 requests in 16 slots with long-tailed limits: the last steps run compacted (8 rows)
    compacted = Sampler(model.config, max_new_tokens=6, eos_id=95, pad_id=0, max_slots=16)
    assert compacted.engine_shape(16, 64, 8).compact == (8,)
    compacted.load_params(model)
    rows = [IDS[i % 2, : 2 + i % 4].tolist() for i in range(20)]
    limits = [6 if i in (3, 17) else 1 + i % 3 for i in range(20)]
    result = compacted.generate(rows, jax.random.key(2), max_tokens=limits)
    for prompt, completion, routes in zip(rows, result.completions(), result.routes, strict=True):
        _, trace = model.routed_hidden_states(np.asarray([prompt + completion.tolist()]))
        np.testing.assert_array_equal(routes[:-1], np.asarray(trace.routes_BTLK)[0, :-1])


def test_replayed_routes_reach_the_router_gradient(ckpt):
    """Replaying other experts' ids changes the output and still differentiates the router
    (its probabilities are gathered at the replayed ids); ids < 0 keep the router's choice."""
    model = hf.from_pretrained(ckpt)
    _, trace = model.routed_hidden_states(IDS)
    own = np.asarray(trace.routes_BTLK)
    perturbed = (own + 1) % 8
    graphdef, state = nnx.split(model)

    def loss(state, replay):
        hidden, _ = nnx.merge(graphdef, state).routed_hidden_states(IDS, replay_routes=replay)
        return jnp.sum(jnp.sin(hidden))

    g_own = jax.grad(loss)(state, own)
    g_free = jax.grad(lambda s: jnp.sum(jnp.sin(nnx.merge(graphdef, s).hidden_states(IDS))))(state)
    g_pert = jax.grad(loss)(state, perturbed)
    router = lambda g: np.asarray(g["layers"][0]["mlp"]["router_kernel"][...])  # noqa: E731
    np.testing.assert_array_equal(router(g_own), router(g_free))  # own routes: no bit changes
    assert np.abs(router(g_pert)).max() > 1e-4
    assert np.abs(router(g_pert) - router(g_own)).max() > 1e-4
    # negative ids: the router's own top-k for those tokens
    none = np.full_like(own, -1)
    np.testing.assert_array_equal(
        np.asarray(model.routed_hidden_states(IDS, replay_routes=none)[0]),
        np.asarray(model.hidden_states(IDS)),
    )


def test_load_balance_loss_matches_transformers_float64(tmp_path):
    """The step-wide aux loss (jaxrl/losses/load_balance.py) equals transformers'
    ``load_balancing_loss_func`` over the whole batch (its padding masked), in value and in
    the routers' gradient against the float64 HF model, although the engine runs the two
    documents as two micro-batches (per micro-batch, the loss would differ: checked)."""
    from jaxrl.config import SFTConfig
    from jaxrl.losses.load_balance import AUX_LOSS
    from jaxrl.runtime.mesh import make_mesh
    from jaxrl.train.accumulate import make_accumulate
    from jaxrl.train.objectives import load_balance_constants, on_params, sft_objective

    qwen3_moe = transformers.models.qwen3_moe.modeling_qwen3_moe
    write_moe_checkpoint(tmp_path, output_router_logits=True, router_aux_loss_coef=1.0)
    lens = (12, 7)
    ids = [IDS[0].tolist(), IDS[1, : lens[1]].tolist()]
    # transformers, float64: the two documents as a padded batch
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float64, experts_implementation="eager"
    )
    mask = torch.tensor([[1] * n + [0] * (12 - n) for n in lens])
    x = torch.tensor([d + [0] * (12 - len(d)) for d in ids])
    logits = ref(x, attention_mask=mask, output_router_logits=True).router_logits
    aux = qwen3_moe.load_balancing_loss_func(logits, 8, 2, mask)
    aux.backward()
    aux = float(aux.detach())
    grads = [ref.model.layers[i].mlp.gate.weight.grad.numpy().T for i in range(2)]
    with torch.no_grad():  # per micro-batch (one document each), averaged: not the same loss
        per_mb = [
            qwen3_moe.load_balancing_loss_func(
                ref(torch.tensor([d]), output_router_logits=True).router_logits, 8, 2
            )
            for d in ids
        ]
    assert abs(float(sum(per_mb)) / 2 - aux) > 1e-3
    # jaxrl: one document per micro-batch, no loss token (the step loss is the aux loss)
    model = hf.from_pretrained(tmp_path)
    assert model.config.router_aux_loss_coef == 1.0
    graphdef, params = nnx.split(model)
    batch = {k: np.zeros((1, 2, 16), np.int32) for k in ("tokens", "targets", "segment_ids")}
    for m, d in enumerate(ids):
        batch["tokens"][0, m, : len(d)] = d
        batch["segment_ids"][0, m, : len(d)] = 1
    batch["loss_mask"] = np.zeros((1, 2, 16), np.float32)
    batch["doc_sample_index"] = np.zeros((1, 2, 2), np.int32)
    loss_fn = on_params(sft_objective(SFTConfig()), graphdef)
    acc = make_accumulate(
        loss_fn, make_mesh(1), step_constants=load_balance_constants(model.config)
    )
    sums = jax.jit(acc)(params, batch, np.array([0, 2], np.int32))
    assert float(sums.denominator) == 0  # the step loss = numerator / max(0, 1)
    np.testing.assert_allclose(float(sums.numerator), aux, rtol=1e-5)
    total, rows = sums.metrics[AUX_LOSS]
    assert float(rows) == 2 * sum(lens)
    np.testing.assert_allclose(float(total / rows), aux, rtol=1e-5)
    for i, g in enumerate(grads):
        ours = np.asarray(sums.grads["layers"][i]["mlp"]["router_kernel"][...])
        np.testing.assert_allclose(ours, g, atol=1e-5 * np.abs(g).max(), rtol=0)


def test_scorer_replays_recorded_routes(ckpt):
    """``grpo.router_replay: rollout`` scores old log-probs with the recorded routes too
    (``Scorer.token_logprobs(token_fields=)``, packed as the train step's rows): the model's
    own routes change no bit, perturbed ones change the log-probs."""
    from jaxrl.models.moe.trace import route_fields
    from jaxrl.train.forward import ROUTE_REPLAY
    from jaxrl.train.score import Scorer

    model = hf.from_pretrained(ckpt)
    graphdef, params = nnx.split(model)
    seqs = [IDS[0], IDS[1, :7], IDS[1, 3:12]]
    own = [np.asarray(model.routed_hidden_states(s[None])[1].routes_BTLK)[0] for s in seqs]

    def fields(routes):
        out = {}
        for s, r in zip(seqs, routes, strict=True):
            for name, values in route_fields(r, len(s)).items():
                out.setdefault(name, []).append(values)
        out[ROUTE_REPLAY] = [np.ones(len(s), np.float32) for s in seqs]
        return out

    scorer = Scorer(graphdef, row_len=32)
    plain = scorer.token_logprobs(params, seqs)
    replayed = scorer.token_logprobs(params, seqs, token_fields=fields(own))
    perturbed = scorer.token_logprobs(params, seqs, token_fields=fields([(r + 1) % 8 for r in own]))
    for a, b, c in zip(plain, replayed, perturbed, strict=True):
        np.testing.assert_array_equal(a, b)
        assert np.abs(a[1:] - c[1:]).min() > 0  # every predicted token moved


def test_session_turns_record_the_routes_of_a_forward(ckpt):
    """A tool episode's engine session (generate/session.py): each turn's routes (its new
    tokens' then its generated tokens', the last one included) concatenate to a teacher-forced
    forward's routes over the whole conversation; a slot sitting a turn out records none."""
    model = hf.from_pretrained(ckpt, scan_layers=True)
    sampler = Sampler(model.config, max_new_tokens=5, eos_id=95, pad_id=0)
    sampler.load_params(model)
    session = sampler.session(2, 40)
    keys = jax.random.split(jax.random.key(3), 2)
    prompts = [IDS[0, :5].tolist(), IDS[1, :3].tolist()]
    first = session.generate(prompts, keys, max_tokens=[5, 4])
    env = [IDS[1, 5:9].tolist(), None]  # slot 1 sits turn 2 out
    second = session.generate(env, keys, max_tokens=[3, 1])
    assert second.routes[1].shape[0] == 0
    seq = prompts[0] + first.tokens[0, : first.lengths[0]].tolist() + env[0]
    seq += second.tokens[0, : second.lengths[0]].tolist()
    routes = np.concatenate([first.routes[0], second.routes[0]])
    assert routes.shape == (len(seq), 2, 2)
    _, trace = model.routed_hidden_states(np.asarray([seq]))
    np.testing.assert_array_equal(routes, np.asarray(trace.routes_BTLK)[0])


def test_expert_parallel_sampler_equals_expert_1(ckpt, monkeypatch):
    """The sampler's decode mesh takes the run's ``mesh.expert`` (decode_layout.py): on a
    trainer mesh (data 4, expert 2) it decodes on that mesh, holds 1/2 of each expert kernel per
    device, runs every MoE block expert-parallel (prefill and decode), and its greedy completions
    and recorded routes equal the expert=1 decode mesh's (data 8), token for token; a synchronous
    sampler reads the trainer's arrays on that mesh in place."""
    from jaxrl.generate.decode_layout import sampler_mesh
    from jaxrl.models.moe import expert_parallel
    from jaxrl.models.sharding import state_shardings
    from jaxrl.runtime.mesh import make_mesh

    seen = []
    axis = expert_parallel.expert_axis
    monkeypatch.setattr(expert_parallel, "expert_axis", lambda e: seen.append(axis(e)) or seen[-1])
    model = hf.from_pretrained(ckpt, scan_layers=True)
    prompts = [IDS[0, :5].tolist(), IDS[1, :3].tolist(), IDS[0, :4].tolist(), IDS[1, :6].tolist()]
    out = {}
    for e, trainer in ((1, make_mesh(8, 1, 1)), (2, make_mesh(4, 1, 1, expert=2))):
        mesh = sampler_mesh(trainer, model.config, 0, 100.0)
        assert mesh is trainer and mesh.shape.get("expert", 1) == e
        seen.clear()
        sampler = Sampler(model.config, max_new_tokens=6, eos_id=95, pad_id=0, prefill_chunk=4,
                          sampling=SamplingParams(temperature=0.0), mesh=mesh)  # fmt: skip
        sampler.load_params(model)
        result = sampler.generate(prompts, jax.random.key(0))
        assert seen and set(seen) == {0 if e == 1 else 2}  # traced expert-parallel (or not)
        leaves = jax.tree.leaves_with_path(sampler.weights.get())
        kernel = next(x for p, x in leaves if "expert_up_kernel" in jax.tree_util.keystr(p))
        assert kernel.shape[0] == 8  # the engine's layers are unrolled: [E, D, F] per layer
        assert {s.data.shape[0] for s in kernel.addressable_shards} == {8 // e}
        out[e] = ([c.tolist() for c in result.completions()], result.routes, sampler.weight_bytes())
    assert out[2][0] == out[1][0]
    for a, b in zip(out[2][1], out[1][1], strict=True):
        np.testing.assert_array_equal(a, b)
    c = model.config  # half of the expert kernels leave each device
    experts = c.num_hidden_layers * 3 * c.num_experts * c.hidden_size * c.moe_intermediate_size
    itemsize = np.dtype(c.dtype).itemsize
    assert out[1][2] - out[2][2] == experts * itemsize // 2
    # the trainer's (data 4, expert 2) arrays already lie in the decode layout: read in place
    # (decoded in the trainer's layer scan: rollout.scan_layers)
    params = nnx.split(model, nnx.Param)[1]
    params = jax.device_put(params, state_shardings(params, trainer))
    in_place = Sampler(model.config, max_new_tokens=6, eos_id=95, pad_id=0, mesh=trainer,
                       copy_params=False, scan_layers=True)  # fmt: skip
    in_place.load_params(params)
    assert not in_place.weights.copied


def test_cpu_chunked_grouped_matmul_equals_ragged_dot():
    """On the CPU the grouped matmul goes ``CPU_CHUNK`` sorted pairs at a time (docs/moe.md):
    the output is ``ragged_dot``'s to the bit (rows past the groups, as on an expert shard,
    stay zero), the input's gradient too, the kernel's within fp32 summation order."""
    from jaxrl.models.moe import grouped

    kx, kw, kc = jax.random.split(jax.random.key(0), 3)
    m = 3 * grouped.CPU_CHUNK + 17
    x, w = jax.random.normal(kx, (m, 16)), jax.random.normal(kw, (5, 16, 8))
    sizes = jnp.asarray([300, 0, 250, 140, 80], jnp.int32)  # 770 of the pairs are routed here
    ct = jax.random.normal(kc, (m, 8))

    def run(f):
        y, vjp = jax.vjp(lambda x, w: f(x, w, sizes), x, w)
        return (y, *vjp(ct))

    want = jax.jit(lambda: run(jax.lax.ragged_dot))()
    got = jax.jit(lambda: run(grouped.ragged_dot))()
    np.testing.assert_array_equal(got[0], want[0])
    assert not np.any(np.asarray(got[0])[770:])
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_allclose(got[2], want[2], rtol=1e-5, atol=1e-5)
    hlo = jax.jit(grouped.ragged_dot).lower(x, w, sizes).as_text()
    assert "while" in hlo  # the chunked loop, not one [5, M, 16] expansion
