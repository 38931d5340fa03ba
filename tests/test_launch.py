"""The argv and environment each backend's engine server gets (SGLang cannot run here)."""

from __future__ import annotations

import sys

import pytest

from rollfleet.config import ConfigError, load_config
from rollfleet.engine.process.launch import EngineLaunch, engine_argv, engine_env


def rollout(*overrides):
    return load_config(None, ["rollout.model_path=/models/m", *overrides]).rollout


def flag(argv, name):
    return argv[argv.index(name) + 1]


@pytest.mark.parametrize("tp, pp, ep, dp", [(1, 1, 1, 1), (2, 1, 1, 4), (4, 1, 2, 2), (2, 2, 1, 2), (8, 2, 8, 1)])
def test_sglang_argv_carries_the_engine_shape(tp, pp, ep, dp):
    cfg = rollout(
        "rollout.backend=sglang",
        f"rollout.tp_size={tp}",
        f"rollout.pp_size={pp}",
        f"rollout.ep_size={ep}",
        f"rollout.num_engines={dp}",
    )
    argv = engine_argv(cfg, EngineLaunch(port=31234, base_gpu_id=0, load_format="dummy"))
    assert argv[:3] == [sys.executable, "-m", "sglang.launch_server"]
    assert (flag(argv, "--tp-size"), flag(argv, "--pp-size"), flag(argv, "--ep-size")) == (str(tp), str(pp), str(ep))
    assert flag(argv, "--port") == "31234" and flag(argv, "--host") == "127.0.0.1"
    assert flag(argv, "--base-gpu-id") == "0" and flag(argv, "--load-format") == "dummy"
    assert flag(argv, "--model-path") == "/models/m"
    assert "--dp-size" not in argv  # one server per data-parallel replica
    assert "--enable-memory-saver" not in argv and "--api-key" not in argv


def test_sglang_colocated_key_and_extras():
    cfg = rollout(
        "rollout.backend=sglang",
        "rollout.placement=colocated",
        "rollout.api_key=k",
        "rollout.admin_api_key=a",
        "rollout.server_extras=['--mem-fraction-static', '0.6']",
    )
    argv = engine_argv(cfg, EngineLaunch(port=1, host="0.0.0.0"))
    assert "--enable-memory-saver" in argv and flag(argv, "--api-key") == "k" and flag(argv, "--admin-api-key") == "a"
    embedded = engine_argv(cfg.model_copy(update={"backend": "embedded"}), EngineLaunch(port=1))
    assert flag(embedded, "--api-key") == "k" and flag(embedded, "--admin-api-key") == "a"
    assert argv[-2:] == ["--mem-fraction-static", "0.6"] and flag(argv, "--host") == "0.0.0.0"


def test_embedded_and_sglang_differ_only_in_the_program():
    base = ["rollout.tp_size=2", "rollout.ep_size=2"]
    embedded = engine_argv(rollout(*base), EngineLaunch(port=5))
    sglang = engine_argv(rollout("rollout.backend=sglang", *base), EngineLaunch(port=5))
    assert embedded[:3] == [sys.executable, "-m", "rollfleet.engine.process.server"]
    for name in ("--model-path", "--host", "--port", "--tp-size", "--ep-size", "--load-format", "--base-gpu-id"):
        assert flag(embedded, name) == flag(sglang, name), name


