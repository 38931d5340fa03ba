"""Environments for multi-turn episodes (`grpo.environment: my_pkg.envs:Calculator`).

An environment is a class; the rollout makes one instance per episode (keyword arguments from
`grpo.environment_args`), asks it for the episode's prompt, and after every model turn for what comes
next: an observation to append (tool results as chat messages, raw text or token ids), or the end of
the episode with its reward. `step` may be a coroutine (slow or remote tools); a sync `step` runs on a
thread of asyncio's default executor (a few threads: slow or many tools should be coroutines; a sync
step that hangs keeps its thread). A step slower than `grpo.agent.tool_timeout_s`, or one that
raises, ends only its episode.

    from rollfleet.envs import Done, Environment, Observation

    class Calculator(Environment):
        def start(self, item):                      # item: rollfleet.data.prompts.PromptItem
            self.answer = item.answer
            return [{"role": "user", "content": item.prompt}]   # or a plain string
        async def step(self, turn):                 # turn.text, turn.token_ids, turn.index, ...
            if turn.text.startswith("calc "):
                return Observation(messages=[{"role": "tool", "content": str(eval_safely(turn.text[5:]))}])
            return Done(reward=float(turn.text.strip() == self.answer))
"""

from rollfleet.envs.base import Done, Environment, Observation, Turn, load_environment

__all__ = ["Done", "Environment", "Observation", "Turn", "load_environment"]
