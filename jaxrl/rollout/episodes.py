"""Multi-turn episodes with tools: generate → parse tool calls → run them → append the tool
messages → generate again, up to ``grpo.max_turns`` assistant turns (docs/tools.md).

An episode is one GRPO row. Its completion is everything after the prompt: the model's turns
(each ending with its EOS, the end-of-turn token) and, between them, the **environment
tokens**, the tool messages as the chat template renders them plus the template's glue (TRL's
``_get_tool_suffix_ids``: the tokens a conversation gains after the assistant's EOS when its tool
messages and the next generation prompt are added, from a conversation of the prompt and a
placeholder call). Environment tokens stay in the context the model conditions on (for later
turns, and in the training document, so old / reference / current log-probs condition on them
too) but carry loss mask 0, sampler log-prob 0 and so no loss and no advantage; the exact
engine's normalisers count loss-mask tokens only, so they count model tokens alone.

``grpo.max_completion_length`` is the episode's token budget (model and environment tokens
together): a turn cut by it, or tool messages that would leave no room for a model token, end
the episode as truncated (the tool messages are then dropped, as TRL does).

The model's tokens are kept as sampled, never re-tokenised from text. Reward functions receive
the whole conversation after the prompt as messages (TRL): the assistant turns (with
``tool_calls``), the tool messages, the final answer.

Random keys. Row ``r``'s turn ``t`` is sampled with ``fold_in(fold_in(key, r), t)``, where
``key`` is the generation's key (the run key folded with the generation index): a function of
(run key, generation, row, turn) only, so an episode does not depend on which other rows run
with it, on batching or on the mesh.

Engine calls. With the engine (a backend with ``session``: ``jaxrl/generate/session.py``) episode
r lives in decode slot r for the whole episode: turn t of every live episode is one engine call,
and the environment's tokens are appended to the slot's cache after what it holds, so the
conversation is never prefilled again. Another backend (a remote server) gets each episode's
whole conversation as token ids, one ``generate`` per episode and turn. Both give the same
episodes (tokens and masks; log-probs to float reduction order).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.config import ConfigError
from jaxrl.data.tokenizer import TextTokenizer
from jaxrl.generate.backend import RolloutBackend
from jaxrl.generate.session import EngineSession
from jaxrl.rollout.tools.toolbox import Toolbox, ToolResult

__all__ = [
    "Episode",
    "EpisodeBatch",
    "EpisodeRows",
    "EpisodeRunner",
    "episode_key",
    "episode_metrics",
    "episode_rows",
]

STAT_NAMES = ("turns", "tool_calls", "tool_failures")  # per-row episode statistics


def episode_key(key: jax.Array, row: int, turn: int) -> jax.Array:
    """The sampling key of ``row``'s ``turn`` in a generation whose key is ``key``."""
    return jax.random.fold_in(jax.random.fold_in(key, row), turn)


@dataclasses.dataclass
class Episode:
    """One row's conversation while it runs (host lists, appended turn by turn)."""

    prompt_ids: list[int]
    prompt: list[dict[str, Any]]  # the prompt messages
    functions: dict[str, Any]  # tool name → function (an environment's bound methods)
    environment: Any = None
    tokens: list[int] = dataclasses.field(default_factory=list)  # the completion so far
    mask: list[float] = dataclasses.field(default_factory=list)  # 1 model token, 0 environment
    logps: list[float] = dataclasses.field(default_factory=list)  # sampler's; 0 on environment
    messages: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    failures: dict[str, int] = dataclasses.field(default_factory=dict)
    truncated: bool = False
    done: bool = False
    routes: list[np.ndarray] = dataclasses.field(default_factory=list)  # MoE: expert ids of
    # the context's tokens, in pieces [t, Lm, K] (router replay, docs/moe.md)

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.tokens


