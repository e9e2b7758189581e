"""`specserve serve --dp-size N`: N replica servers on loopback ports, and the Shepherd Model Gateway (`smg`,
the optional `router` extra) in front of them on the public address. specserve has no router of its own: `smg`
routes by prefix cache and load, retries, and stops routing to a replica whose health fails.

Each replica is a whole `specserve serve` process (its own engine, KV pool and prefix cache): on a GPU machine
one per GPU (or per `--tp-size` GPUs), on a CPU the cores shared out. The parent only starts, watches and stops
them; docs/scale-out.md gives the same layout across machines."""
from __future__ import annotations

import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from specserve import envs
from specserve.config import ScaleOutConfig, ServerConfig
from specserve.distributed.ranks import free_port

log = logging.getLogger(__name__)

_POLL_S = 0.2
_RESTART_DELAY_MAX_S = 60.0
_STARTUP_TIMEOUT_S = 1800.0  # a large model takes a while to load on every GPU at once
_KEY_ENV = envs.env_name("api_key")  # children read the key there, out of `ps`
# The router process: smg's own launcher, with the key appended from the environment so that it is not on
# the command line (`ps` shows the arguments a process was started with, not what it changes them to).
_ROUTER_MAIN = ("import os, sys\n"
                "from smg.launch_router import main\n"
                f"key = os.environ.pop({_KEY_ENV!r}, '')\n"
                "sys.argv[1:] += ['--api-key', key] if key else []\n"
                "main()\n")


@dataclass
class _Child:
    name: str
    proc: subprocess.Popen
    url: str
    cmd: list[str]
    env: dict[str, str]
    restarts: int = 0
    restart_at: float | None = None  # when a dead replica is due to start again


