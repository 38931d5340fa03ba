"""`make demo`: a GRPO run on CPU with the embedded engine (examples/cpu-demo.yaml).

Writes the tiny model the config points at (a Qwen3 of hidden 64 and 2 layers with a BPE
tokenizer trained in code; nothing is downloaded), then runs `rollfleet train` on it. A first
argument ending in .yaml names another config (`make demo-lora`: examples/cpu-demo-lora.yaml; `make
demo-agent`: examples/cpu-agent.yaml, multi-turn episodes with a calculator tool).
"""

from __future__ import annotations

import sys
from pathlib import Path

from rollfleet.config import ConfigError, load_config
from rollfleet.tiny_models import CHATML_TEMPLATE, make_tiny_model
from rollfleet.train.loop import train

CONFIG = Path(__file__).resolve().parent.parent / "examples" / "cpu-demo.yaml"


def main(argv: list[str] | None = None) -> None:
    overrides = list(sys.argv[1:] if argv is None else argv)
    config = overrides.pop(0) if overrides and overrides[0].endswith(".yaml") else str(CONFIG)
    try:
        cfg = load_config(config, overrides)
        model_dir = Path(cfg.rollout.model_path)
        if not (model_dir / "config.json").exists():
            make_tiny_model(model_dir, "qwen3", seed=0, chat_template=CHATML_TEMPLATE)  # the agent demo renders chat
        output_dir = train(cfg)
    except ConfigError as err:  # one line naming the field, the value and the fix; no traceback
        sys.exit(str(err))
    print(f"done: metrics.jsonl, TensorBoard logs, checkpoints and curves.png in {output_dir}")


if __name__ == "__main__":
    main()
