"""``attnpool`` command line: one subcommand per job. Bad input exits with code 2 and one line."""

from __future__ import annotations

import argparse
import os
import re
import sys
import traceback

from attnpool.console import mark_start
from attnpool.errors import ConfigError, TrainingError


# A negative size as a flag's value ("-1K", "-80GB"), beside the negative numbers argparse tells from flags itself:
# otherwise argparse takes "-1K" for a flag and says only "expected one argument", where the flag's own check names
# the value.
NEGATIVE_SIZE = r"^-\d*\.?\d+\s*[kKmMgG](i?[bB])?$"


class OneLineParser(argparse.ArgumentParser):
    """Argument errors in one line (no usage block) and exit code 2, as every other input error; negative sizes
    taken as values (NEGATIVE_SIZE)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(f"{self._negative_number_matcher.pattern}|{NEGATIVE_SIZE}")

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="attnpool", description="Core attention disaggregation for long-context training.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    from attnpool.cli import bench_cmd, eval_cmd, export_cmd, memory_cmd, plan_cmd, profile_cmd, simulate_cmd, train_cmd

    plan_cmd.add_parser(sub)
    train_cmd.add_parser(sub)
    memory_cmd.add_parser(sub)
    export_cmd.add_parser(sub)
    eval_cmd.add_parser(sub)
    simulate_cmd.add_parser(sub)
    profile_cmd.add_parser(sub)
    bench_cmd.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    mark_start()
    parser = build_parser()
    args = parser.parse_args(argv)  # unknown flags: argparse prints usage and exits 2
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"attnpool {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except TrainingError as exc:
        print(f"attnpool {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _opened_process_group() -> bool:
    """Whether this command opened a process group (attnpool.comm.process is loaded only by commands that
    may: checking it must not load torch into the others)."""
    process = sys.modules.get("attnpool.comm.process")
    return process is not None and process.opened_process_group()


def entry() -> None:
    """The ``attnpool`` command (console script and ``python -m attnpool.cli.main``)."""
    try:
        code = main()
    except BrokenPipeError:  # the reader of the output went away (`attnpool plan --json | head`): no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (Python's flush at exit would fail again)
        code = 1
    except Exception:
        if not _opened_process_group():
            raise
        traceback.print_exc()  # then leave as below, exit code 1 as Python's own
        code = 1
    if _opened_process_group():
        from attnpool.comm.process import end_process

        end_process(code)  # see attnpool.comm.process
    sys.exit(code)


if __name__ == "__main__":
    entry()
