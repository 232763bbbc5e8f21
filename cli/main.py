"""The ``ptplan`` command group: each subcommand lives in its own module and only parses and hands over."""
from __future__ import annotations

import os
import sys
from typing import Sequence

import click

from ptplan.planner.errors import PtplanError


NEEDS_EXECUTOR = {"torch", "transformers"}
"""Packages only ``profile`` and ``run`` need (``pip install -e ".[executor]"``); planning never imports them."""


class PtplanGroup(click.Group):
    """A click group that turns PtplanError (and a missing executor dependency) into one clear message
    and exit code 2."""

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except PtplanError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)
        except KeyboardInterrupt:
            click.echo("error: interrupted (Ctrl-C)", err=True)
            sys.exit(130)
        except ModuleNotFoundError as e:
            top = (e.name or "").split(".")[0]
            if top not in NEEDS_EXECUTOR:
                raise
            cmd = ctx.invoked_subcommand or "this command"
            click.echo(f"error: `ptplan {cmd}` needs {top}, which is not installed. Install the executor's "
                       f"dependencies: pip install torch==2.13.0 transformers (or the torch build for your GPU), "
                       f'or pip install -e ".[executor]" from a checkout', err=True)
            sys.exit(2)


def _same_file(a: str, b: str) -> bool:
    """Whether two paths name one file (after links and relative parts), existing or not."""
    try:
        if os.path.exists(a) and os.path.exists(b):
            return os.path.samefile(a, b)
    except OSError:
        pass
    return os.path.realpath(a) == os.path.realpath(b)


def _creatable(folder: str) -> bool:
    """Whether ``folder`` exists as a writable folder, or can be made under its nearest existing ancestor."""
    d = os.path.abspath(folder or ".")
    while not os.path.exists(d):
        parent = os.path.dirname(d)
        if parent == d:
            return False
        d = parent
    return os.path.isdir(d) and os.access(d, os.W_OK | os.X_OK)


def check_outputs(inputs: Sequence[tuple[str, str | None]], outputs: Sequence[tuple[str, str | None]], *,
                  make_folders: bool = False) -> None:
    """Every command's output guard, called before anything is read or written: no output is one of the
    inputs or another output, none is an existing folder, and each one's folder exists (``make_folders``:
    can be made). ``inputs``/``outputs``: (what, path) pairs, e.g. ("plan", "plan.json") and
    ("--out", "report.html"); None paths are skipped. Raises PtplanError with the fix."""
    seen: list[tuple[str, str]] = []
    for what, out in outputs:
        if out is None:
            continue
        for name, src in inputs:
            if src is not None and _same_file(out, src):
                raise PtplanError(f"{what} {out} is the {name} itself; writing there would destroy the {name}. "
                                  f"Give {what} another file name")
        for other, path in seen:
            if _same_file(out, path):
                raise PtplanError(f"{other} and {what} are the same file ({out}); give them different names")
        if os.path.isdir(out):
            raise PtplanError(f"{what} {out} is a folder; give a file name")
        folder = os.path.dirname(os.path.abspath(out))
        if not (_creatable(folder) if make_folders else os.path.isdir(folder)):
            raise PtplanError(f"{what} {out}: the folder {folder} does not exist"
                              + (" and cannot be made" if make_folders else "") + "; create it or write elsewhere")
        if os.path.exists(out) and not os.access(out, os.W_OK):
            raise PtplanError(f"{what} {out} exists and is not writable")
        seen.append((what, out))


@click.group(cls=PtplanGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="ptplan")
def cli() -> None:
    """ptplan: plan and run elastic pipelined training of Transformers.

    \b
    profile  measure every layer of a model on a device -> profile.json
    plan     freeze trajectory, AutoPipe, AutoDP, simulator -> plan.json
    show     interactive offline HTML report of a plan
    run      replay a plan as real elastic training (torchrun)
    compare  predicted versus measured, phase by phase
    ablate   the paper's ablation (freeze, AutoPipe, AutoDP, AutoCache) for a model and cluster
    data     tokenize a CSV/JSONL of texts (and labels) into the training format
    """


def _register() -> None:
    # Each command module is optional until it exists; import errors of real modules must surface.
    import importlib

    for mod, name in (("profile_cmd", "profile"), ("plan_cmd", "plan"), ("show_cmd", "show"),
                      ("run_cmd", "run"), ("compare_cmd", "compare"), ("ablate_cmd", "ablate"),
                      ("data_cmd", "data")):
        try:
            m = importlib.import_module(f"ptplan.cli.{mod}")
        except ModuleNotFoundError as e:
            if e.name == f"ptplan.cli.{mod}":
                continue
            raise
        cli.add_command(getattr(m, name))


_register()


def main() -> None:
    cli(prog_name="ptplan")


if __name__ == "__main__":
    main()
