"""A warm `ptdp` for the doc tests: one server imports torch and ptdp once, and each `ptdp`
command a page runs is a fork of it instead of a fresh interpreter.

The pages run about 90 `ptdp` commands; each cold start imports torch and ptdp (3-4 s of
CPU on this machine's 2 cores, more than most of the commands then take). Here the `ptdp`
on the pages' PATH is a small stdlib-only client (`client_script`): it hands the server its
arguments, working directory, environment and its stdin, stdout and stderr (as file
descriptors over a Unix socket), forwards the signals it gets to the command, and exits as
the command did (a command killed by a signal kills the client by the same signal). The
server forks; the child takes those, runs `ptdp.cli.main`, runs the exit handlers a normal
exit runs and leaves without freeing the heap. What differs from a cold start: modules are
imported before the command's environment is set, so a variable that torch reads at import
is the server's (it starts with the pages' environment, `OMP_NUM_THREADS=1` included), and
the command's parent process is the server. `python -m ptdp` and `torchrun` still start
cold. `PTDP_DOC_TESTS_COLD=1` runs every command cold.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import select
import socket
import struct
import sys
import traceback
from pathlib import Path

PRELOAD = (
    "torch",
    "torch._dynamo",  # imported by the first optimizer step
    "ptdp.cli",
    "ptdp.train.run",
    "ptdp.sample",
    "ptdp.data.preprocess",
    "ptdp.perf.commands",
    "ptdp.checkpoint.inspect",
    "ptdp.convert.hf",
)
"""What the server imports once: everything the pages' commands import at start."""

_LEN = struct.Struct("!q")


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the client went away")
        data += chunk
    return data


def _receive(conn: socket.socket) -> tuple[list[int], dict]:
    """The client's three file descriptors and its job (argv, cwd, env)."""
    header, fds, _, _ = socket.recv_fds(conn, _LEN.size, 3)
    if len(header) < _LEN.size:
        header += _recv_exact(conn, _LEN.size - len(header))
    (size,) = _LEN.unpack(header)
    return fds, json.loads(_recv_exact(conn, size))


def _reap(children: dict[int, socket.socket]) -> None:
    """Send each finished command's status to its client: the exit code, or -signal."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is None:
            continue
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        try:
            conn.sendall(_LEN.pack(code))
        except OSError:
            pass
        conn.close()


def serve(path: str) -> list[str]:
    """Serve until the parent (the test session) goes; returns only in a forked child, with
    the command's arguments, its stdio, cwd and environment already in place."""
    for name in PRELOAD:
        importlib.import_module(name)
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    print("ready", flush=True)
    children: dict[int, socket.socket] = {}
    while os.getppid() == parent:
        ready, _, _ = select.select([listener], [], [], 0.05)
        if ready:
            conn, _ = listener.accept()
            try:
                fds, job = _receive(conn)
            except (ConnectionError, OSError, ValueError):
                conn.close()
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                listener.close()
                for other in children.values():
                    other.close()
                conn.close()
                return _become(fds, job)
            for fd in fds:
                os.close(fd)
            children[pid] = conn
            try:
                conn.sendall(_LEN.pack(pid))
            except OSError:
                pass
        _reap(children)
    raise SystemExit(0)


def _become(fds: list[int], job: dict) -> list[str]:
    """In the forked child: the client's stdio, cwd and environment."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(job["cwd"])
    os.environ.clear()
    os.environ.update(job["env"])
    sys.argv = ["ptdp", *job["argv"]]
    return list(job["argv"])


CLIENT = """\
import json, os, signal, socket, struct, sys
LEN = struct.Struct("!q")
def recv(conn, n):
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            sys.exit("ptdp (doc-test client): the warm server went away")
        data += chunk
    return data
conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
conn.connect({socket!r})
job = json.dumps({{"argv": sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ)}}).encode()
socket.send_fds(conn, [LEN.pack(len(job))], [0, 1, 2])
conn.sendall(job)
(pid,) = LEN.unpack(recv(conn, LEN.size))
def forward(signum, frame):
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass
for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2"):
    signal.signal(getattr(signal, name), forward)
(code,) = LEN.unpack(recv(conn, LEN.size))
if code < 0:
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
sys.exit(code)
"""


def client_script(bin_dir: Path, socket_path: str) -> Path:
    """Write the `ptdp` client into `bin_dir` (put it first on the pages' PATH)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    script = bin_dir / "ptdp"
    body = CLIENT.format(socket=socket_path)
    script.write_text(f"#!{sys.executable} -S\n{body}")
    script.chmod(0o755)
    return script


def _main() -> None:
    argv = serve(sys.argv[1])
    from ptdp.cli import main  # imported by the server already

    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's exits, and `raise SystemExit(code)`
        code = exc.code
    except BaseException:
        traceback.print_exc()  # as the interpreter prints an uncaught exception
        code = 1
    # The exit handlers a normal exit runs, then out without tearing down the heap (torch's
    # modules take a second or more to free, with nothing left to write by then).
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)  # SystemExit("message"): printed, exit 1
        code = 1
    os._exit(code)


if __name__ == "__main__":
    _main()
