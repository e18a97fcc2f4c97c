"""Where the ``kvstack`` command line writes: its own output to the terminal, everything else out of the way.

The one mechanism: ``redirect_output`` points file descriptors 1 (and, for ``kvstack serve``, 2) and
``sys.stdout`` / ``sys.stderr`` elsewhere for the duration of a command. That catches every writer of the process
and of the processes it starts, whatever they use: vLLM's logger (its handler writes to ``sys.stdout`` by default,
``VLLM_LOGGING_STREAM``), Ray's driver (it prints the workers' logs to ``sys.stdout`` / ``sys.stderr``), the
``ray start`` and engine-core child processes (they inherit the descriptors), stray ``print`` calls and C
libraries. The command's own output goes through this module to the streams the command was started with:

- ``print_document(text)``: the one JSON document of a ``--json`` command (``kvstack plan … --json``,
  ``kvstack simulate --json``, ``kvstack bench reuse|router|oracle|agent|trace --json``, ``kvstack status --json``);
- ``say(line)``: progress lines of ``kvstack serve``; ``warn(line)``: its errors.

Who calls it: ``cluster.cli.main`` wraps every command run with ``--json`` in ``redirect_output(stdout_to=2)``
(stdout carries the document only, the logs go to stderr); ``cluster.commands.serve.run`` wraps the server in
``redirect_output(stdout_to=log, stderr_to=log)`` with the log file under ``.kvstack/logs/`` unless ``--verbose``.
Outside a redirection these functions write to ``sys.stdout`` / ``sys.stderr`` as ``print`` would.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

_terminal_out: TextIO | None = None
_terminal_err: TextIO | None = None


def _write(stream: TextIO, text: str) -> None:
    stream.write(text if text.endswith("\n") else text + "\n")
    stream.flush()


def print_document(text: str) -> None:
    """The command's result on the stdout it was started with (one JSON document for ``--json``)."""
    _write(_terminal_out or sys.stdout, text)


def say(line: str) -> None:
    """A progress line of the command itself, on the terminal's stdout."""
    _write(_terminal_out or sys.stdout, line)


def warn(line: str) -> None:
    """An error or warning of the command itself, on the terminal's stderr."""
    _write(_terminal_err or sys.stderr, line)


def _keep(stream: TextIO, fd: int, saved_fd: int) -> TextIO:
    """The stream to keep writing the command's own output to once ``fd`` points elsewhere."""
    try:
        on_fd = stream.fileno() == fd
    except (AttributeError, OSError, ValueError):  # e.g. pytest's capture objects: not a descriptor, keep them
        on_fd = False
    return os.fdopen(os.dup(saved_fd), "w", encoding="utf-8", errors="replace") if on_fd else stream


@contextmanager
def redirect_output(stdout_to: int, stderr_to: int | None = None) -> Iterator[None]:
    """Point fd 1 (and fd 2 when ``stderr_to`` is given) at those descriptors, and ``sys.stdout`` / ``sys.stderr``
    with them, until the block ends; ``print_document`` / ``say`` / ``warn`` keep writing to the original streams."""
    global _terminal_out, _terminal_err
    if _terminal_out is not None:
        raise RuntimeError("redirect_output does not nest")
    targets = {1: stdout_to} if stderr_to is None else {1: stdout_to, 2: stderr_to}
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved = {fd: os.dup(fd) for fd in targets}
    old_out, old_err = sys.stdout, sys.stderr
    _terminal_out = _keep(old_out, 1, saved[1])
    _terminal_err = _keep(old_err, 2, saved[2]) if 2 in saved else old_err
    replacement = os.fdopen(os.dup(stdout_to), "w", encoding="utf-8", errors="replace", buffering=1)
    try:
        for fd, target in targets.items():
            os.dup2(target, fd)
        sys.stdout = replacement
        if stderr_to is not None:
            sys.stderr = replacement
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        sys.stdout, sys.stderr = old_out, old_err
        for fd, dup in saved.items():
            os.dup2(dup, fd)
            os.close(dup)
        for kept, old in ((_terminal_out, old_out), (_terminal_err, old_err)):
            if kept is not old:
                kept.close()
        replacement.close()
        _terminal_out = _terminal_err = None
