"""LoRA adapters in the embedded engine: read a peft adapter, check it against the model, and the
arithmetic of merge on activation.

An adapter is kept as it arrived (peft's saved naming `base_model.model.<module>.lora_A.weight`, an
embedding's `.lora_embedding_A`; tensors on the CPU) plus, per target, its (A, B, scale). The runner
serves it by merging: see ModelRunner's LoRA section. What may be a target (plain nn.Linear modules
and an untied input embedding at tp 1, never fused MoE experts): targets.py.

Every check runs before anything changes, and a refusal names the key or field, the value and
the fix (LoraError, a ValueError: HTTP 400).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from rollfleet.engine.lora.host_copies import owned_copies
from rollfleet.engine.lora.targets import LoraTarget, factor_keys, is_embedding, why_not_targetable
from rollfleet.wire.fingerprint import DEFAULT_SAMPLES, Fingerprints, fingerprints
from rollfleet.wire.hf_files import ADAPTER_CONFIG_FILE as CONFIG_FILE
from rollfleet.wire.hf_files import ADAPTER_WEIGHTS_FILE as WEIGHTS_FILE
from rollfleet.wire.hf_files import dir_problem, shown

# a linear target's factors `lora_A.weight`, an embedding's `lora_embedding_A` (peft's names for each)
KEY = re.compile(
    r"^base_model\.model\.(?P<module>.+)\.(?:lora_(?P<half>[AB])\.weight|lora_(?P<embedding>embedding_)(?P<ehalf>[AB]))$"
)
TENSORS_PATH = "__tensor__"  # the `path` of an adapter loaded from tensors (SGLang registers the same)
# peft features that change the arithmetic W + scale * B @ A, refused rather than served wrong
UNSUPPORTED = {
    "use_dora": "DoRA (use_dora=True)",
    "lora_bias": "LoRA bias (lora_bias=True)",
    "modules_to_save": "fully trained modules (modules_to_save)",
    "target_parameters": "LoRA on parameters (target_parameters, e.g. MoE experts)",
    "trainable_token_indices": "trainable tokens (trainable_token_indices)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "layer_replication": "layer replication (layer_replication)",
    "use_qalora": "QA-LoRA (use_qalora=True)",
}


class LoraError(ValueError):
    """A LoRA request refused before anything changed."""


@dataclass(frozen=True)
class LoraLimits:
    """The server's LoRA flags: --max-lora-rank, --lora-target-modules, --max-loaded-loras."""

    max_rank: int | None = None
    target_modules: frozenset[str] | None = None  # short names (q_proj); None: any targetable module
    max_loaded: int | None = None


@dataclass
class LoraAdapter:
    name: str
    path: str  # the directory it was read from, or TENSORS_PATH
    config: dict
    tensors: dict[str, torch.Tensor]  # as received, peft's saved naming (what fingerprints cover)
    targets: list[LoraTarget] = field(default_factory=list)
    # the samples of every tensor at DEFAULT_SAMPLES, gathered at load where they arrived (one `cat`
    # on the sender's device, no strided gathers over host memory at verify), hashed at first ask
    load_prints: Fingerprints | None = None
    _prints: dict[str, str] | None = field(default=None, init=False, repr=False)

    def fingerprints(self, names: list[str] | None, samples: int) -> dict[str, str]:
        """peft key -> rollfleet.wire.fingerprint of the stored tensor (all keys when None), in the
        dtype it arrived in: the sender fingerprints what it sent the same way. At the default sample
        count, from the samples taken at load (the stored tensors are byte copies of what arrived)."""
        unknown = sorted(set(names or []) - set(self.tensors))
        if unknown:
            raise LoraError(f"names not in adapter {self.name!r}: {unknown[:10]}")
        if samples != DEFAULT_SAMPLES or self.load_prints is None:
            return fingerprints(((name, self.tensors[name]) for name in (names or self.tensors)), samples=samples)
        if self._prints is None:
            self._prints = self.load_prints.digests()
        return {name: self._prints[name] for name in (names or self.tensors)}


