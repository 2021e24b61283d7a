"""Total and active parameters of the mixture-of-experts presets against the figures their
publishers give (model cards and papers), as `ptdp.perf.cost.parameters.model_size` counts
them: the unpadded vocabulary, the output layer counted, the routed experts a token is not
sent to left out of the active count. Model-only, deterministic.

    python benchmarks/perf_model/preset_sizes.py
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python benchmarks/<group>/<name>.py`: from the root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ptdp.config.presets import model_preset
from ptdp.perf.cost.parameters import model_size

PUBLISHED = {
    "mixtral-8x7b": ("46.7B", "12.9B", "Mixtral of Experts, arXiv 2401.04088"),
    "qwen3-30b-a3b": ("30.5B", "3.3B", "Qwen3 model card"),
    "qwen3-235b-a22b": ("235B", "22B", "Qwen3 model card"),
    "deepseek-v3": ("671B", "37B", "DeepSeek-V3, arXiv 2412.19437 (without its 14B MTP module)"),
    "kimi-k2": ("1T", "32B", "Kimi K2 model card"),
    "deepseek-v2-lite": ("15.7B", "2.4B", "DeepSeek-V2, arXiv 2405.04434 (active: no embedding)"),
}
"""preset -> (total, active, where the figures are from)."""


def main() -> None:
    print("| preset | total | active | published total | published active | source |")
    print("|---|---|---|---|---|---|")
    for name, (total, active, source) in PUBLISHED.items():
        size = model_size(model_preset(name))
        print(f"| `{name}` | {size.total / 1e9:,.1f}B | {size.active / 1e9:,.2f}B | {total} | "
              f"{active} | {source} |")  # fmt: skip


if __name__ == "__main__":
    main()