@dataclasses.dataclass(frozen=True)
class EpisodeRows:
    """What the episodes add to sampled rows: the completion's loss mask (0 on environment
    tokens) and per-row statistics (``STAT_NAMES``), in row order."""

    masks: list[np.ndarray]  # float32 per completion token
    stats: dict[str, np.ndarray]  # int64 [B] each

    def rows(self, idx: np.ndarray) -> EpisodeRows:
        return EpisodeRows([self.masks[i] for i in idx], {k: v[idx] for k, v in self.stats.items()})

    @staticmethod
    def concat(parts: Sequence[EpisodeRows]) -> EpisodeRows:
        return EpisodeRows(
            [m for p in parts for m in p.masks],
            {k: np.concatenate([p.stats[k] for p in parts]) for k in STAT_NAMES},
        )


def episode_metrics(stats: Sequence[Mapping[str, np.ndarray]]) -> dict[str, float]:
    """``tools/calls_per_episode``, ``tools/call_rate`` (episodes with a call),
    ``tools/failures`` (failed calls, all rows), ``tools/failure_rate`` (per call) and
    ``turns/mean`` over the rows of some batches."""
    turns = np.concatenate([s["turns"] for s in stats])
    calls = np.concatenate([s["tool_calls"] for s in stats])
    failures = np.concatenate([s["tool_failures"] for s in stats])
    return {
        "tools/calls_per_episode": float(calls.mean()),
        "tools/call_rate": float((calls > 0).mean()),
        "tools/failures": float(failures.sum()),
        "tools/failure_rate": float(failures.sum() / max(calls.sum(), 1)),
        "turns/mean": float(turns.mean()),
    }


@dataclasses.dataclass(frozen=True)
class EpisodeBatch:
    """A generation's finished episodes as sampled rows, and what reward functions receive."""

    completions: list[np.ndarray]  # int32 per row: model and environment tokens
    logps: list[np.ndarray]  # float32 per completion token; 0 on environment tokens
    truncated: np.ndarray  # bool [B]: cut by the token budget
    reward_completions: list[list[dict[str, Any]]]  # the messages after the prompt, per row
    columns: dict[str, list[Any]]  # the dataset columns, plus ``environments`` when set
    rows: EpisodeRows
    routes: list[np.ndarray] | None = None  # MoE: expert ids [P + C, Lm, K] per row


