"""What the entry points share: one-line errors, ``--verbose``, the resume line after a signal.

An error prints one line (``error: <Type>: <what>``) naming the field, file, line or tensor its
message names; the full traceback is printed with ``--verbose`` and, for errors raised while a
run held its directory, written to ``<run_dir>/error.log``. A run stopped by a signal prints its
resume line and exits 128 + the signal number (130 for SIGINT, 143 for SIGTERM).

``parse_flags`` is the absl flags parser of both entry points: a ``--config.<path>=`` override
that names no field is reported as one line through ``train.config`` (with "did you mean"),
instead of ml_collections' traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from absl import flags

VERBOSE = flags.DEFINE_bool(
    "verbose", False, "On an error, print the full traceback (default: one line)."
)


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def _override_problem(argv: list[str]) -> str | None:
    from fp8rl_jax.train.config import ConfigError
    from fp8rl_jax.train.experiment import check_override

    for arg in argv[1:]:
        if arg.startswith("--config.") and "=" in arg:
            try:
                check_override(arg[len("--config.") :].split("=", 1)[0])
            except ConfigError as e:
                return str(e)
    return None


def parse_flags(argv: list[str]) -> list[str]:
    """``app.run(main, flags_parser=parse_flags)``: flag errors as one line, exit code 2."""
    try:
        return flags.FLAGS(argv)
    except Exception as e:  # noqa: BLE001 (absl and ml_collections raise many types)
        if "--verbose" in argv:
            raise
        problem = _override_problem(argv) or _first_line(e)
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)


def one_line_errors(main: Callable[[list[str]], None]) -> Callable[[list[str]], None]:
    """Wraps an absl ``main``: errors as one line (``--verbose``: the traceback), exit code 1."""
    from fp8rl_jax.train.run_dir import TRACEBACK_ATTR
    from fp8rl_jax.train.shutdown import Interrupted

    def wrapped(argv: list[str]) -> None:
        try:
            main(argv)
        except Interrupted as e:
            print(str(e), file=sys.stderr, flush=True)
            sys.exit(e.exit_code)
        except Exception as e:  # noqa: BLE001
            if VERBOSE.value:
                raise
            where = getattr(e, TRACEBACK_ATTR, None)
            more = f"traceback in {where}" if where else "--verbose prints the traceback"
            print(f"error: {_first_line(e)} ({more})", file=sys.stderr, flush=True)
            sys.exit(1)

    return wrapped
