"""How `specserve serve --dp-size` lays replicas and the smg router out (server/replicas.py), without
starting processes; tests/server/test_scale_out.py runs them."""
from __future__ import annotations

import pytest

from specserve.config import ScaleOutConfig, ServerConfig
from specserve.server.replicas import (multi_machine_recipe, replica_args, replica_command, replica_env,
                                       router_command)


def test_a_replica_gets_the_model_args_but_not_the_launchers():
    argv = ["--model", "m", "--dp-size", "2", "--port=8000", "--host", "0.0.0.0", "--router-policy",
            "round_robin", "--api-key", "k", "--dp=2"]
    assert replica_args(argv) == ["--model", "m", "--api-key", "k", "--dp=2"]
    cmd = replica_command(argv, 4321)
    # Loopback only, and never a launcher itself: whatever abbreviation came through, --dp-size 1 is last.
    assert cmd[-6:] == ["--host", "127.0.0.1", "--port", "4321", "--dp-size", "1"]


def test_replicas_share_out_gpus_or_cores_and_get_the_key_from_the_environment():
    gpu = replica_env(1, 2, 2, ["0", "1", "2", "3"], 64, "k")
    assert gpu["CUDA_VISIBLE_DEVICES"] == "2,3" and gpu["SPECSERVE_API_KEY"] == "k"
    cpu = replica_env(0, 2, 1, None, 16, None)
    assert cpu["OMP_NUM_THREADS"] == "8"


def test_the_router_command_names_the_workers_but_not_the_key():
    server = ServerConfig(host="0.0.0.0", port=30000, api_key="secret", shutdown_timeout=7)
    cmd = router_command(server, ScaleOutConfig(2, "power_of_two"), ["http://127.0.0.1:1", "http://127.0.0.1:2"],
                         29999)
    assert "secret" not in " ".join(cmd)
    assert cmd[cmd.index("--worker-urls") + 1:cmd.index("--worker-urls") + 3] == ["http://127.0.0.1:1",
                                                                                 "http://127.0.0.1:2"]
    assert cmd[cmd.index("--policy") + 1] == "power_of_two" and cmd[cmd.index("--port") + 1] == "30000"
    recipe = multi_machine_recipe(server, ScaleOutConfig(2), ["--model", "m", "--dp-size", "2"])
    assert "secret" not in recipe and "--api-key $KEY" in recipe and "SPECSERVE_API_KEY=$KEY" in recipe
    assert "specserve serve --model m --host 0.0.0.0" in recipe and "--dp-size" not in recipe


def test_scale_out_config_refuses_what_smg_cannot_do():
    with pytest.raises(ValueError):
        ScaleOutConfig(0)
    with pytest.raises(ValueError):
        ScaleOutConfig(2, "fastest")


def test_without_the_router_extra_dp_size_says_what_to_install(monkeypatch):
    import sys

    from specserve.server.replicas import serve_replicas

    monkeypatch.setitem(sys.modules, "smg", None)  # import smg raises ImportError
    with pytest.raises(SystemExit, match=r"specserve\[router\]"):
        serve_replicas(ServerConfig(), ScaleOutConfig(2), [], on_cpu=True)