def test_engine_env_exposes_only_the_engine_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert engine_env(["2", "3"])["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert engine_env([])["CUDA_VISIBLE_DEVICES"] == "3"


def test_embedded_backend_refuses_pipeline_parallel():
    with pytest.raises(ConfigError) as err:
        rollout("rollout.pp_size=2")
    assert "rollout.pp_size=2" in str(err.value) and "backend=sglang" in str(err.value)


def test_nccl_and_tensor_with_pipeline_parallel_are_refused_naming_disk():
    with pytest.raises(ConfigError) as err:
        load_config(
            None, ["rollout.model_path=m", "rollout.backend=sglang", "rollout.pp_size=2", "weight_sync.transport=nccl"]
        )
    assert "weight_sync.transport='nccl'" in str(err.value) and "['disk']" in str(err.value)
    assert "ignores the pipeline rank" in str(err.value)
    with pytest.raises(ConfigError, match="indexed by tp_rank only"):
        load_config(
            None,
            ["rollout.model_path=m", "rollout.backend=sglang", "rollout.pp_size=2", "weight_sync.transport=tensor"],
        )
    load_config(
        None, ["rollout.model_path=m", "rollout.backend=sglang", "rollout.pp_size=2", "weight_sync.transport=disk"]
    )


@pytest.mark.parametrize("backend", ["sglang", "embedded"])
def test_a_remote_seed_becomes_sglangs_three_flags(backend):
    """R-Fork at start: the same flags, in SGLang's formats (the group ports as a JSON list), for both
    backends; the embedded server parses them as SGLang does and checks one port per tp rank."""
    from rollfleet.engine.process.launch import RemoteSeed
    from rollfleet.engine.process.server_args import build_parser, check_args

    cfg = rollout(f"rollout.backend={backend}", "rollout.tp_size=2")
    seed = RemoteSeed("10.0.0.7", 30001, (29600, 29601))
    argv = engine_argv(cfg, EngineLaunch(port=31234, load_format="dummy", seed=seed))
    assert argv.count("--load-format") == 1 and flag(argv, "--load-format") == "remote_instance"
    assert flag(argv, "--remote-instance-weight-loader-seed-instance-ip") == "10.0.0.7"
    assert flag(argv, "--remote-instance-weight-loader-seed-instance-service-port") == "30001"
    assert flag(argv, "--remote-instance-weight-loader-send-weights-group-ports") == "[29600, 29601]"
    if backend == "embedded":
        parser = build_parser()
        args = parser.parse_args(argv[3:])
        check_args(parser, args)
        assert args.load_format == "remote_instance"
        assert args.remote_instance_weight_loader_send_weights_group_ports == [29600, 29601]
        bad = argv[3:] + ["--remote-instance-weight-loader-send-weights-group-ports", "[29600]"]
        with pytest.raises(SystemExit):
            check_args(parser, parser.parse_args(bad))


def test_sglang_command_replaces_only_the_program():
    """rollout.sglang_command (SGLang in a venv of its own) takes the place of `python -m
    sglang.launch_server`; every flag after it stays the same."""
    base = ["rollout.backend=sglang", "rollout.tp_size=2"]
    default = engine_argv(rollout(*base), EngineLaunch(port=5))
    own = engine_argv(
        rollout(*base, "rollout.sglang_command=['/opt/sg/bin/python', '-m', 'sglang.launch_server']"),
        EngineLaunch(port=5),
    )
    assert own[:3] == ["/opt/sg/bin/python", "-m", "sglang.launch_server"] and own[3:] == default[3:]


def test_a_port_another_engine_serves_is_not_taken_for_ours(qwen3_server, qwen3_dir, tmp_path):
    """Ports are chosen free, then bound: another process can take one in between. The launcher must
    not take the other server's answers for its engine's (it would drive the wrong engine): it waits
    for its own, which exits with "address in use"."""
    from conftest import shared_zygote

    from rollfleet.engine.process.launch import EngineProcess, PortInUse, embedded_argv

    port = qwen3_server.port
    late = EngineProcess(
        embedded_argv(qwen3_dir, port), port=port, log_path=tmp_path / "late.log", zygote=shared_zygote()
    )
    try:
        with pytest.raises(PortInUse):
            late.wait_until_up(timeout=120)
    finally:
        late.stop()
    assert qwen3_server.is_alive()


# a stand-in engine that never listens: it says when its SIGTERM handler (uvicorn has one) is set, in
# capitals (the launcher's line in the log holds this source), then waits for a signal
NEVER_UP = (
    "import signal, sys; signal.signal(signal.SIGTERM, lambda *a: sys.exit(3)); "
    "print('ready'.upper(), flush=True); signal.pause()"
)


def _stopped_never_up(tmp_path):
    import os
    import signal

    from waits import wait_until

    from rollfleet.engine.process.launch import EngineProcess
    from rollfleet.wire.net import free_port

    log = tmp_path / "engine.log"
    proc = EngineProcess([sys.executable, "-c", NEVER_UP], port=free_port(), log_path=log)
    wait_until(lambda: "READY" in log.read_text(), what="the stand-in's SIGTERM handler set")
    os.kill(proc.pid, signal.SIGSTOP)
    wait_until(proc.is_stopped, what="the stand-in stopped")
    return proc


def test_an_engine_stopped_before_it_is_up_is_killed_without_waiting_for_its_stacks(tmp_path):
    """A stopped process runs no handler: no stacks come, so the launcher does not wait for them
    (it waited 10 s), says why there are none, and kills it (a stop would wait out its grace)."""
    from rollfleet.engine.process.launch import EngineStartError

    proc = _stopped_never_up(tmp_path)
    with pytest.raises(EngineStartError, match=r"not up after 0 s; .*\(stopped \(SIGSTOP or a debugger\): no stacks\)"):
        proc.wait_until_up(timeout=0.2)
    assert proc.proc.returncode == -9


# a stand-in that binds its port and never answers (as a server hung after its bind): the kernel takes
# the connections into the listen backlog, and nothing reads them; its stacks on SIGUSR1, as the server's
SILENT = (
    "import faulthandler, socket, sys, signal; faulthandler.register(signal.SIGUSR1); s = socket.socket(); "
    "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('127.0.0.1', int(sys.argv[1]))); "
    "s.listen(64)\nwhile True: signal.pause()"
)


def test_an_engine_that_listens_but_never_answers_is_given_up_on_after_its_silent_polls(tmp_path):
    """Our server binds its port when it is ready to answer: one that takes connections and leaves
    them unanswered is hung, and is killed after the health probes' allowance, not at the start
    timeout (minutes on a GPU: the replacement would wait that long). The error says which."""
    from rollfleet.engine.process.launch import STACK_HEADER, EngineProcess, EngineStartError
    from rollfleet.wire.net import free_port

    port = free_port()
    proc = EngineProcess([sys.executable, "-c", SILENT, str(port)], port=port, log_path=tmp_path / "engine.log")
    with pytest.raises(EngineStartError, match=r"engine listens but left 3 polls unanswered \(0.2 s each\)") as err:
        proc.wait_until_up(timeout=3600, answer_timeout=0.2, silent_polls=3)
    assert STACK_HEADER in str(err.value)  # where it hung: its stack, in the log's tail
    assert proc.proc.returncode == -9  # killed, as at the start timeout


def test_a_stop_continues_a_stopped_engine_so_it_ends_through_its_own_handler(tmp_path):
    proc = _stopped_never_up(tmp_path)
    proc.stop(grace=120)
    assert proc.proc.returncode == 3  # its SIGTERM handler ran: not killed at the grace's end