def read_adapter_dir(path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config, tensors) of a peft adapter directory (adapter_config.json + adapter_model.safetensors)."""
    directory = Path(path)
    if problem := dir_problem(directory):
        raise LoraError(
            f"lora_path={shown(path)} {problem}: give a peft adapter directory "
            f"(save_pretrained), holding {CONFIG_FILE} and {WEIGHTS_FILE}"
        )
    config_file, weights_file = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    if not config_file.is_file():
        raise LoraError(f"lora_path={path!r} has no {CONFIG_FILE}: save the adapter with peft's save_pretrained")
    if not weights_file.is_file():
        raise LoraError(
            f"lora_path={path!r} has no {WEIGHTS_FILE}: save the adapter with "
            "save_pretrained(safe_serialization=True) (pickled .bin adapters are not read)"
        )
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise LoraError(f"{CONFIG_FILE} in {path!r} cannot be read: {exc}") from exc
    try:
        tensors = load_file(weights_file)
    except (SafetensorError, OSError) as exc:
        raise LoraError(f"{WEIGHTS_FILE} in {path!r} cannot be read: {exc}") from exc
    return config, tensors


def parse_adapter(
    name: str,
    path: str,
    config: dict,
    tensors: dict[str, torch.Tensor],
    model: nn.Module,
    targetable: dict[str, tuple[int, int]],
    limits: LoraLimits,
) -> LoraAdapter:
    """Check `config` and `tensors` against the model and the limits; every problem in one LoraError."""
    if not isinstance(config, dict):
        raise LoraError(
            f"config_dict must be a peft LoraConfig as a dict (adapter_config.json), got {type(config).__name__}"
        )
    rank, alpha = _config_numbers(config)
    problems, unreadable = _config_problems(config), _pattern_problems(config)
    if unreadable:  # every target reads the patterns
        raise LoraError(f"adapter {name!r} refused, nothing changed: {'; '.join(problems + unreadable)}")
    modules: dict[str, dict[str, torch.Tensor]] = {}  # module -> {"A", "B", or "embedding A", "embedding B"}
    for key, tensor in tensors.items():
        match = KEY.match(key)
        if match is None:
            problems.append(
                f"key {key!r} is not a LoRA weight: expected base_model.model.<module>.lora_A.weight "
                f"or .lora_B.weight (an embedding's: .lora_embedding_A or .lora_embedding_B){_hint(key)}"
            )
        elif not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            problems.append(f"{key}: {getattr(tensor, 'dtype', type(tensor).__name__)} is not a floating tensor")
        else:
            half = f"embedding {match['ehalf']}" if match["embedding"] else match["half"]
            modules.setdefault(match["module"], {})[half] = tensor
    if not tensors:
        problems.append("the adapter holds no tensors")
    targets = []
    for module, halves in sorted(modules.items()):
        target = _target(module, halves, config, rank, alpha, model, targetable, limits, problems)
        if target is not None:
            targets.append(target)
    if problems:
        shown = "; ".join(problems[:10]) + (f"; ... ({len(problems)} problems)" if len(problems) > 10 else "")
        raise LoraError(f"adapter {name!r} refused, nothing changed: {shown}")
    prints = Fingerprints(samples=DEFAULT_SAMPLES)  # on the device the tensors arrived on: one `cat`
    for key, tensor in tensors.items():
        prints.add(key, tensor)
    prints.flush()  # gathered now: the sender's memory may go
    owned = owned_copies(tensors)  # no sender memory kept; on the GPU it came from, or the CPU
    for target in targets:
        target.lora_a, target.lora_b = (owned[key] for key in target.keys)
    return LoraAdapter(name, path, config, owned, targets, load_prints=prints)


def _hint(key: str) -> str:
    """Why a key that looks like a LoRA weight is not read, and the fix."""
    if key.endswith(".base_layer.weight"):
        return (
            " (peft saved the targeted base layer with the adapter, as save_pretrained does for embeddings "
            "unless save_embedding_layers=False: the engine holds the base; save without it)"
        )
    if ".lora_A." in key or ".lora_B." in key or ".lora_embedding_" in key:
        return (
            " (the adapter name is inside the key: save with get_peft_model_state_dict or save_pretrained, "
            "which drop it)"
        )
    return ""


def _config_numbers(config: dict) -> tuple[int, float]:
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoraError(f"config r={rank!r}: must be a positive integer (the LoRA rank)")
    if not _finite_number(alpha):
        raise LoraError(f"config lora_alpha={alpha!r}: must be a finite number")
    return rank, float(alpha)


def _finite_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _pattern_problems(config: dict) -> list[str]:
    """peft's rank_pattern / alpha_pattern: {module pattern: positive rank / finite alpha}. Anything else
    failed outside the refusal path (a null alpha: TypeError; on tp > 1 every rank raised it, and the
    engine stopped) or as NaN weights."""
    problems = []
    for key, valid, what in [
        ("rank_pattern", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1, "a positive integer"),
        ("alpha_pattern", _finite_number, "a finite number"),
    ]:
        patterns = config.get(key)
        if patterns is None:
            continue
        if not isinstance(patterns, dict):
            problems.append(f"config {key}={patterns!r:.80}: must be a dict {{module pattern: value}} (or null)")
            continue
        bad = {pattern: value for pattern, value in patterns.items() if not valid(value)}
        if bad:
            problems.append(f"config {key}={bad!r:.80}: each value must be {what}")
    return problems


def _config_problems(config: dict) -> list[str]:
    problems = []
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        problems.append(f"config peft_type={peft_type!r}: only LoRA adapters are served (peft_type='LORA')")
    for key, what in UNSUPPORTED.items():
        if config.get(key):
            problems.append(
                f"config {key}={config[key]!r}: {what} is not served by the embedded engine; "
                f"train without it (or serve with SGLang)"
            )
    if config.get("bias", "none") != "none":
        problems.append(f"config bias={config['bias']!r}: bias training is not served; train with bias='none'")
    return problems


def _target(
    module: str,
    halves: dict[str, torch.Tensor],
    config: dict,
    rank: int,
    alpha: float,
    model: nn.Module,
    targetable: dict[str, tuple[int, int]],
    limits: LoraLimits,
    problems: list[str],
) -> LoraTarget | None:
    key = f"base_model.model.{module}"
    if module not in targetable:
        problems.append(f"{key}: module {module!r} cannot be a LoRA target: {why_not_targetable(model, module)}")
        return None
    embedding = is_embedding(model, module)
    if problem := _naming_problem(key, halves, embedding):
        problems.append(problem)
        return None
    short = module.rsplit(".", 1)[-1]
    if limits.target_modules is not None and short not in limits.target_modules:
        problems.append(
            f"{key}: target {short!r} is not in --lora-target-modules {sorted(limits.target_modules)}: "
            f"train without it or start the engine with {short} in --lora-target-modules"
        )
        return None
    lora_a, lora_b = (halves[f"embedding {h}"] if embedding else halves[h] for h in "AB")
    if problem := _shape_problem(module, lora_a, lora_b, targetable[module], embedding):
        problems.append(problem)
        return None
    r = lora_a.shape[0]
    expected_rank = _pattern_value(config.get("rank_pattern"), module, rank)
    if r != expected_rank:
        problems.append(
            f"{key}: rank {r} differs from the config's r={expected_rank} for this module: send the "
            "adapter_config.json that was saved with these tensors"
        )
        return None
    if limits.max_rank is not None and r > limits.max_rank:
        problems.append(
            f"{key}: rank {r} > --max-lora-rank {limits.max_rank}: train with r <= {limits.max_rank} "
            f"or start the engine with --max-lora-rank {r}"
        )
        return None
    module_alpha = float(_pattern_value(config.get("alpha_pattern"), module, alpha))
    scale = module_alpha / math.sqrt(r) if config.get("use_rslora") else module_alpha / r
    return LoraTarget(module, lora_a, lora_b, scale, embedding=embedding)


def _naming_problem(key: str, halves: dict[str, torch.Tensor], embedding: bool) -> str | None:
    """Both factors under the names peft gives this kind of target, or what is wrong and the fix."""
    if embedding:
        names = {"embedding A": "lora_embedding_A", "embedding B": "lora_embedding_B"}
    else:
        names = {"A": "lora_A.weight", "B": "lora_B.weight"}
    if set(halves) - set(names):
        kind = "an nn.Embedding" if embedding else "an nn.Linear"
        return (
            f"{key}: {kind} target's factors are {' and '.join(names.values())} (peft's names), got "
            f"{sorted(halves)}: save the adapter with peft (get_peft_model_state_dict or save_pretrained)"
        )
    missing = [name for half, name in names.items() if half not in halves]
    if missing:
        return f"{key}: has no {' or '.join(missing)}: every target needs both halves"
    return None


def _shape_problem(module: str, lora_a, lora_b, shape: tuple[int, int], embedding: bool) -> str | None:
    """A [r, a_dim] and B [b_dim, r] of the full (unsharded) weight: a linear's [out, in] takes A [r, in],
    B [out, r]; an embedding's [num_embeddings, dim] takes A [r, num_embeddings], B [dim, r]."""
    key_a, key_b = factor_keys(module, embedding)
    b_dim, a_dim = (shape[1], shape[0]) if embedding else shape
    a_names, b_names = ("[r, num_embeddings]", "[dim, r]") if embedding else ("[r, in_features]", "[out_features, r]")
    if lora_a.dim() != 2 or lora_a.shape[1] != a_dim:
        return (
            f"{key_a}: shape {tuple(lora_a.shape)}, expected (r, {a_dim}) = {a_names} of {module} (full, unsharded "
            "size): send the adapter trained on this model"
        )
    if tuple(lora_b.shape) != (b_dim, lora_a.shape[0]):
        return (
            f"{key_b}: shape {tuple(lora_b.shape)}, expected ({b_dim}, {lora_a.shape[0]}) = {b_names} of {module} "
            "(full, unsharded size): send the adapter trained on this model"
        )
    return None


def _pattern_value(patterns: dict | None, module: str, default):
    """peft's rank_pattern / alpha_pattern lookup for one module (peft.utils.other.get_pattern_key)."""
    if not patterns:
        return default
    from peft.utils.other import get_pattern_key  # peft is only needed for adapters with patterns

    key = get_pattern_key(list(patterns), module)
    return patterns.get(key, default)