def replica_env(index: int, dp_size: int, gpus_per_replica: int, visible: list[str] | None,
                cpu_count: int, api_key: str | None) -> dict[str, str]:
    """Replica `index`'s environment: its own GPUs, or its share of the CPU cores so that N replicas do
    not each start a thread per core; and the key."""
    env = dict(os.environ)
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(visible[index * gpus_per_replica:(index + 1) * gpus_per_replica])
    else:
        env["OMP_NUM_THREADS"] = str(max(1, cpu_count // dp_size))
    if api_key:
        env[_KEY_ENV] = api_key
    return env


# The launcher's own options, which a replica's command line leaves out.
_LAUNCHER_OPTIONS = frozenset({"--dp-size", "--data-parallel-size", "--router-policy", "--host", "--port"})


def replica_args(serve_argv: list[str]) -> list[str]:
    """The model and engine arguments of `specserve serve ...`, without the launcher's own options."""
    kept, skip = [], False
    for arg in serve_argv:
        if skip:
            skip = False
        elif arg in _LAUNCHER_OPTIONS:
            skip = True
        elif arg.split("=", 1)[0] not in _LAUNCHER_OPTIONS:
            kept.append(arg)
    return kept


def replica_command(serve_argv: list[str], port: int) -> list[str]:
    # --dp-size 1 last (argparse keeps the last value): a replica never launches replicas, whatever
    # abbreviation of the option the user typed.
    return [sys.executable, "-m", "specserve.cli", "serve", *replica_args(serve_argv),
            "--host", "127.0.0.1", "--port", str(port), "--dp-size", "1"]


def router_command(server: ServerConfig, scale: ScaleOutConfig, worker_urls: list[str],
                   prometheus_port: int) -> list[str]:
    return [sys.executable, "-c", _ROUTER_MAIN, "--host", server.host, "--port", str(server.port),
            "--worker-urls", *worker_urls, "--policy", scale.router_policy,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prometheus_port),
            # smg's own drain on SIGTERM, before the replicas get theirs
            "--shutdown-grace-period-secs", str(max(1, int(server.shutdown_timeout))),
            # Loopback probes cost nothing: notice a dead replica in seconds (smg's defaults suit remote
            # workers: a probe a minute), and keep the load it routes by fresh.
            "--health-check-interval-secs", "2", "--health-failure-threshold", "2",
            "--load-monitor-interval", "2",
            # Retries of a request whose replica died outlast those probes (0.2 + 0.4 + ... + 3.2 s): smg's
            # defaults spend theirs within a second, where cache-aware routing may send each one back to the
            # dead replica, the one holding the prompt's prefix.
            "--retry-max-retries", "6", "--retry-initial-backoff-ms", "200", "--retry-backoff-multiplier", "2",
            # The replicas start together, so none is a newcomer whose cache needs a share of the traffic
            # (smg's warm-up slice): a prefix goes where it is cached.
            "--worker-warmup-secs", "0", "--worker-warmup-divert-every", "0", "--log-level", "warn"]


def multi_machine_recipe(server: ServerConfig, scale: ScaleOutConfig, serve_argv: list[str]) -> str:
    """The same layout over several machines, with this launch's model arguments."""
    args = " ".join(shlex.quote(a) for a in replica_args(serve_argv))
    key = "SPECSERVE_API_KEY=$KEY " if server.api_key else ""
    router_key = " --api-key $KEY" if server.api_key else ""
    return (f"across machines: on each worker machine run\n"
            f"  {key}specserve serve {args} --host 0.0.0.0 --port 30001\n"
            f"then on the gateway machine\n"
            f"  smg launch --host 0.0.0.0 --port {server.port} --policy {scale.router_policy}{router_key} "
            f"--worker-urls http://machine1:30001 http://machine2:30001 ...")


def visible_gpus(on_cpu: bool, needed: int) -> list[str] | None:
    """The GPU ids to share out, or None on a CPU. Refuses a split the machine cannot give."""
    if on_cpu:
        return None
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed:
        ids = [i.strip() for i in listed.split(",") if i.strip()]
    else:
        import torch

        ids = [str(i) for i in range(torch.cuda.device_count())]
    if len(ids) < needed:
        raise SystemExit(f"specserve: --dp-size needs {needed} GPUs (dp size x tp size), {len(ids)} visible")
    return ids


def _own_session_dying_with_parent() -> None:
    """In the child before exec: its own session (a terminal's Ctrl-C reaches the parent only, which stops the
    children in order), and SIGTERM when the parent dies, so no replica outlives a killed launcher."""
    os.setsid()
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _spawn(name: str, cmd: list[str], env: dict[str, str], url: str) -> _Child:
    return _Child(name, _popen(cmd, env), url, cmd, env)


def _popen(cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, env=env, preexec_fn=_own_session_dying_with_parent)


def _healthy(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _wait_healthy(children: list[_Child], stopping) -> None:
    deadline = time.monotonic() + _STARTUP_TIMEOUT_S
    pending = list(children)
    while pending:
        for child in list(pending):
            if child.proc.poll() is not None:
                raise RuntimeError(f"{child.name} exited with status {child.proc.returncode} while starting")
            if _healthy(child.url):
                pending.remove(child)
        if stopping() or time.monotonic() > deadline:
            raise RuntimeError("stopped before every replica was up" if stopping() else "replicas did not start")
        time.sleep(_POLL_S)


def _stop(children: list[_Child], timeout: float) -> None:
    """SIGTERM, then SIGKILL whatever is still running after `timeout` seconds."""
    for child in children:
        if child.proc.poll() is None:
            child.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for child in children:
        try:
            child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop in %.0f s; killing it", child.name, timeout)
            child.proc.kill()
            child.proc.wait()


def serve_replicas(server: ServerConfig, scale: ScaleOutConfig, serve_argv: list[str], on_cpu: bool,
                   gpus_per_replica: int = 1) -> int:
    """Runs until SIGTERM/SIGINT: the router drains first, then the replicas (each its own drain). Exits
    non-zero when the router dies; a replica that dies is out of routing until it has been started again."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        import smg  # noqa: F401
    except ImportError:
        raise SystemExit("specserve: --dp-size needs the smg gateway: pip install 'specserve[router]'") from None
    visible = visible_gpus(on_cpu, scale.dp_size * gpus_per_replica)
    stop_requested = []
    previous = {sig: signal.signal(sig, lambda s, f: stop_requested.append(s))
                for sig in (signal.SIGTERM, signal.SIGINT)}
    replicas: list[_Child] = []
    router: list[_Child] = []
    try:
        for i in range(scale.dp_size):
            port = free_port()
            env = replica_env(i, scale.dp_size, gpus_per_replica, visible, os.cpu_count() or 1, server.api_key)
            replicas.append(_spawn(f"replica {i}", replica_command(serve_argv, port), env,
                                   f"http://127.0.0.1:{port}"))
        _wait_healthy(replicas, lambda: bool(stop_requested))
        urls = [r.url for r in replicas]
        env = {**os.environ, **({_KEY_ENV: server.api_key} if server.api_key else {})}
        router.append(_spawn("smg", router_command(server, scale, urls, free_port()), env,
                             f"http://{server.host}:{server.port}"))
        log.info("serving on http://%s:%d: smg (%s) in front of %d replicas at %s", server.host, server.port,
                 scale.router_policy, scale.dp_size, " ".join(urls))
        log.info("%s", multi_machine_recipe(server, scale, serve_argv))
        return _watch(router[0], replicas, lambda: bool(stop_requested))
    except RuntimeError as exc:
        log.error("%s", exc)
        return 1
    finally:
        _stop(router, server.shutdown_timeout + 5)
        _stop(replicas, server.shutdown_timeout + 5)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _watch(router: _Child, replicas: list[_Child], stopping) -> int:
    """Until a stop is asked: a replica that exits is started again on its port (smg's health checks take it
    out of routing meanwhile and back in once it answers), after a delay that doubles with each restart up
    to a minute, so one that cannot start does not spin. smg's exit ends the launch."""
    while not stopping():
        if router.proc.poll() is not None:
            log.error("smg exited with status %s; stopping the replicas", router.proc.returncode)
            return 1
        now = time.monotonic()
        for replica in replicas:
            if replica.restart_at is None and replica.proc.poll() is not None:
                delay = min(_RESTART_DELAY_MAX_S, 2.0 ** replica.restarts)
                replica.restart_at = now + delay
                log.warning("%s (%s) exited with status %s; smg routes to the others; restarting it in %.0f s",
                            replica.name, replica.url, replica.proc.returncode, delay)
            elif replica.restart_at is not None and now >= replica.restart_at:
                replica.proc, replica.restart_at = _popen(replica.cmd, replica.env), None
                replica.restarts += 1
        time.sleep(_POLL_S)
    return 0
