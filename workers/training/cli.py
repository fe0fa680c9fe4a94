"""``rdserve drafter ...`` commands (self-distillation training of a ReDrafter draft head)."""

from __future__ import annotations

import typer

drafter_app = typer.Typer(help="Train and export ReDrafter draft heads.", no_args_is_help=True)
