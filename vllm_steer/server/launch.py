"""Run `vllm serve` on loopback for as long as a ``with`` block lasts (demo, benchmarks, tests).

    with serve([model, "--steer", "detox=detox.safetensors"], log_path="server.log") as url:
        requests.post(url + "/v1/completions", json={...})

Picks a free port, starts the ``vllm`` command of this Python environment, waits for
``/health``, and stops the server (terminate, then kill) when the block ends. A server that
exits or does not come up in time is an error carrying the tail of its log. Light: no torch.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator, Sequence


class ServerStartError(RuntimeError):
    """`vllm serve` exited or did not answer /health in time; the message ends with its log."""


def free_port() -> int:
    """A free loopback port below the kernel's ephemeral range.

    A port the kernel hands out (``bind(("", 0))``) is in the ephemeral range, where the
    next process's outgoing and ZMQ sockets are also placed: another process can take it
    before `vllm serve` binds it. Ports 20000-32767 are only used when asked for.
    """
    import random
    pick = random.SystemRandom()  # not the seeded module state: test workers share seeds
    for _ in range(200):
        port = pick.randint(20000, 32767)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_executable() -> str:
    """The ``vllm`` command installed next to this interpreter (the one this plugin is in)."""
    return str(Path(sys.executable).with_name("vllm"))


@contextlib.contextmanager
def serve(args: Sequence[str], log_path: str | os.PathLike, env: dict | None = None,
          timeout: float = 600.0, on_wait: Callable[[float], None] | None = None,
          port: int | None = None) -> Iterator[str]:
    """``vllm serve *args --host 127.0.0.1 --port PORT``; yields ``http://127.0.0.1:PORT``.

    ``env`` is added to this process's environment; ``on_wait(seconds_elapsed)`` is called
    while waiting (a spinner, a progress line).
    """
    chosen = port
    for attempt in range(_PORT_ATTEMPTS):
        port = chosen or free_port()
        try:
            proc, base = _start(args, port, Path(log_path), env, timeout, on_wait)
        except _PortTaken:
            if chosen is not None or attempt == _PORT_ATTEMPTS - 1:
                raise ServerStartError(f"port {port} is in use (log {log_path}):\n"
                                       f"{_tail(Path(log_path))}") from None
            continue
        break
    try:
        yield base
    finally:
        _stop(proc)


_PORT_ATTEMPTS = 3


class _PortTaken(Exception):
    """Another process bound the port between it being chosen and `vllm serve` binding it."""


def _start(args, port: int, log_path: Path, env, timeout, on_wait):
    import requests

    cmd = [vllm_executable(), "serve", *map(str, args), "--host", "127.0.0.1",
           "--port", str(port)]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    base = f"http://127.0.0.1:{port}"
    t0 = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env=dict(os.environ, **(env or {})))
    try:
        while True:
            if proc.poll() is not None:
                if "Address already in use" in _tail(log_path):
                    raise _PortTaken()
                raise ServerStartError(f"vllm serve exited with code {proc.returncode} "
                                       f"(log {log_path}):\n{_tail(log_path)}")
            if time.time() - t0 > timeout:
                raise ServerStartError(f"vllm serve did not answer {base}/health within "
                                       f"{timeout:.0f} s (log {log_path}):\n"
                                       f"{_tail(log_path)}")
            try:
                if requests.get(base + "/health", timeout=2).status_code == 200:
                    return proc, base
            except requests.RequestException:
                pass
            if on_wait is not None:
                on_wait(time.time() - t0)
            time.sleep(0.5)
    except BaseException:
        _stop(proc)
        raise


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no log)"
