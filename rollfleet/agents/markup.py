"""Token ids of an episode's prompt and observations, each rendered once with the model's chat template.

The model's own turns are never rendered or tokenized again: the episode keeps the ids the engine
sampled, and an observation's ids are only appended after them. An observation of chat messages is
the template's text for those messages in a conversation that already holds a user turn and an
assistant turn (`render(base + messages) - render(base)`), so it carries the markup that opens
their turns and the generation prompt of the model's next turn, and, in front, the markup that closes
the model's turn (ChatML: `<|im_end|>\\n`), less its first token when the model sampled that
token itself (it stopped on it). Templates that rewrite earlier turns (Qwen3's strips old `<think>`
blocks) never touch the kept ids this way.
"""

from __future__ import annotations

from rollfleet.envs.base import Observation

_BASE = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]


class TurnMarkup:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.has_template = bool(getattr(tokenizer, "chat_template", None))
        self._base = self._closing = ""
        if self.has_template:
            opened = self._render(_BASE[:1], generation_prompt=True)
            self._base = self._render(_BASE, generation_prompt=False)
            if not self._base.startswith(opened + "a"):
                raise ValueError(
                    "the chat template does not render an assistant message after its generation prompt "
                    "(fix: give the environment's observations as text or token_ids instead of messages)"
                )
            self._closing = self._base[len(opened) + 1 :]

    def _render(self, messages: list[dict], *, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt(self, start: str | list[dict]) -> list[int]:
        """An episode's prompt ids: text as the fleet encodes a prompt, or messages with the generation prompt."""
        if isinstance(start, str):
            return list(self.tokenizer.encode(start))
        self._need_template("the episode's prompt")
        return self._encode(self._render(start, generation_prompt=True))

    def observation(self, observation: Observation, turn_ids: list[int]) -> list[int]:
        """The ids to append after a model turn of `turn_ids`."""
        if observation.token_ids is not None:
            return list(observation.token_ids)
        if observation.text is not None:
            return self._encode(observation.text)
        self._need_template("an observation of messages")
        rendered = self._render(_BASE + list(observation.messages), generation_prompt=True)
        assert rendered.startswith(self._base), "the template rendered the same conversation two ways"
        ids = self._encode(self._closing + rendered[len(self._base) :])
        if ids and turn_ids and turn_ids[-1] == ids[0]:
            return ids[1:]  # the model closed its turn itself (it stopped on the end-of-turn token)
        return ids

    def _need_template(self, what: str) -> None:
        if not self.has_template:
            raise ValueError(
                f"{what} is chat messages, and the model's tokenizer has no chat template (fix: add one to the "
                "model directory's tokenizer_config.json, or return text or token_ids from the environment)"
            )
