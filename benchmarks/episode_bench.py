"""Tool episodes: rollout time in the engine's slots vs re-sending each conversation.

    python benchmarks/episode_bench.py [--rows 64] [--repeat 3] [--budget 72] [--turns 2]

The shapes of ``configs/grpo_tools_tiny.yaml`` (the character tokenizer of the calculator task,
D=128, 2 layers, 64 rows = 8 problems x G=8, an episode budget of 72 tokens, 2 turns,
temperature 1) on an untrained model whose every turn is read as a ``calc`` call (so every
episode runs all its turns) and which ends a turn on any of 40 ids (so turns are short, as a
trained model's are). Two ways, interleaved after a warm-up each (compiles):

- **slots**: ``EpisodeRunner.run`` with the ``Sampler`` (an engine session: one engine call per
  turn, the environment's tokens appended to live slots);
- **re-send**: the same sampler behind the bare rollout interface (one ``generate`` of the whole
  conversation per episode and turn: the path before issue 30 item 5, and a remote backend's).

Both give the same episodes token for token (checked here too).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from episode_fixtures import AlwaysCall, Resend  # noqa: E402
from flax import nnx  # noqa: E402

from jaxrl.data.tool_task import CalculatorTask, calc  # noqa: E402
from jaxrl.generate.sampler import Sampler, SamplingParams  # noqa: E402
from jaxrl.models.model_config import ModelConfig  # noqa: E402
from jaxrl.models.transformer import Transformer  # noqa: E402
from jaxrl.rollout.episodes import EpisodeRunner  # noqa: E402
from jaxrl.rollout.tools.toolbox import Toolbox  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--budget", type=int, default=72)
    ap.add_argument("--turns", type=int, default=2)
    args = ap.parse_args()
    task = CalculatorTask(min_digits=3, max_digits=3, ops="*")
    tok = task.tokenizer()
    config = ModelConfig.tiny(
        tok.vocab_size, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=384,
    )  # fmt: skip
    sampler = Sampler(
        config, max_new_tokens=args.budget, eos_id=[tok.eos_id, *range(4, 44)],
        pad_id=tok.pad_id, sampling=SamplingParams(temperature=1.0),
    )  # fmt: skip
    sampler.load_params(Transformer(config, rngs=nnx.Rngs(0)))
    runner = EpisodeRunner(
        tok, Toolbox([calc], parser=AlwaysCall()), max_turns=args.turns,
        max_completion_length=args.budget,
    )  # fmt: skip
    problems = [r["prompt"] for r in task.rows("grpo", args.rows // args.group)]
    prompts = [p for p in problems for _ in range(args.group)]
    rows = [{} for _ in prompts]
    ids = [np.asarray(tok.apply_chat_template(p), np.int32) for p in prompts]
    ways = {"slots": sampler, "re-send": Resend(sampler)}
    times: dict[str, list[float]] = {w: [] for w in ways}
    out = {}
    for i in range(args.repeat + 1):  # the first round warms up (compiles)
        for name, backend in ways.items():
            t0 = time.perf_counter()
            out[name] = runner.run(backend, ids, prompts, rows, jax.random.key(i))
            if i:
                times[name].append(time.perf_counter() - t0)
    a, b = out["slots"], out["re-send"]
    same = all(x.tokens == y.tokens and x.mask == y.mask for x, y in zip(a, b, strict=True))
    turns = np.mean([e.turns for e in a])
    tokens = sum(len(e.tokens) for e in a)
    print(f"rows {len(a)}, turns/episode {turns:.2f}, completion tokens {tokens}, "
          f"episodes equal: {same}, load {os.getloadavg()}")  # fmt: skip
    print("| way | s/rollout median (min-max) |\n|---|---|")
    for name, ts in times.items():
        print(f"| {name} | {statistics.median(ts):.2f} ({min(ts):.2f}-{max(ts):.2f}) |")
    ratio = statistics.median(times["re-send"]) / statistics.median(times["slots"])
    print(f"speed-up: {ratio:.2f}x")


if __name__ == "__main__":
    main()
