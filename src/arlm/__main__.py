"""`python -m arlm` and the `arlm` console script."""

import gc

from . import prefer_huge_pages

# Start-up allocates ~1M objects (torch's import, the model's modules) that all live as long as
# the process: at the default thresholds Python runs ~400 collections over them before the first
# token (~0.3-0.5 s on a 2-core host). Collections are rare until the model is loaded
# (cli_common.load_llm freezes what start-up made and restores the thresholds).
STARTUP_GC_THRESHOLD = 100_000


def main() -> None:
    prefer_huge_pages()  # (before torch loads: arlm.cli imports it)
    gc.set_threshold(STARTUP_GC_THRESHOLD, *gc.get_threshold()[1:])
    from .cli import entry

    entry()


if __name__ == "__main__":
    main()
