"""Single-stream decode at each CPU kernel level, side by side in one run.

Each level runs in its own process, set up as on a CPU of that level: SLUICE_CPU_ISA
for our kernels (and sluice's dtype/oneDNN choices), ATEN_CPU_CAPABILITY for torch's
kernels and ONEDNN_MAX_CPU_ISA for oneDNN's, so an AVX-512 machine measures what an
AVX2 one would run (the memory system stays this machine's). Rounds alternate the
levels (A B, B A, ...); every round runs `single_stream.py --rounds 1` per level, which
also times llama.cpp in the same process when it is installed, so each level has its
own same-minute ratio to llama.cpp. Writes benchmarks/results/cpu_levels.json (--output).

Run from the repo root:
    .venv/bin/python benchmarks/cpu_levels.py --levels avx512,avx2 --rounds 5
"""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks.common import (  # noqa: E402
    add_output_arg,
    add_rounds_arg,
    compare,
    fmt_spread,
    format_table,
    interleave,
    shown_path,
    write_result,
)
from sluice.kernels import cpu  # noqa: E402

# What torch and oneDNN are capped at for each of our levels.
_TORCH_ENV = {
    "generic": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    # On an AMX CPU, avx512 keeps oneDNN off the tiles too.
    "avx512": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
    "amx": {},
}


# llama.cpp's CPU backend built for a lower level (`make llamacpp-levels`), if it is.
_GGML_LEVELS = Path(_ROOT) / ".venv" / "llama.cpp"


def ggml_level_dir(level: str) -> Path | None:
    """Where `make llamacpp-levels` put llama.cpp's CPU backend for `level`, if it did."""
    path = _GGML_LEVELS / f"ggml-cpu-{level}"
    return path if (path / "libggml-cpu.so.0").exists() else None


def level_env(level: str) -> dict[str, str]:
    env = {**os.environ, "SLUICE_CPU_ISA": level, **_TORCH_ENV[level]}
    ggml = ggml_level_dir(level)
    if ggml is not None:  # found before the installed library (its RUNPATH comes after)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in (str(ggml), os.environ.get("LD_LIBRARY_PATH", "")) if p
        )
    return env


def run_level(level: str, args: argparse.Namespace) -> dict[str, Any]:
    """One single_stream.py round at `level`: sluice's and llama.cpp's decode tok/s."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        cmd = [
            sys.executable,
            str(Path(__file__).with_name("single_stream.py")),
            "--rounds",
            "1",
            "--methods",
            args.method,
            "--max-tokens",
            str(args.max_tokens),
            "--output",
            str(out),
        ]
        if args.model:
            cmd += ["--model", args.model]
        subprocess.run(cmd, env=level_env(level), check=True, stdout=subprocess.DEVNULL)
        data = json.loads(out.read_text())
    summary = data["comparison"]["summary"]
    sluice = summary[args.method]["decode_tokens_per_s"]["median"]
    llama = summary.get("llama.cpp", {}).get("decode_tokens_per_s", {}).get("median")
    return {
        "sluice_tok_s": sluice,
        "llamacpp_tok_s": llama,
        "ratio_to_llamacpp": sluice / llama if llama else None,
        "variant": data["provenance"]["kernel_variant"],
        "dtype": data["systems"][args.method]["dtype"],
        "llamacpp_isa": data["systems"].get("llama.cpp", {}).get("isa"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--levels", default=",".join(reversed(cpu.supported_levels())))
    ap.add_argument("--method", default="auto", help="sluice quantization (default: auto)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-tokens", type=int, default=128)
    add_rounds_arg(ap)
    add_output_arg(ap, "cpu_levels")
    args = ap.parse_args()
    levels = args.levels.split(",")
    runs = interleave(levels, args.rounds, lambda level: run_level(level, args), "cpu levels")
    for level, rs in runs.items():
        assert all(r["variant"] == level for r in rs), (level, rs)
    cmp = compare(runs, ["sluice_tok_s", "llamacpp_tok_s", "ratio_to_llamacpp"], levels[0])
    rows = []
    for level in levels:
        s = cmp["summary"][level]
        vs_top = cmp["ratio_of_medians"].get(level, {}).get("sluice_tok_s", 1.0)
        rows.append(
            [
                level,
                runs[level][0]["dtype"],
                fmt_spread(s["sluice_tok_s"]),
                fmt_spread(s["llamacpp_tok_s"]),
                fmt_spread(s["ratio_to_llamacpp"], 1, 2),
                f"{vs_top:.2f}x",
            ]
        )
    print(
        f"\n== Single-stream decode per kernel level ({args.method}); median (min-max) of "
        f"{cmp['rounds']} interleaved rounds =="
    )
    print(
        format_table(
            [
                "level",
                "dtype",
                "sluice tok/s",
                "llama.cpp tok/s",
                "sluice / llama.cpp",
                f"vs {levels[0]}",
            ],
            rows,
        )
    )
    path = write_result(
        "cpu_levels",
        {"config": vars(args) | {"output": str(args.output)}, "comparison": cmp},
        args.output,
    )
    print(f"\nwrote {shown_path(path)}")


if __name__ == "__main__":
    main()
