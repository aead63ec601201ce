"""``grpo.reward_funcs`` from YAML (built-ins, parameters, modules, files): their shape checked
when the config is built, the functions loaded once by the trainer (``load_reward_funcs``), and
called exactly as TRL's GRPOTrainer calls them."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxrl.config import ConfigError, GRPOConfig, load_run_config, to_dict
from jaxrl.config.reward_entries import BUILTIN_REWARD_NAMES
from jaxrl.losses.advantages import compute_advantages
from jaxrl.rollout.rewards.builtin import (
    BUILTIN_REWARDS,
    ExactAnswer,
    FormatReward,
    LengthPenalty,
    format_reward,
)
from jaxrl.rollout.rewards.compute import (
    RewardFunctionError,
    TrainingProgress,
    reward_inputs,
    reward_names,
    score_completions,
)
from jaxrl.trainers.grpo import load_reward_funcs

ROOT = Path(__file__).resolve().parents[1]
USER_MODULE = """
def by_length(completions, **kwargs):
    return [float(len(c)) for c in completions]

NOT_A_FUNCTION = 3

def positional_only(prompts, completions):
    return [0.0] * len(completions)
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    pkg = tmp_path / "lib" / "myrewards"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "shaping.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path / "lib"))
    yield "myrewards.shaping"
    for name in [m for m in sys.modules if m.startswith("myrewards")]:
        del sys.modules[name]


def _yaml(tmp_path, reward_funcs: str, extra: str = "", name: str = "run.yaml"):
    path = tmp_path / name
    path.write_text(f"algorithm: grpo\ngrpo:\n  reward_funcs: {reward_funcs}\n{extra}")
    return path


def test_yaml_names_built_ins_parameters_modules_and_files(tmp_path, user_module):
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "extra.py").write_text(USER_MODULE)
    path = _yaml(
        tmp_path / "conf",
        "[exact_answer, {name: format, pattern: '<answer>.*</answer>'}, "
        "{name: length_penalty, soft_punish_cache: 2}, "
        f"'{user_module}:by_length', '{user_module}.by_length', 'extra.py:by_length']",
        "  max_completion_length: 6\n  reward_weights: [1, 1, 0.5, 1, 1, 1]\n",
    )
    funcs = load_reward_funcs(load_run_config(path).grpo)
    assert reward_names(funcs) == [
        "exact_answer", "format", "length_penalty", "by_length", "by_length_2", "by_length_3"
    ]  # fmt: skip
    assert funcs[1] == FormatReward(pattern="<answer>.*</answer>")
    assert funcs[2] == LengthPenalty(max_completion_len=6, soft_punish_cache=2)  # grpo's length
    assert funcs[3] is funcs[4]  # the module's own function, both spellings
    assert funcs[5].__module__.startswith("_jaxrl_reward_files")  # relative to the YAML's dir
    assert funcs[5](completions=["abc"]) == [3.0]


def test_shipped_gsm8k_config_takes_a_shorter_completion_length():
    """The GSM8K recipe's length window is a fraction: --set max_completion_length alone works,
    and a fixed window longer than the completion is an error that names the fraction."""
    path = ROOT / "configs" / "grpo_gsm8k_qwen.yaml"
    funcs = load_reward_funcs(load_run_config(path).grpo)
    assert funcs[0] == ExactAnswer(fallback="last_number")
    assert funcs[2] == LengthPenalty(max_completion_len=512, soft_punish_cache=0.25)
    assert funcs[2].cache_tokens == 128
    short = load_reward_funcs(load_run_config(path, ["grpo.max_completion_length=64"]).grpo)
    assert short[2].cache_tokens == 16
    assert short[2].max_completion_len == 64
    fixed = ["grpo.max_completion_length=64", "grpo.reward_funcs=[{name: length_penalty, "
             "soft_punish_cache: 128}]", "grpo.reward_weights=null"]  # fmt: skip
    with pytest.raises(ConfigError, match=r"reward_funcs\[0\].*soft_punish_cache=128 .*fraction"):
        load_reward_funcs(load_run_config(path, fixed).grpo)


