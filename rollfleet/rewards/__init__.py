"""Verifiable reward functions, `reward(sample_text: str, answer: str) -> float`, named by path.

reward = load_reward("rollfleet.rewards.basic:exact_match")
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

RewardFn = Callable[[str, str], float]


def load_reward(path: str) -> RewardFn:
    """Import `package.module:function`; errors name grpo.reward, which part is wrong, and the fix."""
    module_name, sep, attribute = path.partition(":")
    head = f"grpo.reward={path!r}"
    if not sep or not module_name or not attribute:
        raise ValueError(
            f"{head}: not 'package.module:function' (fix: write it as 'package.module:function', "
            "e.g. rollfleet.rewards.basic:exact_match)"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(
            f"{head}: cannot import module {module_name!r} ({err}) (fix: install the package that holds it or put "
            "it on PYTHONPATH, or name another reward, e.g. rollfleet.rewards.basic:exact_match)"
        ) from err
    function = getattr(module, attribute, None)
    if not callable(function):
        raise ValueError(
            f"{head}: module {module_name!r} has no function {attribute!r} (fix: name a function of "
            f"{module_name!r}, reward(sample_text, answer) -> float)"
        )
    return function
