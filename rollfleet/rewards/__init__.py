"""Verifiable reward functions, `reward(sample_text: str, answer: str) -> float`, named by path.

reward = load_reward("rollfleet.rewards.basic:exact_match")
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

RewardFn = Callable[[str, str], float]


def load_reward(path: str) -> RewardFn:
    """Import `package.module:function`; errors say which part is wrong."""
    module_name, sep, attribute = path.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(
            f"reward {path!r}: write it as 'package.module:function', e.g. 'rollfleet.rewards.basic:exact_match'"
        )
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        raise ValueError(f"reward {path!r}: cannot import module {module_name!r} ({err})") from err
    function = getattr(module, attribute, None)
    if not callable(function):
        raise ValueError(f"reward {path!r}: module {module_name!r} has no function {attribute!r}")
    return function