def test_python_callables_and_the_trainer_default():
    def mine(prompts, completions, **kwargs):
        return [1.0] * len(completions)

    config = GRPOConfig(reward_funcs=(mine, "format"))
    assert config.reward_funcs[0] is mine  # kept as given
    assert to_dict(config)["reward_funcs"] == [f"{__name__}:{mine.__qualname__}", "format"]
    assert load_reward_funcs(config)[0] is mine
    assert load_reward_funcs(config, [format_reward]) == [format_reward]  # the trainer's argument
    assert GRPOConfig().reward_funcs is None  # the trainer's default applies
    assert reward_names(load_reward_funcs(GRPOConfig())) == ["exact_answer", "format"]


@pytest.mark.parametrize(
    ("funcs", "match"),
    [
        ("[exact]", r"grpo.reward_funcs\[0\]='exact' is invalid: not a built-in reward.*"),
        ("['{mod}:nope']", r"\[0\]=.* module 'myrewards.shaping' has no function 'nope'"),
        ("['{mod}:by_lenght']", r"has no function 'by_lenght'; did you mean 'by_length'\?"),
        ("['{mod}:NOT_A_FUNCTION']", r"it names a int, not a function"),
        ("['{mod}:positional_only']", r"must accept \*\*kwargs"),
        ("['no_such_pkg.mod:f']", r"cannot import module 'no_such_pkg.mod'"),
        ("['missing.py:f']", r"file '.*/missing.py' does not exist"),
        ("['broken.py:f']", r"executing file '.*broken.py' raised ZeroDivisionError"),
        (
            "[{name: format, patern: x}]",
            r"\[0\]='format' .* no parameter 'patern'; did you mean 'pattern'\?",
        ),
        ("[{name: fromat}]", r"give 'name' as one of .*did you mean 'format'"),
        ("[length_penalty]", r"the built-in 'length_penalty' needs soft_punish_cache"),
        ("[{name: format, pattern: '('}]", r"pattern='\(' is invalid: not a regular expr"),
        ("exact_answer", r"grpo.reward_funcs='exact_answer' is invalid: expected a list"),
        ("[]", r"at least one reward function"),
    ],
)
def test_bad_entries_are_config_errors_naming_field_value_and_problem(
    tmp_path, user_module, funcs, match
):
    (tmp_path / "broken.py").write_text("1 / 0\n")
    with pytest.raises(ConfigError, match=match):
        load_reward_funcs(
            load_run_config(_yaml(tmp_path, funcs.replace("{mod}", user_module))).grpo
        )


@pytest.mark.parametrize(
    ("funcs", "match"),
    [
        ("[exact]", r"^grpo.reward_funcs\[0\]='exact' is invalid: not a built-in reward"),
        ("[{name: fromat}]", r"^grpo.reward_funcs\[0\]=.*give 'name' as one of .*'format'"),
        ("[3]", r"^grpo.reward_funcs\[0\]=3 is invalid: use a built-in name"),
        ("exact_answer", r"^grpo.reward_funcs='exact_answer' is invalid: expected a list"),
        ("[]", r"^grpo.reward_funcs=\[\] is invalid: GRPO needs at least one"),
    ],
)
def test_the_config_checks_the_shape_of_entries(tmp_path, funcs, match):
    with pytest.raises(ConfigError, match=match):
        load_run_config(_yaml(tmp_path, funcs))


def test_building_the_config_runs_no_user_code(tmp_path, user_module):
    """Modules and files are named, not imported: the trainer loads them."""
    (tmp_path / "broken.py").write_text("1 / 0\n")
    cfg = load_run_config(_yaml(tmp_path, f"['{user_module}:nope', broken.py:f, missing.py:f]"))
    assert user_module not in sys.modules
    assert cfg.grpo.reward_funcs[0] == f"{user_module}:nope"
    assert cfg.grpo.reward_funcs[1] == f"{tmp_path}/broken.py:f"  # relative to the YAML
    with pytest.raises(ConfigError, match=r"\[0\]=.* module 'myrewards.shaping' has no function"):
        load_reward_funcs(cfg.grpo)


