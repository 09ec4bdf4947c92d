"""A fork server: one process imports torch, minikv and IPython once, then forks a process per notebook.

    server = ForkServer(runner, cwd, env, threads)  # python runner.py --serve FD THREADS: imports, then waits
    proc = server.fork(events_fd)                   # used as subprocess.Popen is: pid, stdin, stdout, wait(timeout)
    server.close()

A fresh `python runner.py` spends most of its start importing torch before a notebook's first cell; a
fork of a process that has imported it starts at once. The grader talks to the server over a socket pair:

    grader                                  server (runner.py --serve)            child (one notebook)
    stdin, stdout, events pipes  --fds-->   fork ------------------------------>  setsid, its own session
                                 <--pid--   (once the child has its session)      0, 1, 2 := the pipes
                                 <--exit--  waitpid                               runner.main(events)

The child is as isolated as a fresh process: its own session (the grader kills it and all it started),
its own stdin, stdout and stderr, the server's socket closed (the notebook cannot reach the grader but by
its events pipe), `random` and numpy reseeded; runner.main sets its memory limit, threads, working
directory and sys.path before the notebook's code runs, as in a fresh process. The server itself runs no
notebook code, so every child starts from the same untouched imports (memory is copied on write). What
children share that fresh processes would not: the server's hash seed (the order of a set of strings).
What a notebook could do to the server (it runs as the same user) it could do to the grader already.
A course that sets environment variables before anything imports (registry.py's `env`) is forked only
where the server's imports saw the same values; else its notebook starts a fresh process.

Forking a process that runs threads is unsafe (a lock another thread holds stays held in the child, and
torch's thread pool does not survive a fork): the server starts none and runs no torch work, and it
checks that it has one thread before each fork (else it refuses, and the grader starts a fresh process).
The grader forks only on Linux, and never with MINIKV_GRADER_FORK=0 in its environment: then each
notebook starts a fresh `python runner.py` (minikv/classroom/check.py).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Callable

READY_TIMEOUT = 120.0  # seconds for the server's imports, or for it to fork, on a loaded machine


def available() -> bool:
    """True where the grader forks notebooks from a server: Linux, unless MINIKV_GRADER_FORK=0."""
    return sys.platform.startswith("linux") and os.environ.get("MINIKV_GRADER_FORK", "1") != "0"


# ---- the grader's side ---------------------------------------------------------------------------

class ForkServer:
    """A warm `python runner.py --serve` in `cwd` with `env`; forks one notebook's process at a time."""

    def __init__(self, runner: Path, cwd: Path, env: dict[str, str], threads: int | None):
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)  # one message per send
        python = [sys.executable] + (["-S"] if sys.flags.no_site else [])
        try:
            self.proc = subprocess.Popen([*python, str(runner), "--serve", str(theirs.fileno()), str(threads or 0)],
                                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL, pass_fds=(theirs.fileno(),), cwd=cwd, env=env,
                                         start_new_session=True)
        finally:
            theirs.close()
        self.last: Forked | None = None
        try:
            ready = self.receive(READY_TIMEOUT)
        except subprocess.TimeoutExpired:
            ready = None
        self.environ: dict[str, str] | None = ready.get("ready") if ready else None  # None: never ready, or gone

    def can_run(self, env: dict[str, str]) -> bool:
        """Ready and alive, and `env` (a course's variables, set before anything imports) already holds in
        its imports' environment; else the notebook needs a fresh process."""
        return self.environ is not None and self.proc.poll() is None and all(
            self.environ.get(k) == v for k, v in env.items())

    def fork(self, events_fd: int) -> Forked | None:
        """A notebook's process that writes its events to events_fd; None if the server cannot fork now."""
        if self.last is not None:
            self.last.wait()  # its exit message comes first
        stdin_r, stdin_w = os.pipe()
        out_r, out_w = os.pipe()
        try:
            socket.send_fds(self.sock, [b"fork"], [stdin_r, out_w, events_fd])
            answer = self.receive(READY_TIMEOUT)
        except (OSError, subprocess.TimeoutExpired):
            answer = None
        finally:
            os.close(stdin_r)
            os.close(out_w)
        if not answer or "pid" not in answer:
            os.close(stdin_w)
            os.close(out_r)
            self.environ = None  # refused (a thread appeared) or gone: use it no more
            return None
        self.last = Forked(self, answer["pid"], os.fdopen(stdin_w, "wb"), os.fdopen(out_r, "rb"))
        return self.last

    def receive(self, timeout: float | None) -> dict | None:
        """The server's next message; None when it is gone (raises subprocess.TimeoutExpired past timeout)."""
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(1 << 20)
        except socket.timeout:
            raise subprocess.TimeoutExpired("the grader's fork server", timeout) from None
        except OSError:
            return None
        finally:
            self.sock.settimeout(None)
        return json.loads(data) if data else None

    def close(self) -> None:
        """End the server (a closed socket ends its loop; a kill if it is stuck) and a notebook left running."""
        if self.last is not None and not self.last.ended:
            try:
                os.killpg(self.last.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.sock.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Forked:
    """A notebook's process forked by the server, used as subprocess.Popen is (check.py's grade_notebook)."""

    def __init__(self, server: ForkServer, pid: int, stdin, stdout):
        self.server, self.pid, self.stdin, self.stdout = server, pid, stdin, stdout
        self.returncode: int | None = None
        self.ended = False

    def wait(self, timeout: float | None = None) -> int | None:
        """Its exit code (-N: killed by signal N), as the server's waitpid saw it; None if the server died."""
        if not self.ended:
            try:
                answer = self.server.receive(timeout)
            except subprocess.TimeoutExpired:
                raise subprocess.TimeoutExpired(f"notebook process {self.pid}", timeout) from None
            self.ended = True
            self.returncode = answer.get("exit") if answer else None
            if answer is None:
                self.server.environ = None
        return self.returncode

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


# ---- the server's side (runs in `python runner.py --serve`) --------------------------------------

def serve(sock_fd: int, run_notebook: Callable[[int], None]) -> None:
    """Answer the grader until it closes the socket: fork a child per request, which runs run_notebook."""
    sock = socket.socket(fileno=sock_fd)
    try:
        sock.send(json.dumps({"ready": dict(os.environ)}).encode())
        while _serve_one(sock, run_notebook):
            pass
    except OSError:  # the grader is gone
        pass


def _serve_one(sock: socket.socket, run_notebook: Callable[[int], None]) -> bool:
    """One request: fork, report the child's pid, wait for it, report its exit. False: the grader closed."""
    _, fds, _, _ = socket.recv_fds(sock, 16, 3)
    if len(fds) != 3:  # the grader closed the socket (or sent what is not a request)
        for fd in fds:
            os.close(fd)
        return False
    if _threads() != 1:
        for fd in fds:
            os.close(fd)
        sock.send(json.dumps({"refused": f"the server runs {_threads()} threads; forking needs one"}).encode())
        return True
    has_session_r, has_session_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(has_session_r)
        _child(sock, fds, has_session_w, run_notebook)
    for fd in (*fds, has_session_w):
        os.close(fd)
    os.read(has_session_r, 1)  # end of file: the child has its own session (or died), the grader may kill it
    os.close(has_session_r)
    sock.send(json.dumps({"pid": pid}).encode())
    _, status = os.waitpid(pid, 0)
    sock.send(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode())
    return True


def _child(sock: socket.socket, fds: list[int], has_session_w: int, run_notebook: Callable[[int], None]) -> None:
    """In the forked child: become a fresh process's equal, run the notebook, never return to the loop."""
    try:
        os.setsid()
        os.close(has_session_w)
        sock.close()  # the notebook reaches the grader by its events pipe alone
        stdin, out, events = fds
        os.dup2(stdin, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(stdin)
        os.close(out)
        sys.argv[1:] = [str(events)]  # as `python runner.py FD` has
        _reseed()
        run_notebook(events)  # ends the process itself
    except BaseException:  # noqa: BLE001  whatever happens, this process never serves again
        import traceback

        traceback.print_exc()
    finally:
        os._exit(1)


def _reseed() -> None:
    """A fresh process seeds numpy's global generator from the OS; a forked one would share the server's
    (`random` reseeds itself after a fork; numpy.random is not among the server's imports today)."""
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        import threading

        return threading.active_count()
