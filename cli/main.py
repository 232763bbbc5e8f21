"""The ``ptplan`` command group: each subcommand lives in its own module and only parses and hands over."""
from __future__ import annotations

import sys

import click

from ptplan.cli.outputs import check_outputs, same_file as _same_file  # noqa: F401  (every command imports them here)
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