def test_the_config_knows_the_built_in_names():
    assert tuple(BUILTIN_REWARDS) == BUILTIN_REWARD_NAMES


def test_weights_must_match_the_functions():
    with pytest.raises(ConfigError, match=r"reward_weights=\[1.0, 2.0, 3.0\] has 3 entries but "):
        GRPOConfig(reward_funcs=("exact_answer", "format"), reward_weights=(1.0, 2.0, 3.0))
    with pytest.raises(ConfigError, match="reward_funcs has 2"):
        GRPOConfig(reward_funcs=("exact_answer", "format"), reward_weights=(1.0,))


def test_command_line_paths_are_relative_to_the_current_directory(tmp_path, monkeypatch):
    (tmp_path / "here.py").write_text(USER_MODULE)
    path = _yaml(tmp_path, "[format]", name="conf.yaml")
    monkeypatch.chdir(tmp_path)
    cfg = load_run_config(path, ["grpo.reward_funcs=[here.py:by_length]"])
    assert load_reward_funcs(cfg.grpo)[0](completions=["ab"]) == [2.0]


def test_functions_are_called_like_trl():
    seen = []

    def spy(**kwargs):  # TRL calls by keyword only
        seen.append(kwargs)
        return [0.0] * len(kwargs["completions"])

    state = TrainingProgress(global_step=3, max_steps=10)
    score_completions(
        [spy],
        ["p0", "p1"],
        ["c0", "c1"],
        {"answer": ["a0", "a1"], "level": [1, 2]},
        completion_ids=[np.asarray([5, 6]), [7]],
        trainer_state=state,
    )
    assert seen == [
        {
            "prompts": ["p0", "p1"],
            "completions": ["c0", "c1"],
            "completion_ids": [[5, 6], [7]],
            "trainer_state": state,
            "answer": ["a0", "a1"],
            "level": [1, 2],
        }
    ]
    assert all(type(t) is int for t in seen[0]["completion_ids"][0])
    with pytest.raises(ValueError, match="column 'trainer_state' clashes"):
        score_completions([spy], ["p"], ["c"], {"trainer_state": [1]})


def test_conversational_prompts_give_message_completions_as_trl():
    user = {"role": "user", "content": "2+2?"}
    started = [user, {"role": "assistant", "content": "It is "}]
    prompts, completions = reward_inputs(["plain", [user], started], ["x", "4", "4."])
    assert prompts == ["plain", [user], [user]]
    assert completions == [
        "x",
        [{"role": "assistant", "content": "4"}],
        [{"role": "assistant", "content": "It is 4."}],
    ]
    assert started[-1]["content"] == "It is "  # the caller's prompt is not modified


def test_a_raising_function_is_named_with_its_rows():
    def flaky(completions, **kwargs):
        raise KeyError("solution")

    with pytest.raises(RewardFunctionError, match=r"'flaky' raised KeyError: 'solution' \(scor"):
        score_completions([flaky], ["a", "b", "c"], ["x", "y", "z"])
    try:
        score_completions([flaky], ["a"], ["x"])
    except RewardFunctionError as e:
        assert "rows 0-0 of the generation batch" in str(e)
        assert isinstance(e.__cause__, KeyError)  # the traceback is kept (--debug)


def test_absurd_magnitudes_are_rejected_and_the_bound_is_safe():
    def huge(completions, **kwargs):
        return [1e300, 0.0]

    with pytest.raises(ValueError, match=r"'huge' returned 1e\+300 for row 0: \|reward\| must be"):
        score_completions([huge], ["a", "b"], ["x", "y"])
    # at the bound the float64 group std is finite, so advantages are ±1/√2·… not NaN
    r = score_completions([lambda completions, **_: [1e30, -1e30, 0.0, 1e30]], *[["a"] * 4] * 2)
    adv = compute_advantages(r, 2, scale_rewards="group")
    assert np.all(np.isfinite(adv)) and adv[0] == pytest.approx(1 / math.sqrt(2), rel=1e-3)
    assert adv[2] == pytest.approx(-1 / math.sqrt(2), rel=1e-3)
