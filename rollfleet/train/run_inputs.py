"""What a run's config names outside itself, checked before anything starts (no Ray, no engine).

A config is read and validated on its own (tests load configs that point at models written later);
the model, the dataset file and the reward or environment to import must exist only when a run
starts. `check_run_inputs` refuses a run whose inputs are missing with one line per problem, naming
the field, the value and the fix, instead of a library's traceback from deep inside the start:

    rollout.model_path='runs/cpu-agent/tiny-qwen3': no such folder (fix: `make demo-agent` writes the
    tiny model there; or point rollout.model_path at a HF model folder)

A model path that is not a local folder but reads as a hub id (`org/name`) is accepted when the local
HF cache holds its config.json, or when the hub answers for it within HUB_TIMEOUT_S; with
HF_HUB_OFFLINE set the hub is not asked.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import yaml

from rollfleet.config import ConfigError, RunConfig
from rollfleet.envs import load_environment
from rollfleet.rewards import load_reward

BUILTIN_DATASETS = ("synthetic", "arithmetic")  # made in code (rollfleet.train.loop.load_dataset)
HUB_TIMEOUT_S = 10.0
EXAMPLES = Path(__file__).resolve().parent.parent.parent / "examples"
# The make targets that write a demo's tiny model: each runs `python -m rollfleet.demo CONFIG`, which
# writes CONFIG's rollout.model_path before training (tests/test_run_inputs.py checks the Makefile).
DEMO_TARGETS = {
    "demo": "cpu-demo.yaml",
    "demo-lora": "cpu-demo-lora.yaml",
    "demo-agent": "cpu-agent.yaml",
}


def check_run_inputs(cfg: RunConfig) -> None:
    """Raise ConfigError, one line per problem, if the model, dataset, reward or environment is missing."""
    problems = [_model_problem(cfg.rollout.model_path), _dataset_problem(cfg.grpo.dataset)]
    if cfg.grpo.environment is not None:
        problems.append(_import_problem(load_environment, cfg.grpo.environment))
    else:  # with an environment, grpo.reward is ignored (the environment rewards each episode)
        problems.append(_import_problem(load_reward, cfg.grpo.reward))
    found = [p for p in problems if p is not None]
    if found:
        raise ConfigError(found)


def _model_problem(path: str) -> str | None:
    head, fix = f"rollout.model_path={path!r}", _model_fix(path)
    local = Path(path).expanduser()
    if local.is_dir():
        if (local / "config.json").is_file():
            return None
        return f"{head}: the folder has no config.json, so it is no HF model folder (fix: {fix})"
    if local.exists():
        return f"{head}: a file, not a HF model folder (fix: {fix})"
    if not _reads_as_hub_id(path):
        return f"{head}: no such folder (fix: {fix})"
    problem = _hub_problem(path)
    return f"{head}: no such folder, and {problem} (fix: {fix})" if problem else None


def _model_fix(path: str) -> str:
    targets = [f"`make {target}`" for target in _demo_targets_writing(path)]
    if targets:
        return f"{' or '.join(targets)} writes the tiny model there; or point rollout.model_path at a HF model folder"
    return "write the model there or point rollout.model_path at a HF model folder"


def _demo_targets_writing(path: str) -> list[str]:
    """The make targets whose demo writes the model at `path` (none when the examples are not here)."""
    targets = []
    for target, name in DEMO_TARGETS.items():
        example = EXAMPLES / name
        if not example.is_file():
            continue
        written = Path(yaml.safe_load(example.read_text())["rollout"]["model_path"])
        if written == Path(path) or (EXAMPLES.parent / written).resolve() == Path(path).resolve():
            targets.append(target)
    return targets


def _reads_as_hub_id(path: str) -> bool:
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if path.startswith((".", "/", "~")):
        return False
    try:
        validate_repo_id(path)
    except HFValidationError:
        return False
    return True


def _hub_problem(repo_id: str) -> str | None:
    """Why hub id `repo_id` cannot be loaded here (None: the local HF cache or the hub has it)."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url, is_offline_mode, try_to_load_from_cache
    from huggingface_hub.errors import EntryNotFoundError, GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    if isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
        return None
    if is_offline_mode():
        return f"hub id {repo_id!r} is not in the local HF cache (HF_HUB_OFFLINE is set, so the hub is not asked)"
    url = hf_hub_url(repo_id, "config.json")
    try:
        get_hf_file_metadata(url, timeout=HUB_TIMEOUT_S)
    except GatedRepoError:
        return f"hub model {repo_id!r} is gated (accept its terms on the hub and set HF_TOKEN)"
    except RepositoryNotFoundError:
        return f"the hub has no model {repo_id!r} (or it is private: set HF_TOKEN)"
    except EntryNotFoundError:
        return f"hub repo {repo_id!r} has no config.json (not a transformers model)"
    except HfHubHTTPError as err:
        return f"the hub answered {err.response.status_code} for {url}"
    except _transport_errors() as err:  # no route, refused, DNS, timeout
        return f"hub id {repo_id!r} is not in the local HF cache and the hub could not be reached ({err})"
    return None


def _transport_errors() -> tuple[type[BaseException], ...]:
    """What a hub that cannot be reached raises: huggingface_hub 2 asks through httpx2, 1.x (still in
    some GPU images) through httpx; OSError for the rest."""
    errors: list[type[BaseException]] = [OSError]
    for name in ("httpx2", "httpx"):
        try:
            errors.append(importlib.import_module(name).TransportError)
        except ImportError:
            continue
    return tuple(errors)


def _dataset_problem(dataset: str) -> str | None:
    if dataset in BUILTIN_DATASETS or Path(dataset).expanduser().is_file():
        return None
    where = "is a folder, not a file" if Path(dataset).exists() else "no such file"
    return (
        f"grpo.dataset={dataset!r}: {where} (fix: write a JSONL file of {{prompt, answer}} lines there, "
        f"or set grpo.dataset to one of {', '.join(BUILTIN_DATASETS)})"
    )


def _import_problem(load, path: str) -> str | None:
    """The loader's one-line refusal (it names the field, the value and the fix), or None if it imports."""
    try:
        load(path)
    except ValueError as err:
        return str(err)
    return None
