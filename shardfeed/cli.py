"""The ``shardfeed`` command line.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``; ``COMMANDS`` maps the command name to that module and a help line.
Only the chosen command's module is imported, so a client-only install can still run
``shardfeed --help`` and gets a one-line error (not a traceback) for a server command.
Errors surface as ``shardfeed: error: <one line>`` and exit status 1; ``--verbose``
adds the traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback
from collections.abc import Sequence
from types import ModuleType

from shardfeed import __version__
from shardfeed.service.stores.base import StoreError  # dependency-free, unlike the store backends

COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("shardfeed.service.server", "run the service (the main job)"),
    "seed": ("shardfeed.tools.seed", "write a synthetic dataset (or the sklearn digits)"),
    "pack": ("shardfeed.tools.pack", "pack a directory of KEY.FIELD files into tar shards + index"),
    "index": ("shardfeed.tools.index", "write index.parquet for existing tar shards (reads headers only) "
                                        "or loose objects (--objects)"),
    "demo": ("shardfeed.client.demo", "train a small model through the service"),
    "bench": ("shardfeed.benchmarks.run", "benchmark shardfeed against one GET per sample"),
    "capacity": ("shardfeed.benchmarks.capacity", "the shardfeed nodes, S3 traffic and cache a training job needs, "
                                                  "from costs measured here (--calibrate) and checked (--check)"),
    "stack": ("shardfeed.stack", "run the docker-compose stack as local processes: SeaweedFS, seeder, 3 replicas"),
    "ps": ("shardfeed.tools.ps", "list the shardfeed services running on this node"),
    "stop": ("shardfeed.tools.stop", "stop this node's shardfeed services (default: the node service)"),
}

# Third-party modules -> the extra that installs them, for "missing dependency" errors.
EXTRAS = {
    "fastapi": "server", "uvicorn": "server", "aiohttp": "server", "botocore": "server", "boto3": "server",
    "pyarrow": "server", "tqdm": "server", "prometheus_client": "server",
    "sklearn": "demo", "matplotlib": "demo", "torch": "torch", "moto": "test", "PIL": "image", "simplejpeg": "image",
}


class CommandUnavailable(Exception):
    """The command's module or one of its dependencies is not installed."""


def _missing(err: ModuleNotFoundError) -> str:
    top = (err.name or "").partition(".")[0]
    extra = EXTRAS.get(top)
    hint = f": pip install 'shardfeed[{extra}]'" if extra else ""
    return f"missing Python package {top!r}{hint}"


def load_command(name: str) -> ModuleType:
    """Import the module behind command ``name``; ``CommandUnavailable`` with a one-line reason."""
    path = COMMANDS[name][0]
    try:
        module = importlib.import_module(path)
    except ModuleNotFoundError as err:
        if err.name and (path == err.name or path.startswith(err.name + ".")):
            raise CommandUnavailable(f"command {name!r} is not available in this installation "
                                     f"(no module {path})") from None
        raise CommandUnavailable(f"command {name!r} needs a {_missing(err)}") from None
    if not (hasattr(module, "add_arguments") and hasattr(module, "run")):
        raise CommandUnavailable(f"command {name!r} is not available ({path} is not a command module)")
    return module


def _chosen(argv: Sequence[str]) -> str | None:
    """The command word, found without parsing the rest (global options come before it)."""
    for arg in argv:
        if not arg.startswith("-"):
            return arg if arg in COMMANDS else None
    return None


def _common(parser: argparse.ArgumentParser, default) -> None:
    # On subparsers the default is SUPPRESS, so `-v` before the command is not reset by it.
    parser.add_argument("-v", "--verbose", action="store_true", default=default,
                        help="print tracebacks on errors")
    parser.add_argument("-q", "--quiet", action="store_true", default=default, help="no progress bars")


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = argparse.ArgumentParser(
        prog="shardfeed", description="Batched, ordered sample loading from S3-compatible storage.",
        epilog="S3 settings come from the standard AWS variables (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, "
               "AWS_PROFILE, ...). Sizes accept 10KiB, 64MiB, 20GiB.")
    parser.add_argument("--version", action="version", version=f"shardfeed {__version__}")
    _common(parser, False)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    subparsers = {}
    for name, (_, help_line) in COMMANDS.items():
        subparsers[name] = sub.add_parser(name, help=help_line, description=help_line)
        _common(subparsers[name], argparse.SUPPRESS)
    return parser, subparsers


def _one_line(err: BaseException) -> str:
    """The error as one line; the type name too when it is not one of ours or a plain input error."""
    text = " ".join(str(err).split()) or type(err).__name__
    expected = (StoreError, OSError, ValueError, LookupError)
    return text if isinstance(err, expected) else f"{type(err).__name__}: {text}"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``shardfeed`` command line; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, subparsers = build_parser()
    name = _chosen(argv)
    if name is not None:
        try:
            module = load_command(name)
        except CommandUnavailable as err:
            print(f"shardfeed: error: {err}", file=sys.stderr)
            return 2
        module.add_arguments(subparsers[name])
    args = parser.parse_args(argv)
    args.progress = not args.quiet
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        print("shardfeed: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # noqa: BLE001 - the one place that turns errors into exit codes
        if args.verbose:
            traceback.print_exception(err)
        message = (f"command {name!r} needs a {_missing(err)}" if isinstance(err, ModuleNotFoundError)
                   else _one_line(err))
        print(f"shardfeed: error: {message}", file=sys.stderr)
        return 1

if __name__ == "__main__":
    sys.exit(main())
