"""Tests only: a Python that has imported moetool already, for the tests that run commands in
processes of their own.

A test that runs ``python -m moetool ...`` (or a script, or ``-c``) as a user would pays for a
new interpreter importing torch each time: ~1.5 CPU-s a run on this project's 2-core machine,
about 50 runs in tests/hostile. Here one server process a pytest worker (``python warm_python.py``,
started at the first run) imports torch, moetool and its commands once, then forks a child a
run: a real process of its own (its pid, its session if asked, its signals, exit status and
stdin / stdout / stderr pipes), running the same code from the same ``__main__`` entry as a
fresh ``python`` would, with the test's argv, environment and working folder. Only the start-up
is skipped, so a run whose environment differs from the server's where start-up reads it (a
variable other than those in ``RUN_TIME_VARIABLES``), or that passes interpreter options, gets
a fresh interpreter (``subprocess``) as before; so does every run under
``MOETOOL_TESTS_FRESH_PYTHON=1``. tests/cli/test_cli_entry.py starts fresh ones on purpose.

``run(argv, ...)`` is ``subprocess.run(argv, capture_output=True, text=True, ...)``;
``Popen(argv, ...)`` is ``subprocess.Popen(argv, stdout=PIPE, stderr=PIPE, text=True, ...)``,
with pid, poll, wait, communicate, send_signal, terminate, kill and returncode.
"""
from __future__ import annotations

import atexit
import json
import os
import select
import selectors
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

#: variables read only while a command runs (the child gets the test's value): a run whose
#: environment differs from the server's in another variable starts a fresh interpreter
RUN_TIME_VARIABLES = frozenset({"PYTEST_CURRENT_TEST", "MOETOOL_TRACEBACK"})
#: what the server imports before its first fork: torch and every command's module
PRELOAD = ("torch", "safetensors.torch", "moetool.cli", "moetool.cli.inspect", "moetool.cli.quantize",
           "moetool.cli.repack", "moetool.cli.shard", "moetool.cli.verify", "moetool.cli.demo")
FRESH_VARIABLE = "MOETOOL_TESTS_FRESH_PYTHON"


# ------------------------------------------------------------------------------ the server


