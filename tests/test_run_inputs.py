"""A run's inputs (model, dataset, reward, environment) are checked before anything starts: one line
per problem, naming the field, the value and the fix."""

from __future__ import annotations

import http.server
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from rollfleet.config import ConfigError, load_config
from rollfleet.train.run_inputs import DEMO_TARGETS, check_run_inputs
from rollfleet.wire.net import free_port

REPO = Path(__file__).resolve().parent.parent
GENERIC_FIX = "write the model there or point rollout.model_path at a HF model folder"


@pytest.fixture
def model_dir(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    return folder


def problems(*overrides) -> list[str]:
    with pytest.raises(ConfigError) as err:
        check_run_inputs(load_config(None, list(overrides)))
    return err.value.problems


def test_a_model_folder_with_config_json_and_the_builtin_data_pass(model_dir):
    for dataset in ("synthetic", "arithmetic"):
        check_run_inputs(load_config(None, [f"rollout.model_path={model_dir}", f"grpo.dataset={dataset}"]))


def test_a_missing_model_folder_is_refused_with_the_generic_fix(tmp_path):
    missing = tmp_path / "no" / "model"
    assert problems(f"rollout.model_path={missing}") == [
        f"rollout.model_path={str(missing)!r}: no such folder (fix: {GENERIC_FIX})"
    ]


def test_a_folder_without_config_json_or_a_file_is_no_model(model_dir):
    (model_dir / "config.json").unlink()
    (line,) = problems(f"rollout.model_path={model_dir}")
    assert (
        line.startswith(f"rollout.model_path={str(model_dir)!r}: the folder has no config.json") and GENERIC_FIX in line
    )
    (line,) = problems(f"rollout.model_path={model_dir / 'weights.bin'}")
    assert "no such folder" in line
    (model_dir / "weights.bin").write_bytes(b"")
    (line,) = problems(f"rollout.model_path={model_dir / 'weights.bin'}")
    assert "a file, not a HF model folder" in line


def test_a_missing_dataset_file_is_refused(model_dir, tmp_path):
    (line,) = problems(f"rollout.model_path={model_dir}", f"grpo.dataset={tmp_path / 'task.jsonl'}")
    assert line.startswith(f"grpo.dataset={str(tmp_path / 'task.jsonl')!r}: no such file (fix: write a JSONL file")
    assert "synthetic, arithmetic" in line
    (line,) = problems(f"rollout.model_path={model_dir}", f"grpo.dataset={tmp_path}")
    assert "is a folder, not a file" in line
    (tmp_path / "task.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    check_run_inputs(load_config(None, [f"rollout.model_path={model_dir}", f"grpo.dataset={tmp_path / 'task.jsonl'}"]))


@pytest.mark.parametrize(
    "reward, says",
    [
        ("no_such_pkg.rewards:score", "cannot import module 'no_such_pkg.rewards'"),
        ("rollfleet.rewards.basic:nope", "module 'rollfleet.rewards.basic' has no function 'nope'"),
        ("rollfleet.rewards.basic.exact_match", "not 'package.module:function'"),
    ],
)
def test_a_reward_that_does_not_import_is_refused(model_dir, reward, says):
    (line,) = problems(f"rollout.model_path={model_dir}", f"grpo.reward={reward}")
    assert line.startswith(f"grpo.reward={reward!r}: {says}") and "(fix: " in line, line


def test_an_environment_that_does_not_import_is_refused_and_the_ignored_reward_is_not_checked(model_dir):
    env = ["grpo.environment=no_such_pkg.envs:Calc", "grpo.reward=no_such_pkg.rewards:score"]
    env += ["rollout.sampling.max_new_tokens=3"]
    with pytest.warns(UserWarning, match="grpo.reward is ignored"):
        (line,) = problems(f"rollout.model_path={model_dir}", *env)
    assert line.startswith("grpo.environment='no_such_pkg.envs:Calc': cannot import module 'no_such_pkg.envs'")
    assert "(fix: " in line
    (line,) = problems(f"rollout.model_path={model_dir}", "grpo.environment=rollfleet.envs.calculator:Nope")
    assert "has no class 'Nope' with a step(turn) method" in line


def test_every_problem_is_named_at_once(tmp_path):
    found = problems(f"rollout.model_path={tmp_path / 'm'}", f"grpo.dataset={tmp_path / 'd.jsonl'}", "grpo.reward=x:y")
    assert [line.split("=", 1)[0] for line in found] == ["rollout.model_path", "grpo.dataset", "grpo.reward"]


# --- the examples: their message names the make target that writes the model ------------------------


def _makefile_demo_targets() -> dict[str, str]:
    """target -> example config, from the Makefile's `$(PY) -m rollfleet.demo [examples/X.yaml]` recipes."""
    from rollfleet.demo import CONFIG  # the config of a bare `-m rollfleet.demo`

    found, target = {}, None
    for line in (REPO / "Makefile").read_text().splitlines():
        head = re.match(r"([\w-]+):", line)
        target = head.group(1) if head else target
        recipe = re.search(r"-m rollfleet\.demo(?: examples/(\S+\.yaml))?\s*$", line)
        if recipe:
            found[target] = recipe.group(1) or CONFIG.name
    return found


def test_the_demo_targets_are_the_makefiles():
    assert _makefile_demo_targets() == DEMO_TARGETS


@pytest.mark.parametrize("target", sorted(DEMO_TARGETS))
def test_an_examples_missing_model_names_the_make_target_that_writes_it(target, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a fresh clone: no runs/ folder
    cfg = load_config(str(REPO / "examples" / DEMO_TARGETS[target]))
    with pytest.raises(ConfigError) as err:
        check_run_inputs(cfg)
    (line,) = err.value.problems
    assert line.startswith(f"rollout.model_path={cfg.rollout.model_path!r}: no such folder (fix: ")
    assert f"`make {target}`" in line and "point rollout.model_path at a HF model folder" in line, line


def test_rollfleet_train_on_a_fresh_clone_prints_one_line_and_starts_nothing(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "rollfleet", "train", str(REPO / "examples" / "cpu-agent.yaml")]
    out = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert out.stderr.strip().splitlines() == [
        "invalid config: rollout.model_path='runs/cpu-agent/tiny-qwen3': no such folder (fix: `make demo-agent` "
        "writes the tiny model there; or point rollout.model_path at a HF model folder)"
    ], out.stderr
    assert not (tmp_path / "runs").exists()  # no output folder: refused before anything started


# --- hub ids: the local HF cache, HF_HUB_OFFLINE, a hub that answers or does not -----------------------

_CHECK = """
import json, sys
from rollfleet.config import ConfigError, load_config
from rollfleet.train.run_inputs import check_run_inputs
found = {}
for path in sys.argv[1:]:
    try:
        check_run_inputs(load_config(None, ["rollout.model_path=" + path]))
        found[path] = None
    except ConfigError as err:
        found[path] = err.problems[0]
print(json.dumps(found))
"""


def _check_in(env: dict[str, str], *paths: str) -> dict[str, str | None]:
    """check_run_inputs on each model path in a process of its own: huggingface_hub reads HF_* at import."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), **env}
    out = subprocess.run([sys.executable, "-c", _CHECK, *paths], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _cache_with(root: Path, repo_id: str) -> Path:
    """An HF hub cache (huggingface_hub's layout) holding `repo_id`'s config.json."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "config.json").write_text("{}")
    return root


def test_a_hub_id_offline_is_accepted_only_from_the_local_cache(tmp_path):
    cache = _cache_with(tmp_path / "hub", "org/cached")
    found = _check_in({"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}, "org/cached", "org/absent")
    assert found["org/cached"] is None
    assert found["org/absent"] == (
        "rollout.model_path='org/absent': no such folder, and hub id 'org/absent' is not in the local HF cache "
        f"(HF_HUB_OFFLINE is set, so the hub is not asked) (fix: {GENERIC_FIX})"
    )


class _Hub(http.server.BaseHTTPRequestHandler):
    """A hub on loopback that has one model, org/there."""

    def do_HEAD(self):  # noqa: N802 (http.server's name)
        if self.path == "/org/there/resolve/main/config.json":
            self.send_response(200)
            self.send_header("ETag", '"abc"')
            self.send_header("X-Repo-Commit", "0" * 40)
            self.send_header("Content-Length", "2")
        else:
            self.send_response(404)
            self.send_header("X-Error-Code", "RepoNotFound")
            self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_a_hub_id_is_asked_of_the_hub_when_not_cached(tmp_path):
    hub = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hub)
    threading.Thread(target=hub.serve_forever, daemon=True).start()
    try:
        env = {"HF_HUB_CACHE": str(tmp_path / "empty"), "HF_HUB_OFFLINE": "0"}
        env["HF_ENDPOINT"] = f"http://127.0.0.1:{hub.server_address[1]}"
        found = _check_in(env, "org/there", "org/absent")
    finally:
        hub.shutdown()
        hub.server_close()
    assert found["org/there"] is None
    assert "no such folder, and the hub has no model 'org/absent'" in found["org/absent"], found


def test_a_hub_that_cannot_be_reached_refuses_the_id_at_once(tmp_path):
    env = {"HF_HUB_CACHE": str(tmp_path / "empty"), "HF_HUB_OFFLINE": "0"}
    env["HF_ENDPOINT"] = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    (line,) = _check_in(env, "org/name").values()
    assert "hub id 'org/name' is not in the local HF cache and the hub could not be reached" in line, line
