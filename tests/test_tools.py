"""Tools (docs/tools.md): Hermes tool-call parsing, schemas equal to transformers'
``get_json_schema``, rendering with the Qwen2.5 template equal to transformers'
``apply_chat_template(tools=...)`` (environment tokens included), and every failure (unknown
tool, bad arguments, exception, timeout, crash, memory) becoming a tool message."""

from __future__ import annotations

import enum
import time
from pathlib import Path
from typing import Any, Literal

import pytest
from hf_fixtures import write_tiny_tokenizer
from tool_fixtures import boom, sleepy
from transformers import AutoTokenizer
from transformers.utils import get_json_schema as hf_get_json_schema

from jaxrl.config import ConfigError, GRPOConfig, load_run_config
from jaxrl.data.tokenizer import load_tokenizer
from jaxrl.data.tool_task import CalculatorTask, calc
from jaxrl.rollout.episodes import EpisodeRunner
from jaxrl.rollout.tools.calls import HermesToolParser, ToolCall
from jaxrl.rollout.tools.schema import SchemaError, get_json_schema
from jaxrl.rollout.tools.toolbox import (
    Toolbox,
    load_environment,
    load_tools,
    toolbox_from_config,
)

# -- schemas ----------------------------------------------------------------------------------


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


def add(a: int, b: float = 1.0) -> float:
    """Add two numbers.

    Args:
        a: The first number
        b: The second
            number, on two lines

    Returns:
        The sum.
    """
    return a + b


def search(
    query: str,
    tags: list[str] | None = None,
    limits: dict[str, int] | None = None,
    mode: Literal["fast", "exact"] = "fast",
    pair: tuple[int, str] = (1, "a"),
    color: Color = Color.RED,
    anything: Any = None,
    either: int | str = 0,
    flag: bool = False,
    unit: str = "m",
) -> list[dict]:
    """Search the index
    for documents.

    Args:
        query (str): What to look for
        tags: Tags to filter on
        limits: Per-field limits
        mode: How to search
        pair: A pair
        color: A color
        anything: Any value
        either: A number or a name
        flag: Whether to flag
        unit: The unit (choices: ["m", "km"])
    """
    return []


class Counter:
    def reset(self, **row: Any) -> None:
        self.count = int(row.get("start", 0))

    def increment(self, by: int) -> int:
        """Add to the counter.

        Args:
            by: How much to add
        """
        self.count += by
        return self.count

    def _private(self) -> None:
        """Not a tool."""


@pytest.mark.parametrize(
    "func",
    [add, search, calc, Counter.increment, Counter().increment],
    ids=["add", "search", "calc", "unbound_method", "bound_method"],  # stable across workers
)
def test_schema_equals_transformers(func):
    assert get_json_schema(func) == hf_get_json_schema(func)


def test_schema_errors_name_the_tool_and_the_fix():
    def undocumented(x: int) -> int:
        return x

    def untyped(x):
        """Do it.

        Args:
            x: a value
        """

    def undescribed(x: int, y: int) -> int:
        """Do it.

        Args:
            x: a value
        """

    with pytest.raises(SchemaError, match="'undocumented' has no docstring"):
        get_json_schema(undocumented)
    with pytest.raises(SchemaError, match="argument 'x' of tool 'untyped' has no type hint"):
        get_json_schema(untyped)
    with pytest.raises(SchemaError, match="does not describe argument 'y'"):
        get_json_schema(undescribed)


# -- parsing ----------------------------------------------------------------------------------

PARSER = HermesToolParser()


