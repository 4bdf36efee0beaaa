"""``python -m workbench ...`` runs the CLI (as the ``workbench`` console script does)."""

from workbench.cli import app

app()