class EpisodeRunner:
    """Runs the episodes of a generation with a sampler (module docstring).

    ``max_completion_length``: the episode's token budget; ``max_turns``: assistant turns.
    """

    def __init__(
        self,
        tokenizer: TextTokenizer,
        toolbox: Toolbox,
        *,
        max_turns: int,
        max_completion_length: int,
    ):
        self.tokenizer = tokenizer
        self.toolbox = toolbox
        self.max_turns = max_turns
        self.budget = max_completion_length
        self.unknown_text = 0  # environment characters the tokenizer could not represent

    # -- environment tokens -------------------------------------------------------------------
    def environment_ids(
        self, prompt: Sequence[Mapping[str, Any]], tool_messages: Sequence[Mapping[str, Any]]
    ) -> list[int]:
        """The tokens that follow an assistant turn's EOS when ``tool_messages`` and the next
        generation prompt are added (TRL's suffix, on the episode's own prompt)."""
        placeholder = {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": tool_messages[0]["name"], "arguments": {}},
                }
            ],
        }
        before = [*prompt, placeholder]
        tok = self.tokenizer
        tools = self.toolbox.schemas
        prefix = tok.apply_chat_template(before, add_generation_prompt=False, tools=tools)
        eos = [i for i, t in enumerate(prefix) if t == tok.eos_id]
        if eos:
            prefix = prefix[: eos[-1] + 1]
        allow, tok.allow_unknown = tok.allow_unknown, True  # a tool's text never stops the run
        count = tok.unknown_count
        try:
            full = tok.apply_chat_template(
                [*before, *tool_messages], add_generation_prompt=True, tools=tools
            )
        finally:
            tok.allow_unknown = allow
            self.unknown_text += tok.unknown_count - count
        if full[: len(prefix)] != prefix:
            raise ConfigError(
                "grpo.tools: the chat template does not render a conversation with tool "
                "messages as an extension of the conversation before them, so the environment's "
                "tokens cannot be located; use a template that appends turns (docs/tools.md)"
            )
        return full[len(prefix) :]

    # -- the loop -----------------------------------------------------------------------------
    def start(
        self, prompt_ids: Sequence[np.ndarray], prompts: Sequence[Any], rows: Sequence[Mapping]
    ) -> list[Episode]:
        """A fresh episode per row; an environment's ``reset`` gets the row."""
        episodes = []
        for ids, prompt, row in zip(prompt_ids, prompts, rows, strict=True):
            if isinstance(prompt, str):
                raise ConfigError(
                    "grpo.tools / grpo.environment need conversational prompts (lists of "
                    f"messages) rendered by a chat template; got the text prompt {prompt[:60]!r}: "
                    "write the prompt column as [{role: user, content: ...}]"
                )
            env, functions = self.toolbox.new_episode({"prompt": prompt, **row})
            episodes.append(
                Episode([int(t) for t in ids], list(prompt), functions, environment=env)
            )
        return episodes

    def run(
        self,
        sampler: RolloutBackend,
        prompt_ids: Sequence[np.ndarray],
        prompts: Sequence[Any],
        rows: Sequence[Mapping[str, Any]],
        key: jax.Array,
        sampling: Any = None,
    ) -> list[Episode]:
        """Every row's episode, sampled with ``sampler`` (weights already loaded) and
        ``episode_key(key, row, turn)``. A backend with sessions (``Sampler.session``) runs
        them in its slots (:meth:`run_in_slots`); another (``session`` gives None) re-sends
        each conversation, one ``generate`` per episode and turn."""
        episodes = self.start(prompt_ids, prompts, rows)
        longest = max(len(ep.prompt_ids) for ep in episodes)
        session = sampler.session(len(episodes), longest + self.budget)
        if session is not None:
            return self.run_in_slots(session, episodes, key, sampling, sampler.max_new_tokens)
        for turn in range(self.max_turns):
            for r, ep in enumerate(episodes):
                if not ep.done:
                    self.turn(ep, sampler, episode_key(key, r, turn), sampling, turn)
        return episodes

    def run_in_slots(
        self,
        session: EngineSession,
        episodes: list[Episode],
        key: jax.Array,
        sampling: Any,
        max_new_tokens: int,
    ) -> list[Episode]:
        """:meth:`run` in an engine session (``jaxrl/generate/session.py``): episode r lives in
        slot r; turn t of every live episode is one engine call, which appends what the
        environment said after the slot's conversation (the prompt, on turn 0) and generates
        the next model turn from it. Turn t of row r draws with ``fold_in(episode_key(key, r,
        t), 0)``, the key request 0 of a ``generate`` call with ``episode_key`` gets, so the
        episodes are those of the re-sending path, token for token (log-probs to float
        reduction order). ``session`` is closed at the end."""
        n = max_new_tokens
        pending: list[list[int] | None] = [list(ep.prompt_ids) for ep in episodes]
        try:
            for turn in range(self.max_turns):
                live = [not ep.done for ep in episodes]
                if not any(live):
                    break
                keys = _request_keys(key, len(episodes), turn)
                limits = [min(n, self.budget - len(ep.tokens)) for ep in episodes]
                res = session.generate(
                    [p if go else None for p, go in zip(pending, live, strict=True)],
                    keys,
                    sampling,
                    max_tokens=limits,
                )
                for r, ep in enumerate(episodes):
                    if live[r]:
                        m = int(res.lengths[r])
                        if res.routes is not None:  # the new tokens', then the kept ones'
                            kept = min(m, self.budget - len(ep.tokens))
                            ep.routes.append(res.routes[r][: len(pending[r]) + kept])
                        pending[r] = self.record(
                            ep, res.tokens[r, :m], res.logprobs[r, :m], bool(res.truncated[r]),
                            turn,
                        )  # fmt: skip
        finally:
            session.close()
        return episodes

    def sample(
        self,
        sampler: RolloutBackend,
        prompt_ids: Sequence[np.ndarray],
        prompts: Sequence[Any],
        columns: Mapping[str, Sequence[Any]],
        key: jax.Array,
    ) -> EpisodeBatch:
        """:meth:`run` on a generation's rows (``columns``: the dataset's other fields, one value
        per row), as sampled rows."""
        rows = [{k: v[i] for k, v in columns.items()} for i in range(len(prompts))]
        eps = self.run(sampler, prompt_ids, prompts, rows, key)
        out = {k: list(v) for k, v in columns.items()}
        if self.toolbox.environment is not None:  # TRL passes them to reward functions
            out["environments"] = [e.environment for e in eps]
        return EpisodeBatch(
            completions=[np.asarray(e.tokens, np.int32) for e in eps],
            logps=[np.asarray(e.logps, np.float32) for e in eps],
            truncated=np.asarray([e.truncated for e in eps], bool),
            reward_completions=[e.messages for e in eps],
            columns=out,
            rows=episode_rows(eps),
            routes=[np.concatenate(e.routes) for e in eps] if all(e.routes for e in eps) else None,
        )

    def turn(
        self, ep: Episode, sampler: RolloutBackend, key: jax.Array, sampling: Any, turn: int
    ) -> None:
        """One assistant turn of ``ep`` by re-sending its conversation, then its tool calls."""
        res = sampler.generate([ep.context], key, sampling)
        n = int(res.lengths[0])
        if res.routes is not None:  # the whole context was run again: its routes replace
            ep.routes = [res.routes[0][: len(ep.context) + min(n, self.budget - len(ep.tokens))]]
        self.record(ep, res.tokens[0, :n], res.logprobs[0, :n], bool(res.truncated[0]), turn)

    def record(
        self, ep: Episode, tokens: np.ndarray, logps: np.ndarray, truncated: bool, turn: int
    ) -> list[int] | None:
        """Add a generated assistant turn (``tokens`` and their log-probs; ``truncated``: cut
        by its token limit) to ``ep``, then run its tool calls (if any): the environment's
        tokens appended, or None when the episode ended."""
        n = len(tokens)
        room = self.budget - len(ep.tokens)
        cut = n > room
        ids = [int(t) for t in tokens[: min(n, room)]]
        ep.tokens += ids
        ep.mask += [1.0] * len(ids)
        ep.logps += [float(x) for x in logps[: len(ids)]]
        ep.turns += 1
        text = self.tokenizer.decode(ids)
        if cut or truncated:
            ep.messages.append({"role": "assistant", "content": text})
            ep.done = ep.truncated = True
            return None
        parsed = self.toolbox.parser.parse(text)
        if not parsed.calls and not parsed.errors:
            ep.messages.append({"role": "assistant", "content": text})
            ep.done = True
            return None
        ep.messages.append(parsed.message())
        ep.tool_calls += len(parsed.calls) + len(parsed.errors)
        if turn + 1 >= self.max_turns:  # no turn left to read the results
            ep.done = True
            return None
        results = [self.toolbox.run(c, ep.functions) for c in parsed.calls]
        results += [ToolResult("unknown", str({"error": e}), "malformed") for e in parsed.errors]
        for result in results:
            if result.failure is not None:
                ep.failures[result.failure] = ep.failures.get(result.failure, 0) + 1
        tool_messages = [r.message() for r in results]
        env_ids = self.environment_ids(ep.prompt, tool_messages)
        if len(ep.tokens) + len(env_ids) >= self.budget:  # no room left for a model token
            ep.done = ep.truncated = True
            return None
        ep.messages += tool_messages
        ep.tokens += env_ids
        ep.mask += [0.0] * len(env_ids)
        ep.logps += [0.0] * len(env_ids)
        return list(env_ids)


@functools.partial(jax.jit, static_argnums=(1,))
def _request_keys(key: jax.Array, rows: int, turn: int | jax.Array) -> jax.Array:
    """``fold_in(episode_key(key, r, turn), 0)`` for every row r, in one program."""
    return jax.vmap(lambda r: jax.random.fold_in(episode_key(key, r, turn), 0))(jnp.arange(rows))


def episode_rows(episodes: Sequence[Episode]) -> EpisodeRows:
    """The masks and statistics of finished episodes (``EpisodeRows``)."""
    stats = {
        "turns": [e.turns for e in episodes],
        "tool_calls": [e.tool_calls for e in episodes],
        "tool_failures": [sum(e.failures.values()) for e in episodes],
    }
    return EpisodeRows(
        [np.asarray(e.mask, np.float32) for e in episodes],
        {k: np.asarray(v, np.int64) for k, v in stats.items()},
    )