def test_parse_one_call_with_content():
    text = (
        'Let me compute.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    )
    turn = PARSER.parse(text)
    assert turn.content == "Let me compute."
    assert turn.calls == [ToolCall("add", {"a": 1, "b": 2})] and turn.errors == []
    assert turn.message() == {
        "role": "assistant",
        "content": "Let me compute.",
        "tool_calls": [
            {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
        ],
    }


def test_parse_multiple_calls_and_string_arguments():
    text = (
        '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
        '<tool_call>{"name": "calc", "arguments": "{\\"x\\": \\"2*3\\"}"}</tool_call>'
    )
    turn = PARSER.parse(text)
    assert turn.content == ""
    assert turn.calls == [ToolCall("add", {"a": 1}), ToolCall("calc", {"x": "2*3"})]


@pytest.mark.parametrize(
    "body, message",
    [
        ('{"name": "add", "arguments": {"a": 1}', "not valid JSON"),
        ('{"arguments": {"a": 1}}', '"name"'),
        ('["add"]', '"name"'),
        ('{"name": "add", "arguments": [1, 2]}', "must be a JSON object"),
    ],
)
def test_parse_malformed_calls_are_errors_not_exceptions(body, message):
    text = (
        f'<tool_call>{body}</tool_call><tool_call>{{"name": "add", "arguments": {{}}}}</tool_call>'
    )
    turn = PARSER.parse(text)
    assert turn.calls == [ToolCall("add", {})]
    assert len(turn.errors) == 1 and message in turn.errors[0]


def test_parse_unclosed_call_and_plain_text():
    assert PARSER.parse('<tool_call>{"name": "add"').errors == ["<tool_call> without </tool_call>"]
    plain = PARSER.parse("The answer is 4.")
    assert plain.calls == [] and plain.errors == [] and plain.content == "The answer is 4."


# -- running ----------------------------------------------------------------------------------


def test_failures_become_tool_messages_in_process():
    box = Toolbox([calc, boom, sleepy], timeout=0.3)
    _, functions = box.new_episode({})
    ok = box.run(ToolCall("calc", {"x": "12*3"}), functions)
    assert ok.failure is None and ok.message() == {"role": "tool", "name": "calc", "content": "36"}
    cases = {
        "unknown_tool": ToolCall("mul", {"a": 1}),
        "bad_arguments": ToolCall("calc", {"y": "1"}),
        "exception": ToolCall("boom", {"x": 1}),
        "timeout": ToolCall("sleepy", {"seconds": 5.0}),
    }
    start = time.perf_counter()
    for kind, call in cases.items():
        result = box.run(call, functions)
        assert result.failure == kind, (kind, result)
        assert result.content.startswith("{'error': ")
    assert time.perf_counter() - start < 2.0  # the hung call was abandoned at its deadline
    assert (
        "unknown tool 'mul'; the tools are boom, calc, sleepy"
        in box.run(cases["unknown_tool"], functions).content
    )
    assert "KeyError" in box.run(cases["exception"], functions).content


def test_subprocess_isolation_kills_hung_tools_and_limits_memory():
    path = Path(__file__).with_name("tool_fixtures.py")
    specs = [f"{path}:{name}" for name in ("sleepy", "hog", "die", "boom")]
    box = Toolbox(
        load_tools(specs), timeout=2.0, isolation="subprocess", memory_limit_mb=200, specs=specs
    )
    try:
        _, functions = box.new_episode({})
        assert box.run(ToolCall("hog", {"megabytes": 1}), functions).content == str(2**20)
        start = time.perf_counter()
        hung = box.run(ToolCall("sleepy", {"seconds": 60.0}), functions)
        assert hung.failure == "timeout" and time.perf_counter() - start < 5.0
        big = box.run(ToolCall("hog", {"megabytes": 400}), functions)
        assert big.failure == "exception" and "MemoryError" in big.content
        crash = box.run(ToolCall("die", {"code": 3}), functions)
        assert crash.failure == "crashed" and "exit 3" in crash.content
        err = box.run(ToolCall("boom", {"x": 1}), functions)
        assert err.failure == "exception" and "KeyError" in err.content
        assert box.run(ToolCall("hog", {"megabytes": 2}), functions).failure is None  # restarted
    finally:
        box.close()


def test_environment_state_is_per_episode():
    box = Toolbox([calc], environment=load_environment(Counter))
    assert box.names == ["calc", "increment"]
    env_a, fa = box.new_episode({"start": 10})
    env_b, fb = box.new_episode({"start": 0})
    assert box.run(ToolCall("increment", {"by": 2}), fa).content == "12"
    assert box.run(ToolCall("increment", {"by": 2}), fa).content == "14"
    assert box.run(ToolCall("increment", {"by": 5}), fb).content == "5"
    assert (env_a.count, env_b.count) == (14, 5)


def test_config_fields_and_loading_errors(tmp_path):
    with pytest.raises(ConfigError, match="tools=.*give a list"):
        GRPOConfig(tools="pkg.mod:fn")
    with pytest.raises(ConfigError, match="max_turns=0"):
        GRPOConfig(max_turns=0)
    with pytest.raises(ConfigError, match="tool_isolation='process'"):
        GRPOConfig(tool_isolation="process")
    with pytest.raises(ConfigError, match="has no function 'nope'"):
        toolbox_from_config(GRPOConfig(tools=("jaxrl.data.tool_task:nope",)))
    with pytest.raises(ConfigError, match="must define reset"):
        load_environment(Color)
    # a relative tool file in a YAML file is relative to that file
    (tmp_path / "my_tools.py").write_text(
        "def twice(x: int) -> int:\n    '''Double.\n\n    Args:\n        x: a number\n    '''\n"
        "    return 2 * x\n"
    )
    (tmp_path / "run.yaml").write_text("algorithm: grpo\ngrpo:\n  tools: [my_tools.py:twice]\n")
    cfg = load_run_config(tmp_path / "run.yaml")
    box = toolbox_from_config(cfg.grpo)
    assert box.names == ["twice"] and box.run(ToolCall("twice", {"x": 4}), {"twice": box.tools[0]})


# -- rendering --------------------------------------------------------------------------------


def test_qwen25_episode_tokens_equal_transformers_render(tmp_path):
    """prompt (rendered with tools) + the model's turn + the environment tokens jaxrl appends ==
    transformers' ``apply_chat_template(conversation, tools=..., add_generation_prompt=True)``
    of the whole conversation, token for token; and the next turn continues it."""
    d = write_tiny_tokenizer(tmp_path / "qwen", "qwen2.5")
    hf, ours = AutoTokenizer.from_pretrained(d), load_tokenizer(d)
    box = Toolbox([add, calc])
    runner = EpisodeRunner(ours, box, max_turns=3, max_completion_length=10_000)
    prompt = [{"role": "user", "content": "What is 12 + 30?"}]
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 12, "b": 30}}}
    turn1 = {"role": "assistant", "content": "", "tool_calls": [call]}
    tools = [{"role": "tool", "name": "add", "content": "42"}]
    tools2 = [*tools, {"role": "tool", "name": "add", "content": "error: nope"}]
    want_prompt = hf.apply_chat_template(
        prompt, tools=box.schemas, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert ours.apply_chat_template(prompt, tools=box.schemas) == want_prompt
    for tool_messages in (tools, tools2):
        full = hf.apply_chat_template(
            [*prompt, turn1, *tool_messages],
            tools=box.schemas,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        # the model's turn: what the template renders for it, through <|im_end|>
        through = hf.apply_chat_template(
            [*prompt, turn1], tools=box.schemas, tokenize=True, return_dict=False
        )
        model_turn = through[len(want_prompt) : len(through) - 1]  # drop the "\n" after eos
        assert model_turn[-1] == ours.eos_id
        text = ours.decode(model_turn)
        assert PARSER.parse(text).calls == [ToolCall("add", {"a": 12, "b": 30})]
        env = runner.environment_ids(prompt, tool_messages)
        assert want_prompt + model_turn + env == full
        assert ours.decode(env, stop_at_eos=False).count("<tool_response>") == len(tool_messages)


def test_calculator_template_round_trips_a_transcript():
    tok = CalculatorTask().tokenizer()
    task = CalculatorTask()
    messages = task.transcript("123*456=", "56088", use_tool=True)
    ids, mask = tok.chat_assistant_mask(messages)
    text = tok.decode(ids, stop_at_eos=False)
    assert text == (
        '123*456=<tool_call>{"name":"calc","arguments":{"x":"123*456"}}</tool_call>'
        "<tool_response>56088</tool_response>56088"
    )
    turn = HermesToolParser().parse(
        tok.decode([t for t, m in zip(ids, mask, strict=True) if m][:-7])
    )
    assert turn.calls == [ToolCall("calc", {"x": "123*456"})]
    # the environment tokens (tool response) are exactly the unmasked span between the turns
    runner = EpisodeRunner(tok, Toolbox([calc]), max_turns=2, max_completion_length=100)
    env = runner.environment_ids(messages[:1], [messages[2]])
    first_end = mask.index(1) + mask[mask.index(1) :].index(0)
    assert ids[first_end : first_end + len(env)] == env
    assert all(m == 0 for m in mask[first_end : first_end + len(env)])


def test_grpo_prompts_are_rendered_with_the_tools(tmp_path):
    """GRPO's prompt ids of conversational rows carry the tools' schemas, as transformers renders
    them (the trainer passes ``Toolbox.schemas``)."""
    from jaxrl.data.datasets import rows_dataset
    from jaxrl.data.documents import grpo_prompts

    d = write_tiny_tokenizer(tmp_path / "qwen", "qwen2.5")
    hf, ours = AutoTokenizer.from_pretrained(d), load_tokenizer(d)
    schemas = Toolbox([add, calc]).schemas
    prompts = [[{"role": "user", "content": "What is 1 + 2?"}], [{"role": "user", "content": "Hi"}]]
    data = rows_dataset([{"prompt": p} for p in prompts], "grpo", source="t", split="train")
    got = grpo_prompts(data, ours, max_prompt_length=10_000, tools=schemas).ids
    for ids, p in zip(got, prompts, strict=True):
        want = hf.apply_chat_template(
            p, tools=schemas, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert ids.tolist() == want
