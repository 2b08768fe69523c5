"""`python -m sluice.kernels [LEVEL ...]`: build the kernel libraries of the levels named
(default: every level this process runs, to SLUICE_CPU_ISA's if set) into the cache at
once, one compiler per core.
`make test` runs it first so its workers do not each compile every level."""

from __future__ import annotations

import sys
import time

from sluice import kernels


def main(argv: list[str]) -> int:
    start = time.perf_counter()
    try:
        built = kernels.build(argv or None)
    except ValueError as e:
        print(f"sluice.kernels: {e}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - start
    for level, ok in built.items():
        print(f"sluice kernels {level}: {'ready' if ok else 'FAILED (see the log above)'}")
    print(f"({seconds:.0f} s)")
    return 0 if all(built.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
