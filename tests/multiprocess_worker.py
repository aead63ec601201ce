"""One process of the multi-process test (``test_multiprocess.py``), or the same work in-process.

``python tests/multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_DIR`` joins a
``jax.distributed`` run of NUM_PROCESSES CPU processes with 8 / NUM_PROCESSES devices each (gloo
collectives), then samples, scores and builds a reference cache on a global 2×2×2 mesh with
parameters sharded over fsdp and tensor, and saves what it got to ``OUT_DIR/process_<id>.npz``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def run(cache_dir: str | Path) -> dict:
    """Sampler, scorer and reference cache on ``make_mesh(2, 2, 2)``; host results."""
    import jax
    import numpy as np
    from flax import nnx

    from jaxrl.data.documents import dpo_documents, prompt_completion_document
    from jaxrl.data.tasks import ArithmeticTask
    from jaxrl.data.tokenizer import char_tokenizer
    from jaxrl.generate.sampler import Sampler, SamplingParams
    from jaxrl.models.model_config import ModelConfig
    from jaxrl.models.sharding import state_shardings
    from jaxrl.models.transformer import Transformer
    from jaxrl.runtime.mesh import make_mesh
    from jaxrl.train import ref_cache
    from jaxrl.train.score import Scorer

    mesh = make_mesh(2, 2, 2)
    task = ArithmeticTask(max_digits=2)
    tok = char_tokenizer(task.alphabet)
    config = ModelConfig.tiny(
        tok.vocab_size,
        num_hidden_layers=1,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
    )

    make = lambda: nnx.split(Transformer(config, rngs=nnx.Rngs(0)))  # noqa: E731
    graphdef, abstract = jax.eval_shape(make)
    # created on their shards (no process holds the whole model), the same on every process
    params = jax.jit(lambda: make()[1], out_shardings=state_shardings(abstract, mesh))()

    sampler = Sampler(config, max_new_tokens=6, eos_id=tok.eos_id, pad_id=tok.pad_id, mesh=mesh)
    sampler.load_params(params)
    prompts = [tok.encode(f"{a}+{a + 3}=", add_bos=True) for a in range(10)]  # 10 → 12 rows
    res = sampler.generate(prompts, jax.random.key(3), SamplingParams(temperature=1.0))
    seqs = [
        prompt_completion_document(p, c)[0] for p, c in zip(prompts, res.completions(), strict=True)
    ]
    scorer = Scorer(graphdef, mesh=mesh, row_len=32, rows_per_call=4)
    logp = scorer.token_logprobs(params, seqs, temperature=0.9)

    docs, _, _ = dpo_documents(task.dataset("dpo", 12), tok, max_length=16)
    identity = ref_cache.CacheIdentity(
        model="init",
        weights=ref_cache.weight_fingerprint(params),
        dataset={"rows": docs.num_pairs},
        data=docs.fingerprint(),
        tokenizer="char",
        max_length=16,
        packing={"max_tokens": 64, "packing": "ffd"},
        layout={"rows": "pack_pairs"},
        loss_type="sigmoid",
        aggregation="sum",
        param_dtype="float32",
        dtype="float32",
        fp32_lm_head=False,
        logprob_chunk=0,
    )
    cache = ref_cache.load_or_build(
        cache_dir,
        identity,
        docs.num_pairs,
        lambda sink: ref_cache.fill_pair_logps(scorer, params, docs, sink, max_tokens=64),
    )
    return {
        "tokens": res.tokens,
        "logprobs": res.logprobs,
        "scored": np.concatenate(logp),
        "chosen": cache.chosen,
        "rejected": cache.rejected,
        "files": np.asarray(sorted(os.listdir(cache_dir))),
    }


def main(process_id: int, num_processes: int, port: int, out_dir: str) -> None:
    os.environ["XLA_FLAGS"] = (
        f"--xla_force_host_platform_device_count={8 // num_processes}"  # before jax starts
    )
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    import numpy as np

    jax.config.update("jax_default_matmul_precision", "highest")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        f"localhost:{port}", num_processes=num_processes, process_id=process_id
    )
    assert len(jax.devices()) == 8 and len(jax.local_devices()) == 8 // num_processes
    out = run(Path(out_dir) / "cache")
    np.savez(Path(out_dir) / f"process_{process_id}.npz", **out)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
