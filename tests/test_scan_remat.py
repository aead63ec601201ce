"""``model.scan_layers`` and ``model.remat`` change how the layer stack is compiled, never the
numbers: logits, gradients, HF files, sharded training, sampled tokens and training losses
equal the unrolled model's (docs/scale_out.md)."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from hf_fixtures import hf_logits, write_case
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file

from jaxrl.cli import main
from jaxrl.config import ConfigError, load_run_config
from jaxrl.generate.sampler import Sampler, SamplingParams
from jaxrl.models import ModelConfig, Transformer, from_pretrained, save_pretrained
from jaxrl.models.layer_stack import remat_policy_names, unstack_blocks
from jaxrl.models.sharding import state_partition_specs
from jaxrl.runtime.mesh import make_mesh
from jaxrl.train.run_io.metrics import read_metrics
from jaxrl.trainers.sft import SFTTrainer

V = 64
IDS = np.random.default_rng(0).integers(0, V, (2, 12))
SEGMENTS = np.array([[1] * 5 + [2] * 7, [1] * 9 + [0] * 3])  # two packed documents, padding


def _config(model_type: str, **overrides) -> ModelConfig:
    """3 layers, GQA (H=4, K=2), untied head; qwen2 has q/k/v biases, qwen3 q/k norms."""
    fields = dict(
        model_type=model_type,
        num_hidden_layers=3,
        hidden_size=32,
        intermediate_size=48,
        tie_word_embeddings=False,
    )
    return ModelConfig.tiny(V, **(fields | overrides))


def _randomised(model: Transformer, seed: int) -> Transformer:
    """The model with every parameter (norm scales and biases too) random: a layer mix-up or a
    skipped norm cannot hide behind ones and zeros."""
    graphdef, state = nnx.split(model)
    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    leaves = [
        0.2 * jax.random.normal(k, x.shape, x.dtype) + 0.5
        for k, x in zip(keys, leaves, strict=True)
    ]
    return nnx.merge(graphdef, jax.tree.unflatten(tree, leaves))


def _loss_and_grads(model: Transformer) -> tuple[np.ndarray, dict[tuple, np.ndarray]]:
    """Logits and the gradient of a packed-row loss, by state path (jitted)."""
    graphdef, state = nnx.split(model)

    def loss(state):
        logits = nnx.merge(graphdef, state)(IDS, segment_ids=SEGMENTS)
        return jnp.sum(jax.nn.log_softmax(logits)[..., 0] * (SEGMENTS > 0)), logits

    (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(state)
    paths = jax.tree_util.tree_leaves_with_path(grads)
    return np.asarray(logits), {_path(p): np.asarray(g) for p, g in paths}


def _path(key_path) -> tuple:
    """``("layers", 0, "attn", "q_kernel")``: dict keys and list indices (not ``.value``)."""
    keys = [k for k in key_path if not isinstance(k, jax.tree_util.GetAttrKey)]
    return tuple(getattr(k, "key", getattr(k, "idx", k)) for k in keys)


def _stacked(per_layer: dict[tuple, np.ndarray]) -> dict[tuple, np.ndarray]:
    """An unrolled model's tree in the scanned layout, ``("layers", i, *rest)`` →
    ``("layers", *rest)`` stacked over i with numpy (the reference for the scanned layout)."""
    out: dict[tuple, list] = {}
    for path, x in sorted(per_layer.items(), key=lambda item: str(item[0])):
        if path[0] == "layers":
            out.setdefault(("layers", *path[2:]), []).append((path[1], x))
        else:
            out[path] = x
    return {
        p: np.stack([x for _, x in sorted(v)]) if isinstance(v, list) else v for p, v in out.items()
    }


@functools.cache
def _unrolled(model_type: str) -> tuple[Transformer, np.ndarray, dict]:
    model = _randomised(Transformer(_config(model_type), rngs=nnx.Rngs(0)), seed=1)
    logits, grads = _loss_and_grads(model)
    return model, logits, _stacked(grads)


def _as(model: Transformer, **layout) -> Transformer:
    """The same weights in another layout (``scan_layers`` / ``remat``), stacked with numpy."""
    config = dataclasses.replace(model.config, **layout)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
    values = {
        _path(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(nnx.state(model))
    }
    if config.scan_layers:
        values = _stacked(values)
    leaves = [
        jnp.asarray(values[_path(p)]) for p, _ in jax.tree_util.tree_leaves_with_path(abstract)
    ]
    return nnx.merge(graphdef, jax.tree.unflatten(jax.tree.structure(abstract), leaves))


LAYOUTS = [
    dict(scan_layers=True),
    dict(scan_layers=True, remat="block"),
    dict(scan_layers=False, remat="block"),
]


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=["scan", "scan+block", "block"])
def test_logits_and_gradients_equal_the_unrolled_model(model_type, layout):
    model, want_logits, want_grads = _unrolled(model_type)
    logits, grads = _loss_and_grads(_as(model, **layout))
    np.testing.assert_allclose(logits, want_logits, atol=1e-5, rtol=1e-5)
    if layout["scan_layers"]:
        assert grads.keys() == want_grads.keys()
    else:
        grads = _stacked(grads)
    for path, g in want_grads.items():
        assert np.abs(g).max() > 0, path  # every parameter matters to the loss
        np.testing.assert_allclose(grads[path], g, atol=1e-5, rtol=1e-5, err_msg=str(path))


@pytest.mark.parametrize(
    "policy", ["nothing_saveable", "dots_with_no_batch_dims_saveable", "checkpoint_dots"]
)
def test_remat_policies_give_the_same_gradients(policy):
    model, want_logits, want_grads = _unrolled("qwen3")
    logits, grads = _loss_and_grads(_as(model, scan_layers=True, remat=policy))
    np.testing.assert_allclose(logits, want_logits, atol=1e-5, rtol=1e-5)
    for path, g in want_grads.items():
        np.testing.assert_allclose(grads[path], g, atol=1e-5, rtol=1e-5, err_msg=str(path))


def _grad_program(model: Transformer, tokens: int):
    graphdef, state = nnx.split(model)
    ids = jnp.zeros((1, tokens), jnp.int32)
    loss = lambda s: jnp.sum(nnx.merge(graphdef, s)(ids)[..., 0])  # noqa: E731
    return jax.jit(jax.grad(loss)), state, ids


@pytest.mark.parametrize("scan_layers", [False, True])
def test_remat_recomputes_in_the_backward_pass_and_scan_compiles_one_block(scan_layers):
    """The settings reach the compiled program: ``remat`` checkpoints the blocks and the
    recomputation survives XLA (more matmuls); ``scan_layers`` turns N block copies into one
    scan, where the checkpoint also cuts the temporaries (XLA:CPU schedules an unrolled
    model's recomputation early, so there it saves no memory: docs/scale_out.md)."""
    model = _unrolled("llama")[0]
    programs = {r: _grad_program(_as(model, scan_layers=scan_layers, remat=r), 256)
                for r in ("none", "block")}  # fmt: skip
    prims = {
        r: set(re.findall(r"= (\w+)\[", str(jax.make_jaxpr(f)(s))))
        for r, (f, s, _) in programs.items()
    }
    remat = {r: any(p.startswith(("remat", "checkpoint")) for p in ps) for r, ps in prims.items()}
    assert remat == {"none": False, "block": True}
    assert all(("scan" in ps) == scan_layers for ps in prims.values())
    compiled = {r: f.lower(s).compile() for r, (f, s, _) in programs.items()}
    dots = {r: len(re.findall(r" dot\(", c.as_text())) for r, c in compiled.items()}
    assert dots["block"] > dots["none"], dots
    temp = {r: c.memory_analysis().temp_size_in_bytes for r, c in compiled.items()}
    if scan_layers:
        assert temp["block"] < 0.6 * temp["none"], temp


def test_a_seed_gives_the_same_weights_in_both_layouts():
    config = _config("qwen2")
    unrolled = nnx.state(Transformer(config, rngs=nnx.Rngs(3)))
    scanned = Transformer(dataclasses.replace(config, scan_layers=True), rngs=nnx.Rngs(3))
    values = {_path(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(unrolled)}
    got = {
        _path(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(nnx.state(scanned))
    }
    want = _stacked(values)
    assert got.keys() == want.keys()
    for path in want:
        np.testing.assert_array_equal(got[path], want[path], err_msg=str(path))
    q = scanned.layers.attn.q_kernel
    assert q.shape == (3, 32, 4, 8) and q.get_metadata()["out_sharding"][0] == "layers"
    blocks = unstack_blocks(scanned.layers)  # the inverse gives the per-layer blocks back
    assert len(blocks) == 3 and blocks[2].attn.q_kernel.get_metadata()["out_sharding"][0] == "embed"
    np.testing.assert_array_equal(
        blocks[2].mlp.up_kernel[...], values[("layers", 2, "mlp", "up_kernel")]
    )


def test_scanned_model_runs_in_tree_mode():
    model, want_logits, _ = _unrolled("qwen2")
    scanned = _as(model, scan_layers=True, remat="block")
    with nnx.set_graph_mode(False):
        graphdef, state = nnx.split(scanned)
        logits = jax.jit(lambda s: nnx.merge(graphdef, s)(IDS, segment_ids=SEGMENTS))(state)
    np.testing.assert_allclose(np.asarray(logits), want_logits, atol=1e-5, rtol=1e-5)


def test_the_layer_axis_is_never_sharded():
    mesh = make_mesh(2, 2, 2)
    config = dataclasses.replace(_config("qwen3"), scan_layers=True)
    abstract = nnx.state(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
    specs = state_partition_specs(abstract, mesh=mesh)
    assert specs["layers"]["attn"]["q_kernel"].get_value() == P(None, "fsdp", "tensor", None)
    assert specs["layers"]["mlp"]["down_kernel"].get_value() == P(None, "tensor", "fsdp")
    assert specs["layers"]["input_norm"]["scale"].get_value() == P(None, "fsdp")


# ------------------------------------------------------------------ HF checkpoints


def _load_hf(path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("case", ["qwen2_tied", "qwen3"])
def test_scanned_model_round_trips_through_transformers(case, tmp_path):
    src, hf_model = write_case(case, tmp_path)
    want = hf_logits(hf_model, IDS)
    scanned = from_pretrained(src, scan_layers=True)
    assert scanned.layers.mlp.up_kernel.shape[0] == 2
    np.testing.assert_allclose(np.asarray(scanned(IDS)), want, atol=1e-4, rtol=1e-4)
    save_pretrained(scanned, tmp_path / "scanned")
    save_pretrained(from_pretrained(src), tmp_path / "unrolled")
    got, ref = (load_file(tmp_path / d / "model.safetensors") for d in ("scanned", "unrolled"))
    assert got.keys() == ref.keys() and "model.layers.1.self_attn.q_proj.weight" in got
    for name in ref:
        np.testing.assert_array_equal(got[name], ref[name], err_msg=name)
    reloaded = _load_hf(tmp_path / "scanned")
    np.testing.assert_allclose(hf_logits(reloaded, IDS), want, atol=1e-4, rtol=1e-4)


def test_scanned_load_places_the_stacked_tensors_on_their_shards(tmp_path):
    src, hf_model = write_case("qwen2", tmp_path, max_shard_size="20KB")
    mesh = make_mesh(2, 2, 2)
    sharded = from_pretrained(src, scan_layers=True, mesh=mesh)
    q = sharded.layers.attn.q_kernel.get_value()  # [N, D, H*Dh...] split over fsdp and tensor
    assert q.sharding.spec == P(None, "fsdp", "tensor", None)
    assert q.addressable_shards[0].data.shape == (2, 32, 2, 16)
    whole = from_pretrained(src)
    np.testing.assert_array_equal(
        np.asarray(q), np.stack([np.asarray(whole.layers[i].attn.q_kernel[...]) for i in (0, 1)])
    )
    ids = IDS[:, :8]
    np.testing.assert_allclose(
        np.asarray(sharded(ids)), hf_logits(hf_model, ids), atol=2e-5, rtol=2e-5
    )


# ------------------------------------------------------------------ sampling


@pytest.mark.parametrize("on_mesh", [False, True], ids=["one device", "2x2x2 sharded"])
def test_the_kv_cache_sampler_gives_the_unrolled_tokens(on_mesh):
    model = Transformer(_config("qwen3"), rngs=nnx.Rngs(2))  # near-uniform: rows differ
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [4], [60, 3, 17, 20, 9]]
    mesh = make_mesh(2, 2, 2) if on_mesh else None
    results = {}
    for scan in (False, True):
        m = _as(model, scan_layers=scan)
        params = nnx.state(m, nnx.Param)
        if mesh is not None:
            from jaxrl.models.sharding import state_shardings

            params = jax.device_put(params, state_shardings(params, mesh))
        sampler = Sampler(m.config, max_new_tokens=10, eos_id=V - 1, pad_id=0, mesh=mesh)
        sampler.load_params(params)
        results[scan] = [
            sampler.generate(prompts, jax.random.key(7), s)
            for s in (SamplingParams(temperature=0.0), SamplingParams(temperature=1.0))
        ]
    for want, got in zip(results[False], results[True], strict=True):
        np.testing.assert_array_equal(got.tokens, want.tokens)
        np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)
        np.testing.assert_array_equal(got.lengths, want.lengths)
    assert len(set(map(tuple, results[False][1].tokens))) == len(prompts)  # rows differ


# ------------------------------------------------------------------ training


def _sft_trainer(tmp_path, *sets):
    cfg = load_run_config(
        "configs/sft_tiny.yaml",
        [f"output_dir={tmp_path}", "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2",
         "sft.per_device_train_batch_size=8", "optimizer.warmup_steps=0", "task.train_size=256",
         "model.init={hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 4, "
         "num_key_value_heads: 2, intermediate_size: 64}", *sets],
    )  # fmt: skip
    return SFTTrainer(cfg)


@pytest.mark.slow
def test_scanned_training_on_a_data_fsdp_tensor_mesh(tmp_path):
    """Stacked parameters and moments live split over fsdp (embed) and tensor, stay so after a
    step, and the step equals the unrolled model's on the same mesh."""
    rows = {}
    for scan, remat in (("false", "none"), ("true", "block")):
        trainer = _sft_trainer(tmp_path / scan, f"model.scan_layers={scan}", f"model.remat={remat}")
        session = trainer.session
        if scan == "true":
            q = session.state.params["layers"]["attn"]["q_kernel"].get_value()
            assert q.sharding.spec == P(None, "fsdp", "tensor", None)
            assert q.shape[0] == 2 and q.addressable_shards[0].data.size == q.size // 4
            mu = session.state.opt_state[0].mu["layers"]["attn"]["q_kernel"].get_value()
            assert mu.sharding.spec == q.sharding.spec
            shardings = jax.tree.map(lambda x: x.sharding, session.state.params)
        rows[scan] = [session.train_on(trainer.next_batch()) for _ in range(2)]
    assert jax.tree.map(lambda x: x.sharding, session.state.params) == shardings
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(
            [r[key] for r in rows["true"]], [r[key] for r in rows["false"]], rtol=1e-5
        )


def _cli_losses(out, *sets) -> list[float]:
    args = ["train", "configs/sft_tiny.yaml", "--set", "max_steps=3", "--set", f"output_dir={out}"]
    for s in ("logging.progress=false", "task.eval_size=8", *sets):
        args += ["--set", s]
    assert main(args) == 0
    return [r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]


@pytest.mark.slow
def test_cli_losses_do_not_depend_on_scan_or_remat(tmp_path, capsys):
    runs = {
        (scan, remat): _cli_losses(
            tmp_path / f"{scan}_{remat}", f"model.scan_layers={scan}", f"model.remat={remat}"
        )
        for scan, remat in [("false", "none"), ("true", "none"), ("false", "block"),
                            ("true", "block")]
    }  # fmt: skip
    want = runs[("false", "none")]
    assert len(want) == 3 and want[2] != want[0]  # the updates move the loss
    for layout, losses in runs.items():
        np.testing.assert_allclose(losses, want, rtol=1e-5, err_msg=str(layout))
    # an orbax checkpoint keeps its layer layout: resuming in the other one is refused clearly
    capsys.readouterr()
    args = ["train", "configs/sft_tiny.yaml", "--set", f"output_dir={tmp_path / 'true_none'}"]
    args += ["--set", "max_steps=4", "--set", "model.scan_layers=false"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "model.scan_layers=true but this run has model.scan_layers=false" in err


def test_remat_and_scan_layers_are_validated_with_the_choices():
    with pytest.raises(ConfigError, match="model.remat='blocks'.*dots_with_no_batch_dims_saveable"):
        load_run_config("configs/sft_tiny.yaml", ["model.remat=blocks"])
    # policy factories need arguments: not accepted by name
    assert "save_only_these_names" not in remat_policy_names()
    assert {"nothing_saveable", "checkpoint_dots", "everything_saveable"} <= set(
        remat_policy_names()
    )
    cfg = load_run_config("configs/sft_tiny.yaml", ["model.remat=nothing_saveable"])
    assert cfg.model.remat == "nothing_saveable"
    with pytest.raises(ValueError, match="ModelConfig.remat='save_only_these_names'"):
        _config("llama", remat="save_only_these_names")
    with pytest.raises(ValueError, match="ModelConfig.scan_layers=1"):
        _config("llama", scan_layers=1)