def _serve(path: str) -> dict:
    """Accept runs on the socket at ``path`` until stdin closes (the test process went away);
    returns only in a forked child, with its request, its stdio already in place."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    children: dict[int, socket.socket] = {}
    while True:
        readable, _, _ = select.select([listener, sys.stdin], [], [], 0.01)
        if sys.stdin in readable and not os.read(sys.stdin.fileno(), 1):
            os._exit(0)  # the children are the test's: left to it
        if listener in readable:
            conn, _ = listener.accept()
            try:
                message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
                request = json.loads(message)
            except (OSError, ValueError):
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                listener.close()
                conn.close()
                for other in children.values():
                    other.close()
                _take_stdio(fds, request)
                return request
            for fd in fds:
                os.close(fd)
            conn.send(json.dumps({"pid": pid}).encode())
            children[pid] = conn
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                try:
                    conn.send(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode())
                except OSError:
                    pass  # the test stopped listening
                conn.close()


def _take_stdio(fds: list[int], request: dict) -> None:
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    if request["new_session"]:
        os.setsid()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])


def _run_child(request: dict) -> None:
    """What ``python ARGS`` runs, in this process: ``-m MODULE``, ``-c CODE`` or a script."""
    import runpy
    import types

    args = request["args"]
    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    elif args[0] == "-c":
        sys.argv = ["-c", *args[2:]]
        sys.path[0] = ""
        main = types.ModuleType("__main__")
        main.__builtins__ = __builtins__
        sys.modules["__main__"] = main
        exec(compile(args[1], "<string>", "exec"), main.__dict__)
    else:
        sys.argv = list(args)
        sys.path[0] = os.path.dirname(os.path.realpath(args[0]))
        runpy.run_path(args[0], run_name="__main__")


# ------------------------------------------------------------------------------ the test side


class _Server:
    def __init__(self, env: dict[str, str]):
        self.env = env
        self.folder = tempfile.mkdtemp(prefix="moetool-warm-")
        self.path = os.path.join(self.folder, "socket")
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), self.path], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True)
        if self.proc.stdout.readline() != "ready\n":
            raise RuntimeError(f"the warm Python did not start (exit status {self.proc.wait()})")

    def close(self) -> None:
        self.proc.stdin.close()  # the server exits; runs under way go on
        self.proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


_servers: dict[tuple, _Server] = {}
_lock = threading.Lock()


def _start_time_env(env: dict[str, str]) -> tuple:
    return tuple(sorted((k, v) for k, v in env.items() if k not in RUN_TIME_VARIABLES))


def _server_for(env: dict[str, str]) -> _Server | None:
    key = _start_time_env(env)
    with _lock:
        server = _servers.get(key)
        if server is None and len(_servers) < 2:  # more start-time environments: fresh ones
            server = _servers[key] = _Server(dict(env))
        return server


@atexit.register
def _close_servers() -> None:
    for server in _servers.values():
        server.close()
    _servers.clear()


def _warm_args(argv: list) -> list[str] | None:
    """argv without the interpreter, if the warm Python can run it (no interpreter options)."""
    argv = [str(a) for a in argv]
    if os.environ.get(FRESH_VARIABLE) == "1" or not argv or argv[0] != sys.executable or len(argv) < 2:
        return None
    rest = argv[1:]
    if rest[0] in ("-m", "-c"):
        return rest if len(rest) >= 2 else None
    return None if rest[0].startswith("-") else rest


class Popen:
    """``subprocess.Popen(argv, stdout=PIPE, stderr=PIPE, text=True, env=, cwd=,
    start_new_session=)`` in the warm Python where it can be (else a real one: ``.fresh``)."""

    def __new__(cls, argv, env=None, cwd=None, start_new_session=False):
        args = _warm_args(argv)
        env = dict(os.environ if env is None else env)
        server = None if args is None else _server_for(env)
        if server is None:
            return subprocess.Popen([str(a) for a in argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, env=env, cwd=cwd, start_new_session=start_new_session)
        self = super().__new__(cls)
        self._start(server, args, env, cwd, start_new_session)
        return self

    def _start(self, server, args, env, cwd, new_session) -> None:
        self.args = args
        self.returncode = None
        self._out: dict[str, list[bytes]] = {"stdout": [], "stderr": []}
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        null = os.open(os.devnull, os.O_RDONLY)
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._conn.connect(server.path)
            request = {"args": args, "env": env, "cwd": os.path.abspath(cwd or os.getcwd()),
                       "new_session": bool(new_session)}
            socket.send_fds(self._conn, [json.dumps(request).encode()], [null, out_w, err_w])
        finally:
            for fd in (null, out_w, err_w):
                os.close(fd)
        self.stdout = os.fdopen(out_r, "r")
        self.stderr = os.fdopen(err_r, "r")
        self.pid = json.loads(self._conn.recv(1 << 16))["pid"]

    def _status(self, timeout: float | None) -> int | None:
        if self.returncode is None:
            ready, _, _ = select.select([self._conn], [], [], timeout)
            if ready:
                message = self._conn.recv(1 << 16)
                self.returncode = json.loads(message)["returncode"] if message else -9
                self._conn.close()
        return self.returncode

    def poll(self) -> int | None:
        return self._status(0)

    def wait(self, timeout: float | None = None) -> int:
        if self._status(timeout) is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Both pipes to their end, then the exit status; on a timeout the output so far is kept
        for the next call, as subprocess does."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            for name in ("stdout", "stderr"):
                stream = getattr(self, name)
                if not stream.closed:
                    sel.register(stream, selectors.EVENT_READ, name)
            while sel.get_map():
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                events = sel.select(left)
                if not events:
                    raise subprocess.TimeoutExpired(self.args, timeout)
                for key, _ in events:
                    chunk = os.read(key.fileobj.fileno(), 1 << 16)
                    if chunk:
                        self._out[key.data].append(chunk)
                    else:
                        sel.unregister(key.fileobj)
                        key.fileobj.close()
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return _text(self._out["stdout"]), _text(self._out["stderr"])

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(15)

    def kill(self) -> None:
        self.send_signal(9)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        for stream in (self.stdout, self.stderr):
            stream.close()
        self.wait()


def _text(chunks: list[bytes]) -> str:
    """As text=True reads a pipe: UTF-8, universal newlines."""
    return b"".join(chunks).decode(errors="replace").replace("\r\n", "\n").replace("\r", "\n")


def run(argv, env=None, cwd=None, timeout: float | None = None) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, capture_output=True, text=True, env=, cwd=, timeout=)``, warm
    where it can be; on a timeout the process is killed, as subprocess does."""
    p = Popen(argv, env=env, cwd=cwd)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        raise
    return subprocess.CompletedProcess(argv, p.returncode, out, err)


if __name__ == "__main__":
    for module in PRELOAD:
        __import__(module)
    request = _serve(sys.argv[1])
    del module
    _run_child(request)
