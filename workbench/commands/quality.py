"""``workbench quality``: precision loss, weight memory and speed of the real model's weight formats (fp32,
bf16, int8, int4) on this machine (``workbench.quality``)."""

from __future__ import annotations

import json

from workbench.commands import set_torch_threads
from workbench.errors import UsageError


def main(model: str = "smollm2-135m", weight_dtypes: list[str] | None = None, quant_dtype: str = "float32",
         num_prompts: int = 32, max_new_tokens: int = 64, window_tokens: int = 512, max_windows: int = 0,
         speed_prompts: int = 64, speed_tokens: int = 64, text: str | None = None, out: str | None = None) -> dict:
    """Measure every variant, print the table and the formulas, write ``out`` (JSON) when given; returns the
    report (``workbench.quality.run_quality``).

    Raises:
        UsageError: a bad option (one line naming it).
        ModelNotFoundError: ``model`` is neither a known name nor a model folder.
    """
    from pathlib import Path

    from workbench.quality import TEXT_PATH, WEIGHT_DTYPES, QualitySettings, format_table, run_quality

    settings = QualitySettings(model=model, weight_dtypes=tuple(weight_dtypes or WEIGHT_DTYPES),
                               quant_dtype=quant_dtype, num_prompts=num_prompts, max_new_tokens=max_new_tokens,
                               window_tokens=window_tokens, max_windows=max_windows, speed_prompts=speed_prompts,
                               speed_tokens=speed_tokens, text=text or str(TEXT_PATH))
    bad = settings.problems()
    if bad:
        raise UsageError("; ".join(bad))
    set_torch_threads()
    report = run_quality(settings, echo=print)
    m = report["machine"]
    print(f"{settings.model} on {m['cpu']} ({m['cpu_capability']}; {' '.join(m['isa'])}), torch {m['torch']}, "
          f"{m['torch_threads']} threads; text {Path(report['text']['path']).name}, {report['text']['windows']} "
          f"windows of {settings.window_tokens} tokens")
    print(format_table(report))
    for name, formula in report["formulas"].items():
        print(f"  {name}: {formula}")
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=2) + "\n")
        print(out)
    return report
